"""The sampler's statistics over a vocabulary split across ranks, without gathering the logits.

Rank r holds the logits (and so the weights) of its vocabulary shard [start, end) of
`plan.vocab_shard`: [R, Vs] per rank instead of [R, V]. Each function here equals its
single-process counterpart in engine/sampler.py (or constraints/grammar.py) on the full rows,
and exchanges only per-row scalars or each shard's top-k, never a [R, V] tensor:

- `sharded_step_statistics`: one all_gather of each shard's (row max, its global index), which
  gives both the global max every shard rescales by and the argmax (ties to the lowest global
  index, as `max` on the full row picks its first maximum), then one all_reduce of the two sums
  (weights, d x weights) that total and entropy need. The weights stay local.
- `sharded_sample`: inverse-CDF sampling from the shards' totals and a local search.
- `sharded_row_logprobs`, `sharded_topk_weights`, `sharded_top_candidates`: from each shard's
  top-k, gathered once.
- `sharded_best_allowed_at`: a grammar walk's fallback (the most likely allowed token of a whole
  row), called by every rank at the same position of its own (identical) walk; `sharded_pass_rows`
  gives a walk both reads (`grammar.PassRows`).

Pure functions of the tensors and the ranks' `Collectives`: every rank calls them in the same order with
rows of the same shape (the collectives pair up). With `ShardGroup.single()` and vocab_start 0
they are the single-process functions.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ...kernels import EXP_FLOOR
from ..constraints.grammar import CANDIDATES, PassRows
from ..events import TokenLogprob
from ..sampler import StepStatistics, unpack_token_mask


class Collectives(Protocol):
    """What the reductions ask of the ranks: parallel/group.py's `ShardGroup`, which comes with the
    cut model (`net.shards`)."""

    rank: int

    def all_gather(self, t: torch.Tensor) -> torch.Tensor: ...
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor: ...


class ShardMaskError(ValueError):
    """An allowed-token mask that cannot be sliced at a shard's bounds."""


def shard_mask(allowed: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The words of a packed allowed-token mask int32 [..., W] that cover tokens [start, end): a
    view, no copy (start is a multiple of 32, as `plan.vocab_shard` makes it, so the shard's
    tokens begin at bit 0 of a word; bits past `end` in its last word are ignored by the unpack).
    An empty shard (a vocabulary too small for the ranks) gets no words."""
    if end <= start:
        return allowed[..., :0]
    if start % 32:
        raise ShardMaskError(f"vocabulary shard starts at {start}, not at a 32-token word of the allowed-token mask")
    first, words = start // 32, -(-(end - start) // 32)
    if allowed.shape[-1] < first + words:
        raise ShardMaskError(
            f"allowed-token mask has {allowed.shape[-1]} words, the shard [{start}, {end}) needs {first + words}"
        )
    return allowed[..., first : first + words]


def _best_lowest(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Over dim 0 (the ranks): the highest value and, among the ranks holding it, the lowest id
    (float64 ids: exact below 2^53)."""
    best = values.amax(dim=0)
    lowest = torch.where(values == best, ids, torch.inf).amin(dim=0)
    return best, lowest


def sharded_step_statistics(
    local_logits: torch.Tensor,
    temp: float | torch.Tensor,
    group: Collectives,
    vocab_start: int,
    allowed: torch.Tensor | None = None,
    overwrite_logits: bool = False,
    out: torch.Tensor | None = None,
) -> StepStatistics:
    """`sampler.step_statistics` of the full rows from this rank's logits [..., Vs] (float32,
    softcapped) of tokens [vocab_start, vocab_start + Vs): argmax (a global token id), entropy and
    total of the whole vocabulary; weights [..., Vs] this shard's, bit-equal to the full weights'
    columns (the same exp((l - M) / T) clamped at EXP_FLOOR, with the same global max M).

    Two collectives: an all_gather of each shard's (row max, global index of its first maximum)
    in float64 (exact for float32 values and ids), whose maximum is M and whose lowest index
    among the ranks holding M is the full row's first maximum; an all_reduce of the stacked
    (sum of weights, sum of d x weights). Total and entropy differ from the full row's by the
    summation order only (float32 rounding). `allowed` is the full packed mask [..., ceil(V / 32)]
    (sliced here at the shard's words): disallowed tokens weigh exactly 0, as in step_statistics.
    """
    logits, width = local_logits, local_logits.shape[-1]
    hidden = None  # this shard's disallowed tokens
    if allowed is not None and width:
        mine = shard_mask(allowed, vocab_start, vocab_start + width)
        keep = unpack_token_mask(mine.reshape(-1, mine.shape[-1]), width)
        hidden = keep.logical_not_().reshape(logits.shape)
        logits = logits.masked_fill_(hidden, -torch.inf) if overwrite_logits else logits.masked_fill(hidden, -torch.inf)
    if width:
        top, index = logits.max(dim=-1)
    else:  # an empty shard: never the maximum, adds nothing
        top = logits.new_full(logits.shape[:-1], -torch.inf)
        index = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    every = group.all_gather(torch.stack([top.double(), (index + vocab_start).double()], dim=-1))
    top, argmax = _best_lowest(every[..., 0], every[..., 1])
    top, argmax = top.to(logits.dtype), argmax.long()
    d = logits.sub_(top[..., None]) if overwrite_logits else logits - top[..., None]
    d.div_(temp).clamp_(min=EXP_FLOOR)
    e = torch.exp(d, out=out) if out is not None else torch.exp(d)
    if hidden is not None:  # d = -inf there was clamped to EXP_FLOOR: the weight must be exactly 0
        e.masked_fill_(hidden, 0.0)
    sums = torch.stack([e.sum(dim=-1), (d.mul_(e) if overwrite_logits else d * e).sum(dim=-1)], dim=-1)
    group.all_reduce(sums)
    total, expected_d = sums[..., 0], sums[..., 1]
    entropy = (torch.log(total) - expected_d / total).clamp_min_(0.0)
    if hidden is not None:  # a row allowing nothing (the caller's error): 0/0 there, kept finite
        entropy.nan_to_num_(nan=0.0)
    return StepStatistics(argmax=argmax, entropy=entropy, weights=e, total=total)


def sharded_sample(
    weights_local: torch.Tensor, uniforms: torch.Tensor, group: Collectives, vocab_start: int
) -> torch.Tensor:
    """`sampler.sample_from_weights` over the full rows from this rank's weights [R, Vs]: one global
    token id per row [R], the same on every rank.

    The shards' row totals are gathered ([size, R]); with target = u x (their sum), the chosen
    shard is the first whose cumulative total exceeds the target (searchsorted right=True, as on
    the full CDF), and it searches its own CDF for target minus the earlier shards' totals; one
    all_reduce (sum) of the chosen index, 0 on the other ranks, gives every rank the token. Never
    a zero-weight token: where rounding puts the target at or past the end (of a row or a shard),
    the last token of positive weight is taken (the full-row function clamps to the last token).

    The full CDF is one cumulative sum and this one is the shards' sums added up, so the two
    agree except where the target falls within the float32 rounding of those sums (tested: 1e-5
    of the row's total, relative) of a CDF boundary: there the neighbouring token may be drawn
    instead. A row whose weights are all 0 (the caller's error) gives token 0 here, the last
    token there.
    """
    rows, width = weights_local.shape
    cdf = torch.cumsum(weights_local, dim=-1)
    local_total = cdf[:, -1] if width else weights_local.new_zeros(rows)
    cum = torch.cumsum(group.all_gather(local_total).T.contiguous(), dim=-1)  # [R, size]
    target = uniforms.to(cum.dtype)[:, None] * cum[:, -1:]
    last = torch.searchsorted(cum, cum[:, -1:].contiguous(), right=False)  # the last shard of positive total
    shard = torch.minimum(torch.searchsorted(cum, target, right=True), last)
    before = torch.where(shard > 0, cum.gather(1, (shard - 1).clamp_(min=0)), 0.0)
    shard = shard.squeeze(-1)
    if width:
        last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)  # the last token of positive weight
        index = torch.minimum(torch.searchsorted(cdf, target - before, right=True), last).squeeze(-1)
    else:
        index = torch.zeros(rows, dtype=torch.long, device=weights_local.device)
    token = torch.where(shard == group.rank, index + vocab_start, 0)
    return group.all_reduce(token)


def sharded_topk_weights(
    weights_local: torch.Tensor, k: int, group: Collectives, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` heaviest tokens of each full row (k capped at the vocabulary), from this rank's
    weights [R, Vs]: values [R, k] (descending, the weights' dtype) and global ids [R, k], the
    same on every rank. Exact: a row's k heaviest tokens are among its shards' k heaviest, so
    each shard's top-k is gathered once (padded with -inf where a shard is narrower than k);
    among equal weights the lower id comes first. One host read (how many tokens there are, when
    a shard is narrower than k)."""
    rows, width = weights_local.shape
    values, index = weights_local.topk(min(k, width), dim=-1)
    mine = torch.empty(rows, k, 2, dtype=torch.float64, device=weights_local.device)
    mine[..., 0], mine[..., 1] = -torch.inf, -1.0
    mine[:, : values.shape[-1], 0], mine[:, : values.shape[-1], 1] = values.double(), (index + vocab_start).double()
    every = group.all_gather(mine)  # [size, R, k, 2]
    kept = k if rows == 0 else min(k, int((every[:, 0, :, 1] >= 0).sum()))  # sum over shards of min(k, Vs) >= min(k, V)
    values, ids = every[..., 0].permute(1, 0, 2).reshape(rows, -1), every[..., 1].permute(1, 0, 2).reshape(rows, -1)
    order = ids.argsort(dim=-1, stable=True)  # by id, then (stably) by weight descending
    values, ids = values.gather(1, order), ids.gather(1, order)
    order = values.argsort(dim=-1, descending=True, stable=True)[:, :kept]
    return values.gather(1, order).to(weights_local.dtype), ids.gather(1, order).long()


def sharded_row_logprobs(
    weights_local: torch.Tensor, tokens: torch.Tensor, top_logprobs: int, group: Collectives, vocab_start: int
) -> list[TokenLogprob]:
    """`sampler.row_logprobs` of the full rows from this rank's weights [R, Vs]: the log
    probabilities of `tokens` [R] (global ids) with the `top_logprobs` most likely tokens per row,
    the same on every rank. One all_reduce (float64) of (this shard's row sum, the picked token's
    weight where this shard holds it, else 0), and `sharded_topk_weights`' one gather."""
    rows, width = weights_local.shape
    tokens = tokens.to(weights_local.device)
    local = tokens - vocab_start
    here = (local >= 0) & (local < width)
    sums = torch.zeros(rows, 2, dtype=torch.float64, device=weights_local.device)
    if width:
        sums[:, 0] = weights_local.sum(dim=-1, dtype=torch.float64)
        picked_w = weights_local.gather(1, local.clamp(0, width - 1)[:, None]).squeeze(1).double()
        sums[:, 1] = torch.where(here, picked_w, 0.0)
    group.all_reduce(sums)
    log_total = sums[:, 0].log()
    picked = (sums[:, 1].log() - log_total).clamp_(max=0.0)
    top_w, top_ids = sharded_topk_weights(weights_local, top_logprobs, group, vocab_start)
    top = (top_w.double().log() - log_total[:, None]).clamp_(max=0.0)
    kept = (top_w > 0).tolist()  # probability 0 (banned): never an alternative
    return [
        TokenLogprob(t, lp, [(a, b) for a, b, keep in zip(ids, lps, ks) if keep])
        for t, lp, ids, lps, ks in zip(tokens.tolist(), picked.tolist(), top_ids.tolist(), top.tolist(), kept)
    ]


def sharded_top_candidates(
    weights_local: torch.Tensor, group: Collectives, vocab_start: int, k: int = CANDIDATES
) -> list[tuple[list[float], list[int]]]:
    """`grammar.top_candidates` of the full rows (what a grammar's refine reads first: each
    position's `k` heaviest tokens, descending, as float32 values and global ids), from each
    shard's top-k gathered once; the same on every rank."""
    values, ids = sharded_topk_weights(weights_local.float(), k, group, vocab_start)
    return list(zip(values.tolist(), ids.tolist()))


class WalkDivergedError(RuntimeError):
    """The ranks' grammar walks asked for different positions: their grammar states differ."""


def _best_allowed_local(weights_local: torch.Tensor, vocab_start: int, row: int, mask: torch.Tensor) -> torch.Tensor:
    """This shard's (best allowed weight, its global id) at `row` as float64 [2]: (-1, start)
    where it allows nothing (or holds no tokens)."""
    width = weights_local.shape[-1]
    if not width:
        return torch.tensor([-1.0, float(vocab_start)], dtype=torch.float64, device=weights_local.device)
    allowed = unpack_token_mask(shard_mask(mask.to(weights_local.device), vocab_start, vocab_start + width), width)
    scores = torch.where(allowed, weights_local[row].float(), -1.0)
    best = scores.argmax()
    return torch.stack([scores[best].double(), (best + vocab_start).double()])


def sharded_best_allowed_at(
    weights_local: torch.Tensor, group: Collectives, vocab_start: int, row: int, mask: torch.Tensor
) -> int | None:
    """`grammar.best_allowed(mask, full_row)` at `row` of this rank's weights [C, Vs], called by
    every rank with the same row and mask (each walks the same canvas from the same grammar
    state, so each reaches the same positions): the allowed token of highest weight, the lowest
    id among equals, or None when every allowed token weighs 0. One all_gather of each shard's
    (best weight, global id, row); rows that differ across the ranks raise WalkDivergedError
    (their walks no longer pair up) instead of answering."""
    mine = torch.cat(
        [
            _best_allowed_local(weights_local, vocab_start, row, mask),
            weights_local.new_tensor([row], dtype=torch.float64),
        ]
    )
    every = group.all_gather(mine)  # [size, 3]
    rows = every[:, 2].tolist()
    if any(r != row for r in rows):
        raise WalkDivergedError(f"grammar walks diverged across ranks: positions {[int(r) for r in rows]}")
    value, token = _best_lowest(every[:, 0], every[:, 1])
    return int(token) if float(value) > 0 else None


def sharded_pass_rows(
    weights_local: torch.Tensor, group: Collectives, vocab_start: int, k: int = CANDIDATES
) -> PassRows:
    """What a grammar's walk reads of a pass's full rows [C, V], from this rank's [C, Vs]: the
    candidates from each shard's top-k, gathered once (when the walk first rejects a token), and
    the whole-row fallback in one gather per unsettled position; never a [C, V] tensor. Every
    rank walks the same tokens from the same grammar state (its scheduler replica runs the same
    requests, and the candidates and fallback answers are the same on every rank), so every rank
    issues these collectives at the same points of its walk."""
    return PassRows(
        lambda: sharded_top_candidates(weights_local, group, vocab_start, k),
        lambda row, mask: sharded_best_allowed_at(weights_local, group, vocab_start, row, mask),
    )

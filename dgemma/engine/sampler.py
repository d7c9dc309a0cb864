"""The denoising sampler, as pure functions over one step's logits.

Per step (paper / reference): temperature from a linear schedule -> a token sampled per canvas
position -> entropy-bound acceptance (the k lowest-entropy positions whose summed entropy minus
their largest entropy stays within the bound) -> every other position re-noised with a uniform
random token. A canvas stops when its argmax is stable and its mean entropy is below a threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import EXP_FLOOR  # the floor every step-statistics path clamps d at
from .events import TokenLogprob


def temperature(steps_remaining: int, max_steps: int, t_min: float, t_max: float) -> torch.Tensor:
    """Linear schedule: t_max at the first step (steps_remaining == max_steps), falling towards t_min.

    Computed as the reference does (an int32 step tensor divided in float32), so processed logits
    agree to the bit.
    """
    step = torch.tensor(steps_remaining, dtype=torch.int32)
    return t_min + ((t_max - t_min) * (step / max_steps))


def reference_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy exactly as torch.distributions.Categorical computes it."""
    return torch.distributions.Categorical(logits=logits).entropy()


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Accepted positions [B, C]: lowest entropies first, while cumsum(entropy) - max(entropy) <= bound.

    The lowest-entropy position is always accepted (its own sum minus max is 0).
    """
    sorted_entropy, order = torch.sort(entropy, dim=-1, descending=False)
    cumulative = torch.cumsum(sorted_entropy, dim=-1)
    selected = cumulative - sorted_entropy <= bound
    return torch.scatter(torch.zeros_like(selected), dim=-1, index=order, src=selected)


def stable_and_confident(
    history: torch.Tensor | None,
    argmax_canvas: torch.Tensor,
    entropy: torch.Tensor,
    stability_threshold: int,
    confidence_threshold: float,
    free: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Adaptive stopping: (stop [B], new history).

    Stable: the argmax canvas equals each of the last `stability_threshold` argmax canvases
    (history starts at -1, so a canvas is never stable on its first step). Confident: the mean
    per-position entropy is below `confidence_threshold`. With `free` [B, C] (False at fixed
    positions of the canvas constraints), the mean runs over the free positions only (0 when
    none is free).
    """
    if stability_threshold == 0:
        stable = torch.ones(argmax_canvas.shape[0], dtype=torch.bool, device=argmax_canvas.device)
    else:
        if history is None:
            history = torch.full(
                (stability_threshold, *argmax_canvas.shape), -1, dtype=argmax_canvas.dtype, device=argmax_canvas.device
            )
        stable = (history == argmax_canvas[None]).all(dim=-1).all(dim=0)
        history = torch.roll(history, shifts=-1, dims=0)
        history[-1] = argmax_canvas
    if free is None:
        mean = entropy.mean(dim=-1)
    else:
        mean = (entropy * free).sum(dim=-1) / free.sum(dim=-1).clamp_min(1)
    confident = mean < confidence_threshold
    return stable & confident, history


@dataclass
class StepStatistics:
    """What one denoising step needs from the [N, vocab] logits, computed in few passes."""

    argmax: torch.Tensor  # [N] most likely token
    entropy: torch.Tensor  # [N] entropy of softmax(logits / T)
    weights: torch.Tensor  # [N, vocab] exp((logits - max) / T): unnormalised probabilities
    total: torch.Tensor  # [N] sum of weights


def step_statistics(
    logits: torch.Tensor,
    temp: float | torch.Tensor,
    overwrite_logits: bool = False,
    out: torch.Tensor | None = None,
    *,
    allowed: torch.Tensor | None = None,
) -> StepStatistics:
    """Argmax, entropy and unnormalised probabilities of logits / temp.

    Entropy is log(sum e) - sum(e * d) / sum(e) with d = (logits - max) / T <= 0 and e = exp(d),
    which avoids the cancellation of logsumexp - E[z] for peaked rows. With `overwrite_logits`
    the logits buffer is reused for d (the engine's full-vocab tensors are 32 MB each at vocab
    32768: each one saved is a pass over memory and, on CPU, a fresh mmap of page faults);
    `out` receives the weights.

    `allowed` (int32 [..., ceil(V / 32)], the packed bitmask of `pack_token_mask`, one row per
    logits row) restricts each row to its allowed tokens, as if the others had logit -inf: never
    the argmax, weight exactly 0, no part of total or entropy. A row whose mask is all ones gives
    bit-identical results to no mask; every row must allow a token (one that allows none gets
    zero weights and entropy 0).
    """
    hidden = None  # the disallowed tokens
    if allowed is not None:
        keep = unpack_token_mask(allowed.reshape(-1, allowed.shape[-1]), logits.shape[-1])
        hidden = keep.logical_not_().reshape(logits.shape)
        logits = logits.masked_fill_(hidden, -torch.inf) if overwrite_logits else logits.masked_fill(hidden, -torch.inf)
    top, argmax = logits.max(dim=-1)
    d = logits.sub_(top[..., None]) if overwrite_logits else logits - top[..., None]
    d.div_(temp).clamp_(min=EXP_FLOOR)
    e = torch.exp(d, out=out) if out is not None else torch.exp(d)
    if hidden is not None:  # d = -inf there was clamped to EXP_FLOOR: the weight must be exactly 0
        e.masked_fill_(hidden, 0.0)
    total = e.sum(dim=-1)
    expected_d = (d.mul_(e) if overwrite_logits else d * e).sum(dim=-1)
    entropy = (torch.log(total) - expected_d / total).clamp_min_(0.0)
    if hidden is not None:  # a row allowing nothing (the caller's error): 0/0 there, kept finite
        entropy.nan_to_num_(nan=0.0)
    return StepStatistics(argmax=argmax, entropy=entropy, weights=e, total=total)


def pack_token_mask(allowed_bool: torch.Tensor) -> torch.Tensor:
    """Bool [..., V] -> the packed bitmask llguidance uses, int32 [..., ceil(V / 32)]: token t is
    allowed iff bit t % 32 (little-endian) of word t // 32 is set; the bits past V are 0."""
    *lead, vocab = allowed_bool.shape
    words = -(-vocab // 32)
    bits = torch.zeros(*lead, words * 32, dtype=torch.int64, device=allowed_bool.device)
    bits[..., :vocab] = allowed_bool.to(torch.int64)
    shifts = torch.arange(32, dtype=torch.int64, device=allowed_bool.device)
    packed = (bits.view(*lead, words, 32) << shifts).sum(dim=-1)  # distinct bits: the sum is their OR
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # bit 31 is the sign bit


def unpack_token_mask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The packed bitmask int32 [..., W] (W >= ceil(vocab / 32)) -> bool [..., vocab]; bits past
    vocab are ignored."""
    if bits.dtype != torch.int32 or bits.shape[-1] * 32 < vocab:
        raise ValueError(
            f"allowed-token mask: need int32 [..., >= {-(-vocab // 32)}], got {bits.dtype} {list(bits.shape)}"
        )
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    unpacked = (bits[..., None] >> shifts).bitwise_and_(1).bool()  # arithmetic shift: bit 31 still lands in bit 0
    return unpacked.flatten(-2)[..., :vocab]


def sample_from_weights(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of unnormalised `weights` [N, V] given u ~ U(0,1) [N].

    The first index whose cumulative weight exceeds u x (total weight): never a zero-weight token.
    """
    cdf = torch.cumsum(weights, dim=-1)
    target = uniform.to(cdf.dtype)[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_(max=weights.shape[-1] - 1)


def row_logprobs(rows: torch.Tensor, tokens: torch.Tensor, top_logprobs: int) -> list[TokenLogprob]:
    """The log probabilities of `tokens` [R] under unnormalised weights `rows` [R, V], with the
    `top_logprobs` most likely tokens per row: log p = log(w[token] / sum w)."""
    log_total = rows.sum(dim=-1, dtype=torch.float64).log()
    tokens = tokens.to(rows.device)
    picked = (rows.gather(1, tokens[:, None]).squeeze(1).double().log() - log_total).clamp_(max=0.0)
    top_w, top_ids = rows.topk(min(top_logprobs, rows.shape[-1]), dim=-1)
    top = (top_w.double().log() - log_total[:, None]).clamp_(max=0.0)
    kept = (top_w > 0).tolist()  # probability 0 (banned): never an alternative
    return [
        TokenLogprob(t, lp, [(a, b) for a, b, keep in zip(ids, lps, ks) if keep])
        for t, lp, ids, lps, ks in zip(tokens.tolist(), picked.tolist(), top_ids.tolist(), top.tolist(), kept)
    ]

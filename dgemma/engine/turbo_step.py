"""One turbo decoder step of one request: a pass over its active rows, then the sampler over the
whole canvas with frozen positions held (engine/turbo.py says what freezes and why).

The pass computes the positions `TurboState.query_rows` names (every position on a canvas's first
pass and on refresh passes, else those neither frozen nor resting); statistics, masks and sampling
run over the positions computed and not frozen, and are scattered back into [C] vectors, where
frozen and resting positions keep their token and last entropy (a resting one is not accepted).
The random draws are an exact pass's (C uniforms, C noise tokens from the request's stream), so a
turbo run differs from an exact one only by the approximation.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..config import ModelConfig
from ..kernels import triton_step
from ..model.diffusion_gemma import DiffusionGemma
from . import sampler
from .constraints.grammar import PassRows, held_rows
from .kv.paged_cache import PagedKVCache
from .request import Request
from .step_plan import DecodeResult
from .turbo import TurboPass, TurboState, freeze, may_rest


class Runner(Protocol):
    """The parts of engine/runner.py's Runner a turbo step uses (it calls `turbo_step`)."""

    config: ModelConfig
    kv_config: ModelConfig
    net: DiffusionGemma
    cache: PagedKVCache
    triton: bool

    def statistics(
        self, hidden: torch.Tensor, temps: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]: ...
    def temperatures(self, group: list[Request]) -> torch.Tensor: ...
    def allowed_masks(self, group: list[Request]) -> torch.Tensor | None: ...
    def fixed_tokens(self, group: list[Request]) -> torch.Tensor | None: ...
    def to_device(self, t: torch.Tensor) -> torch.Tensor: ...
    def sample_rows(self, weights: torch.Tensor, total: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor: ...
    def row_logprobs(self, weights: torch.Tensor, tokens: torch.Tensor, top_logprobs: int) -> list: ...
    def full_rows(self, weights: torch.Tensor) -> torch.Tensor | PassRows: ...


def turbo_step(runner: Runner, group: list[Request]) -> list[DecodeResult]:
    """Denoise the group's canvases once with their frozen positions skipped, in one decoder pass
    (each request's active rows padded to the group's most with copies of its last one, whose
    results are dropped): per request the next canvas, argmax, self-conditioning input, stop flag
    and turbo state."""
    config, device = runner.config, runner.net.device
    c = config.canvas_length
    states = [r.turbo for r in group]
    for state in states:
        state.ensure_buffers(runner.kv_config, runner.net.dtype, device)  # this rank's KV heads when sharded
    planned = [s.query_rows(r.config.turbo_settings, may_rest(r)) for r, s in zip(group, states)]
    queries, resting = [q for q, _ in planned], [d for _, d in planned]
    lives = [(~s.frozen & ~d).nonzero().squeeze(-1) for s, d in zip(states, resting)]  # the rows the sampler decides
    width = max(q.numel() for q in queries)
    padded = torch.stack([torch.cat([q, q[-1:].expand(width - q.numel())]) for q in queries])  # [n, A]
    kvs = [r.kv for r in group]
    plan = runner.cache.plan_canvas(c, kvs) if runner.triton else runner.cache.plan_decoder(c, kvs)
    canvas_in = torch.stack([r.canvas[rows] for r, rows in zip(group, padded)])
    soft_in = None
    if any(r.soft is not None for r in group):  # a zero input is exactly "no self-conditioning"
        zeros = torch.zeros(c, config.hidden_size, dtype=runner.net.dtype, device=device)
        soft_in = torch.stack([(zeros if r.soft is None else r.soft)[rows] for r, rows in zip(group, padded)])
    hidden = runner.net.decode(canvas_in, TurboPass(plan, padded, states), soft_in)
    # each live row's place among its request's computed rows: all of them, or (everything passes) the live ones
    picks = [
        live if q.numel() != live.numel() else torch.arange(live.numel(), device=device)
        for q, live in zip(queries, lives)
    ]
    hidden = torch.cat([hidden[i, pick] for i, pick in enumerate(picks)])[None]
    flat = torch.cat([i * c + live for i, live in enumerate(lives)])  # the live rows among the group's n * C
    temps = runner.temperatures(group)[flat]
    allowed = runner.allowed_masks(group)
    allowed = None if allowed is None else allowed[flat]
    argmax_l, entropy_l, weights, total, soft_l = runner.statistics(hidden, temps, allowed)
    results, start = [], 0
    for r, live, rows, rest in zip(group, lives, queries, resting):
        end = start + live.numel()  # its own rows count as its positions; the padding is the batch's
        results.append(
            _decide(
                runner,
                r,
                live,
                rest,
                rows.numel(),
                argmax_l[0, start:end],
                entropy_l[0, start:end],
                weights[start:end],
                total[start:end],
                soft_l[0, start:end],
            )
        )
        start = end
    return results


def _decide(
    runner: Runner,
    r: Request,
    live: torch.Tensor,
    resting: torch.Tensor,
    positions: int,
    argmax_l: torch.Tensor,
    entropy_l: torch.Tensor,
    weights: torch.Tensor,
    total: torch.Tensor,
    soft_l: torch.Tensor,
) -> DecodeResult:
    """One request's sampler decisions over its whole canvas, from its live rows' statistics
    (argmax, entropy [R], weights [R, V], totals [R], self-conditioning inputs [R, H]);
    `resting` [C]: positions not computed (never accepted); `positions`: the canvas positions its
    pass computed."""
    state, settings, config = r.turbo, r.config.turbo_settings, runner.config
    c, device = config.canvas_length, runner.net.device
    fixed = runner.fixed_tokens([r])
    free = None if fixed is None else fixed[0] < 0  # False where the constraints fix the token
    argmax = state.tokens.clone()
    argmax[live] = argmax_l
    entropy = state.entropy.clone()
    entropy[live] = entropy_l
    weighed = entropy if free is None else entropy * free
    bound = torch.tensor([[r.config.entropy_bound]], dtype=torch.float32, device=device)
    # a resting position has no fresh sample: it ranks last (inf) and is never accepted
    accepted = sampler.entropy_bound_accept(torch.where(resting, torch.inf, weighed)[None], bound)[0] & ~resting
    if free is not None:
        accepted &= free

    uniforms, noise = _draws(runner, r)
    canvas = noise.clone()
    picked = accepted[live]
    rows = live[picked]
    if rows.numel():
        canvas[rows] = runner.sample_rows(weights[picked], total[picked], uniforms[rows])
    canvas = torch.where(state.frozen, state.tokens, canvas)
    if fixed is not None:
        canvas = torch.where(free, canvas, fixed[0])
        argmax = torch.where(free, argmax, fixed[0])
    grammar = r.refines
    if grammar:
        argmax = r.constraints.refine(argmax.cpu(), _full_weights(runner.full_rows(weights), live, state, c)).to(device)
    argmax = torch.where(state.frozen, state.tokens, argmax)  # a frozen position never changes

    stop, history = sampler.stable_and_confident(
        r.history,
        argmax[None],
        entropy[None],
        r.config.stability_threshold,
        r.config.confidence_threshold,
        None if free is None else free[None],
    )
    kept = accepted if free is None else accepted | ~free
    frozen, streak = freeze(
        state.frozen,
        state.streak,
        state.tokens,
        argmax,
        kept,
        weighed,
        settings,
        prefix_only=grammar,
        eos_ids=tuple(r.config.eos_token_ids),
    )
    canvas = torch.where(frozen, argmax, canvas)  # a frozen position holds its token (read again on refresh passes)
    stop = (bool(stop[0]) and not bool(resting.any())) or bool(frozen.all())  # what commits was computed

    logprobs = dict(state.logprobs)
    if r.top_logprobs is not None:
        newly = (frozen & ~state.frozen)[live]
        for pos, lp in zip(
            live[newly].tolist(), runner.row_logprobs(weights[newly], argmax[live][newly], r.top_logprobs)
        ):
            logprobs[pos] = lp
    block_logprobs = None
    if r.top_logprobs is not None and r.block_ends(stop):
        computed = dict(zip(live.tolist(), runner.row_logprobs(weights, argmax[live], r.top_logprobs)))
        block_logprobs = [logprobs[p] if p in logprobs and bool(state.frozen[p]) else computed[p] for p in range(c)]

    soft = torch.zeros(c, config.hidden_size, dtype=soft_l.dtype, device=device) if r.soft is None else r.soft.clone()
    soft[live] = soft_l.to(soft.dtype)
    new_state = TurboState(
        frozen, streak, argmax, entropy, state.keys, state.values, state.passes + 1, logprobs, resting
    )
    shown = entropy if free is None else entropy * free
    return DecodeResult(
        r,
        canvas,
        argmax,
        soft,
        history,
        stop,
        block_logprobs,
        kept | state.frozen,
        shown,
        positions=positions,
        turbo=new_state,
    )


def _draws(runner: Runner, r: Request) -> tuple[torch.Tensor, torch.Tensor]:
    """An exact pass's random numbers for `r`: C uniforms and C noise tokens, on the device."""
    c, vocab, device = runner.config.canvas_length, runner.config.vocab_size, runner.net.device
    if runner.triton:
        seeds = runner.to_device(torch.tensor([triton_step.seed_bits(r.seed)], dtype=torch.long))
        passes = runner.to_device(torch.tensor([r.passes + r.block_passes], dtype=torch.long))
        uniforms, noise = triton_step.philox_draws(seeds, passes, c, vocab)
        return uniforms.view(-1), noise.view(-1)
    uniforms = torch.rand(c, generator=r.generator)
    noise = torch.randint(0, vocab, (c,), generator=r.generator)
    return uniforms.to(device), noise.to(device)


def _full_weights(
    weights: torch.Tensor | PassRows, live: torch.Tensor, state: TurboState, c: int
) -> torch.Tensor | PassRows:
    """[C, V] weights for a grammar's walk: the pass's rows where computed, and a frozen
    position's own token with all the weight (it is what that position holds). From the walk's
    reads of the live rows (`PassRows`: a model cut by vocabulary), the same walk's reads of
    those [C, V] weights, which are never built."""
    if isinstance(weights, PassRows):
        frozen = state.frozen.nonzero().squeeze(-1).tolist()
        return held_rows(weights, live.tolist(), dict(zip(frozen, state.tokens[frozen].tolist())), c)
    full = weights.new_zeros(c, weights.shape[-1])
    full[live] = weights
    frozen = state.frozen.nonzero().squeeze(-1)
    full[frozen, state.tokens[frozen]] = 1.0
    return full

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

import torch

from ..request import Request
from ..step_ops import StepOps
from ..step_plan import DecodeResult
from ..turbo import TurboPass, TurboState, freeze, may_rest
from .step import decide


class HostTurboPath:
    """Turbo passes, eager, their decisions on the host path (see the module): every turbo
    request the fused turbo path (engine/fused/turbo.py) does not take."""

    name = "host turbo"

    def __init__(self, ops: StepOps):
        self.ops = ops

    def accepts(self, r: Request) -> bool:
        return r.turbo is not None

    def graph_key(self, group: list[Request]) -> None:
        return None  # eager: no graph

    def run(self, group: list[Request], copy_out: bool = False) -> list[DecodeResult]:
        return turbo_step(self.ops, group)


def turbo_step(ops: StepOps, group: list[Request]) -> list[DecodeResult]:
    """Denoise the group's canvases once with their frozen positions skipped, in one decoder pass
    (each request's active rows padded to the group's most with copies of its last one, whose
    results are dropped): per request the next canvas, argmax, self-conditioning input, stop flag
    and turbo state."""
    config, device = ops.config, ops.net.device
    c = config.canvas_length
    states = [r.turbo for r in group]
    for state in states:
        state.ensure_buffers(ops.kv_config, ops.net.dtype, device)  # this rank's KV heads when sharded
    planned = [s.query_rows(r.config.turbo_settings, may_rest(r)) for r, s in zip(group, states)]
    queries, resting = [q for q, _ in planned], [d for _, d in planned]
    lives = [(~s.frozen & ~d).nonzero().squeeze(-1) for s, d in zip(states, resting)]  # the rows the sampler decides
    width = max(q.numel() for q in queries)
    padded = torch.stack([torch.cat([q, q[-1:].expand(width - q.numel())]) for q in queries])  # [n, A]
    kvs = [r.kv for r in group]
    plan = ops.cache.plan_canvas(c, kvs) if ops.triton else ops.cache.plan_decoder(c, kvs)
    canvas_in = torch.stack([r.canvas[rows] for r, rows in zip(group, padded)])
    soft_in = None
    if any(r.soft is not None for r in group):  # a zero input is exactly "no self-conditioning"
        zeros = torch.zeros(c, config.hidden_size, dtype=ops.net.dtype, device=device)
        soft_in = torch.stack([(zeros if r.soft is None else r.soft)[rows] for r, rows in zip(group, padded)])
    with ops.adapters(group):
        hidden = ops.net.decode(canvas_in, TurboPass(plan, padded, states), soft_in)
    # each live row's place among its request's computed rows: all of them, or (everything passes) the live ones
    picks = [
        live if q.numel() != live.numel() else torch.arange(live.numel(), device=device)
        for q, live in zip(queries, lives)
    ]
    hidden = torch.cat([hidden[i, pick] for i, pick in enumerate(picks)])[None]
    flat = torch.cat([i * c + live for i, live in enumerate(lives)])  # the live rows among the group's n * C
    temps = ops.temperatures(group)[flat]
    allowed = ops.allowed_masks(group)
    allowed = None if allowed is None else allowed[flat]
    argmax_l, entropy_l, weights, total, soft_l = ops.statistics(hidden, temps, allowed)
    results, start = [], 0
    for r, live, rows, rest in zip(group, lives, queries, resting):
        end = start + live.numel()  # its own rows count as its positions; the padding is the batch's
        results.append(
            decide_request(
                ops,
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


def decide_request(
    ops: StepOps,
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
    """One request's decisions over its whole canvas, from its live rows' statistics (argmax,
    entropy [R], weights [R, V], totals [R], self-conditioning inputs [R, H]): host/step.py's
    `decide` with its frozen positions held and its resting ones ([C]: not computed, never
    accepted) ranked last, then the freeze rule, the turbo stop rule and the new TurboState.
    `positions`: the canvas positions its pass computed."""
    state, settings, config = r.turbo, r.config.turbo_settings, ops.config
    c, device = config.canvas_length, ops.net.device
    argmax = state.tokens.clone()
    argmax[live] = argmax_l
    entropy = state.entropy.clone()
    entropy[live] = entropy_l
    d = decide(ops, [r], argmax[None], entropy[None], weights, total, live, resting[None], (state.frozen, state.tokens))
    canvas, argmax, kept, weighed = d.canvas[0], d.argmax[0], d.kept[0], d.weighed[0]
    grammar = r.refines
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
    stop = (bool(d.stops[0]) and not bool(resting.any())) or bool(frozen.all())  # what commits was computed

    logprobs = dict(state.logprobs)
    if r.top_logprobs is not None:
        newly = (frozen & ~state.frozen)[live]
        for pos, lp in zip(live[newly].tolist(), ops.row_logprobs(weights[newly], argmax[live][newly], r.top_logprobs)):
            logprobs[pos] = lp
    block_logprobs = None
    if r.top_logprobs is not None and r.block_ends(stop):
        computed = dict(zip(live.tolist(), ops.row_logprobs(weights, argmax[live], r.top_logprobs)))
        block_logprobs = [logprobs[p] if p in logprobs and bool(state.frozen[p]) else computed[p] for p in range(c)]

    soft = torch.zeros(c, config.hidden_size, dtype=soft_l.dtype, device=device) if r.soft is None else r.soft.clone()
    soft[live] = soft_l.to(soft.dtype)
    new_state = TurboState(
        frozen, streak, argmax, entropy, state.keys, state.values, state.passes + 1, logprobs, resting
    )
    return DecodeResult(
        r,
        canvas,
        argmax,
        soft,
        d.histories[0],
        stop,
        block_logprobs,
        kept | state.frozen,
        weighed,
        positions=positions,
        turbo=new_state,
    )

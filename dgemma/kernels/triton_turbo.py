"""Turbo denoising's decisions on a GPU (engine/fused/turbo.py's captured step): which canvas
positions a pass computes, and the sampler's and the freeze rule's decisions after it, one
program a canvas, no host sync. The rules are engine/turbo.py's (`dormant`, `freeze`) and
engine/host/step.py's (`decide`, with engine/host/turbo.py's `decide_request`), written over [C] vectors in one kernel each:

- `turbo_plan`: the positions resting this pass (`dormant`: still noise, above the request's
  rest threshold, not resting last pass; none when every position not frozen would), those
  computed (every position on a full pass, else those neither frozen nor resting) compacted into
  A rows, padded with the last computed one, and each position's row among them (-1: none).
- `turbo_decide`: the pass's rows scattered back to the canvas (frozen and resting positions keep
  their token and last entropy), entropy-bound acceptance (a resting position ranks last and is
  never accepted), the next canvas (sampled, Philox noise, a frozen position's token), the
  stopping rule and rolled history, the freeze rule (a streak of accepted, unchanged argmaxes at
  a low entropy; every position after a frozen end of answer), and the next pass's computed
  positions, with and without resting: what the host reads with the stop flags to pick the next
  pass's row bucket.
"""

from __future__ import annotations

import torch

from .triton_canvas import MAX_STABILITY, entropy_bound, noise_tokens, stable_rolled
from .triton_support import HAVE_TRITON, tl, triton

if HAVE_TRITON:

    @triton.jit
    def _resting(frozen, streak, entropy, rested, threshold, inside):
        """engine/turbo.py's `dormant` over one canvas (`threshold` +inf: none rests)."""
        resting = ~frozen & (streak == 0) & (entropy > threshold) & ~rested & inside
        computes = tl.sum((~frozen & ~resting & inside).to(tl.int32), axis=0)
        return resting & ((inside.to(tl.int32) * 0 + computes) > 0)  # a vector: the interpreter's & takes no scalar

    @triton.jit
    def _turbo_plan_kernel(
        frozen_ptr, streak_ptr, entropy_ptr, rested_ptr, full_ptr, threshold_ptr,
        slot_ptr, positions_ptr, temps_ptr, canvas_ptr,
        rows_ptr, index_ptr, live_ptr, resting_ptr, writes_ptr, pos_a_ptr, temps_a_ptr, canvas_a_ptr,
        C, A,
        BLOCK_C: tl.constexpr, BLOCK_A: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0).to(tl.int64)
        pos = tl.arange(0, BLOCK_C)
        inside = pos < C
        at = i * C + pos
        frozen = tl.load(frozen_ptr + at, mask=inside, other=1) != 0
        streak = tl.load(streak_ptr + at, mask=inside, other=1)
        entropy = tl.load(entropy_ptr + at, mask=inside, other=0.0)
        rested = tl.load(rested_ptr + at, mask=inside, other=0) != 0
        full = (pos * 0 + tl.load(full_ptr + i)) != 0  # as a vector (the interpreter's & takes no scalar)
        resting = _resting(frozen, streak, entropy, rested, tl.load(threshold_ptr + i), inside) & ~full
        active = (full | (~frozen & ~resting)) & inside
        index = tl.cumsum(active.to(tl.int32), axis=0) - 1
        count = tl.sum(active.to(tl.int32), axis=0)
        kept = active & (index < A)
        last = tl.max(tl.where(kept, pos, 0), axis=0)
        pad = tl.arange(0, BLOCK_A)
        padding = (pad >= count) & (pad < A)
        # each computed row's canvas position, and what the pass reads at it: its RoPE position,
        # temperature and token, and where its keys and values go (its slot's row of the pool)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        at_a = i * A + index
        tl.store(rows_ptr + at_a, pos.to(tl.int64), mask=kept)
        tl.store(writes_ptr + at_a, slot * C + pos, mask=kept)
        tl.store(pos_a_ptr + at_a, tl.load(positions_ptr + at, mask=kept, other=0), mask=kept)
        tl.store(temps_a_ptr + at_a, tl.load(temps_ptr + at, mask=kept, other=1.0), mask=kept)
        tl.store(canvas_a_ptr + at_a, tl.load(canvas_ptr + at, mask=kept, other=0), mask=kept)
        at_pad = i * A + pad  # the rows past the computed ones repeat the last
        last_at = i * C + last
        tl.store(rows_ptr + at_pad, last.to(tl.int64) + pad * 0, mask=padding)
        tl.store(writes_ptr + at_pad, slot * C + last + pad * 0, mask=padding)
        tl.store(pos_a_ptr + at_pad, tl.load(positions_ptr + last_at) + pad * 0, mask=padding)
        tl.store(temps_a_ptr + at_pad, tl.load(temps_ptr + last_at) + pad * 0, mask=padding)
        tl.store(canvas_a_ptr + at_pad, tl.load(canvas_ptr + last_at) + pad * 0, mask=padding)
        tl.store(index_ptr + at, tl.where(kept, index, -1), mask=inside)
        tl.store(live_ptr + at, (kept & ~frozen).to(tl.int8), mask=inside)
        tl.store(resting_ptr + at, resting.to(tl.int8), mask=inside)

    @triton.jit
    def _turbo_decide_kernel(
        index_ptr, live_ptr, resting_ptr, argmax_a_ptr, entropy_a_ptr, sampled_a_ptr,
        tokens_ptr, entropy_ptr, frozen_ptr, streak_ptr,
        seeds_ptr, passes_ptr, bound_ptr, conf_ptr, stab_ptr, fpasses_ptr, fentropy_ptr, dormant_ptr, eos_ptr,
        hist_in_ptr, hist_out_ptr,
        canvas_ptr, argmax_out_ptr, entropy_out_ptr, kept_ptr, frozen_out_ptr, streak_out_ptr, flags_ptr,
        C, A, vocab, E,
        MAX_STABILITY: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0).to(tl.int64)
        pos = tl.arange(0, BLOCK_C)
        inside = pos < C
        at = i * C + pos
        live = (tl.load(live_ptr + at, mask=inside, other=0) != 0) & inside
        resting = (tl.load(resting_ptr + at, mask=inside, other=0) != 0) & inside
        tokens = tl.load(tokens_ptr + at, mask=inside, other=0)
        frozen = (tl.load(frozen_ptr + at, mask=inside, other=0) != 0) & inside
        streak = tl.load(streak_ptr + at, mask=inside, other=0)
        row = i * A + tl.maximum(tl.load(index_ptr + at, mask=inside, other=0), 0)
        argmax = tl.where(live, tl.load(argmax_a_ptr + row, mask=live, other=0), tokens)
        entropy = tl.where(
            live, tl.load(entropy_a_ptr + row, mask=live, other=0.0), tl.load(entropy_ptr + at, mask=inside, other=0.0)
        )
        # a resting position has no fresh sample: it ranks last (inf) and is never accepted
        ranked = tl.where(resting, float("inf"), entropy)
        accepted = entropy_bound(ranked, pos, inside, tl.load(bound_ptr + i), C, BLOCK_C) & ~resting
        canvas = tl.where(
            accepted & live,
            tl.load(sampled_a_ptr + row, mask=live, other=0),
            noise_tokens(seeds_ptr, passes_ptr, i, pos, C, vocab),
        )
        canvas = tl.where(frozen, tokens, canvas)
        argmax = tl.where(frozen, tokens, argmax)
        stable = stable_rolled(
            hist_in_ptr, hist_out_ptr, i, pos, inside, argmax, tl.load(stab_ptr + i), C, MAX_STABILITY
        )
        stop = stable & (tl.sum(tl.where(inside, entropy, 0.0), axis=0) / C < tl.load(conf_ptr + i))
        # the freeze rule (engine/turbo.py's `freeze`)
        streak = tl.where(accepted & (argmax == tokens), streak + 1, accepted.to(tl.int64))
        ready = frozen | ((streak >= tl.load(fpasses_ptr + i)) & (entropy <= tl.load(fentropy_ptr + i)))
        e = tl.arange(0, BLOCK_E)
        eos = tl.load(eos_ptr + i * E + e, mask=e < E, other=-1)
        is_eos = tl.sum(((argmax[:, None] == eos[None, :]) & (eos >= 0)[None, :]).to(tl.int32), axis=1) > 0
        first = tl.min(tl.where(ready & is_eos & inside, pos, BLOCK_C), axis=0)
        ready = (ready | (pos >= first)) & inside  # every position after a frozen end of answer
        canvas = tl.where(ready, argmax, canvas)
        stop = (stop & (tl.sum(resting.to(tl.int32), axis=0) == 0)) | (
            tl.sum((~ready & inside).to(tl.int32), axis=0) == 0
        )
        # the next pass's computed positions: resting allowed (at dormant_entropy), and not
        rest_next = _resting(ready, streak, entropy, resting, tl.load(dormant_ptr + i), inside)
        tl.store(flags_ptr + 3 * i, stop.to(tl.int32))
        tl.store(flags_ptr + 3 * i + 1, tl.sum((~ready & ~rest_next & inside).to(tl.int32), axis=0))
        tl.store(flags_ptr + 3 * i + 2, tl.sum((~ready & inside).to(tl.int32), axis=0))
        tl.store(canvas_ptr + at, canvas, mask=inside)
        tl.store(argmax_out_ptr + at, argmax, mask=inside)
        tl.store(entropy_out_ptr + at, entropy, mask=inside)
        tl.store(kept_ptr + at, (accepted | frozen).to(tl.int8), mask=inside)
        tl.store(frozen_out_ptr + at, ready.to(tl.int8), mask=inside)
        tl.store(streak_out_ptr + at, streak, mask=inside)


def turbo_plan(
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    full: torch.Tensor,
    threshold: torch.Tensor,
    reads: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    pool_rows: int,
    active: int,
) -> tuple[torch.Tensor, ...]:
    """The positions a turbo pass computes for n canvases (see the module). `state`: frozen /
    rested [n, C] bool, streak [n, C] int64, entropy [n, C] float32 (frozen, streak, entropy,
    rested); full [n] int32 (a pass over every position), threshold [n] float32 (the rest
    threshold; +inf: none rests); `reads`: slot [n] int32, positions [n, C] int32, temps [n C]
    float32, canvas [n, C] int64; `pool_rows`: a slot's rows in the canvas K/V pool (C); `active`
    rows a canvas (at least its computed positions). Returns rows [n, A] int64, index [n, C]
    int32, live [n, C] bool (computed, not frozen), resting [n, C] bool, and at the rows: pool
    writes [n A] int64 (slot x C + position), RoPE positions [n, A] int32, temperatures [n A]
    float32, tokens [n, A] int64."""
    frozen, streak, entropy, rested = state
    slot, positions, temps, canvas = reads
    n, c = frozen.shape
    device = frozen.device
    rows = torch.empty(n, active, dtype=torch.long, device=device)
    index = torch.empty(n, c, dtype=torch.int32, device=device)
    live = torch.empty(n, c, dtype=torch.int8, device=device)
    resting = torch.empty(n, c, dtype=torch.int8, device=device)
    writes = torch.empty(n * active, dtype=torch.long, device=device)
    pos_a = torch.empty(n, active, dtype=positions.dtype, device=device)
    temps_a = torch.empty(n * active, dtype=temps.dtype, device=device)
    canvas_a = torch.empty(n, active, dtype=canvas.dtype, device=device)
    if n:
        if pool_rows != c:
            raise ValueError(f"a canvas K/V slot holds the canvas's {c} positions, got {pool_rows}")
        _turbo_plan_kernel[(n,)](
            frozen.view(torch.int8), streak, entropy, rested.view(torch.int8), full, threshold,
            slot, positions, temps, canvas,
            rows, index, live, resting, writes, pos_a, temps_a, canvas_a, c, active,
            BLOCK_C=triton.next_power_of_2(c), BLOCK_A=triton.next_power_of_2(active),
        )  # fmt: skip
    return rows, index, live.view(torch.bool), resting.view(torch.bool), writes, pos_a, temps_a, canvas_a


def turbo_decide(
    plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    argmax: torch.Tensor,
    entropy: torch.Tensor,
    sampled: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    knobs: dict[str, torch.Tensor],
    history: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, ...]:
    """The decisions after a turbo pass (see the module). `plan`: `turbo_plan`'s first four; argmax /
    entropy / sampled [n, A] of its rows; `state` (tokens [n, C] int64, entropy [n, C] float32,
    frozen [n, C] bool, streak [n, C] int64) before the pass; `knobs` [n] each: seeds, passes
    (int64), bounds, confidence (float32), stability (int32), freeze_passes (int64),
    freeze_entropy, dormant_entropy (float32: the rest threshold where resting is allowed; +inf:
    never), eos
    [n, E] int64 (-1: none);
    history [n, MAX_STABILITY, C]. Returns (canvas, argmax [n, C], history, kept [n, C] bool,
    entropy [n, C], frozen [n, C] bool, streak [n, C], flags [n, 3] int32: the stop flag and the
    next pass's computed positions with and without resting, what the host reads)."""
    rows, index, live, resting = plan[:4]
    tokens, entropy_in, frozen, streak = state
    n, c = tokens.shape
    a = rows.shape[1]
    device = tokens.device
    canvas = torch.empty(n, c, dtype=torch.long, device=device)
    argmax_out = torch.empty_like(canvas)
    entropy_out = torch.empty(n, c, dtype=torch.float32, device=device)
    history_out = torch.empty_like(history)
    kept = torch.empty(n, c, dtype=torch.int8, device=device)
    frozen_out = torch.empty(n, c, dtype=torch.int8, device=device)
    streak_out = torch.empty_like(streak)
    flags = torch.empty(n, 3, dtype=torch.int32, device=device)
    eos = knobs["eos"]
    if n:
        _turbo_decide_kernel[(n,)](
            index, live.view(torch.int8), resting.view(torch.int8), argmax, entropy, sampled,
            tokens, entropy_in, frozen.view(torch.int8), streak,
            knobs["seeds"], knobs["passes"], knobs["bounds"], knobs["confidence"], knobs["stability"],
            knobs["freeze_passes"], knobs["freeze_entropy"], knobs["dormant_entropy"], eos,
            history, history_out,
            canvas, argmax_out, entropy_out, kept, frozen_out, streak_out, flags,
            c, a, vocab, eos.shape[1],
            MAX_STABILITY=MAX_STABILITY, BLOCK_C=triton.next_power_of_2(c), BLOCK_E=triton.next_power_of_2(eos.shape[1]),
        )  # fmt: skip
    return (
        canvas,
        argmax_out,
        history_out,
        kept.view(torch.bool),
        entropy_out,
        frozen_out.view(torch.bool),
        streak_out,
        flags,
    )

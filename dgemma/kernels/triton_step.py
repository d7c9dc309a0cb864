"""The sampler's full-vocabulary work on a GPU, in Triton: what `StepOps.decoder_step` and
engine/host/step.py's `decide` do with torch ops over the [rows, vocab] logits.

Each denoising step reads the LM head's output (rows = canvas positions, vocab 262144 on the
released model: 256 MB per canvas in float32) and needs, per row, the argmax, the entropy at the
step's temperature, and unnormalised probabilities for the self-conditioning matmul and for
sampling. In torch that is a chain of full-vocab passes (softcap, max, subtract, divide, clamp,
exp, sum, multiply, sum; then a cumsum and a search to sample). Here:

- `step_statistics`: one kernel reads each row once (vocab tiled, one program per row) and keeps an
  online maximum, argmax, sum of exp(d) and sum of d * exp(d), with d = (softcap(z) - max) / T,
  rescaling both sums when the maximum moves (as an online softmax does); entropy =
  log(sum e) - sum(d e) / sum e. A second kernel writes the unnormalised probabilities
  exp(max(d, EXP_FLOOR)) in the dtype the self-conditioning matmul reads (bf16 for a bf16 model),
  reading the row a second time. Allowed-token masks (the packed bitmask of `sampler.pack_token_mask`)
  are honoured in both: a banned token is never the argmax and weighs exactly 0.
- `philox_draws`: each request's uniforms and re-noising tokens from its own Philox stream
  (`tl.randint4x` keyed by the request's seed, at offsets step * C + position), drawn on
  the device: no host round trip, and a captured graph replays with new step counters. Seeds run
  over [0, 2^64) (the API's range); an int64 tensor holds them as `seed_bits(seed)` (the same 64
  bits) and the kernel reads those bits as the unsigned key, so seeds >= 2^63 get their own streams
  and seeds below 2^63 the streams they always had.
- `sample_rows`: inverse-CDF sampling over the unnormalised probabilities, vocab tiled with a
  running float32 cumulative sum: the first token whose cumulative weight exceeds u x sum, never
  a zero-weight one. The sum is the kernel's own, of the weights as stored and in the order it
  searches them (a first pass over the row), not the caller's `total`: that one is of the weights
  before rounding, and with bf16 weights u x total could land past the searched weights' end
  (up to ~1e-3 of draws on peaked rows), which used to return the last non-zero token, i.e. the
  last vocabulary id (every weight is at least exp(EXP_FLOOR)). A draw still at or past the end
  (u rounding up to 1) takes the row's argmax.

Rounding: softcap's tanh is computed as 1 - 2 / (exp(2x) + 1) (float32), and sums are taken tile
by tile, so values differ from torch's by float32 rounding (tests: argmax equal, entropy and
total within 1e-5 relative, weights within 1e-4 relative, as exp((z - max) / T) amplifies
tanh's rounding by up to 2 cap / T; samples equal except where u x sum falls within float32
rounding of a cumulative-weight boundary).
"""

from __future__ import annotations

import torch

from . import EXP_FLOOR, triton_canvas
from .triton_canvas import (
    MAX_STABILITY,
    entropy_bound,
    noise_tokens,
    rows_per_program,
    softcapped,
    stable_rolled,
    vocab_block,
)
from .triton_support import HAVE_TRITON, runs_on, tl, triton

if HAVE_TRITON:

    @triton.jit
    def _allowed(mask_ptr, rows, cols, valid, words, HAS_MASK: tl.constexpr):
        """Whether token cols[j] is allowed in row rows[i] ([R, BLOCK_V]; bit t % 32 of word t // 32)."""
        if HAS_MASK:
            word = tl.load(mask_ptr + rows.to(tl.int64)[:, None] * words + (cols // 32)[None, :], mask=valid, other=0)
            valid = valid & (((word >> (cols % 32)[None, :]) & 1) != 0)
        return valid

    @triton.jit
    def _stats_kernel(
        z_ptr,
        mask_ptr,
        temps_ptr,
        argmax_ptr,
        entropy_ptr,
        max_ptr,
        total_ptr,
        ROWS,
        V,
        stride_z,
        words,
        CAP: tl.constexpr,
        HAS_MASK: tl.constexpr,
        FLOOR: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows < ROWS
        inv_t = 1.0 / tl.load(temps_ptr + rows, mask=r_ok, other=1.0).to(tl.float32)
        base = z_ptr + rows.to(tl.int64)[:, None] * stride_z
        best = tl.full((BLOCK_R,), -float("inf"), tl.float32)
        best_index = tl.zeros((BLOCK_R,), tl.int32)
        s = tl.zeros((BLOCK_R,), tl.float32)  # sum of exp(d), d relative to `best`
        t = tl.zeros((BLOCK_R,), tl.float32)  # sum of d * exp(d)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            inside = r_ok[:, None] & (cols < V)[None, :]
            valid = _allowed(mask_ptr, rows, cols, inside, words, HAS_MASK)
            z = softcapped(tl.load(base + cols[None, :], mask=inside, other=0.0).to(tl.float32), CAP)
            z = tl.where(valid, z, -float("inf"))
            tile_best = tl.max(z, axis=1)
            tile_index = tl.argmax(z, axis=1) + v0
            new_best = tl.maximum(best, tile_best)
            best_index = tl.where(tile_best > best, tile_index, best_index)  # ties: the first tile's
            # rescale the sums to the new maximum: d' = d + delta, delta = (best - new_best) / T <= 0
            # (no inf - inf anywhere: where nothing is allowed yet, best and new_best are both -inf)
            ref = tl.where(new_best == -float("inf"), 0.0, new_best)
            delta = (tl.where(best == -float("inf"), ref, best) - ref) * inv_t
            alpha = tl.exp(delta)
            t = alpha * (t + delta * s)
            s = alpha * s
            d = tl.maximum((z - ref[:, None]) * inv_t[:, None], FLOOR)
            e = tl.where(valid, tl.exp(d), 0.0)
            s += tl.sum(e, axis=1)
            t += tl.sum(tl.where(valid, d * e, 0.0), axis=1)
            best = new_best
        entropy = tl.maximum(tl.log(s) - t / s, 0.0)
        entropy = tl.where(s > 0, entropy, 0.0)  # a row allowing nothing (the caller's error)
        tl.store(argmax_ptr + rows, best_index, mask=r_ok)
        tl.store(entropy_ptr + rows, entropy, mask=r_ok)
        tl.store(max_ptr + rows, best, mask=r_ok)
        tl.store(total_ptr + rows, s, mask=r_ok)

    @triton.jit
    def _weights_kernel(
        z_ptr,
        mask_ptr,
        temps_ptr,
        max_ptr,
        total_ptr,
        w_ptr,
        ROWS,
        V,
        stride_z,
        stride_w,
        words,
        CAP: tl.constexpr,
        HAS_MASK: tl.constexpr,
        FLOOR: tl.constexpr,
        NORMALIZE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows < ROWS
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        inside = r_ok[:, None] & (cols < V)[None, :]
        inv_t = 1.0 / tl.load(temps_ptr + rows, mask=r_ok, other=1.0).to(tl.float32)
        best = tl.load(max_ptr + rows, mask=r_ok, other=0.0)
        best = tl.where(best == -float("inf"), 0.0, best)  # a row allowing nothing: all weights 0 below
        valid = _allowed(mask_ptr, rows, cols, inside, words, HAS_MASK)
        r64 = rows.to(tl.int64)[:, None]
        z = softcapped(tl.load(z_ptr + r64 * stride_z + cols[None, :], mask=inside, other=0.0).to(tl.float32), CAP)
        e = tl.where(valid, tl.exp(tl.maximum((z - best[:, None]) * inv_t[:, None], FLOOR)), 0.0)
        if NORMALIZE:  # probabilities: softmax's values, in the dtype of the self-conditioning matmul
            e = e / tl.load(total_ptr + rows, mask=r_ok, other=1.0)[:, None]
        tl.store(w_ptr + r64 * stride_w + cols[None, :], e.to(w_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _sample_kernel(
        w_ptr,
        u_ptr,
        seeds_ptr,
        passes_ptr,
        out_ptr,
        ROWS,
        V,
        C,
        R,
        stride_w,
        DRAW: tl.constexpr,
        POSITIONS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows < ROWS
        base = w_ptr + rows.to(tl.int64)[:, None] * stride_w
        # pass 1: the float32 sum of the weights as stored (the same tile cumsums as pass 2, so the
        # same running values: the draw can only land inside the CDF that pass 2 searches), and
        # their argmax (first of ties) for a draw that lands at or past the end.
        running = tl.zeros((BLOCK_R,), tl.float32)
        best = tl.full((BLOCK_R,), -float("inf"), tl.float32)
        best_index = tl.zeros((BLOCK_R,), tl.int32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            w = tl.load(base + cols[None, :], mask=r_ok[:, None] & (cols < V)[None, :], other=0.0).to(tl.float32)
            running = tl.max(tl.cumsum(w, axis=1) + running[:, None], axis=1)
            tile_best = tl.max(w, axis=1)
            best_index = tl.where(tile_best > best, tl.argmax(w, axis=1) + v0, best_index)
            best = tl.maximum(best, tile_best)
        if DRAW:  # each row's own Philox uniform (rows of one program are R rows of one request)
            req = (tl.program_id(0) * BLOCK_R) // R
            seed = tl.load(seeds_ptr + req).to(tl.uint64, bitcast=True)
            if POSITIONS:  # a turbo pass's rows: their canvas positions (u_ptr)
                position = tl.load(u_ptr + rows, mask=r_ok, other=0)
            else:
                position = rows % R
            offsets = (tl.load(passes_ptr + req) * C + position).to(tl.uint32)
            r0, _, _, _ = tl.randint4x(seed, offsets)
            u = tl.random.uint_to_uniform_float(r0)
        else:
            u = tl.load(u_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)
        target = u * running
        # pass 2: the first token of non-zero weight whose cumulative weight exceeds u x sum
        running = tl.zeros((BLOCK_R,), tl.float32)
        found = tl.full((BLOCK_R,), V, tl.int32)  # V: none yet
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            w = tl.load(base + cols[None, :], mask=r_ok[:, None] & (cols < V)[None, :], other=0.0).to(tl.float32)
            cdf = tl.cumsum(w, axis=1) + running[:, None]
            hit = tl.min(tl.where((cdf > target[:, None]) & (w > 0), cols[None, :], V), axis=1)
            found = tl.minimum(found, hit)
            running = tl.max(cdf, axis=1)
        # u x sum at or past the last cumulative weight (u rounding up to 1, u >= 1, NaN): the argmax
        tl.store(out_ptr + rows, tl.where(found < V, found, best_index).to(tl.int64), mask=r_ok)

    @triton.jit
    def _philox_kernel(seeds_ptr, steps_ptr, u_ptr, noise_ptr, C, vocab, BLOCK_C: tl.constexpr):
        row = tl.program_id(0)
        seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)  # the key: the seed's unsigned 64 bits
        step = tl.load(steps_ptr + row)
        pos = tl.arange(0, BLOCK_C)
        inside = pos < C
        offsets = (step * C + pos).to(tl.uint32)
        # one Philox call gives four 32-bit words per offset: the first makes the uniform, the second the noise token
        r0, r1, _, _ = tl.randint4x(seed, offsets)
        tl.store(u_ptr + row * C + pos, tl.random.uint_to_uniform_float(r0), mask=inside)
        tl.store(noise_ptr + row * C + pos, (r1.to(tl.uint32) % vocab.to(tl.uint32)).to(tl.int64), mask=inside)

    @triton.jit
    def _decide_kernel(
        entropy_ptr, argmax_ptr, sampled_ptr, seeds_ptr, passes_ptr, fixed_ptr, bound_ptr, conf_ptr, stab_ptr,
        hist_in_ptr, hist_out_ptr, canvas_ptr, argmax_out_ptr, kept_ptr, shown_ptr, stop_ptr,
        C, vocab,
        HAS_FIXED: tl.constexpr, MAX_STABILITY: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        """One request's sampler decisions after its pass (engine/host/step.py's `decide`, sampler.py): entropy-bound
        acceptance over the free positions, the next canvas (accepted: the sampled token; else its
        Philox noise token; fixed: the fixed one), the stopping rule (stable over the last
        `stability` argmax canvases, mean entropy of the free positions below the threshold) and
        the rolled history, what a draft shows."""
        i = tl.program_id(0).to(tl.int64)
        pos = tl.arange(0, BLOCK_C)
        inside = pos < C
        row = i * C + pos
        entropy = tl.load(entropy_ptr + row, mask=inside, other=0.0)
        argmax = tl.load(argmax_ptr + row, mask=inside, other=0)
        if HAS_FIXED:
            fixed = tl.load(fixed_ptr + row, mask=inside, other=-1).to(tl.int64)
            free = fixed < 0
        else:
            fixed = tl.full((BLOCK_C,), -1, tl.int64)
            free = pos >= 0
        weighed = tl.where(free, entropy, 0.0)
        accepted = entropy_bound(weighed, pos, inside, tl.load(bound_ptr + i), C, BLOCK_C) & free
        noise = noise_tokens(seeds_ptr, passes_ptr, i, pos, C, vocab)
        canvas = tl.where(accepted, tl.load(sampled_ptr + row, mask=inside, other=0), noise)
        canvas = tl.where(free, canvas, fixed)
        argmax = tl.where(free, argmax, fixed)
        stable = stable_rolled(
            hist_in_ptr, hist_out_ptr, i, pos, inside, argmax, tl.load(stab_ptr + i), C, MAX_STABILITY
        )
        count = tl.sum((free & inside).to(tl.float32), axis=0)
        mean = tl.sum(weighed, axis=0) / tl.maximum(count, 1.0)
        stop = stable & (mean < tl.load(conf_ptr + i))
        tl.store(canvas_ptr + row, canvas, mask=inside)
        tl.store(argmax_out_ptr + row, argmax, mask=inside)
        tl.store(kept_ptr + row, (accepted | ~free).to(tl.int8), mask=inside)
        tl.store(shown_ptr + row, weighed, mask=inside)
        tl.store(stop_ptr + i, stop.to(tl.int8))


def available(device: torch.device | str) -> bool:
    """Whether these kernels can run on `device` (triton_support.runs_on)."""
    return runs_on(device, triton_canvas.INTERPRETED)


def _check_rows(name: str, rows: int, t: torch.Tensor) -> None:
    if t.dim() != 1 or t.shape[0] != rows:
        raise ValueError(f"{name} must be [{rows}] (one per row), got {list(t.shape)}")


def step_statistics(
    logits: torch.Tensor,
    temps: torch.Tensor,
    softcap: float = 0.0,
    allowed: torch.Tensor | None = None,
    probs_dtype: torch.dtype = torch.float32,
    normalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """argmax [N], entropy [N], total [N] and unnormalised probabilities [N, V] (`probs_dtype`) of
    softcap(logits) / temps, as `sampler.step_statistics` gives them for already-softcapped logits;
    `normalize`: the probabilities themselves (divided by total before the store: softmax's values,
    what the self-conditioning matmul reads, so it needs no division afterwards).

    logits: [N, V] float32 / bf16 / fp16, the LM head's raw output (softcapped here: `softcap` > 0);
    temps: [N] (or [N, 1]) each row's temperature; allowed: int32 [N, ceil(V / 32)] or None."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with contiguous rows, got {list(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    rows, vocab = logits.shape
    temps = temps.reshape(-1).to(device=logits.device, dtype=torch.float32).contiguous()
    _check_rows("temps", rows, temps)
    words = -(-vocab // 32)
    if allowed is not None:
        if allowed.dtype != torch.int32 or tuple(allowed.shape) != (rows, words):
            raise ValueError(f"allowed must be int32 [{rows}, {words}], got {allowed.dtype} {list(allowed.shape)}")
        allowed = allowed.contiguous()
    mask = allowed if allowed is not None else torch.empty(1, dtype=torch.int32, device=logits.device)
    argmax = torch.empty(rows, dtype=torch.long, device=logits.device)
    entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
    best = torch.empty(rows, dtype=torch.float32, device=logits.device)
    total = torch.empty(rows, dtype=torch.float32, device=logits.device)
    probs = torch.empty(rows, vocab, dtype=probs_dtype, device=logits.device)
    block, cap = vocab_block(vocab), float(softcap or 0.0)
    block_r = rows_per_program(rows)
    common = dict(CAP=cap, HAS_MASK=allowed is not None, FLOOR=EXP_FLOOR, BLOCK_R=block_r, BLOCK_V=block)
    grid = (triton.cdiv(rows, block_r),)
    _stats_kernel[grid](
        logits, mask, temps, argmax, entropy, best, total, rows, vocab, logits.stride(0), words, **common
    )
    _weights_kernel[(grid[0], triton.cdiv(vocab, block))](
        logits,
        mask,
        temps,
        best,
        total,
        probs,
        rows,
        vocab,
        logits.stride(0),
        probs.stride(0),
        words,
        NORMALIZE=normalize,
        **common,
    )
    return argmax, entropy, total, probs


def seed_bits(seed: int) -> int:
    """The int64 with the same 64 bits (two's complement) as `seed`, a request's seed in
    [0, 2^64): what `philox_draws` takes in its int64 `seeds` tensor (seeds >= 2^63 become
    negative; the kernel reads the bits back as the unsigned key, so each seed keeps its own stream
    and seeds below 2^63 map to themselves). ValueError outside [0, 2^64)."""
    seed = int(seed)
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2^64), got {seed}")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def sample_rows(weights: torch.Tensor, total: torch.Tensor | None, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of unnormalised `weights` [N, V] (any float dtype; summed in float32)
    given u ~ U(0, 1) [N]: `sampler.sample_from_weights` over the weights as stored.

    `total` ([N] or None) is ignored: the kernel sums the weights it searches itself, because a
    total of other values (the unrounded weights, before a bf16 store) can put u x total past the
    searched weights' end. Where u x sum still reaches the end (u rounding up to 1), the row's
    argmax is sampled. Fixed work per row (two reads of it), no host sync: graph-capturable."""
    if weights.dim() != 2 or weights.stride(-1) != 1:
        raise ValueError(f"weights must be [rows, vocab] with contiguous rows, got {list(weights.shape)}")
    rows, vocab = weights.shape
    if total is not None:
        _check_rows("total", rows, total.reshape(-1))
    uniforms = uniforms.reshape(-1).contiguous()
    _check_rows("uniforms", rows, uniforms)
    out = torch.empty(rows, dtype=torch.long, device=weights.device)
    block_r = rows_per_program(rows)
    _sample_kernel[(triton.cdiv(rows, block_r),)](
        weights,
        uniforms,
        out,
        out,
        out,
        rows,
        vocab,
        1,
        1,
        weights.stride(0),
        DRAW=False,
        POSITIONS=False,
        BLOCK_R=block_r,
        BLOCK_V=vocab_block(vocab),
    )
    return out


def sample_drawn(
    weights: torch.Tensor,
    seeds: torch.Tensor,
    passes: torch.Tensor,
    canvas_length: int,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sample_rows` with each row's uniform drawn in the kernel from its request's Philox stream:
    row r is position r % C of request r // C (seeds / passes [n] int64, as `philox_draws`), the
    uniform the one `philox_draws` gives it. One launch instead of two. `positions` [n, A] (int64):
    a turbo pass's rows, A a request, at those canvas positions (the uniforms an exact pass draws
    there)."""
    rows, vocab = weights.shape
    per = canvas_length if positions is None else positions.shape[1]
    out = torch.empty(rows, dtype=torch.long, device=weights.device)
    block_r = rows_per_program(rows, per)
    _sample_kernel[(triton.cdiv(rows, block_r),)](
        weights,
        weights if positions is None else positions.reshape(-1),
        seeds,
        passes,
        out,
        rows,
        vocab,
        canvas_length,
        per,
        weights.stride(0),
        DRAW=True,
        POSITIONS=positions is not None,
        BLOCK_R=block_r,
        BLOCK_V=vocab_block(vocab),
    )
    return out


def philox_draws(
    seeds: torch.Tensor, steps: torch.Tensor, canvas_length: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [n, C] in [0, 1) and re-noising tokens [n, C] in [0, vocab) for n requests, each
    from its own Philox stream: `seeds` [n] (int64: `seed_bits(seed)` of a request's seed in
    [0, 2^64), whose 64 bits are the Philox key), `steps` [n] (int64, how many steps it has drawn
    for; step x C wraps at 2^32): a request draws the same numbers whatever runs beside it."""
    if seeds.dtype != torch.int64:
        raise ValueError(f"seeds must be int64 (seed_bits of each seed), got {seeds.dtype}")
    n = seeds.shape[0]
    _check_rows("steps", n, steps)
    u = torch.empty(n, canvas_length, dtype=torch.float32, device=seeds.device)
    noise = torch.empty(n, canvas_length, dtype=torch.long, device=seeds.device)
    block = triton.next_power_of_2(canvas_length)
    _philox_kernel[(n,)](seeds.contiguous(), steps.contiguous(), u, noise, canvas_length, vocab, BLOCK_C=block)
    return u, noise


def decide(
    entropy: torch.Tensor,
    argmax: torch.Tensor,
    sampled: torch.Tensor,
    seeds: torch.Tensor,
    passes: torch.Tensor,
    fixed: torch.Tensor | None,
    bounds: torch.Tensor,
    confidence: torch.Tensor,
    stability: torch.Tensor,
    history: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, ...]:
    """The sampler's decisions for n canvases in one launch: engine/host/step.py's `decide`: its entropy-bound
    acceptance, re-noising (each request's Philox noise tokens, as `philox_draws`), fixed
    positions and stopping rule. entropy [n, C] float32, argmax / sampled [n, C] int64, fixed
    [n, C] int (-1 free) or None, bounds / confidence [n] float32, stability [n] int32 (at most
    MAX_STABILITY), history [n, MAX_STABILITY, C] int64 (row s < stability: the argmax canvas of s +
    1 passes before the newest, -1 unknown; the newest last). Returns (canvas, argmax [n, C] int64,
    history [n, MAX_STABILITY, C], stop [n] bool, kept [n, C] bool, shown [n, C] float32)."""
    n, c = entropy.shape
    if history.shape != (n, MAX_STABILITY, c):
        raise ValueError(f"history must be [{n}, {MAX_STABILITY}, {c}], got {tuple(history.shape)}")
    device = entropy.device
    canvas = torch.empty(n, c, dtype=torch.long, device=device)
    argmax_out = torch.empty_like(canvas)
    history_out = torch.empty_like(history)
    kept = torch.empty(n, c, dtype=torch.int8, device=device)
    shown = torch.empty(n, c, dtype=torch.float32, device=device)
    stop = torch.empty(n, dtype=torch.int8, device=device)
    if n:
        _decide_kernel[(n,)](
            entropy, argmax, sampled, seeds, passes, fixed if fixed is not None else canvas, bounds, confidence, stability,
            history, history_out, canvas, argmax_out, kept, shown, stop, c, vocab,
            HAS_FIXED=fixed is not None, MAX_STABILITY=MAX_STABILITY, BLOCK_C=triton.next_power_of_2(c),
        )  # fmt: skip
    return canvas, argmax_out, history_out, stop.view(torch.bool), kept.view(torch.bool), shown

"""The per-canvas rules that the sampler's kernels share: triton_step's decide kernel (the default
step), triton_turbo's (turbo passes) and triton_ar's argmax read the same softcap, entropy-bound
acceptance, Philox re-noising and stop-rule history, so the three paths decide alike. Also the
host-side sizes of the vocabulary kernels (rows a program, vocabulary tile).

Every name here exists whether or not triton is installed (None, or a plain value, without it):
a module that imports them must import on a CPU-only install, where PyTorch's CPU wheel brings
no triton (tests/test_plain_install.py).
"""

from __future__ import annotations

from .triton_support import HAVE_TRITON, interpreted, tl, triton

MAX_STABILITY = 4  # the longest stop-rule history the decide kernels keep (longer: the torch decisions)

if HAVE_TRITON:

    @triton.jit
    def softcapped(z, CAP: tl.constexpr):
        """cap * tanh(z / cap) (CAP 0: z), with tanh(x) = 1 - 2 / (exp(2x) + 1): exact at the
        extremes (exp overflows to inf: 1; underflows to 0: -1) and portable across Triton versions."""
        if CAP > 0:
            z = CAP * (1.0 - 2.0 / (tl.exp(2.0 * z / CAP) + 1.0))
        return z

    @triton.jit
    def entropy_bound(weighed, pos, inside, bound, C, BLOCK_C: tl.constexpr):
        """sampler.entropy_bound_accept over one canvas: lowest entropies first while (cumulative sum
        - own) <= bound, a prefix of the sorted order; keys are the entropy's bits (>= 0: ordered as
        integers; +inf last) and the position (ties: the lower first)."""
        keys = (weighed.to(tl.int32, bitcast=True).to(tl.int64) << 16) | pos.to(tl.int64)
        keys = tl.where(inside, keys, 0x7FFFFFFFFFFFFFFF)
        ordered = tl.sort(keys)
        sorted_e = tl.where(tl.arange(0, BLOCK_C) < C, (ordered >> 16).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
        before = tl.cumsum(sorted_e, axis=0) - sorted_e
        taken = tl.sum(((before <= bound) & (tl.arange(0, BLOCK_C) < C)).to(tl.int32), axis=0)
        last = tl.max(tl.where(tl.arange(0, BLOCK_C) < taken, ordered, -1), axis=0)
        return (keys <= last) & inside

    @triton.jit
    def noise_tokens(seeds_ptr, passes_ptr, i, pos, C, vocab):
        """Each position's re-noising token from the request's Philox stream (as triton_step.philox_draws)."""
        seed = tl.load(seeds_ptr + i).to(tl.uint64, bitcast=True)
        offsets = (tl.load(passes_ptr + i) * C + pos).to(tl.uint32)
        _, r1, _, _ = tl.randint4x(seed, offsets)
        return (r1.to(tl.uint32) % vocab.to(tl.uint32)).to(tl.int64)

    @triton.jit
    def stable_rolled(hist_in_ptr, hist_out_ptr, i, pos, inside, argmax, stability, C, MAX_STABILITY: tl.constexpr):
        """Whether `argmax` equals the last `stability` argmax canvases of the history, and the
        history rolled with it (rows s < stability: the oldest first, the newest the argmax)."""
        stable = True
        for s in tl.static_range(MAX_STABILITY):
            h_off = (i * MAX_STABILITY + s) * C + pos
            past = tl.load(hist_in_ptr + h_off, mask=inside, other=0)
            same = tl.sum(((past != argmax) & inside).to(tl.int32), axis=0) == 0
            stable = stable & (same | (s >= stability))
            if s + 1 < MAX_STABILITY:  # rolled: row s takes row s + 1, the newest row the argmax canvas
                newer = tl.load(hist_in_ptr + h_off + C, mask=inside, other=0)
                rolled = tl.where(s + 1 < stability, newer, argmax)
            else:
                rolled = argmax
            tl.store(hist_out_ptr + h_off, tl.where(s < stability, rolled, past), mask=inside)
        return stable

    INTERPRETED = interpreted(softcapped)
else:  # pragma: no cover - exercised only where triton is not installed
    softcapped = entropy_bound = noise_tokens = stable_rolled = None
    INTERPRETED = False


def rows_per_program(rows: int, canvas_length: int | None = None) -> int:
    """Rows a program of the vocabulary kernels takes: one on a GPU (a row is the parallel unit),
    up to 16 under the interpreter (which runs programs one by one), dividing the canvas length
    where rows are canvas positions (a program's rows then belong to one request)."""
    if not INTERPRETED:
        return 1
    block = min(16, triton.next_power_of_2(max(rows, 1)))
    while canvas_length and canvas_length % block:
        block //= 2
    return block


def vocab_block(vocab: int) -> int:
    """The vocabulary tile of a program: small under the interpreter (which runs tiles one by one)."""
    return 128 if INTERPRETED else min(4096, triton.next_power_of_2(vocab))

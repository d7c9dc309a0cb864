"""Served LoRA adapters on the fused GPU layer: a shrink and an expand kernel per adapted GEMM.

kernels/fused.py runs a layer's linears as four GEMMs (q|k|v, o, gate|up, down). With adapters
(kernels/lora.py's `LoraSlots`: A [S, R, K], B [S, N, R] per linear, preallocated, rank padded
with zeros), each GEMM's output gets, row by row, its row's adapter's delta:

    shrink   low[m, p R : (p + 1) R] = x[m] @ A_p[slot[m]].T          (float32, [M, P R])
    expand   out[m, n] += low[m, p(n) R : (p(n) + 1) R] @ B_p[slot[m], n].T

for the P linears a fused GEMM holds side by side (q, k, v: P = 3; global layers P = 2; gate|up: 2;
o and down: 1), p(n) the linear output column n belongs to. `slot[m]` is the row's adapter
(-1: none; its output is left as it is). Two launches a GEMM, eight a layer, whatever the batch
holds: the grid covers (row blocks, slots) and a program whose block holds no row of its slot
returns at once, so a step of base rows costs the launches and no work. The rows of one request
(a canvas) are consecutive, so a block of rows is almost always one slot's; no sort, no host
sync, fixed shapes: one CUDA graph per bucket replays any mix of adapters.

Rounding: x and the weights are read in their dtype and multiplied in float32 (tl.dot's float32
accumulator); the low-rank product stays float32 (as vLLM's punica kernels keep it); the sum with
the GEMM's output is rounded once, to the output's dtype.
"""

from __future__ import annotations

import torch

from .triton_support import HAVE_TRITON, interpreted, runs_on, tl, triton

BLOCK_M = 32
BLOCK_K = 64
BLOCK_N = 64
MAX_PARTS = 3  # q, k, v: the most linears one fused GEMM holds side by side

if HAVE_TRITON:

    @triton.jit
    def _rows_of_slot(slot_ptr, M, s, BLOCK_M: tl.constexpr):
        """This program's rows (int64 [BLOCK_M]) and which of them run adapter slot `s`."""
        m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(slot_ptr + m, mask=m < M, other=-1)
        return m, (slot == s) & (m < M)

    @triton.jit
    def _shrink_part(x_ptr, a_ptr, m, mine, s, K, stride_x, stride_as, stride_ar, R,
                     RP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        """x[rows] @ A[s].T over K, float32 [BLOCK_M, RP] (ranks past R read as 0)."""
        r = tl.arange(0, RP)
        acc = tl.zeros((BLOCK_M, RP), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mine[:, None] & (k < K)[None, :], other=0.0)
            a = tl.load(
                a_ptr + s * stride_as + r[None, :] * stride_ar + k[:, None],
                mask=(r < R)[None, :] & (k < K)[:, None],
                other=0.0,
            )
            acc += tl.dot(xs.to(tl.float32), a.to(tl.float32))
        return acc

    @triton.jit
    def _shrink_kernel(
        x_ptr, slot_ptr, low_ptr, a0_ptr, a1_ptr, a2_ptr,
        M, K, R, stride_x, stride_low, stride_as, stride_ar,
        PARTS: tl.constexpr, RP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        s = tl.program_id(1)
        m, mine = _rows_of_slot(slot_ptr, M, s, BLOCK_M)
        if tl.max(mine.to(tl.int32), axis=0) == 0:
            return
        r = tl.arange(0, RP)
        out = low_ptr + m[:, None] * stride_low + r[None, :]
        keep = mine[:, None] & (r < RP)[None, :]
        low = _shrink_part(x_ptr, a0_ptr, m, mine, s, K, stride_x, stride_as, stride_ar, R, RP, BLOCK_M, BLOCK_K)
        tl.store(out, low, mask=keep)
        if PARTS > 1:
            low = _shrink_part(x_ptr, a1_ptr, m, mine, s, K, stride_x, stride_as, stride_ar, R, RP, BLOCK_M, BLOCK_K)
            tl.store(out + RP, low, mask=keep)
        if PARTS > 2:
            low = _shrink_part(x_ptr, a2_ptr, m, mine, s, K, stride_x, stride_as, stride_ar, R, RP, BLOCK_M, BLOCK_K)
            tl.store(out + 2 * RP, low, mask=keep)

    @triton.jit
    def _expand_part(low_ptr, b_ptr, m, mine, s, n, inside, stride_low, stride_bs, stride_bn, R, part,
                     RP: tl.constexpr):  # fmt: skip
        """low[rows, part] @ B[s, n].T for the columns `inside` this part (float32 [BLOCK_M, BLOCK_N])."""
        r = tl.arange(0, RP)
        low = tl.load(low_ptr + m[:, None] * stride_low + part * RP + r[None, :], mask=mine[:, None], other=0.0)
        b = tl.load(
            b_ptr + s * stride_bs + n[None, :] * stride_bn + r[:, None],
            mask=(r < R)[:, None] & inside[None, :],
            other=0.0,
        )
        return tl.dot(low, b.to(tl.float32))

    @triton.jit
    def _expand_kernel(
        low_ptr, slot_ptr, out_ptr, b0_ptr, b1_ptr, b2_ptr,
        M, N0, N1, N2, R, stride_low, stride_out, stride_b0s, stride_b1s, stride_b2s, stride_bn,
        PARTS: tl.constexpr, RP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        s = tl.program_id(2)
        m, mine = _rows_of_slot(slot_ptr, M, s, BLOCK_M)
        if tl.max(mine.to(tl.int32), axis=0) == 0:
            return
        n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _expand_part(low_ptr, b0_ptr, m, mine, s, n, n < N0, stride_low, stride_b0s, stride_bn, R, 0, RP)
        if PARTS > 1:
            n1 = n - N0
            inside = (n1 >= 0) & (n1 < N1)
            acc += _expand_part(low_ptr, b1_ptr, m, mine, s, n1, inside, stride_low, stride_b1s, stride_bn, R, 1, RP)
        if PARTS > 2:
            n2 = n - N0 - N1
            inside = (n2 >= 0) & (n2 < N2)
            acc += _expand_part(low_ptr, b2_ptr, m, mine, s, n2, inside, stride_low, stride_b2s, stride_bn, R, 2, RP)
        n_all = N0 + N1 + N2
        where = out_ptr + m[:, None] * stride_out + n[None, :]
        keep = mine[:, None] & (n < n_all)[None, :]
        y = tl.load(where, mask=keep, other=0.0).to(tl.float32)
        tl.store(where, (y + acc).to(out_ptr.dtype.element_ty), mask=keep)


def available(device: torch.device | str) -> bool:
    """The kernels run on `device` (CUDA, or anything under TRITON_INTERPRET=1)."""
    return HAVE_TRITON and runs_on(device, interpreted(_shrink_kernel))


def padded_rank(max_rank: int) -> int:
    """The rank tl.dot multiplies by: a power of two, at least 16."""
    return max(16, 1 << (max(1, max_rank) - 1).bit_length())


def add_lora(
    x: torch.Tensor,
    out: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    slots: torch.Tensor,
    low: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [M, sum N_p] += per row m, the adapter in `slots[m]` (-1: none) of each of the P linears
    side by side in `out`: (x [M, K] @ A_p[slot].T) @ B_p[slot].T, A_p [S, R, K], B_p [S, N_p, R]
    (kernels/lora.py's slots); in place, two launches. `low` [M, P * padded_rank(R)] float32: the
    shrink's output buffer (a fresh one when None)."""
    parts = len(a)
    if not 1 <= parts <= MAX_PARTS or len(b) != parts:
        raise ValueError(f"add_lora takes 1 to {MAX_PARTS} linears, A and B alike (got {len(a)}, {len(b)})")
    m, k = x.shape
    slot_count, rank = a[0].shape[0], a[0].shape[1]
    rp = padded_rank(rank)
    if low is None:
        low = torch.empty(m, parts * rp, dtype=torch.float32, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    a_ptrs = (a + [a[0]] * MAX_PARTS)[:MAX_PARTS]
    _shrink_kernel[(triton.cdiv(m, BLOCK_M), slot_count)](
        x, slots, low, *a_ptrs,
        m, k, rank, x.stride(0), low.stride(0), a[0].stride(0), a[0].stride(1),
        PARTS=parts, RP=rp, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    widths = [t.shape[1] for t in b] + [0] * (MAX_PARTS - parts)
    b_ptrs = (b + [b[0]] * MAX_PARTS)[:MAX_PARTS]
    strides = [t.stride(0) for t in b_ptrs]
    _expand_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(sum(widths), BLOCK_N), slot_count)](
        low, slots, out, *b_ptrs,
        m, *widths, rank, low.stride(0), out.stride(0), *strides, b[0].stride(1),
        PARTS=parts, RP=rp, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return out

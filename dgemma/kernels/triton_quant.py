"""GPU matmuls with quantised weights: y = x @ dequantize(W).T without a full-precision W.

`modules.py` dequantises a tile of W with torch and calls F.linear: on a GPU that writes and
reads the tile back in full precision, so a memory-bound matmul (decoding, the MoE experts)
moves 2-4x the weight's quantised bytes. Here a Triton kernel reads the quantised parts
(`formats.py`, laid out as compressed-tensors stores them) and dequantises each K-tile in
registers, accumulating in float32:

    scheme  read per K-tile                                      dequantised as
    int4    weight_packed int32 [N, K/8], weight_scale [N, K/g]  (nibble - 8) * scale  (g: group)
    int8    weight int8 [N, K]                                   q, times weight_scale [N, 1] at the end
    fp8     weight float8_e4m3fn [N, K] (decoded by bits)        q, times weight_scale [N, 1] at the end
    nvfp4   weight_packed uint8 [N, K/2], weight_scale e4m3 [N, K/16]
                                                                 e2m1(code) * (scale / weight_global_scale)

float8 parts are passed as uint8 views and decoded by bit manipulation: the same code runs in
Triton's interpreter (TRITON_INTERPRET=1, numpy has no float8) and on any GPU, including those
without float8 support. Per-channel scales (int8, fp8) are applied to the accumulator, not to
each weight: the codes are exact in bf16 / fp16, so this is the same product with fewer
multiplies.

The grouped variant runs the MoE experts in one launch: rows sorted by expert, `offsets` the
cumulative row counts, a grid of (row tiles, N tiles) where each row tile belongs to one expert
(a tile -> expert map built on the device, so no host synchronisation: CUDA-graph friendly).

On GPUs with FP8 tensor cores (compute capability >= 8.9) fp8 weights instead go to
torch._scaled_mm (tensor-core FP8, activations quantised per token) and, where torch has a
grouped kernel for the device (sm90 / sm100), experts to torch._scaled_grouped_mm.

Public: `available`, `quant_linear`, `quant_grouped_linear` (dispatchers), the kernels' wrappers
`triton_quant_linear`, `triton_quant_grouped_linear`, and the FP8 tensor-core paths
`fp8_scaled_mm_linear`, `fp8_scaled_grouped_mm`, `quantize_activations_fp8`. The CPU path stays
in `dgemma/quant/modules.py`; the dispatchers raise on a device they cannot serve.

Block sizes are heuristics, not tuned on hardware: the interpreter tests check numerics, and a
test compiles the kernel for sm90 without running it. Two interpreter quirks are worked around:
it multiplies bf16 tiles' raw bits in tl.dot (so there the bf16 dot runs in float32, the same
products) and casts int8 -> bf16 wrongly (so int8 goes through float32 everywhere).
"""

from __future__ import annotations

import functools

import torch

from .triton_support import HAVE_TRITON, interpreted, runs_on, tl, triton

from ..quant.formats import FP8_MAX, NVFP4_GROUP, QTensor

SCHEME_IDS = {"int4": 0, "int8": 1, "fp8": 2, "nvfp4": 3}
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAVE_TRITON:

    @triton.jit
    def _decode_e4m3(b):
        """float8_e4m3fn bytes (int32 0..255) -> float32, exactly: normals by building the
        float32 bits, subnormals as man * 2^-9, 0x7F / 0xFF as NaN."""
        exp = (b >> 3) & 0xF
        man = b & 7
        normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        val = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)
        val = tl.where((b & 0x80) != 0, -val, val)
        return tl.where((b & 0x7F) == 0x7F, float("nan"), val)

    @triton.jit
    def _decode_e2m1(c):
        """e2m1 codes (int32 0..15: bit 3 sign, bits 0-2 the index of 0, .5, 1, 1.5, 2, 3, 4, 6)
        -> float32: exponent idx >> 1 (bias 1), mantissa idx & 1, subnormal 0 / 0.5."""
        idx = c & 7
        exp = idx >> 1
        man = idx & 1
        normal = (((exp + 126) << 23) | (man << 22)).to(tl.float32, bitcast=True)
        val = tl.where(exp == 0, man.to(tl.float32) * 0.5, normal)
        return tl.where((c & 8) != 0, -val, val)

    @triton.jit
    def _quant_matmul_kernel(
        x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
        M, N, K,
        stride_xm, stride_xk,
        stride_we, stride_wn, stride_wk,
        stride_se, stride_sn, stride_sk,
        stride_ge,
        stride_ym, stride_yn,
        SCHEME: tl.constexpr, GROUP: tl.constexpr, GROUPED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """One [BLOCK_M, BLOCK_N] tile of y = x @ dequantize(W).T. GROUPED: the row tile
        `program_id(0)` belongs to expert tile_expert[pid] (-1: an unused slot of the grid, which
        computes and stores nothing), starts at row tile_row[pid] and ends at ends[expert]."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if GROUPED:  # an unused slot gets no rows and no K loop (no early return: portable)
            expert = tl.load(tile_expert_ptr + pid_m)
            used = expert >= 0
            expert = tl.maximum(expert, 0)
            row_start = tl.load(tile_row_ptr + pid_m)
            row_end = tl.where(used, tl.minimum(tl.load(ends_ptr + expert), M), row_start)
            k_end = tl.where(used, K, 0)
            expert_off = expert.to(tl.int64)
        else:
            row_start = pid_m * BLOCK_M
            row_end = M
            k_end = K
            expert_off = 0
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < row_end
        col_mask = cols < N
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        w_cols = w_ptr + expert_off * stride_we + cols.to(tl.int64)[None, :] * stride_wn
        s_cols = s_ptr + expert_off * stride_se + cols.to(tl.int64)[None, :] * stride_sn
        if SCHEME == 3:
            global_scale = tl.load(gs_ptr + expert_off * stride_ge).to(tl.float32)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & col_mask[None, :]
            if SCHEME == 0:  # int4: 8 nibbles a word, value k in bits 4k..4k+3, offset by 8
                word = tl.load(w_cols + (ks // 8)[:, None] * stride_wk, mask=w_mask, other=0)
                q = ((word >> ((ks % 8) * 4)[:, None]) & 0xF) - 8
                scale = tl.load(s_cols + (ks // GROUP)[:, None] * stride_sk, mask=w_mask, other=0.0)
                w = q.to(tl.float32) * scale.to(tl.float32)
            elif SCHEME == 1:  # int8: the per-channel scale is applied after the loop; via float32
                # (the interpreter casts int8 -> bf16 wrongly)
                w = tl.load(w_cols + ks[:, None] * stride_wk, mask=w_mask, other=0).to(tl.float32)
            elif SCHEME == 2:  # fp8 (uint8 view): likewise
                byte = tl.load(w_cols + ks[:, None] * stride_wk, mask=w_mask, other=0)
                w = _decode_e4m3(byte.to(tl.int32))
            else:  # nvfp4: two codes a byte, the first in the low nibble; an e4m3 scale per 16
                byte = tl.load(w_cols + (ks // 2)[:, None] * stride_wk, mask=w_mask, other=0).to(tl.int32)
                code = (byte >> ((ks % 2) * 4)[:, None]) & 0xF
                scale = tl.load(s_cols + (ks // 16)[:, None] * stride_sk, mask=w_mask, other=0)
                w = _decode_e2m1(code) * (_decode_e4m3(scale.to(tl.int32)) / global_scale)
            w = w.to(x.dtype)  # the weight tile in x's dtype, as tensor cores take it
            if UPCAST_DOT:  # the same products in float32 (bf16 x bf16 is exact in float32)
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        if SCHEME == 1 or SCHEME == 2:
            scale = tl.load(s_ptr + expert_off * stride_se + cols.to(tl.int64) * stride_sn, mask=col_mask, other=0.0)
            acc = acc * scale.to(tl.float32)[None, :]
        y = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])

    INTERPRETED = interpreted(_quant_matmul_kernel)
else:  # pragma: no cover
    INTERPRETED = False


# ------------------------------------------------------------------------------- device checks
def available(device: torch.device | str) -> bool:
    """Whether these kernels can run on `device` (triton_support.runs_on)."""
    return runs_on(device, INTERPRETED)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA GPU; None for other devices and ROCm (whose fp8 differs)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _fp8_tensor_cores(x: torch.Tensor, n: int, k: int) -> bool:
    """torch._scaled_mm can serve this fp8 matmul: FP8 tensor cores (sm89+) and the 16-element
    alignment cuBLASLt / CUTLASS need of both matrices' leading dimensions."""
    cap = _cuda_capability(x.device)
    return cap is not None and cap >= (8, 9) and n % 16 == 0 and k % 16 == 0


def _fp8_grouped_tensor_cores(x: torch.Tensor, n: int, k: int) -> bool:
    """torch._scaled_grouped_mm exists in this torch and has a kernel for the device: torch
    builds it for sm90 and sm100 only (sm89 / sm120 raise), with the same alignment."""
    cap = _cuda_capability(x.device)
    return hasattr(torch, "_scaled_grouped_mm") and cap is not None and cap[0] in (9, 10) and n % 16 == 0 and k % 16 == 0


# ------------------------------------------------------------------------------------ operands
def _check(x: torch.Tensor, q: QTensor, dims: int) -> None:
    if q.scheme not in SCHEME_IDS:
        raise ValueError(f"unknown quantization scheme {q.scheme!r}")
    if len(q.shape) != dims:
        raise ValueError(f"expected a {dims}D quantised weight, got shape {q.shape}")
    if x.dtype not in X_DTYPES:
        raise TypeError(f"activations must be bfloat16, float16 or float32, got {x.dtype}")
    if x.shape[-1] != q.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} inputs, the weight {q.shape[-1]}")


def _operands(q: QTensor, stacked: bool) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], int]:
    """The kernel's (weight, scale, global scale) tensors, their strides (expert, row, column;
    expert 0 for a 2D weight) and the inputs per scale of int4."""
    p, k = q.parts, q.shape[-1]
    if q.scheme in ("int8", "fp8"):
        w = p["weight"].view(torch.uint8) if q.scheme == "fp8" else p["weight"]
        s = p["weight_scale"]
        gs, group = s, 1
    else:
        w, s = p["weight_packed"], p["weight_scale"]
        if q.scheme == "int4":
            group = k // s.shape[-1]
            if w.dtype != torch.int32 or group < 8 or group % 8 or group * s.shape[-1] != k:
                raise ValueError(f"int4 needs int32 words and a group size a multiple of 8 dividing {k} (got {w.dtype}, {group})")
            gs = s
        else:
            if k % NVFP4_GROUP or s.shape[-1] != k // NVFP4_GROUP:
                raise ValueError(f"nvfp4 needs one scale per {NVFP4_GROUP} inputs (inputs {k}, scales {s.shape[-1]})")
            s, gs, group = s.view(torch.uint8), p["weight_global_scale"], NVFP4_GROUP
    if stacked:
        strides = (w.stride(0), w.stride(1), w.stride(2), s.stride(0), s.stride(1), s.stride(2), gs.stride(0))
    else:
        strides = (0, w.stride(0), w.stride(1), 0, s.stride(0), s.stride(1), 0)
    return (w, s, gs), strides, group


def _pick_blocks(rows: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) from the rows a tile sees: small M (decoding, an expert's
    few tokens) is memory bound, so a short M tile and a deep K tile; tl.dot needs >= 16.
    tests/test_triton_compile.py compiles every pick, scheme, plain and grouped, at the released
    model's shapes for sm90 (triton 3.9's ptxas): none spills; the tightest is int4's 16 x 64 x 128
    (4 warps: 236-239 of 255 registers, 88 KiB shared), the most shared int4's 128 x 128 x 64
    (8 warps: 128 KiB of 227)."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128
    block_n = 64 if rows <= 64 or n <= 64 else 128
    block_k = 128 if rows <= 16 else 64
    return block_m, block_n, block_k


def _launch(
    x: torch.Tensor, q: QTensor, stacked: bool, grid_m: int, maps: tuple[torch.Tensor, ...] | None,
    blocks: tuple[int, int, int], num_warps: int | None,
) -> torch.Tensor:  # fmt: skip
    m, k = x.shape
    n = q.shape[-2]
    (w, s, gs), strides, group = _operands(q, stacked)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = blocks
    tile_expert, tile_row, ends = maps if maps is not None else (y, y, y)  # unused unless grouped
    grid = (grid_m, triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](
        x, w, s, gs, y, tile_expert, tile_row, ends,
        m, n, k,
        x.stride(0), x.stride(1),
        *strides,
        y.stride(0), y.stride(1),
        SCHEME=SCHEME_IDS[q.scheme], GROUP=group, GROUPED=maps is not None,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,  # fp32: no tf32 rounding
        UPCAST_DOT=INTERPRETED and x.dtype == torch.bfloat16,  # the interpreter multiplies bf16's raw bits
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps or (4 if block_m * block_n <= 64 * 64 else 8),
        enable_fp_fusion=True,  # triton's default until 3.10 (3.9 warns when it is left unsaid)
    )  # fmt: skip
    return y


# ------------------------------------------------------------------------------ Triton wrappers
def triton_quant_linear(
    x: torch.Tensor, q: QTensor, blocks: tuple[int, int, int] | None = None, num_warps: int | None = None
) -> torch.Tensor:
    """x [..., K] @ dequantize(q).T for a 2D QTensor [N, K], in x's dtype (float32 accumulation).
    `blocks` = (BLOCK_M, BLOCK_N, BLOCK_K), each a power of two >= 16; None picks by shape."""
    _check(x, q, 2)
    lead, n = x.shape[:-1], q.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_empty(*lead, n)
    blocks = blocks or _pick_blocks(x2.shape[0], n)
    y = _launch(x2, q, False, triton.cdiv(x2.shape[0], blocks[0]), None, blocks, num_warps)
    return y.reshape(*lead, n)


def _tile_map(ends: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For each slot of the grid's first dim: the expert of its row tile (-1 if unused) and the
    tile's first row, from the experts' cumulative row counts `ends`. Computed on the device
    (no host sync); the grid is sized by a host bound: at most one partial tile per expert."""
    e = ends.numel()
    ends64 = ends.to(torch.int64)
    starts = torch.cat((ends64.new_zeros(1), ends64[:-1]))
    tiles = (ends64 - starts + block_m - 1) // block_m
    last = torch.cumsum(tiles, 0)  # one past each expert's last tile
    slots = min(rows, triton.cdiv(rows, block_m) + e)
    t = torch.arange(slots, device=ends.device)
    expert = torch.searchsorted(last, t, right=True)
    used = expert < e
    expert_c = expert.clamp(max=e - 1)
    first_row = starts[expert_c] + (t - (last[expert_c] - tiles[expert_c])) * block_m
    tile_expert = torch.where(used, expert, -1).to(torch.int32)
    return tile_expert, first_row.to(torch.int32), slots


def triton_quant_grouped_linear(
    x_sorted: torch.Tensor,
    q_stacked: QTensor,
    offsets: torch.Tensor,
    blocks: tuple[int, int, int] | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Each expert's rows of x_sorted [S, K] (sorted by expert) @ its dequantised weight.T, for a
    stacked QTensor [E, N, K], in one launch. offsets: int32 [E], the cumulative row counts
    (expert e owns rows offsets[e-1]..offsets[e]; offsets[-1] == S, not checked: a host sync)."""
    _check(x_sorted, q_stacked, 3)
    e, n, _ = q_stacked.shape
    if x_sorted.dim() != 2 or offsets.shape != (e,):
        raise ValueError(f"expected x_sorted [S, K] and offsets [{e}], got {tuple(x_sorted.shape)} and {tuple(offsets.shape)}")
    s = x_sorted.shape[0]
    if s == 0:
        return x_sorted.new_empty(0, n)
    blocks = blocks or _pick_blocks(triton.cdiv(s, e), n)
    ends = offsets.to(device=x_sorted.device, dtype=torch.int32)
    tile_expert, tile_row, slots = _tile_map(ends, s, blocks[0])
    return _launch(x_sorted, q_stacked, True, slots, (tile_expert, tile_row, ends), blocks, num_warps)


# ------------------------------------------------------------------------- FP8 tensor-core paths
def quantize_activations_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row-wise) float8_e4m3fn activations for x [M, K]: (x_fp8, scale [M, 1] float32)
    with x ~= x_fp8 * scale, each row's absmax mapped to 448."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_scaled_mm_linear(x: torch.Tensor, q: QTensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [..., K] @ W.T for an fp8 QTensor [N, K] on FP8 tensor cores (sm89+): activations
    quantised per token, then torch._scaled_mm(x_fp8, w_fp8.t(), scale_a [M, 1], scale_b [1, N]).

    The product is computed in `out_dtype` then cast to x's dtype: bfloat16 by default because
    torch's row-wise CUTLASS kernel (sm89, or cuBLAS older than 12.9) only writes bf16. Needs
    N and K multiples of 16. torch 2.13's CPU build runs _scaled_mm too (tests use it)."""
    _check(x, q, 2)
    if q.scheme != "fp8":
        raise ValueError(f"fp8_scaled_mm_linear needs an fp8 weight, got {q.scheme}")
    lead, n = x.shape[:-1], q.shape[0]
    x_fp8, scale_a = quantize_activations_fp8(x.reshape(-1, x.shape[-1]))
    w = q.parts["weight"].contiguous()  # [N, K] row-major: w.t() is the column-major mat2 needed
    scale_b = q.parts["weight_scale"].float().reshape(1, n).contiguous()
    y = torch._scaled_mm(x_fp8, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return y.to(x.dtype).reshape(*lead, n)


def fp8_scaled_grouped_mm(x_sorted: torch.Tensor, q_stacked: QTensor, offsets: torch.Tensor) -> torch.Tensor:
    """The grouped fp8 matmul on FP8 tensor cores: torch._scaled_grouped_mm(x_fp8 [S, K],
    w_fp8 [E, K, N] column-major, scale_a [S], scale_b [E, N], offs=offsets), bf16 out (the only
    output dtype torch's grouped kernel writes), cast to x's dtype. torch builds it for sm90 /
    sm100 only and has no CPU kernel (its meta kernel checks these arguments in the tests)."""
    _check(x_sorted, q_stacked, 3)
    if q_stacked.scheme != "fp8":
        raise ValueError(f"fp8_scaled_grouped_mm needs an fp8 weight, got {q_stacked.scheme}")
    e, n, _ = q_stacked.shape
    x_fp8, scale_a = quantize_activations_fp8(x_sorted)
    w = q_stacked.parts["weight"].contiguous()
    scale_b = q_stacked.parts["weight_scale"].float().reshape(e, n).contiguous()
    offs = offsets.to(device=x_sorted.device, dtype=torch.int32)
    y = torch._scaled_grouped_mm(
        x_fp8, w.transpose(-2, -1), scale_a.reshape(-1), scale_b, offs=offs, out_dtype=torch.bfloat16
    )
    return y.to(x_sorted.dtype)


# ---------------------------------------------------------------------------------- dispatchers
def _unavailable(device: torch.device) -> RuntimeError:
    why = "triton is not installed" if not HAVE_TRITON else f"the device is {device.type}, not CUDA"
    return RuntimeError(f"no GPU kernel for quantised weights here ({why}); on CPU use dgemma.quant.modules")


def quant_linear(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """x [..., K] @ dequantize(q).T on a GPU: fp8 on FP8 tensor cores via torch._scaled_mm,
    everything else (and fp8 on older GPUs) in the Triton kernel; raises where neither runs."""
    _check(x, q, 2)
    if q.scheme == "fp8" and _fp8_tensor_cores(x, q.shape[0], q.shape[1]):
        return fp8_scaled_mm_linear(x, q)
    if not available(x.device):
        raise _unavailable(x.device)
    return triton_quant_linear(x, q)


def quant_grouped_linear(x_sorted: torch.Tensor, q_stacked: QTensor, offsets: torch.Tensor) -> torch.Tensor:
    """The MoE experts' matmul on a GPU (rows sorted by expert, `offsets` their cumulative
    counts): fp8 via torch._scaled_grouped_mm where torch has it for the device, otherwise the
    grouped Triton kernel; raises where neither runs."""
    _check(x_sorted, q_stacked, 3)
    if q_stacked.scheme == "fp8" and _fp8_grouped_tensor_cores(x_sorted, q_stacked.shape[1], q_stacked.shape[2]):
        return fp8_scaled_grouped_mm(x_sorted, q_stacked, offsets)
    if not available(x_sorted.device):
        raise _unavailable(x_sorted.device)
    return triton_quant_grouped_linear(x_sorted, q_stacked, offsets)

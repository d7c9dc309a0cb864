"""GPU matmuls with weights in any stored format: y = x @ W.T, the weight dequantised a K-tile at a
time in registers (no full-precision copy of a quantised weight is ever made).

One kernel (`_gemm_kernel`) for every format the model stores, read as compressed-tensors lays
it out (quant/formats.py):

    scheme  read per K-tile of a row                     dequantised as
    plain   the bf16 / fp16 / fp32 weight                as it is
    fp8     e4m3 bytes                                   q, times the per-channel scale on the accumulator
    int8    int8                                         likewise
    int4    BLOCK_K / 8 int32 words (eight codes a       (code - 8) * scale, a bf16 scale per group
            word, the first in the lowest nibble), its
            group scales
    nvfp4   BLOCK_K / 8 int32 words, its e4m3 scales     e2m1(code) * scale; 1 / the global scale per
            (one per 16 inputs)                          channel on the accumulator

The weight's codes are decoded in registers by kernels/triton_decode.py's helpers (`weight_tile`:
e4m3 by the hardware's conversion on sm89+, FP8_CVT, else by bits; 4-bit codes in the activations'
16 bits, FAST4, else through float32), each path exact.

W8A8 (A8: fp8 weights and `Fp8Rows`, activations quantised per token by the kernel that produced
them, kernels/triton_norms.py): on sm89+ both operands go into the MMA as e4m3 (fp8 wgmma / mma:
twice bf16's tensor rate, half the activations' bytes, nothing decoded), float32 accumulation,
then the token's scale and the channel's on the accumulator. Where FP8_CVT is off (the interpreter)
both are decoded to float32 by bits and multiplied in float32: the float32 emulation of the fp8
rounding (quant/modules.py's `w8a8_reference` is its torch copy). Whether the dense linears of an
fp8 model take it is decided once, at load (kernels/choice.py's `fp8_activations`).

4-bit K-tiles are 256 inputs: each row's 32 words and its scales (8 bytes for int4's default group
of 64, 16 for nvfp4's) are read as whole vectors, every byte once; for that a weight's scale rows
are padded once to whole tiles (zeros: `gemm_weight`). Reading the codes as words, not bytes, also
has triton lay the decoded tile out as a 16-bit operand's (ldmatrix, no register shuffles).

Grids and tiles (`_blocks`, `_TILES`: chosen from sm90 compiles, tests/kernels/test_triton_compile.py,
not timed on hardware). A linear: one row tile a program (the grid split over rows: each weight
tile decoded once a row tile, the row tile's MMA inside the K loop), by column tiles; where that
gives fewer CTAs than an H200 has SMs, shorter row tiles, then narrower columns. Stacked expert
weights [E, N, K]: one program column per expert (`grid[0]` = E) walking its own rows (`ends`: the
cumulative row counts), in tiles of BLOCK_M sized for twice the average rows per expert (one tile
per expert at batch 1), with the rows gathered from the tokens in the A-load (`gather`), stored
back in (token, slot) order (`scatter`), or gate and up computed side by side with gelu(gate) * up
in the epilogue (`dual`: the two halves' rows interleaved in one tile and one MMA): the MoE
block's two GEMMs (kernels/triton_moe.py) need no copy of the routed rows. Warps: along N for short
row tiles (at most BLOCK_M / 16 along M, so no warp decodes another's columns and the MMA is issued
at the tile's minimum), a warpgroup a 64-row half for 128-row tiles (wgmma).

Rounding: float32 accumulation; the output is rounded to the activations' dtype where torch rounds
a matmul's output; gelu(gate) * up is computed from the rounded gate and up and rounded once.
Under the interpreter, bf16 tiles are multiplied in float32 (it multiplies bf16's raw bits in
tl.dot; the products are the same) and int8 goes through float32 (it casts int8 -> bf16 wrongly).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..quant import schemes
from ..quant.formats import QTensor
from .triton_support import HAVE_TRITON, interpreted, round_if, runs_on, tl, triton

if HAVE_TRITON:
    from .triton_decode import e4m3, weight_tile

# `_gemm_kernel`'s decoders (its SCHEME constant): a scheme's is its table entry's `kernels.cuda`
# (quant/schemes.py: int4 0, int8 1, fp8 2, nvfp4 3); a full-precision weight is read as it is
PLAIN, PLAIN_CODE = "plain", 4
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAVE_TRITON:

    @triton.jit
    def _gelu(g, TANH: tl.constexpr):
        if TANH:  # 0.5 g (1 + tanh(z)) = g * sigmoid(2z)
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            return g / (1.0 + tl.exp(-2.0 * z))
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))

    @triton.jit
    def _accumulate(
        acc,
        x,
        ns,
        w_base,
        s_base,
        n_ok,
        k0,
        K,
        KB,
        stride_wn,
        stride_sn,
        SCHEME: tl.constexpr,
        GROUP: tl.constexpr,
        SCALE_BYTES: tl.constexpr,
        SCALE_FP16: tl.constexpr,
        BLOCK_K: tl.constexpr,
        OUT: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        FP8_CVT: tl.constexpr,
        FAST4: tl.constexpr,
        W_ALIGN: tl.constexpr,
    ):
        """acc + x @ W[ns, k0 : k0 + BLOCK_K].T, the weight tile decoded in registers (triton_decode's `weight_tile`)."""
        w = weight_tile(
            w_base,
            s_base,
            ns,
            n_ok,
            k0,
            K,
            KB,
            stride_wn,
            stride_sn,
            SCHEME,
            GROUP,
            SCALE_BYTES,
            SCALE_FP16,
            BLOCK_K,
            OUT,
            FP8_CVT,
            FAST4,
            W_ALIGN,
        )
        if UPCAST_DOT:  # the interpreter multiplies bf16's raw bits: the same products in float32
            return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        return tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)

    @triton.jit
    def _dot_fp8(acc, x, ns, w_base, n_ok, k0, K, stride_wn, BLOCK_K: tl.constexpr, FP8_CVT: tl.constexpr):
        """acc + x @ W[ns, k0 : k0 + BLOCK_K].T for e4m3 activations x and e4m3 weights (A8): with
        FP8_CVT the pointers are float8e4nv and the tiles go into the MMA as they are loaded; else
        bytes, decoded by bits and multiplied in float32 (the emulation)."""
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(
            w_base + ns.to(tl.int64)[:, None] * stride_wn + ks[None, :],
            mask=n_ok[:, None] & (ks < K)[None, :],
            other=0.0,
        )
        if FP8_CVT:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            xf = e4m3(x.to(tl.int32) & 0xFF)
            acc = tl.dot(xf, tl.trans(e4m3(w.to(tl.int32) & 0xFF)), acc, input_precision="ieee")
        return acc

    @triton.jit
    def _gemm_kernel(
        x_ptr, xs_ptr, pairs_ptr, w_ptr, s_ptr, cs_ptr, ends_ptr, y_ptr,
        M, N, K, KB,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ce, stride_cn, stride_ym,
        GROUPED: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr, TOP_K: tl.constexpr,
        SCHEME: tl.constexpr, GROUP: tl.constexpr, SCALE_BYTES: tl.constexpr, SCALE_FP16: tl.constexpr,
        CHANNEL_SCALE: tl.constexpr, DUAL: tl.constexpr, A8: tl.constexpr,
        TANH: tl.constexpr, ROUND: tl.constexpr, UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        FP8_CVT: tl.constexpr, FAST4: tl.constexpr, W_ALIGN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """y = x @ W.T for one BLOCK_N column tile. GROUPED: program_id(0) is an expert, whose rows
        [ends[e-1], ends[e]) it walks in tiles of BLOCK_M (rows in expert order; GATHER: row s
        reads x[pairs[s] // TOP_K]; SCATTER: row s is stored at y[pairs[s]]). Otherwise
        program_id(0) is one row tile of BLOCK_M (the grid split over rows: each weight tile decoded
        once a row tile). DUAL: W's rows [0, N) are gates and [N, 2N) ups, read as one tile of 2
        BLOCK_N rows, gate and up interleaved (one MMA, which triton lays out as a single dot, not as
        a chain of two), y = gelu(gate) * up. CHANNEL_SCALE: the accumulator times cs[n] (int8 /
        fp8's scale, nvfp4's 1 / global scale). A8: x is e4m3 (fp8 weights only), the accumulator
        times xs[token] too."""
        pid = tl.program_id(0)
        pid_n = tl.program_id(1)
        if GROUPED:
            expert = pid.to(tl.int64)
            row_end = tl.load(ends_ptr + pid)
            row_start = tl.where(pid > 0, tl.load(ends_ptr + pid - 1, mask=pid > 0, other=0), 0)
        else:
            expert = 0
            row_start = pid * BLOCK_M
            row_end = tl.minimum(row_start + BLOCK_M, M)
        WIDTH: tl.constexpr = 2 * BLOCK_N if DUAL else BLOCK_N  # the weight rows a K-tile reads
        j = tl.arange(0, WIDTH)
        if DUAL:  # column n's gate and up side by side: weight rows n and N + n
            cols = pid_n * BLOCK_N + j // 2
            ns = cols + (j % 2) * N
        else:
            cols = pid_n * BLOCK_N + j
            ns = cols
        n_ok = cols < N
        w_base = w_ptr + expert * stride_we
        s_base = s_ptr + expert * stride_se
        OUT: tl.constexpr = y_ptr.dtype.element_ty  # the activations' dtype (A8: what they stand for)
        if CHANNEL_SCALE:
            cscale = tl.load(cs_ptr + expert * stride_ce + ns.to(tl.int64) * stride_cn, mask=n_ok, other=0.0)
            cscale = cscale.to(tl.float32)
        for m0 in range(row_start, row_end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            r_ok = rows < row_end
            if GATHER:
                pair = tl.load(pairs_ptr + rows, mask=r_ok, other=0)
                x_rows = (pair // TOP_K).to(tl.int64)
            else:
                x_rows = rows.to(tl.int64)
            acc = tl.zeros((BLOCK_M, WIDTH), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(
                    x_ptr + x_rows[:, None] * stride_xm + ks[None, :], mask=r_ok[:, None] & (ks < K)[None, :], other=0.0
                )
                if A8:
                    acc = _dot_fp8(acc, x, ns, w_base, n_ok, k0, K, stride_wn, BLOCK_K, FP8_CVT)
                else:
                    acc = _accumulate(
                        acc,
                        x,
                        ns,
                        w_base,
                        s_base,
                        n_ok,
                        k0,
                        K,
                        KB,
                        stride_wn,
                        stride_sn,
                        SCHEME,
                        GROUP,
                        SCALE_BYTES,
                        SCALE_FP16,
                        BLOCK_K,
                        OUT,
                        UPCAST_DOT,
                        INPUT_PRECISION,
                        FP8_CVT,
                        FAST4,
                        W_ALIGN,
                    )
            if A8:
                acc = acc * tl.load(xs_ptr + x_rows, mask=r_ok, other=0.0)[:, None]
            if CHANNEL_SCALE:
                acc = acc * cscale[None, :]
            if DUAL:  # gate and up: the adjacent columns a thread holds
                gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
                out = round_if(_gelu(round_if(gate, ROUND), TANH) * round_if(up, ROUND), ROUND)
            else:
                out = round_if(acc, ROUND)
            if SCATTER:
                y_rows = tl.load(pairs_ptr + rows, mask=r_ok, other=0).to(tl.int64)
            else:
                y_rows = rows.to(tl.int64)
            y_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(
                y_ptr + y_rows[:, None] * stride_ym + y_cols[None, :],
                out.to(y_ptr.dtype.element_ty),
                mask=r_ok[:, None] & (y_cols < N)[None, :],
            )

    INTERPRETED = interpreted(_gemm_kernel)
else:  # pragma: no cover
    INTERPRETED = False


def available(device: torch.device | str) -> bool:
    """Whether these kernels can run on `device` (triton_support.runs_on)."""
    return runs_on(device, INTERPRETED)


def dot_args(dtype: torch.dtype) -> dict:
    """The tl.dot settings of activations of `dtype` (the MoE kernels use them too)."""
    return dict(
        UPCAST_DOT=INTERPRETED and dtype != torch.float32,  # the interpreter multiplies bf16's raw bits
        INPUT_PRECISION="ieee" if dtype == torch.float32 else None,  # float32: no tf32 rounding
    )


class GemmWeight:
    """A weight [(E,) N, K] as `_gemm_kernel` reads it: the stored tensor (quantised codes, or the
    full-precision weight), its scheme, the group size, the scale tile tensor and the per-channel
    scale on the accumulator (None: none). Built once per weight (`gemm_weight`): 4-bit scale rows
    padded with zeros to whole K-tiles, nvfp4's global scale made one float32 per channel."""

    def __init__(
        self,
        scheme: str,
        shape: tuple[int, ...],
        data: torch.Tensor,
        group: int = 1,
        scales: torch.Tensor | None = None,
        channel: torch.Tensor | None = None,
    ):
        self.scheme, self.shape, self.data, self.group = scheme, tuple(shape), data, group
        self.scales, self.channel = scales, channel

    @property
    def stacked(self) -> bool:
        return len(self.shape) == 3


class Fp8Rows(NamedTuple):
    """Activations quantised per token for the W8A8 GEMM (`gemm`'s x): e4m3 bytes [M, K] (uint8) and
    float32 scales [M] (a row is its codes times its scale), standing for activations of `dtype`
    (the GEMM's output dtype). Written beside the activations by the kernel that produced them
    (kernels/triton_norms.py), so the GEMM reads half the bytes and multiplies on fp8 tensor cores."""

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


FOUR_BIT_K = 256  # inputs per K-tile of a 4-bit weight (128 bytes a row), at least 4 groups


def four_bit_k(group: int, scale_bytes: int = 2) -> int:
    """Inputs per K-tile of a 4-bit weight with `group` inputs per scale of `scale_bytes`: 256, or
    more where a tile's scales of a row would be less than a whole 8-byte word."""
    return max(FOUR_BIT_K, (8 // scale_bytes) * group)


def _padded_scales(scales: torch.Tensor, per_tile: int) -> torch.Tensor:
    """[..., N, G] scales with each row padded with zeros to a whole number of K-tiles' scales
    (the kernel reads a tile's scales of a row as whole 8-byte words)."""
    groups = scales.shape[-1]
    padded = -(-groups // per_tile) * per_tile
    if padded == groups:
        return scales.contiguous()
    out = scales.new_zeros(*scales.shape[:-1], padded)
    out[..., :groups] = scales
    return out


def gemm_weight(weight: torch.Tensor | QTensor) -> GemmWeight:
    """The kernel's view of a weight: a full-precision tensor [(E,) N, K], or a QTensor
    (quant/formats.py, compressed-tensors layout)."""
    if isinstance(weight, torch.Tensor):
        return GemmWeight(PLAIN, tuple(weight.shape), weight)
    q = weight
    scheme = schemes.find(q.scheme)
    if scheme is None or scheme.kernels.cuda is None:
        raise ValueError(f"unknown quantization scheme {q.scheme!r}")
    p, k = q.parts, q.shape[-1]
    data = _as_bytes(p[scheme.main_part])
    if scheme.group.per_channel:  # a scale per output channel, on the accumulator
        channel = p["weight_scale"].float().reshape(*q.shape[:-1])
        return GemmWeight(q.scheme, q.shape, data, channel=channel)
    s = p["weight_scale"]
    s = s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s  # fp8 scales read as bytes
    if scheme.global_scale:  # a fixed group; 1 / the global scale per channel on the accumulator
        group = scheme.group.fixed
        gs = p[schemes.GLOBAL_SCALE].float().reshape(*q.shape[:-2], 1)
        channel = (1.0 / gs).expand(*q.shape[:-1]).contiguous()
    else:  # groups of the size the scales' count says
        group, channel = k // s.shape[-1], None
        if group * s.shape[-1] != k or group & (group - 1) or group < 8:
            raise ValueError(
                f"{q.scheme} on the GPU needs a group size that is a power of two >= 8 dividing {k} (got {group})"
            )
    return GemmWeight(
        q.scheme, q.shape, data, group, _padded_scales(s, four_bit_k(group, s.element_size()) // group), channel
    )


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Stored codes as the kernel reads them: int8 as they are, any other (packed words, fp8) as bytes."""
    return t if t.dtype in (torch.int8, torch.uint8) else t.view(torch.uint8)


def _code(w: GemmWeight) -> int:
    """The kernel's decoder (SCHEME) for `w`."""
    return PLAIN_CODE if w.scheme == PLAIN else schemes.get(w.scheme).kernels.cuda


def concat_weights(weights: list[GemmWeight]) -> GemmWeight:
    """Weights of one input size side by side along N (q|k|v, gate|up): one GEMM for all."""
    first = weights[0]
    if any(w.scheme != first.scheme or w.shape[-1] != first.shape[-1] or w.group != first.group for w in weights):
        raise ValueError("only weights of one scheme, input size and group concatenate")

    def cat(parts: list, dim: int):
        return None if parts[0] is None else torch.cat(parts, dim=dim)

    n = sum(w.shape[-2] for w in weights)
    return GemmWeight(
        first.scheme,
        (*first.shape[:-2], n, first.shape[-1]),
        cat([w.data for w in weights], -2),
        first.group,
        cat([w.scales for w in weights], -2),
        cat([w.channel for w in weights], -1),
    )


ARCH_ON_META = 90  # the compute capability launches on meta tensors choose for (the launch counts, the
# roofline and the compile driver model an H200; tests/kernels/triton_compile.py sets 80 for its sm80 compile)


def arch(device: torch.device) -> int:
    """The compute capability (10 x major + minor) a launch on `device` is compiled for; 0 under
    the interpreter."""
    if INTERPRETED:
        return 0
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return ARCH_ON_META


def fp8_in_hardware(capability: int) -> bool:
    """Whether e4m3 bytes are converted by the hardware there (triton's float8e4nv: sm89 and later)."""
    return capability >= 89


def _fast4(w: GemmWeight, dtype: torch.dtype) -> bool:
    """Whether 4-bit codes are decoded in the activations' 16-bit dtype (triton_decode's `_four_bit_fast`): bf16 and
    fp16 activations (int4: with scales of that dtype, so that the product rounds once, as float32's
    does), but not bf16 under the interpreter (which misreads bf16 bitcasts)."""
    code = _code(w)
    if code not in (0, 3) or dtype not in (torch.bfloat16, torch.float16) or (INTERPRETED and dtype == torch.bfloat16):
        return False
    return code == 3 or w.scales.dtype == dtype


# (BLOCK_N, num_warps) of gate|up side by side, then of one GEMM, by the weight's kind and the row
# tile, chosen from sm90 compiles (tests/kernels/test_triton_compile.py's budgets: the K loop's
# instructions a weight byte, MMA at the tile's minimum, no spills). Short row tiles (mma.sync) put
# their warps along N, at most BLOCK_M / 16 along M (every warp then decodes its own columns, none
# the whole tile); 128-row tiles take wgmma, a warpgroup a 64-row half. gate|up's BLOCK_N is each
# half's: the tile reads 2 BLOCK_N weight rows.
_TILES = {
    "4-bit": {16: (16, 4, 64, 4), 32: (32, 8, 64, 8), 64: (32, 4, 64, 4), 128: (64, 8, 128, 8)},
    "1-byte": {16: (16, 4, 64, 4), 32: (32, 4, 64, 4), 64: (32, 4, 64, 4), 128: (32, 8, 64, 8)},
    "plain": {16: (32, 4, 64, 4), 32: (32, 4, 64, 4), 64: (32, 4, 64, 4), 128: (32, 8, 64, 8)},
    # W8A8 (e4m3 x e4m3): wgmma only, so 64- and 128-row tiles on a GPU (16 and 32: the interpreter's)
    "fp8 x fp8": {16: (16, 4, 64, 4), 32: (32, 4, 64, 4), 64: (64, 4, 128, 4), 128: (64, 8, 128, 8)},
}
SMS = 132  # an H100 / H200's SMs: a linear's grid is made at least this many CTAs where columns allow


def _blocks(w: GemmWeight, rows: int, dual: bool, n_out: int, a8: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) from the rows a program takes (an
    expert's average, or a linear's M): small M is memory bound (a short row tile). Row tiles of
    at most 128, `_TILES`' columns and warps; a linear (one row tile a program, the grid split
    over rows) takes shorter row tiles, then narrower columns (16 at the least), until its grid has
    `SMS` CTAs; activation tiles of 32 KiB and more are pipelined twice, smaller ones three times."""
    rows = rows if not w.stacked else 2 * rows  # an expert's rows vary about their average: room for most
    least_m = 64 if a8 else 16  # W8A8: a warpgroup's wgmma (triton's mma.sync takes e4m3 as fp16 on sm90)
    block_m = max(least_m, min(128, triton.next_power_of_2(max(rows, 1))))
    if INTERPRETED:
        block_m = min(block_m, 32)
    scheme = None if w.scheme == PLAIN else schemes.get(w.scheme)
    four_bit = scheme is not None and scheme.bits == 4
    block_k = four_bit_k(w.group, w.scales.element_size()) if four_bit else (128 if w.data.element_size() == 1 else 64)
    kind = "4-bit" if four_bit else "1-byte" if w.data.element_size() == 1 else "plain"
    kind = "fp8 x fp8" if a8 else kind

    def tile(block_m: int) -> tuple[int, int]:
        dual_n, dual_warps, block_n, warps = _TILES[kind][block_m]
        return (dual_n, dual_warps) if dual else (block_n, warps)

    block_n, warps = tile(block_m)
    if not w.stacked:  # fill the SMs: more row tiles, then narrower columns (never a K loop's metric over budget)
        while triton.cdiv(rows, block_m) * triton.cdiv(n_out, block_n) < SMS:
            if block_m > least_m:
                block_m //= 2
                block_n, warps = tile(block_m)
            elif block_n > 16:
                block_n //= 2
                warps = max(2, min(warps, block_n * (2 if dual else 1) // 8))  # at most a warp each 8 columns
                if four_bit and not dual and block_n == 16:
                    warps = 1  # two warps on a 4-bit 16-column tile spilled 4-8 bytes of registers (sm90 compile)
            else:
                break
    if INTERPRETED:  # programs run one by one there: fewer, wider ones
        block_n = 128
    act = block_m * block_k * (1 if a8 else 2)  # bytes of one activation tile
    stages = 2 if act >= 32 * 1024 or (dual and four_bit) else 3
    return block_m, block_n, block_k, warps, stages


def gemm(
    x: torch.Tensor | Fp8Rows,
    w: GemmWeight,
    ends: torch.Tensor | None = None,
    pairs: torch.Tensor | None = None,
    top_k: int = 1,
    gather: bool = False,
    scatter: bool = False,
    dual: str | None = None,
    rows_per_expert: int | None = None,
    out_rows: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T -> [M (or out_rows), N] in x's dtype; stacked W [E, N, K]: expert e's rows
    are [ends[e-1], ends[e]) of the pair order (`pairs`: each row's (token, slot) pair; `gather`
    reads x[pairs[s] // top_k], `scatter` writes row s at pairs[s]). `dual` ("tanh" / "none"): W's
    rows are gates then ups, the result gelu(gate) * up [M, N / 2]. x an `Fp8Rows` (fp8 weights
    only): the W8A8 GEMM, its result in the rows' `dtype`."""
    a8 = isinstance(x, Fp8Rows)
    if a8:
        if _code(w) != 2 or x.codes.dtype != torch.uint8 or x.scales.shape != x.codes.shape[:1]:
            raise ValueError("the W8A8 GEMM takes fp8 weights and Fp8Rows of uint8 codes [M, K], float32 scales [M]")
        x, xs, dtype = x.codes, x.scales, x.dtype
    else:
        xs, dtype = None, x.dtype
    if dtype not in X_DTYPES or x.dim() != 2 or x.shape[1] != w.shape[-1]:
        raise ValueError(f"gemm needs x [M, {w.shape[-1]}] bfloat16 / float16 / float32, got {tuple(x.shape)} {dtype}")
    x = x if x.stride(1) == 1 else x.contiguous()
    n, k = w.shape[-2], w.shape[-1]
    n_out = n // 2 if dual else n
    rows = pairs.shape[0] if pairs is not None else x.shape[0]
    y = torch.empty(out_rows if out_rows is not None else rows, n_out, dtype=dtype, device=x.device)
    if rows == 0 or n_out == 0:
        return y
    if w.stacked:
        experts = w.shape[0]
        if ends is None or ends.shape != (experts,):
            raise ValueError(f"a stacked weight needs ends [{experts}]")
        block_m, block_n, block_k, warps, stages = _blocks(
            w, rows_per_expert or -(-rows // experts), dual is not None, n_out, a8
        )
        grid_m = experts
    else:  # the grid split over rows: a program a row tile
        block_m, block_n, block_k, warps, stages = _blocks(w, rows, dual is not None, n_out, a8)
        grid_m = triton.cdiv(rows, block_m)
    stacked = w.stacked
    four_bit = _code(w) in (0, 3)
    fp8_cvt = _code(w) in (2, 3) and fp8_in_hardware(arch(x.device))
    data = w.data.view(torch.int32) if four_bit else w.data  # 4-bit codes read as int32 words
    if a8 and fp8_cvt:  # e4m3 operands straight into the MMA: float8e4nv pointers
        x, data = x.view(torch.float8_e4m3fn), data.view(torch.float8_e4m3fn)
    scales = w.scales.view(torch.int64) if w.scales is not None else data  # 4-bit: read as 8-byte words
    channel = w.channel if w.channel is not None else data
    ws = (data.stride(0) if stacked else 0, data.stride(-2))
    ss = (scales.stride(0) if stacked and w.scales is not None else 0, scales.stride(-2) if w.scales is not None else 0)
    cs = (
        channel.stride(0) if stacked and w.channel is not None else 0,
        channel.stride(-1) if w.channel is not None else 0,
    )
    _gemm_kernel[(grid_m, triton.cdiv(n_out, block_n))](
        x, xs if a8 else y, pairs if pairs is not None else y, data, scales, channel, ends if ends is not None else y, y,
        rows, n_out, k, k // 8,
        x.stride(0), *ws, *ss, *cs, y.stride(0),
        GROUPED=w.stacked, GATHER=gather, SCATTER=scatter, TOP_K=top_k,
        SCHEME=_code(w), GROUP=w.group, SCALE_BYTES=w.scales.element_size() if w.scales is not None else 1,
        SCALE_FP16=w.scales is not None and w.scales.dtype == torch.float16,
        CHANNEL_SCALE=w.channel is not None, DUAL=dual is not None, A8=a8,
        TANH=dual == "tanh", ROUND=dtype == torch.bfloat16, **dot_args(dtype),
        FP8_CVT=fp8_cvt, FAST4=_fast4(w, dtype),
        W_ALIGN=4 if four_bit and ws[1] % 4 == 0 and k // 8 % 4 == 0 else 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def quant_linear(x: torch.Tensor, w: GemmWeight | QTensor) -> torch.Tensor:
    """x [..., K] @ W.T on a GPU for a 2D weight (a `GemmWeight`, or a QTensor read as one);
    RuntimeError where the kernels cannot run."""
    if not available(x.device):
        why = "triton is not installed" if not HAVE_TRITON else f"the device is {x.device.type}, not CUDA"
        raise RuntimeError(f"no GPU kernel for quantised weights here ({why}); on CPU use dgemma.quant.modules")
    w = w if isinstance(w, GemmWeight) else gemm_weight(w)
    if w.stacked:
        raise ValueError(f"quant_linear takes a 2D weight, got shape {w.shape}")
    return gemm(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])

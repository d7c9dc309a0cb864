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

Decoding, each path exact (the same bits as the float32 decode it replaces):
- e4m3 bytes (fp8 weights, nvfp4's scales): on sm89 and later a bitcast to float8e4nv and the
  hardware's conversion (FP8_CVT); else, on sm80 and in Triton's interpreter (numpy has no float8;
  its conversion turns the NaN 0x7F into 480), by bit manipulation (`_e4m3`).
- 4-bit codes: in the activations' 16-bit type by the magic-number and bit-placement tricks of
  `_four_bit_fast` (FAST4: bf16 / fp16 activations, int4 with scales of their type; not bf16 under
  the interpreter, which misreads bf16 bitcasts), else through float32 (`_nibbles`, `_e2m1`).

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

import torch

from ..quant import schemes
from ..quant.formats import QTensor
from .triton_support import HAVE_TRITON, interpreted, round_if, runs_on, tl, triton

# `_gemm_kernel`'s decoders (its SCHEME constant): a scheme's is its table entry's `kernels.cuda`
# (quant/schemes.py: int4 0, int8 1, fp8 2, nvfp4 3); a full-precision weight is read as it is
PLAIN, PLAIN_CODE = "plain", 4
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAVE_TRITON:

    @triton.jit
    def _e4m3(b):
        """float8_e4m3fn bytes (int32 0..255) -> float32, exactly (0x7F / 0xFF: NaN)."""
        exp = (b >> 3) & 0xF
        man = b & 7
        normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        val = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)
        val = tl.where((b & 0x80) != 0, -val, val)
        return tl.where((b & 0x7F) == 0x7F, float("nan"), val)

    @triton.jit
    def _fp8_bytes(b, OUT: tl.constexpr, FP8_CVT: tl.constexpr):
        """float8_e4m3fn bytes (any integer type) -> OUT, exactly. FP8_CVT: a bitcast to float8e4nv and
        the hardware's conversion (sm89+: cvt.rn.f16x2.e4m3x2, two values an instruction, NaN kept);
        else `_e4m3`'s bit decode (the interpreter, whose conversion turns 0x7F into 480, and sm80,
        where triton has no float8e4nv)."""
        if FP8_CVT:
            return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(OUT)
        return _e4m3(b.to(tl.int32) & 0xFF).to(OUT)

    @triton.jit
    def _e2m1(c):
        """e2m1 codes (int32 0..15) -> float32: 0, .5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign."""
        idx = c & 7
        exp = idx >> 1
        normal = (((exp + 126) << 23) | ((idx & 1) << 22)).to(tl.float32, bitcast=True)
        val = tl.where(exp == 0, (idx & 1).to(tl.float32) * 0.5, normal)
        return tl.where((c & 8) != 0, -val, val)

    @triton.jit
    def _nibbles(w):
        """int32 words [R, C] of packed 4-bit codes (the first code in the lowest nibble) -> the codes
        [R, 8C] (int32 0..15)."""
        shifts = 4 * tl.arange(0, 8)
        codes = (w[:, :, None] >> shifts[None, None, :]) & 0xF
        return tl.reshape(codes, (w.shape[0], 8 * w.shape[1]))

    @triton.jit
    def _pair16(p, SCHEME: tl.constexpr, OUT: tl.constexpr):
        """Two codes in the low nibbles of a word's 16-bit halves -> the 16 bits of their values in
        OUT (bfloat16 or float16), as two tensors (low, high); see `_four_bit_fast`."""
        if SCHEME == 0:
            v = p | (0x43004300 if OUT == tl.bfloat16 else 0x64006400)
        elif OUT == tl.bfloat16:
            v = ((p << 6) & 0x01C001C0) | ((p << 12) & -0x7FFF8000)  # -0x7FFF8000: 0x80008000
        else:
            v = ((p << 9) & 0x0E000E00) | ((p << 12) & -0x7FFF8000)
        return v.to(tl.int16).to(OUT, bitcast=True), (v >> 16).to(tl.int16).to(OUT, bitcast=True)

    @triton.jit
    def _four_bit_fast(w, SCHEME: tl.constexpr, OUT: tl.constexpr):
        """int32 words [R, C] of packed codes (8 a word, the first in the lowest nibble) -> [R, 8C]
        values in OUT (bfloat16 or float16), exactly, without a scale: int4 code - 8, nvfp4
        e2m1(code).

        A word's byte j becomes the 32 bits of its two 16-bit values at once: its two codes moved
        to the low nibbles of the halves (2 shifts and a mask), then
        - int4: OR-ed into the mantissa of the magic number 128.0 (bf16 0x4300; fp16 1024.0,
          0x6400), which is then subtracted: exact;
        - nvfp4: each code's 3 magnitude bits placed as the lowest 2 exponent bits and the top
          mantissa bit, its sign bit as the sign: e2m1 x 2^-126 (bf16; fp16: 2^-14; 0.5 is a
          subnormal, which half-precision multiplies keep), times 2^126 (2^14): exact.
        About 2 integer and 1 float operation a value where the float32 decode took 10-20; read as
        words (not bytes), triton lays the operand out as a 16-bit one's (kWidth 2: ldmatrix, no
        register shuffles). (Hand-written: no library decodes compressed-tensors' packing in Triton;
        the interpreter misreads bf16 bitcasts, so there the caller takes the float32 decode.)"""
        lo0, hi0 = _pair16((w & 0xF) | ((w << 12) & 0xF0000), SCHEME, OUT)
        lo1, hi1 = _pair16(((w >> 8) & 0xF) | ((w << 4) & 0xF0000), SCHEME, OUT)
        lo2, hi2 = _pair16(((w >> 16) & 0xF) | ((w >> 4) & 0xF0000), SCHEME, OUT)
        lo3, hi3 = _pair16(((w >> 24) & 0xF) | ((w >> 12) & 0xF0000), SCHEME, OUT)
        # value 2 (2u + t) + s of a word is byte 2u + t's low (s = 0) or high code: joined u, t, s
        lows = tl.join(tl.join(lo0, lo2), tl.join(lo1, lo3))
        highs = tl.join(tl.join(hi0, hi2), tl.join(hi1, hi3))
        q = tl.reshape(tl.join(lows, highs), (w.shape[0], 8 * w.shape[1]))
        if SCHEME == 0:
            q = q - (136.0 if OUT == tl.bfloat16 else 1032.0)
        else:
            q = q * (8.507059173023462e37 if OUT == tl.bfloat16 else 16384.0)  # 2^126, 2^14
        return q

    @triton.jit
    def _gelu(g, TANH: tl.constexpr):
        if TANH:  # 0.5 g (1 + tanh(z)) = g * sigmoid(2z)
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            return g / (1.0 + tl.exp(-2.0 * z))
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))

    @triton.jit
    def _weight_tile(
        w_base,
        s_base,
        ns,
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
        FP8_CVT: tl.constexpr,
        FAST4: tl.constexpr,
        W_ALIGN: tl.constexpr,
    ):
        """Rows `ns` [BN] of a weight at inputs k0 .. k0 + BLOCK_K, dequantised -> [BN, BLOCK_K] in
        OUT (the activations' dtype); int8 / fp8 without their per-channel scale (the caller's
        epilogue), nvfp4 without its global scale. FP8_CVT: e4m3 bytes converted by the hardware
        (sm89+), else decoded by bits; FAST4: the 4-bit codes decoded in OUT's 16 bits
        (`_four_bit_fast`), else through float32. Every path gives the same bits."""
        rows = ns.to(tl.int64)[:, None]
        if SCHEME == 0 or SCHEME == 3:  # 4-bit: BLOCK_K / 8 int32 words of a row, eight codes a word
            # (`w_base`: the codes viewed as int32, KB the words a row). Read as words, not bytes: triton
            # then lays the decoded tile out as a 16-bit operand's (read as bytes, kWidth 8 cost the K
            # loop a register shuffle a value)
            kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            # W_ALIGN: a row's words (stride and KB) are a multiple of it; 4: rows start on 16 bytes and
            # the mask along K is whole 16-byte vectors' (compared a vector at a time), read as vectors
            row_words = tl.multiple_of(ns.to(tl.int64) * stride_wn, W_ALIGN)
            k_ok = (kw // W_ALIGN) < KB // W_ALIGN
            b = tl.load(w_base + row_words[:, None] + kw[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            SCALES: tl.constexpr = BLOCK_K // GROUP
            # the tile's scales of a row as whole 8-byte words (rows padded to whole tiles): `s_base`
            # is the scales viewed as int64, WORDS words a row's tile, each holding PER scales
            PER: tl.constexpr = 8 // SCALE_BYTES
            WORDS: tl.constexpr = SCALES // PER
            s_off = tl.multiple_of(ns.to(tl.int64) * stride_sn + k0 // GROUP // PER, WORDS)
            words = tl.load(s_base + s_off[:, None] + tl.arange(0, WORDS)[None, :], mask=n_ok[:, None], other=0)
            shift = (tl.arange(0, PER) * (8 * SCALE_BYTES)).to(tl.int64)
            parts = (words[:, :, None] >> shift[None, None, :]) & ((1 << (8 * SCALE_BYTES)) - 1)  # [BN, WORDS, PER]
            parts = tl.reshape(parts, (b.shape[0], SCALES)).to(tl.int32)
            if FAST4:  # in OUT's 16 bits: the product of value and scale rounds once, as float32's does
                q = _four_bit_fast(b, SCHEME, OUT)
                if SCHEME == 3:  # e2m1 (2 significant bits) x e4m3 (4): exact in either
                    sf = _fp8_bytes(parts, OUT, FP8_CVT)
                else:  # int4: the scales are OUT's dtype (`_fast4`)
                    sf = parts.to(tl.int16).to(OUT, bitcast=True)
            elif SCHEME == 3:
                q = _e2m1(_nibbles(b))
                sf = _fp8_bytes(parts, tl.float32, FP8_CVT)
            else:
                q = (_nibbles(b) - 8).to(tl.float32)
                if SCALE_BYTES == 4:
                    sf = parts.to(tl.float32, bitcast=True)
                elif SCALE_FP16:
                    sf = parts.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                else:  # bf16: its bits are a float32's top half
                    sf = (parts << 16).to(tl.float32, bitcast=True)
            w = tl.reshape(tl.reshape(q, (b.shape[0], SCALES, GROUP)) * sf[:, :, None], (b.shape[0], BLOCK_K))
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            raw = tl.load(w_base + rows * stride_wn + ks[None, :], mask=n_ok[:, None] & (ks < K)[None, :], other=0)
            if SCHEME == 2:
                w = _fp8_bytes(raw, OUT, FP8_CVT)
            elif SCHEME == 1:  # via float32: the interpreter casts int8 -> bf16 wrongly
                w = raw.to(tl.float32)
            else:
                w = raw
        return w.to(OUT)

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
        """acc + x @ W[ns, k0 : k0 + BLOCK_K].T, the weight tile decoded in registers (`_weight_tile`)."""
        w = _weight_tile(
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
    def _gemm_kernel(
        x_ptr, pairs_ptr, w_ptr, s_ptr, cs_ptr, ends_ptr, y_ptr,
        M, N, K, KB,
        stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ce, stride_cn, stride_ym,
        GROUPED: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr, TOP_K: tl.constexpr,
        SCHEME: tl.constexpr, GROUP: tl.constexpr, SCALE_BYTES: tl.constexpr, SCALE_FP16: tl.constexpr,
        CHANNEL_SCALE: tl.constexpr, DUAL: tl.constexpr,
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
        fp8's scale, nvfp4's 1 / global scale)."""
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
        OUT: tl.constexpr = x_ptr.dtype.element_ty
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


def _arch(device: torch.device) -> int:
    """The compute capability (10 x major + minor) a launch on `device` is compiled for; 0 under
    the interpreter."""
    if INTERPRETED:
        return 0
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return ARCH_ON_META


def fp8_in_hardware(arch: int) -> bool:
    """Whether e4m3 bytes are converted by the hardware there (triton's float8e4nv: sm89 and later)."""
    return arch >= 89


def _fast4(w: GemmWeight, dtype: torch.dtype) -> bool:
    """Whether 4-bit codes are decoded in the activations' 16-bit dtype (`_four_bit_fast`): bf16 and
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
}
SMS = 132  # an H100 / H200's SMs: a linear's grid is made at least this many CTAs where columns allow


def _blocks(w: GemmWeight, rows: int, dual: bool, n_out: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) from the rows a program takes (an
    expert's average, or a linear's M): small M is memory bound (a short row tile). Row tiles of
    at most 128, `_TILES`' columns and warps; a linear (one row tile a program, the grid split
    over rows) takes shorter row tiles, then narrower columns (16 at the least), until its grid has
    `SMS` CTAs; activation tiles of 32 KiB and more are pipelined twice, smaller ones three times."""
    rows = rows if not w.stacked else 2 * rows  # an expert's rows vary about their average: room for most
    block_m = max(16, min(128, triton.next_power_of_2(max(rows, 1))))
    if INTERPRETED:
        block_m = min(block_m, 32)
    scheme = None if w.scheme == PLAIN else schemes.get(w.scheme)
    four_bit = scheme is not None and scheme.bits == 4
    block_k = four_bit_k(w.group, w.scales.element_size()) if four_bit else (128 if w.data.element_size() == 1 else 64)
    kind = "4-bit" if four_bit else "1-byte" if w.data.element_size() == 1 else "plain"

    def tile(block_m: int) -> tuple[int, int]:
        dual_n, dual_warps, block_n, warps = _TILES[kind][block_m]
        return (dual_n, dual_warps) if dual else (block_n, warps)

    block_n, warps = tile(block_m)
    if not w.stacked:  # fill the SMs: more row tiles, then narrower columns (never a K loop's metric over budget)
        while triton.cdiv(rows, block_m) * triton.cdiv(n_out, block_n) < SMS:
            if block_m > 16:
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
    act = block_m * block_k * 2  # bytes of one activation tile
    stages = 2 if act >= 32 * 1024 or (dual and four_bit) else 3
    return block_m, block_n, block_k, warps, stages


def gemm(
    x: torch.Tensor,
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
    rows are gates then ups, the result gelu(gate) * up [M, N / 2]."""
    if x.dtype not in X_DTYPES or x.dim() != 2 or x.shape[1] != w.shape[-1]:
        raise ValueError(
            f"gemm needs x [M, {w.shape[-1]}] bfloat16 / float16 / float32, got {tuple(x.shape)} {x.dtype}"
        )
    x = x if x.stride(1) == 1 else x.contiguous()
    n, k = w.shape[-2], w.shape[-1]
    n_out = n // 2 if dual else n
    rows = pairs.shape[0] if pairs is not None else x.shape[0]
    y = torch.empty(out_rows if out_rows is not None else rows, n_out, dtype=x.dtype, device=x.device)
    if rows == 0 or n_out == 0:
        return y
    if w.stacked:
        experts = w.shape[0]
        if ends is None or ends.shape != (experts,):
            raise ValueError(f"a stacked weight needs ends [{experts}]")
        block_m, block_n, block_k, warps, stages = _blocks(
            w, rows_per_expert or -(-rows // experts), dual is not None, n_out
        )
        grid_m = experts
    else:  # the grid split over rows: a program a row tile
        block_m, block_n, block_k, warps, stages = _blocks(w, rows, dual is not None, n_out)
        grid_m = triton.cdiv(rows, block_m)
    stacked = w.stacked
    four_bit = _code(w) in (0, 3)
    data = w.data.view(torch.int32) if four_bit else w.data  # 4-bit codes read as int32 words
    scales = w.scales.view(torch.int64) if w.scales is not None else data  # 4-bit: read as 8-byte words
    channel = w.channel if w.channel is not None else data
    ws = (data.stride(0) if stacked else 0, data.stride(-2))
    ss = (scales.stride(0) if stacked and w.scales is not None else 0, scales.stride(-2) if w.scales is not None else 0)
    cs = (
        channel.stride(0) if stacked and w.channel is not None else 0,
        channel.stride(-1) if w.channel is not None else 0,
    )
    _gemm_kernel[(grid_m, triton.cdiv(n_out, block_n))](
        x, pairs if pairs is not None else y, data, scales, channel, ends if ends is not None else y, y,
        rows, n_out, k, k // 8,
        x.stride(0), *ws, *ss, *cs, y.stride(0),
        GROUPED=w.stacked, GATHER=gather, SCATTER=scatter, TOP_K=top_k,
        SCHEME=_code(w), GROUP=w.group, SCALE_BYTES=w.scales.element_size() if w.scales is not None else 1,
        SCALE_FP16=w.scales is not None and w.scales.dtype == torch.float16,
        CHANNEL_SCALE=w.channel is not None, DUAL=dual is not None,
        TANH=dual == "tanh", ROUND=x.dtype == torch.bfloat16, **dot_args(x.dtype),
        FP8_CVT=_code(w) in (2, 3) and fp8_in_hardware(_arch(x.device)), FAST4=_fast4(w, x.dtype),
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

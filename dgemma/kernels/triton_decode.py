"""e4m3, e2m1 and int4 codes read inside Triton kernels (and e4m3 written): the jit helpers of the
quantised GEMM (kernels/triton_quant.py) and of the row kernels that quantise activations
(kernels/triton_norms.py), kept apart from the GEMM so that each module stays one subject.

Decoding, each path exact (the same bits as the float32 decode it replaces):
- e4m3 bytes (fp8 weights, nvfp4's scales, fp8 activations): on sm89 and later a bitcast to
  float8e4nv and the hardware's conversion (FP8_CVT); else, on sm80 and in Triton's interpreter
  (numpy has no float8; its conversion turns the NaN 0x7F into 480), by bit manipulation (`e4m3`).
- 4-bit codes: in the activations' 16-bit type by the magic-number and bit-placement tricks of
  `_four_bit_fast` (FAST4: bf16 / fp16 activations, int4 with scales of their type; not bf16 under
  the interpreter, which misreads bf16 bitcasts), else through float32 (`_nibbles`, `_e2m1`).

Encoding (`fp8_rows`: activations quantised per token for the W8A8 GEMM): a row's largest
magnitude sets its float32 scale (amax / 448, e4m3's largest finite value), each value times
448 / amax (both quotients correctly rounded: `tl.math.div_rn`), clamped to +-448 and rounded to
the nearest e4m3 (ties to even): by the hardware's conversion on sm89+ (cvt.rn.satfinite), else by
bits (`_e4m3_code`), the same bytes as torch's `.to(torch.float8_e4m3fn)` of the same float32
(quant/modules.py's `fp8_per_token` is the torch copy the tests hold it to).
"""

from __future__ import annotations

from .triton_support import HAVE_TRITON, tl, triton

FP8_MAX = 448.0  # e4m3fn's largest finite value
AMAX_FLOOR = 1e-30  # a row's amax is at least this (an all-zero row: codes 0, no division by zero)

if HAVE_TRITON:

    @triton.jit
    def e4m3(b):
        """float8_e4m3fn bytes (int32 0..255) -> float32, exactly (0x7F / 0xFF: NaN)."""
        exp = (b >> 3) & 0xF
        man = b & 7
        normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        val = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)
        val = tl.where((b & 0x80) != 0, -val, val)
        return tl.where((b & 0x7F) == 0x7F, float("nan"), val)

    @triton.jit
    def fp8_bytes(b, OUT: tl.constexpr, FP8_CVT: tl.constexpr):
        """float8_e4m3fn bytes (any integer type) -> OUT, exactly. FP8_CVT: a bitcast to float8e4nv and
        the hardware's conversion (sm89+: cvt.rn.f16x2.e4m3x2, two values an instruction, NaN kept);
        else `e4m3`'s bit decode (the interpreter, whose conversion turns 0x7F into 480, and sm80,
        where triton has no float8e4nv)."""
        if FP8_CVT:
            return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(OUT)
        return e4m3(b.to(tl.int32) & 0xFF).to(OUT)

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
    def weight_tile(
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
                    sf = fp8_bytes(parts, OUT, FP8_CVT)
                else:  # int4: the scales are OUT's dtype (`_fast4`)
                    sf = parts.to(tl.int16).to(OUT, bitcast=True)
            elif SCHEME == 3:
                q = _e2m1(_nibbles(b))
                sf = fp8_bytes(parts, tl.float32, FP8_CVT)
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
                w = fp8_bytes(raw, OUT, FP8_CVT)
            elif SCHEME == 1:  # via float32: the interpreter casts int8 -> bf16 wrongly
                w = raw.to(tl.float32)
            else:
                w = raw
        return w.to(OUT)

    @triton.jit
    def _e4m3_code(v):
        """float32 in [-448, 448] -> its nearest e4m3fn byte (int32 0..255, ties to even), by bits:
        normals rounded at the float32 mantissa's 3rd bit (a carry moves into the exponent),
        values below 2^-6 (e4m3's smallest normal) as multiples of 2^-9 rounded by the 2^23 trick."""
        bits = v.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        r = a + 0x7FFFF + ((a >> 20) & 1)
        normal = tl.minimum((((r >> 23) - 120) << 3) | ((r >> 20) & 7), 0x7E)  # 0x7E: 448
        t = a.to(tl.float32, bitcast=True) * 512.0
        sub = ((t + 8388608.0) - 8388608.0).to(tl.int32)
        return tl.where(a < 0x3C800000, sub, normal) | sign

    @triton.jit
    def fp8_rows(x, FP8_CVT: tl.constexpr):
        """Rows [R, C] of float32 values (the activations as rounded to the model's dtype; zeros past
        the row's end) -> (e4m3 bytes uint8 [R, C], float32 scales [R, 1]): x ~ e4m3(bytes) x scale,
        one scale a token (see the module)."""
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30)[:, None]  # AMAX_FLOOR
        scale = tl.math.div_rn(amax, 448.0)  # FP8_MAX
        q = tl.minimum(tl.maximum(x * tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax), -448.0), 448.0)
        if FP8_CVT:
            codes = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            codes = _e4m3_code(q).to(tl.uint8)
        return codes, scale

else:  # pragma: no cover
    e4m3 = fp8_bytes = weight_tile = fp8_rows = None

// Quantised weights on a CPU with AVX-512 BF16 (built by native.py with the other AVX-512 kernels).
//
// 1. The GEMMs that dequantise inside: out [M, N] = x [M, K] @ W^T with x, out bf16 and W int8,
//    fp8, int4 or nvfp4 as stored (gemm_avx2.cpp's names and arguments). Four rows of W are
//    dequantised into a buffer that stays in L1, then multiplied with every row of x by
//    VDPBF16PS, lanes along K: a 6 x 4 block of accumulators, summed across their lanes four at
//    a time at the end (float32 accumulation, rounded once to bf16). No dequantised weight is
//    written out. An MoE expert at the released size, [16, 2816] @ [1408, 2816]^T in int4: 0.54 ms,
//    where dequantising the weight whole for oneDNN's bf16 GEMM took 0.78 and oneDNN's GEMM on the
//    unquantised bf16 weight 0.53 (AMD EPYC Zen 4, 2 cores; avx2.py says when it is used).
//
// 2. The row dequantisers those GEMMs use, also bound as dequant.cpp's functions (same names and
//    arguments) for a bf16 `out`: 16 and 32 values a step where dequant.cpp (built for AVX2-only
//    CPUs) takes 8 and 16; 1.3-2.8x its speed. Values equal `formats.dequantize` bit for bit:
//    code * scale in float32 (rounded once), then rounded to bf16 as c10 does (nearest even,
//    subnormals kept, NaN -> 0x7FC0). VCVTNE2PS2BF16 rounds the same way but flushes subnormal
//    inputs to zero and keeps NaN payloads, so it serves only where a row's (or group's) scale
//    rules both out; else integer rounding.
//
//   dequant_int8(weight int8 [N, K], scale [N] or [N, 1], out bf16)
//   dequant_fp8(weight uint8 (e4m3fn bits) [N, K], scale [N] or [N, 1], out bf16)
//   dequant_int4(packed int32 [N, K/8], scale [N, K/group], group, out bf16)
//   dequant_nvfp4(packed uint8 [N, K/2], scale uint8 (e4m3fn bits) [N, K/16], global_scale, out bf16)
//   gemm_int8(x, w, scale, out), gemm_fp8(x, w, scale, out), gemm_int4(x, packed, scale, group, out),
//   gemm_nvfp4(x, packed, scale, global_scale, out)

#include <ATen/core/Tensor.h>

#include <immintrin.h>

#include "dequant_args.h"
#include "scales.h"

#include <cfloat>
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using namespace dgemma_dequant;
using dgemma_scales::ScaleKind;
using dgemma_scales::fp8_table;
using dgemma_scales::scale_at;
using dgemma_scales::scale_kind;

// ------------------------------------------------------------------------------------ rounding
// float32 -> bf16 bits as c10::BFloat16(float), in the low 16 bits of each 32-bit lane
inline __m512i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// 32 floats (a, then b) -> 32 bf16 in order. Fast: VCVTNE2PS2BF16, for values with no subnormal
// and no NaN (the caller knows from the scale); else the exact integer rounding.
template <bool Fast>
inline __m512i bf16_pack(__m512 a, __m512 b) {
  if constexpr (Fast) {
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  } else {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(bf16_bits(a))), _mm512_cvtepi32_epi16(bf16_bits(b)), 1);
  }
}

// |code| >= 1 times this scale is never subnormal nor NaN: VCVTNE2PS2BF16 rounds it as c10
inline bool plain_scale(float s, float smallest_code) {
  return std::isfinite(s) && (s == 0.0f || std::fabs(s) * smallest_code >= FLT_MIN);
}

inline void put_tail(at::BFloat16* o, float v) { *o = at::BFloat16(v); }

// ---------------------------------------------------------------------------------------- rows
template <bool Fast>
void int8_row_(const int8_t* w, float scale, at::BFloat16* o, int64_t K) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k))));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16))));
    _mm512_storeu_si512(o + k, bf16_pack<Fast>(_mm512_mul_ps(a, s), _mm512_mul_ps(b, s)));
  }
  for (; k < K; ++k) put_tail(o + k, static_cast<float>(w[k]) * scale);
}
void int8_row(const int8_t* w, float scale, at::BFloat16* o, int64_t K) {
  if (plain_scale(scale, 1.0f))
    int8_row_<true>(w, scale, o, K);
  else
    int8_row_<false>(w, scale, o, K);
}

// e4m3fn codes (16-bit lanes) -> the fp16 bits of value / 256 (dequant.cpp's fp8_to_half_bits_raw)
inline __m512i fp8_half_bits(__m512i x) {
  const __m512i y = _mm512_slli_epi16(x, 7);
  return _mm512_add_epi16(y, _mm512_and_si512(y, _mm512_set1_epi16(0x4000)));
}
inline __m256i fp8_half_bits(__m256i x) {
  const __m256i y = _mm256_slli_epi16(x, 7);
  return _mm256_add_epi16(y, _mm256_and_si256(y, _mm256_set1_epi16(0x4000)));
}

// Fold: half(code) * (2^8 scale), the code's value times scale rounded once while 2^8 scale is
// exact; else (a huge scale) the value first, then the scale. NaN codes (0x7F, 0xFF) come out as
// 1.875 * 2^-8 and are set to 0x7FC0 after rounding.
template <bool Fast, bool Fold>
void fp8_row_(const uint8_t* w, float scale, at::BFloat16* o, int64_t K) {
  const __m512 s = _mm512_set1_ps(Fold ? scale * 256.0f : scale), two8 = _mm512_set1_ps(256.0f);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k)));
    const __m512i h = fp8_half_bits(x);
    __m512 a = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    if constexpr (!Fold) {
      a = _mm512_mul_ps(a, two8);
      b = _mm512_mul_ps(b, two8);
    }
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x7F));
    const __m512i r = bf16_pack<Fast>(_mm512_mul_ps(a, s), _mm512_mul_ps(b, s));
    _mm512_storeu_si512(o + k, _mm512_mask_mov_epi16(r, nan, _mm512_set1_epi16(0x7FC0)));
  }
  const float* table = fp8_table().v;
  for (; k < K; ++k) put_tail(o + k, table[w[k]] * scale);
}
void fp8_row(const uint8_t* w, float scale, at::BFloat16* o, int64_t K) {
  if (!(std::fabs(scale) <= FLT_MAX / 256))  // huge, infinite or NaN
    fp8_row_<false, false>(w, scale, o, K);
  else if (plain_scale(scale, 0x1p-9f))  // the smallest code, 2^-9, times it is normal
    fp8_row_<true, true>(w, scale, o, K);
  else
    fp8_row_<false, true>(w, scale, o, K);
}

// int4: byte m of a group's bytes holds values 2m (low nibble) and 2m + 1, each stored + 8. Per
// group, a table of the 16 bf16 values (n - 8) * s (each rounded as the reference) in the low
// words of a register; a byte's two nibbles become the indices of two 16-bit lanes, and one
// VPERMW looks up 32 values (16 or 8 at a group's end: groups are multiples of 8).
void int4_row(const int32_t* w, const void* scales, ScaleKind kind, int64_t group, at::BFloat16* o, int64_t K) {
  const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);  // lane m: byte m's low nibble, then its high one
  const auto* bytes = reinterpret_cast<const uint8_t*>(w);
  auto* out = reinterpret_cast<uint16_t*>(o);
  for (int64_t g = 0, groups = K / group; g < groups; ++g) {
    const __m512 s = _mm512_set1_ps(scale_at(scales, kind, g));
    const __m512i table = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(bf16_bits(_mm512_mul_ps(codes, s))));
    int64_t v = g * group;
    const int64_t end = v + group;
    for (; v + 32 <= end; v += 32) {
      const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + v / 2)));
      const __m512i index = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), nibbles, 0xA8);  // (d | d << 12) & mask
      _mm512_storeu_si512(out + v, _mm512_permutexvar_epi16(index, table));
    }
    for (; v < end; v += 8) {  // 8 values from 4 bytes
      int32_t four;
      std::memcpy(&four, bytes + v / 2, 4);
      const __m128i d = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(four));
      const __m128i index = _mm_ternarylogic_epi32(d, _mm_slli_epi32(d, 12), _mm512_castsi512_si128(nibbles), 0xA8);
      const __m256i values = _mm256_permutexvar_epi16(_mm256_castsi128_si256(index), _mm512_castsi512_si256(table));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + v), _mm256_castsi256_si128(values));
    }
  }
}

// nvfp4: byte j holds values 2j (low nibble) and 2j + 1; one e4m3fn scale per 16 values, divided
// by the global scale (as the reference) into the group's step. Per group, the 16 e2m1 values
// (sign in bit 3) times the step in one register, looked up by VPERMPS.
inline bool plain_step(float step) { return plain_scale(step, 0.5f); }  // 0.5: the smallest magnitude

void nvfp4_row(const uint8_t* w, const uint8_t* scales, float global, float* step, at::BFloat16* o, int64_t K) {
  const int64_t groups = K / 16;
  {  // the row's steps, 16 groups a time: e4m3fn -> float (* 2^8), / global
    const __m512 two8 = _mm512_set1_ps(256.0f), g = _mm512_set1_ps(global);
    const __m256i low7 = _mm256_set1_epi16(0x7F);
    int64_t i = 0;
    for (; i + 16 <= groups; i += 16) {
      const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + i)));
      const __m256i h = _mm256_mask_mov_epi16(fp8_half_bits(x), _mm256_cmpeq_epi16_mask(_mm256_and_si256(x, low7), low7),
                                              _mm256_set1_epi16(0x7E00));  // NaN codes: a half NaN
      _mm512_storeu_ps(step + i, _mm512_div_ps(_mm512_mul_ps(_mm512_cvtph_ps(h), two8), g));
    }
    const float* table = fp8_table().v;
    for (; i < groups; ++i) step[i] = table[scales[i]] / global;
  }
  const __m512 e2m1 = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  const __m256i low = _mm256_set1_epi16(0x0F);
  auto* out = reinterpret_cast<uint16_t*>(o);
  // 16 bytes -> 32 codes in value order (16-bit lane j: byte j's low nibble, then its high one)
  auto codes_of = [&](__m128i b) {
    const __m256i x = _mm256_cvtepu8_epi16(b);
    return _mm256_or_si256(_mm256_and_si256(x, low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(x, 4), low), 8));
  };
  auto values = [&](int64_t g, __m128i c) {  // 16 codes (bytes) of group g -> 16 floats
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c), _mm512_mul_ps(e2m1, _mm512_set1_ps(step[g])));
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {  // 32 values from 16 bytes
    const __m256i c = codes_of(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8 * g)));
    const __m512 a = values(g, _mm256_castsi256_si128(c)), b = values(g + 1, _mm256_extracti128_si256(c, 1));
    const __m512i r = plain_step(step[g]) && plain_step(step[g + 1]) ? bf16_pack<true>(a, b) : bf16_pack<false>(a, b);
    _mm512_storeu_si512(out + 16 * g, r);
  }
  if (g < groups) {  // an odd last group: 8 bytes
    const __m256i c = codes_of(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * g)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * g), _mm512_cvtepi32_epi16(bf16_bits(values(g, _mm256_castsi256_si128(c)))));
  }
}

// for_chunks / for_rows over a bf16 out (the float32 instantiation they also make does nothing)
template <typename F>
void for_bf16_chunks(const at::Tensor& out, F chunk) {
  for_chunks(out, [&](int64_t begin, int64_t end, auto* o) {
    if constexpr (std::is_same_v<decltype(o), at::BFloat16*>) chunk(begin, end, o);
  });
}
template <typename F>
void for_bf16_rows(const at::Tensor& out, F row) {
  const int64_t K = out.size(1);
  for_bf16_chunks(out, [&](int64_t begin, int64_t end, at::BFloat16* o) {
    for (int64_t r = begin; r < end; ++r) row(r, o + r * K);
  });
}

void check_bf16_out(const at::Tensor& out, const char* fn) {
  check_out(out, fn);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, fn, ": out must be bfloat16 (the AVX-512 kernels write bf16 only), got ",
              out.scalar_type());
}

// ------------------------------------------------------------------------------------------ GEMM
constexpr int MR = 6, NR = 4;  // rows of x, rows of W per block: 24 accumulators + 4 weights + x

// acc[m][j] = x[m] . w[j] over K (w: NR rows of stride Kp, zero past K), rounded to bf16 into
// out[m * ldo + j]; x rows of stride K, read with a masked load past the last full 32
// [sum of a's lanes, of b's, of c's, of d's]: two unpack-and-add levels within each 128-bit lane,
// then the four lanes added (13 instructions for 4 sums where one horizontal sum takes ~10)
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a02 b02 a13 b13
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)), _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// 4 floats -> bf16 bits as c10 (bf16_bits' rounding), in the low 16 bits of each 32-bit lane
inline __m128i bf16_bits4(__m128 v) {
  const __m128i b = _mm_castps_si128(v);
  const __m128i lsb = _mm_and_si128(_mm_srli_epi32(b, 16), _mm_set1_epi32(1));
  const __m128i r = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(b, _mm_set1_epi32(0x7FFF)), lsb), 16);
  return _mm_mask_mov_epi32(r, _mm_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm_set1_epi32(0x7FC0));
}

template <int Mr, int Nr>
inline void micro(const uint16_t* x, int64_t K, const uint16_t* w, int64_t Kp, uint16_t* out, int64_t ldo) {
  __m512 acc[Mr][Nr];
  for (int m = 0; m < Mr; ++m)
    for (int j = 0; j < Nr; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[Nr];
    for (int j = 0; j < Nr; ++j) wv[j] = _mm512_load_si512(w + j * Kp + k);
    for (int m = 0; m < Mr; ++m) {
      const __m512i xv = _mm512_loadu_si512(x + m * K + k);
      for (int j = 0; j < Nr; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], reinterpret_cast<__m512bh>(xv), reinterpret_cast<__m512bh>(wv[j]));
    }
  }
  if (k < K) {  // the last K % 32 inputs: x read masked (zeros past K), w zero-padded
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512i wv[Nr];
    for (int j = 0; j < Nr; ++j) wv[j] = _mm512_load_si512(w + j * Kp + k);
    for (int m = 0; m < Mr; ++m) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + m * K + k);
      for (int j = 0; j < Nr; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], reinterpret_cast<__m512bh>(xv), reinterpret_cast<__m512bh>(wv[j]));
    }
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int m = 0; m < Mr; ++m) {
    const __m128i sums = bf16_bits4(sum4(acc[m][0], Nr > 1 ? acc[m][1 % Nr] : zero, Nr > 2 ? acc[m][2 % Nr] : zero,
                                         Nr > 3 ? acc[m][3 % Nr] : zero));
    if constexpr (Nr == 4) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + m * ldo), _mm_packus_epi32(sums, sums));
    } else {
      alignas(16) uint32_t lanes[4];
      _mm_store_si128(reinterpret_cast<__m128i*>(lanes), sums);
      for (int j = 0; j < Nr; ++j) out[m * ldo + j] = static_cast<uint16_t>(lanes[j]);
    }
  }
}

template <int Nr>
void rows_times_block(const uint16_t* x, int64_t rows, int64_t K, const uint16_t* w, int64_t Kp, uint16_t* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + MR <= rows; m += MR) micro<MR, Nr>(x + m * K, K, w, Kp, out + m * ldo, ldo);
  const uint16_t* xm = x + m * K;
  uint16_t* om = out + m * ldo;
  switch (rows - m) {
    case 5: micro<5, Nr>(xm, K, w, Kp, om, ldo); break;
    case 4: micro<4, Nr>(xm, K, w, Kp, om, ldo); break;
    case 3: micro<3, Nr>(xm, K, w, Kp, om, ldo); break;
    case 2: micro<2, Nr>(xm, K, w, Kp, om, ldo); break;
    case 1: micro<1, Nr>(xm, K, w, Kp, om, ldo); break;
    default: break;
  }
}

// out [M, N] = x [M, K] @ W^T with W's row n written by decode(n, dst) (K bf16 values). Rows of x
// go in chunks that stay in L2 (~384 KB); per chunk, threads split W's 4-row blocks, each
// dequantised into the thread's buffer once per chunk.
template <typename Decode>
void gemm_decoded(const at::Tensor& x, int64_t N, const at::Tensor& out, Decode decode) {
  const int64_t M = x.size(0), K = x.size(1), Kp = (K + 31) / 32 * 32;
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum
    out.zero_();
    return;
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t chunk = std::max<int64_t>(MR, (int64_t{384} << 10) / (2 * std::max<int64_t>(K, 1)) / MR * MR);
  const int64_t blocks = (N + NR - 1) / NR;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      // zeroed once: the decoders write K values a row, the padding to Kp stays 0
      std::unique_ptr<uint16_t, decltype(&std::free)> buffer(
          static_cast<uint16_t*>(std::aligned_alloc(64, NR * Kp * sizeof(uint16_t))), &std::free);
      TORCH_CHECK(buffer, "gemm_quant_bf16: out of memory for a ", NR, " x ", Kp, " buffer");
      std::memset(buffer.get(), 0, NR * Kp * sizeof(uint16_t));
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * NR, nr = std::min<int64_t>(NR, N - n0);
        for (int64_t j = 0; j < nr; ++j) decode(n0 + j, buffer.get() + j * Kp);
        const uint16_t* xm = xp + m0 * K;
        uint16_t* om = op + m0 * N + n0;
        switch (nr) {
          case 4: rows_times_block<4>(xm, rows, K, buffer.get(), Kp, om, N); break;
          case 3: rows_times_block<3>(xm, rows, K, buffer.get(), Kp, om, N); break;
          case 2: rows_times_block<2>(xm, rows, K, buffer.get(), Kp, om, N); break;
          default: rows_times_block<1>(xm, rows, K, buffer.get(), Kp, om, N); break;
        }
      }
    });
  }
}

}  // namespace

at::Tensor dequant_int8_avx512(const at::Tensor& weight, const at::Tensor& scale, at::Tensor out) {
  const char* fn = "dequant_int8";
  check_int8(weight, scale, out, fn);
  check_bf16_out(out, fn);
  const ScaleKind kind = scale_kind(scale, fn);
  const int64_t K = out.size(1);
  const int8_t* w = weight.data_ptr<int8_t>();
  const void* sc = scale.data_ptr();
  for_bf16_rows(out, [&](int64_t r, at::BFloat16* o) { int8_row(w + r * K, scale_at(sc, kind, r), o, K); });
  return out;
}

at::Tensor dequant_fp8_avx512(const at::Tensor& weight, const at::Tensor& scale, at::Tensor out) {
  const char* fn = "dequant_fp8";
  check_fp8(weight, scale, out, fn);
  check_bf16_out(out, fn);
  const ScaleKind kind = scale_kind(scale, fn);
  const int64_t K = out.size(1);
  const auto* w = static_cast<const uint8_t*>(weight.data_ptr());
  const void* sc = scale.data_ptr();
  for_bf16_rows(out, [&](int64_t r, at::BFloat16* o) { fp8_row(w + r * K, scale_at(sc, kind, r), o, K); });
  return out;
}

at::Tensor dequant_int4_avx512(const at::Tensor& packed, const at::Tensor& scale, int64_t group_size, at::Tensor out) {
  const char* fn = "dequant_int4";
  check_int4(packed, scale, group_size, out, fn);
  check_bf16_out(out, fn);
  const int64_t K = out.size(1);
  const ScaleKind kind = scale_kind(scale, fn);
  const int32_t* w = packed.data_ptr<int32_t>();
  const auto* sc = static_cast<const char*>(scale.data_ptr());
  const int64_t scale_row_bytes = scale.size(1) * scale.element_size();
  for_bf16_rows(out, [&](int64_t r, at::BFloat16* o) { int4_row(w + r * (K / 8), sc + r * scale_row_bytes, kind, group_size, o, K); });
  return out;
}

at::Tensor dequant_nvfp4_avx512(const at::Tensor& packed, const at::Tensor& scale, double global_scale, at::Tensor out) {
  const char* fn = "dequant_nvfp4";
  check_nvfp4(packed, scale, out, fn);
  check_bf16_out(out, fn);
  const int64_t K = out.size(1), groups = K / 16;
  const float global = static_cast<float>(global_scale);
  const auto* w = static_cast<const uint8_t*>(packed.data_ptr());
  const auto* sc = static_cast<const uint8_t*>(scale.data_ptr());
  for_bf16_chunks(out, [&](int64_t begin, int64_t end, at::BFloat16* o) {
    std::vector<float> step(groups);
    for (int64_t r = begin; r < end; ++r) nvfp4_row(w + r * (K / 2), sc + r * groups, global, step.data(), o + r * K, K);
  });
  return out;
}

// ----------------------------------------------------------------------- GEMMs on stored weights
namespace {

// x [M, K] bf16, out [M, N] bf16, both contiguous on the CPU; W [N, K]
void check_gemm(const at::Tensor& x, int64_t N, int64_t K, const at::Tensor& out, const char* fn) {
  check_input(x, fn, "x");
  check_input(out, fn, "out");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, fn, ": x must be a 2D bfloat16 [M, K], got ", x.dim(),
              "D ", x.scalar_type());
  TORCH_CHECK(x.size(1) == K, fn, ": x has ", x.size(1), " inputs, the weight ", K);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == N, fn,
              ": out must be bfloat16 [", x.size(0), ", ", N, "], got ", out.scalar_type(), " ", out.sizes());
}

void check_rows(const at::Tensor& t, int64_t N, int64_t cols, const char* fn, const char* what) {
  check_input(t, fn, what);
  TORCH_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == cols, fn, ": ", what, " must be [", N, ", ", cols, "], got ",
              t.sizes());
}

}  // namespace

at::Tensor gemm_int8_avx512(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, at::Tensor out) {
  const char* fn = "gemm_int8";
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, fn, ": weight must be a 2D int8 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  check_gemm(x, N, K, out, fn);
  check_input(weight, fn, "weight");
  check_row_scale(scale, N, fn);
  const ScaleKind kind = scale_kind(scale, fn);
  const int8_t* w = weight.data_ptr<int8_t>();
  const void* sc = scale.data_ptr();
  gemm_decoded(x, N, out, [&](int64_t n, uint16_t* dst) {
    int8_row(w + n * K, scale_at(sc, kind, n), reinterpret_cast<at::BFloat16*>(dst), K);
  });
  return out;
}

at::Tensor gemm_fp8_avx512(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, at::Tensor out) {
  const char* fn = "gemm_fp8";
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kByte || weight.scalar_type() == at::kFloat8_e4m3fn), fn,
              ": weight must be a 2D float8_e4m3fn (or its bits as uint8) [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  check_gemm(x, N, K, out, fn);
  check_input(weight, fn, "weight");
  check_row_scale(scale, N, fn);
  const ScaleKind kind = scale_kind(scale, fn);
  const auto* w = static_cast<const uint8_t*>(weight.data_ptr());
  const void* sc = scale.data_ptr();
  gemm_decoded(x, N, out, [&](int64_t n, uint16_t* dst) {
    fp8_row(w + n * K, scale_at(sc, kind, n), reinterpret_cast<at::BFloat16*>(dst), K);
  });
  return out;
}

at::Tensor gemm_int4_avx512(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t group,
                            at::Tensor out) {
  const char* fn = "gemm_int4";
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kInt, fn, ": packed must be a 2D int32 [N, K/8]");
  const int64_t N = packed.size(0), K = packed.size(1) * 8;
  check_gemm(x, N, K, out, fn);
  TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0, fn, ": group must be a positive multiple of 8 dividing K (", K,
              "), got ", group);
  check_input(packed, fn, "packed");
  check_rows(scale, N, K / group, fn, "scale");
  const ScaleKind kind = scale_kind(scale, fn);
  const int32_t* w = packed.data_ptr<int32_t>();
  const auto* sc = static_cast<const char*>(scale.data_ptr());
  const int64_t scale_row_bytes = scale.size(1) * scale.element_size();
  gemm_decoded(x, N, out, [&](int64_t n, uint16_t* dst) {
    int4_row(w + n * (K / 8), sc + n * scale_row_bytes, kind, group, reinterpret_cast<at::BFloat16*>(dst), K);
  });
  return out;
}

at::Tensor gemm_nvfp4_avx512(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, double global_scale,
                             at::Tensor out) {
  const char* fn = "gemm_nvfp4";
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte, fn, ": packed must be a 2D uint8 [N, K/2]");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  check_gemm(x, N, K, out, fn);
  TORCH_CHECK(K % 16 == 0, fn, ": K (", K, ") is not a multiple of 16 (nvfp4's group)");
  TORCH_CHECK(scale.scalar_type() == at::kByte || scale.scalar_type() == at::kFloat8_e4m3fn, fn,
              ": scale must be float8_e4m3fn or its bits as uint8, got ", scale.scalar_type());
  check_input(packed, fn, "packed");
  check_rows(scale, N, K / 16, fn, "scale");
  const float global = static_cast<float>(global_scale);
  const auto* w = static_cast<const uint8_t*>(packed.data_ptr());
  const auto* sc = static_cast<const uint8_t*>(scale.data_ptr());
  const int64_t groups = K / 16;
  gemm_decoded(x, N, out, [&](int64_t n, uint16_t* dst) {
    // the row's steps on the stack (no allocation per row on this hot path) up to K = 16384
    float local[1024];
    std::vector<float> heap(groups > 1024 ? groups : 0);
    nvfp4_row(w + n * (K / 2), sc + n * groups, global, groups > 1024 ? heap.data() : local,
              reinterpret_cast<at::BFloat16*>(dst), K);
  });
  return out;
}

// Dequantise (or widen) a tile of weight rows into float32 or bfloat16: AVX2 + FMA + F16C only
// (built by dgemma/kernels/avx2.py as its own extension, so it runs on AVX2-only CPUs too).
//
// Each function takes the parts of rows [start, end) of a weight (contiguous: tiles are slices
// along dim 0) and writes `out` [rows, K] (contiguous; its dtype, float32 or bfloat16, chooses the
// output). Values equal `dgemma/quant/formats.py: dequantize` bit for bit: each is code * scale in
// float32 (rounded once), then rounded to bfloat16 (nearest even, as c10) where out is bf16.
//
//   widen_bf16(src bf16 [N, K], out)
//   dequant_int8(weight int8 [N, K], scale [N] or [N, 1], out)
//   dequant_fp8(weight uint8 (e4m3fn bits) [N, K], scale [N] or [N, 1], out)
//   dequant_int4(packed int32 [N, K/8], scale [N, K/group], group, out)
//   dequant_nvfp4(packed uint8 [N, K/2], scale uint8 (e4m3fn bits) [N, K/16], global_scale, out)
//
// Scales (int8, fp8, int4) may be float32, bfloat16 or float16.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include "dequant_args.h"
#include "scales.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using dgemma_scales::ScaleKind;
using dgemma_scales::scale_at;
using dgemma_scales::scale_kind;
using dgemma_scales::fp8_table;
using namespace dgemma_dequant;

// ------------------------------------------------------------------------------------ outputs
// float32 -> bfloat16 bits, nearest even (as c10::BFloat16(float)), in the low 16 bits of each
// 32-bit lane. `Nan`: map NaN to 0x7FC0 (two more instructions; callers whose values cannot be
// NaN, a finite scale times a finite code, skip it: infinities round correctly without it).
template <bool Nan>
inline __m256i bf16_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  if (!Nan) return r;
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}

template <bool Nan = true>
inline void put8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
template <bool Nan = true>
inline void put8(at::BFloat16* p, __m256 v) {
  const __m256i r = bf16_bits<Nan>(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
template <bool Nan = true>
inline void put16(float* p, __m256 a, __m256 b) {
  _mm256_storeu_ps(p, a);
  _mm256_storeu_ps(p + 8, b);
}
template <bool Nan = true>
inline void put16(at::BFloat16* p, __m256 a, __m256 b) {
  // packus works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7] -> reorder the 64-bit quarters
  const __m256i packed = _mm256_packus_epi32(bf16_bits<Nan>(a), bf16_bits<Nan>(b));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}
inline void put1(float* p, float v) { *p = v; }
inline void put1(at::BFloat16* p, float v) { *p = at::BFloat16(v); }

// ------------------------------------------------------------------------------------- inputs
using dgemma_scales::bits_to_float;


// e4m3fn codes (zero-extended to 16 bits) -> the fp16 patterns of value / 256: the 7 exponent +
// mantissa bits shifted under fp16's (exponent bias 15 vs 7 is a factor 2^8, subnormals
// included: F16C converts those exactly, whatever MXCSR's denormal flags), the sign carried from
// bit 14 to bit 15 by adding bit 14 to itself. 0x7F / 0xFF (NaN) come out as 1.875: `fp8_nan`
// marks them (all ones per 16-bit lane) for a blend.
inline __m256i fp8_to_half_bits_raw(__m256i x) {
  const __m256i y = _mm256_slli_epi16(x, 7);
  return _mm256_add_epi16(y, _mm256_and_si256(y, _mm256_set1_epi16(0x4000)));
}
inline __m256i fp8_nan(__m256i x) {
  return _mm256_cmpeq_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7F));
}
inline __m256i fp8_to_half_bits(__m256i x) {
  return _mm256_blendv_epi8(fp8_to_half_bits_raw(x), _mm256_set1_epi16(0x7E00), fp8_nan(x));
}
inline __m128i fp8_to_half_bits(__m128i x) {
  const __m128i y = _mm_slli_epi16(x, 7);
  const __m128i h = _mm_add_epi16(y, _mm_and_si128(y, _mm_set1_epi16(0x4000)));
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7F));
  return _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), nan);
}


// ---------------------------------------------------------------------------------------- rows
template <typename T>
void widen_row(const uint16_t* s, T* o, int64_t K) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + k));
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
    put16(o + k, a, b);
  }
  for (; k < K; ++k) put1(o + k, bits_to_float(static_cast<uint32_t>(s[k]) << 16));
}

template <bool Nan, typename T>
void int8_row_(const int8_t* w, float scale, T* o, int64_t K) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    put16<Nan>(o + k, _mm256_mul_ps(lo, s), _mm256_mul_ps(hi, s));
  }
  for (; k < K; ++k) put1(o + k, static_cast<float>(w[k]) * scale);
}
template <typename T>
void int8_row(const int8_t* w, float scale, T* o, int64_t K) {
  if (std::isfinite(scale))
    int8_row_<false>(w, scale, o, K);
  else
    int8_row_<true>(w, scale, o, K);
}

template <typename T>
void fp8_row(const uint8_t* w, float scale, T* o, int64_t K) {
  // half(code) * (2^8 scale) is the real code * scale rounded once, as the reference's
  // float(code) * scale, while 2^8 scale is exact (not past FLT_MAX); else two multiplies
  const bool fold = std::fabs(scale) <= FLT_MAX / 256;
  const __m256 s = _mm256_set1_ps(fold ? scale * 256.0f : scale), two8 = _mm256_set1_ps(256.0f);
  int64_t k = 0;
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    // a finite scale: only NaN codes give NaN; round without NaN checks, then blend the NaN
    // codes' lanes (the rounded bf16 values are in code order) to 0x7FC0
    for (; fold && k + 16 <= K; k += 16) {
      const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
      const __m256i h = fp8_to_half_bits_raw(x);
      const __m256 lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s);
      const __m256 hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s);
      const __m256i r = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits<false>(lo), bf16_bits<false>(hi)), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), _mm256_blendv_epi8(r, _mm256_set1_epi16(0x7FC0), fp8_nan(x)));
    }
  }
  {  // float32 out, or an infinite / NaN / huge scale
    for (; k + 16 <= K; k += 16) {
      const __m256i h = fp8_to_half_bits(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k))));
      __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
      if (!fold) {
        lo = _mm256_mul_ps(lo, two8);
        hi = _mm256_mul_ps(hi, two8);
      }
      put16(o + k, _mm256_mul_ps(lo, s), _mm256_mul_ps(hi, s));
    }
  }
  const float* table = fp8_table().v;
  for (; k < K; ++k) put1(o + k, table[w[k]] * scale);
}

// int4 into bfloat16 with a group a multiple of 32: per group, the 16 possible outputs
// (n - 8) * s, each rounded to float32 then bf16 as the reference, are split into a table of low
// bytes and one of high bytes; 32 values (16 bytes: byte m of a word holds values 2m, 2m + 1) are
// then two byte lookups (pshufb) and an interleave, where the arithmetic costs ~20 instructions
// per 16 values.
inline void int4_bf16_table_row(const int32_t* w, const void* scales, ScaleKind kind, int64_t group, at::BFloat16* o, int64_t K) {
  const __m256 below = _mm256_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1), above = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  // packus leaves [T0-3 T8-11 | T4-7 T12-15] (16-bit); this pshufb takes each lane's low bytes
  // then its high bytes, so the dwords are lo0-3 lo8-11 hi0-3 hi8-11 | lo4-7 lo12-15 hi4-7 hi12-15
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i low_order = _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5), high_order = _mm256_setr_epi32(2, 6, 3, 7, 2, 6, 3, 7);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const auto* bytes = reinterpret_cast<const uint8_t*>(w);
  const int64_t groups = K / group;
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(scale_at(scales, kind, g));
    const __m256i t = _mm256_shuffle_epi8(
        _mm256_packus_epi32(bf16_bits<true>(_mm256_mul_ps(below, s)), bf16_bits<true>(_mm256_mul_ps(above, s))), split);
    const __m256i lo_table = _mm256_permutevar8x32_epi32(t, low_order), hi_table = _mm256_permutevar8x32_epi32(t, high_order);
    for (int64_t v = g * group; v < (g + 1) * group; v += 32) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + v / 2));
      const __m128i lo = _mm_and_si128(b, nibble), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
      const __m256i c = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));  // codes 0-15 | 16-31
      const __m256i l = _mm256_shuffle_epi8(lo_table, c), h = _mm256_shuffle_epi8(hi_table, c);
      const __m256i u0 = _mm256_unpacklo_epi8(l, h), u1 = _mm256_unpackhi_epi8(l, h);  // values 0-7 | 16-23, 8-15 | 24-31
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + v), _mm256_permute2x128_si256(u0, u1, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + v + 16), _mm256_permute2x128_si256(u0, u1, 0x31));
    }
  }
}

// int4: word j holds values 8j..8j+7, value i in bits 4i..4i+3, stored + 8: (nibble ^ 8) is the
// value as a 4-bit two's complement. The row's words are xor-ed with 0x88888888 into `flipped`
// first; then per word: broadcast, shift value i to the top (28 - 4i), arithmetic shift back
// (sign-extends), convert, times the group's scale (rounded once, as the reference's
// float(q) * scale). One scale per `group` values (a multiple of 8: no word straddles two).
template <typename T>
void int4_row(const int32_t* w, const void* scales, ScaleKind kind, int64_t group, int32_t* flipped, T* o, int64_t K) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (group % 32 == 0) return int4_bf16_table_row(w, scales, kind, group, o, K);
  }
  const int64_t words = K / 8, words_per_group = group / 8, groups = K / group;
  {
    const __m256i flip = _mm256_set1_epi32(static_cast<int32_t>(0x88888888u));
    int64_t j = 0;
    for (; j + 8 <= words; j += 8)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(flipped + j),
                          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j)), flip));
    for (; j < words; ++j) flipped[j] = static_cast<int32_t>(static_cast<uint32_t>(w[j]) ^ 0x88888888u);
  }
  const __m256i shifts = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
  auto group_values = [&](auto nan, const int32_t* wg, T* og, __m256 s) {
    constexpr bool Nan = decltype(nan)::value;
    auto word = [&](int64_t j) {
      const __m256i q = _mm256_srai_epi32(_mm256_sllv_epi32(_mm256_set1_epi32(wg[j]), shifts), 28);
      return _mm256_mul_ps(_mm256_cvtepi32_ps(q), s);
    };
    int64_t j = 0;
    for (; j + 2 <= words_per_group; j += 2) put16<Nan>(og + 8 * j, word(j), word(j + 1));
    if (j < words_per_group) put8<Nan>(og + 8 * j, word(j));
  };
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = scale_at(scales, kind, g);
    const __m256 s = _mm256_set1_ps(scale);
    if (std::isfinite(scale))
      group_values(std::false_type{}, flipped + g * words_per_group, o + g * group, s);
    else
      group_values(std::true_type{}, flipped + g * words_per_group, o + g * group, s);
  }
}

// nvfp4: byte j holds values 2j (low nibble) and 2j+1; one e4m3fn scale per 16 values, divided
// by the global scale in float32 (as the reference) into the group's step. Per group, a table of
// the 8 magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6) times the step (each rounded once, as the
// reference's e2m1 * step; -(m s) = (-m) s), each xor-ed with (index << 28): a code c (sign in
// bit 3) picks entry c & 7 (vpermd reads the low 3 bits of each lane), and xor-ing c << 28 back
// cancels bits 28..30 and leaves c's sign in bit 31.
template <typename T>
void nvfp4_row(const uint8_t* w, const uint8_t* scales, float global, float* step, T* o, int64_t K) {
  const int64_t groups = K / 16;
  {  // the row's steps, 8 groups a time: e4m3fn -> float (F16C, * 2^8), / global
    const __m256 two8 = _mm256_set1_ps(256.0f), g = _mm256_set1_ps(global);
    int64_t i = 0;
    for (; i + 8 <= groups; i += 8) {
      const __m128i h = fp8_to_half_bits(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + i))));
      _mm256_storeu_ps(step + i, _mm256_div_ps(_mm256_mul_ps(_mm256_cvtph_ps(h), two8), g));
    }
    const float* table = fp8_table().v;
    for (; i < groups; ++i) step[i] = table[scales[i]] / global;
  }
  const __m256 mags = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i index28 = _mm256_setr_epi32(0, 1 << 28, 2 << 28, 3 << 28, 4 << 28, 5 << 28, 6 << 28, 7 << 28);
  const __m128i low = _mm_set1_epi8(0x0F);
  auto values = [](__m256i table, __m128i codes) {  // 8 codes (bytes) -> 8 values
    const __m256i c = _mm256_cvtepu8_epi32(codes);
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_permutevar8x32_epi32(table, c), _mm256_slli_epi32(c, 28)));
  };
  auto group_values = [&](auto nan, int64_t g, __m128i c) {  // 16 codes in order
    constexpr bool Nan = decltype(nan)::value;
    const __m256i table = _mm256_xor_si256(_mm256_castps_si256(_mm256_mul_ps(mags, _mm256_set1_ps(step[g]))), index28);
    put16<Nan>(o + 16 * g, values(table, c), values(table, _mm_srli_si128(c, 8)));
  };
  auto group = [&](int64_t g, __m128i c) {
    if (std::isfinite(step[g]))
      group_values(std::false_type{}, g, c);
    else
      group_values(std::true_type{}, g, c);
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {  // 32 values from 16 bytes
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8 * g));
    const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    group(g, _mm_unpacklo_epi8(lo, hi));  // codes in order
    group(g + 1, _mm_unpackhi_epi8(lo, hi));
  }
  if (g < groups) {  // an odd last group: 8 bytes
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * g));
    group(g, _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low)));
  }
}

}  // namespace

at::Tensor widen_bf16(const at::Tensor& src, at::Tensor out) {
  const char* fn = "widen_bf16";
  check_out(out, fn);
  check_input(src, fn, "src");
  TORCH_CHECK(src.scalar_type() == at::kBFloat16, fn, ": src must be bfloat16, got ", src.scalar_type());
  TORCH_CHECK(src.sizes() == out.sizes(), fn, ": src ", src.sizes(), " and out ", out.sizes(), " differ in shape");
  const int64_t K = out.size(1);
  const auto* s = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>());
  if (out.scalar_type() == at::kBFloat16) {  // nothing to widen: a parallel copy
    auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    const int64_t rows = out.size(0);
    if (rows && K)
      at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / K), [&](int64_t begin, int64_t end) {
        std::memcpy(o + begin * K, s + begin * K, (end - begin) * K * sizeof(uint16_t));
      });
    return out;
  }
  for_rows(out, [&](int64_t r, auto* o) { widen_row(s + r * K, o, K); });
  return out;
}

at::Tensor dequant_int8(const at::Tensor& weight, const at::Tensor& scale, at::Tensor out) {
  const char* fn = "dequant_int8";
  check_int8(weight, scale, out, fn);
  const ScaleKind kind = scale_kind(scale, fn);
  const int64_t K = out.size(1);
  const int8_t* w = weight.data_ptr<int8_t>();
  const void* sc = scale.data_ptr();
  for_rows(out, [&](int64_t r, auto* o) { int8_row(w + r * K, scale_at(sc, kind, r), o, K); });
  return out;
}

at::Tensor dequant_fp8(const at::Tensor& weight, const at::Tensor& scale, at::Tensor out) {
  const char* fn = "dequant_fp8";
  check_fp8(weight, scale, out, fn);
  const ScaleKind kind = scale_kind(scale, fn);
  const int64_t K = out.size(1);
  const auto* w = static_cast<const uint8_t*>(weight.data_ptr());
  const void* sc = scale.data_ptr();
  for_rows(out, [&](int64_t r, auto* o) { fp8_row(w + r * K, scale_at(sc, kind, r), o, K); });
  return out;
}

at::Tensor dequant_int4(const at::Tensor& packed, const at::Tensor& scale, int64_t group_size, at::Tensor out) {
  const char* fn = "dequant_int4";
  check_int4(packed, scale, group_size, out, fn);
  const int64_t K = out.size(1);
  const ScaleKind kind = scale_kind(scale, fn);
  const int32_t* w = packed.data_ptr<int32_t>();
  const auto* sc = static_cast<const char*>(scale.data_ptr());
  const int64_t scale_row_bytes = scale.size(1) * scale.element_size();
  for_chunks(out, [&](int64_t begin, int64_t end, auto* o) {
    std::vector<int32_t> flipped(K / 8);
    for (int64_t r = begin; r < end; ++r)
      int4_row(w + r * (K / 8), sc + r * scale_row_bytes, kind, group_size, flipped.data(), o + r * K, K);
  });
  return out;
}

at::Tensor dequant_nvfp4(const at::Tensor& packed, const at::Tensor& scale, double global_scale, at::Tensor out) {
  const char* fn = "dequant_nvfp4";
  check_nvfp4(packed, scale, out, fn);
  const int64_t K = out.size(1);
  const float global = static_cast<float>(global_scale);
  const auto* w = static_cast<const uint8_t*>(packed.data_ptr());
  const auto* sc = static_cast<const uint8_t*>(scale.data_ptr());
  const int64_t groups = K / 16;
  for_chunks(out, [&](int64_t begin, int64_t end, auto* o) {
    std::vector<float> step(groups);
    for (int64_t r = begin; r < end; ++r) nvfp4_row(w + r * (K / 2), sc + r * groups, global, step.data(), o + r * K, K);
  });
  return out;
}

// the GEMMs on stored weights (csrc/gemm_avx2.cpp), bound here with the rest of the extension
at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& w, at::Tensor out, int64_t kc, int64_t nb);
at::Tensor gemm_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, at::Tensor out, int64_t kc, int64_t nb);
at::Tensor gemm_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t group, at::Tensor out,
                     int64_t kc, int64_t nb);
at::Tensor gemm_fp8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, at::Tensor out, int64_t kc, int64_t nb);
at::Tensor gemm_nvfp4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, double global_scale,
                      at::Tensor out, int64_t kc, int64_t nb);
at::Tensor gemm_bf16_nn(const at::Tensor& x, const at::Tensor& w, at::Tensor out, int64_t kc, int64_t nc);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("widen_bf16", &widen_bf16, "bf16 [N, K] -> out [N, K] (float32 or bf16)", py::arg("src"), py::arg("out"));
  m.def("dequant_int8", &dequant_int8, "int8 [N, K] * scale [N, 1] -> out", py::arg("weight"), py::arg("scale"), py::arg("out"));
  m.def("dequant_fp8", &dequant_fp8, "float8_e4m3fn (uint8 bits) [N, K] * scale [N, 1] -> out", py::arg("weight"),
        py::arg("scale"), py::arg("out"));
  m.def("dequant_int4", &dequant_int4, "packed int4 (int32 [N, K/8]) * group scales [N, K/group] -> out", py::arg("packed"),
        py::arg("scale"), py::arg("group_size"), py::arg("out"));
  m.def("dequant_nvfp4", &dequant_nvfp4, "packed e2m1 (uint8 [N, K/2]) * fp8 scales [N, K/16] / global -> out",
        py::arg("packed"), py::arg("scale"), py::arg("global_scale"), py::arg("out"));
  // kc, nb: K chunk and N block (0: chosen per shape; for tuning)
  m.def("gemm_bf16", &gemm_bf16, "out [M, N] = x [M, K] float32 @ w [N, K] bf16 ^T", py::arg("x"), py::arg("w"), py::arg("out"),
        py::arg("kc") = 0, py::arg("nb") = 0);
  m.def("gemm_int8", &gemm_int8, "out = x @ (w int8 [N, K] * scale [N, 1])^T", py::arg("x"), py::arg("w"), py::arg("scale"),
        py::arg("out"), py::arg("kc") = 0, py::arg("nb") = 0);
  m.def("gemm_int4", &gemm_int4, "out = x @ dequant(packed int32 [N, K/8], scale [N, K/group])^T", py::arg("x"),
        py::arg("packed"), py::arg("scale"), py::arg("group"), py::arg("out"), py::arg("kc") = 0, py::arg("nb") = 0);
  m.def("gemm_fp8", &gemm_fp8, "out = x @ (w e4m3fn [N, K] * scale [N, 1])^T", py::arg("x"), py::arg("w"), py::arg("scale"),
        py::arg("out"), py::arg("kc") = 0, py::arg("nb") = 0);
  m.def("gemm_nvfp4", &gemm_nvfp4, "out = x @ dequant(packed e2m1 [N, K/2], fp8 scales [N, K/16], global)^T", py::arg("x"),
        py::arg("packed"), py::arg("scale"), py::arg("global_scale"), py::arg("out"), py::arg("kc") = 0, py::arg("nb") = 0);
  m.def("gemm_bf16_nn", &gemm_bf16_nn, "out [M, N] = x [M, K] float32 @ w [K, N] bf16 (w not transposed)", py::arg("x"),
        py::arg("w"), py::arg("out"), py::arg("kc") = 0, py::arg("nc") = 0);
}

// y [M, N] = x [M, K] (float32) @ W [N, K]^T with W in its stored layout (bf16, int8, int4, fp8,
// nvfp4; row-major [N, K], as the reference path reads it), converted inside the GEMM: AVX2 +
// FMA + F16C only (part of the dgemma_dequant extension, so it runs on AVX2-only CPUs: AMD Zen
// 2/3), float32 accumulation.
//
//   gemm_bf16(x, w bf16 [N, K], out)
//   gemm_int8(x, w int8 [N, K], scale [N] / [N, 1], out)                 scale applied per output
//   gemm_int4(x, packed int32 [N, K/8], scale [N, K/group], group, out)   formats.py's pack-quantized
//   gemm_fp8(x, w e4m3fn bits (uint8) [N, K], scale [N] / [N, 1], out)
//   gemm_nvfp4(x, packed uint8 [N, K/2], scale e4m3fn bits [N, K/16], global_scale, out)
//
// x [M, K] float32 contiguous, out [M, N] float32 contiguous (written, not accumulated into).
//
// Dot-product form: W rows and x rows are both contiguous along K, so a microkernel of MR x-rows
// by NR W-rows keeps MR*NR vector accumulators (8 partial sums each, lanes summed at the end) and
// per 8 values of K loads MR x vectors and NR W vectors (converted in registers), for MR*NR FMAs.
// No packing of W, no second copy of it.
//
//  - bf16: 16 values (32 bytes) of a W row are one load; as 32-bit lanes each holds values 2i
//    (low half) and 2i+1 (high half): `<< 16` gives the even values as float32, `& 0xFFFF0000`
//    the odd ones, two integer ops per 16 values. x is reordered once per call to match (each run
//    of 16: the 8 even values, then the 8 odd ones), O(M K) against the GEMM's O(M N K).
//  - int8 with few x rows (M <= 8): sign-extend 8 bytes to 32-bit lanes, convert; the row's
//    scale multiplies its sums.
//  - int8 (more rows), int4, fp8, nvfp4: a block of W rows x a chunk of K is decoded once per
//    call into a float32 panel (L2-sized, per thread; the values `formats.dequantize` gives),
//    read by the float32 microkernel for every row block of x: the decoding (several ops per
//    value) is amortised over M rows instead of MR.
//
// Tuning knobs (environment, read per call; 0 / unset: the defaults below): DGEMMA_GEMM_KC (K
// chunk), DGEMMA_GEMM_NB (W rows per block), DGEMMA_GEMM_MC (x rows per block, bf16 / direct
// int8), DGEMMA_GEMM_PANEL_BYTES (KB of float32 panel per block, read once).
//
// Cache blocking: K in chunks of KC (x rows of a chunk stay in L1 across a block's W rows), N in
// blocks of NB rows (a block's W chunk stays in L2 across all of M). Threads (at::parallel_for,
// torch's pool) split N (or M, when N is too small to split).

#include <ATen/core/Tensor.h>

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include "scales.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using dgemma_scales::ScaleKind;
using dgemma_scales::scale_at;
using dgemma_scales::scale_kind;
using dgemma_scales::fp8_table;

constexpr int MR = 4;      // x rows per microkernel
constexpr int NR = 3;      // W rows per microkernel
constexpr int64_t CS = 16;  // K values per microkernel step (two vectors)

using dgemma_scales::bits_to_float;
inline float f32_bits(uint32_t u) { return bits_to_float(u); }

// ------------------------------------------------------------------------------ weight sources
// get(j, c, s): float32 vector s (0, 1) of K-chunk c (16 values) of source row j.

// bf16 rows; x reordered (even values, then odd)
struct Bf16Src {
  const uint16_t* row[NR];
  inline __m256 get(int j, int64_t c, int s) const {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[j] + c * CS));
    return s == 0 ? _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
                  : _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

// int8 rows; x in order
struct Int8Src {
  const int8_t* row[NR];
  inline __m256 get(int j, int64_t c, int s) const {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row[j] + c * CS + 8 * s));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
};

// float32 rows (a decoded panel); x in order
struct F32Src {
  const float* row[NR];
  inline __m256 get(int j, int64_t c, int s) const { return _mm256_loadu_ps(row[j] + c * CS + 8 * s); }
};

// ------------------------------------------------------------------------------- microkernel
// The full 4 x 3 block's loop in assembly: 12 accumulators (ymm0-11), the 3 converted W vectors
// (ymm12-14) and one x vector (ymm15) are all 16 registers, which compilers do not manage: they
// fold x's loads into every FMA (a load per FMA: loads, not FMAs, bound the loop) or spill
// accumulators. Per 16 values of K: 24 FMAs, 14 or 15 loads. acc [12][8]: the accumulators.
#define DG_ZERO12                                                                                      \
  "vxorps %%xmm0, %%xmm0, %%xmm0\n vxorps %%xmm1, %%xmm1, %%xmm1\n vxorps %%xmm2, %%xmm2, %%xmm2\n"       \
  "vxorps %%xmm3, %%xmm3, %%xmm3\n vxorps %%xmm4, %%xmm4, %%xmm4\n vxorps %%xmm5, %%xmm5, %%xmm5\n"       \
  "vxorps %%xmm6, %%xmm6, %%xmm6\n vxorps %%xmm7, %%xmm7, %%xmm7\n vxorps %%xmm8, %%xmm8, %%xmm8\n"       \
  "vxorps %%xmm9, %%xmm9, %%xmm9\n vxorps %%xmm10, %%xmm10, %%xmm10\n vxorps %%xmm11, %%xmm11, %%xmm11\n"
#define DG_STORE12                                                                                     \
  "vmovups %%ymm0, (%[acc])\n vmovups %%ymm1, 32(%[acc])\n vmovups %%ymm2, 64(%[acc])\n"                   \
  "vmovups %%ymm3, 96(%[acc])\n vmovups %%ymm4, 128(%[acc])\n vmovups %%ymm5, 160(%[acc])\n"               \
  "vmovups %%ymm6, 192(%[acc])\n vmovups %%ymm7, 224(%[acc])\n vmovups %%ymm8, 256(%[acc])\n"              \
  "vmovups %%ymm9, 288(%[acc])\n vmovups %%ymm10, 320(%[acc])\n vmovups %%ymm11, 352(%[acc])\n"
#define DG_ROW(addr, a, b, c)                                                                          \
  "vmovups " addr ", %%ymm15\n"                                                                       \
  "vfmadd231ps %%ymm12, %%ymm15, %%ymm" #a "\n vfmadd231ps %%ymm13, %%ymm15, %%ymm" #b                 \
  "\n vfmadd231ps %%ymm14, %%ymm15, %%ymm" #c "\n"
#define DG_ROWS(off)                                                                                   \
  DG_ROW(#off "(%[x])", 0, 1, 2) DG_ROW(#off "(%[x],%[ld],1)", 3, 4, 5) DG_ROW(#off "(%[x],%[ld],2)", 6, 7, 8) \
  DG_ROW(#off "(%[x],%[ld3],1)", 9, 10, 11)
#define DG_CLOBBERS                                                                                    \
  "cc", "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
      "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"

alignas(32) const uint32_t kHighHalves[8] = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                                             0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};

inline void kernel_4x3(const Bf16Src& src, const float* x, int64_t ldx, int64_t chunks, float* acc) {
  const uint16_t *w0 = src.row[0], *w1 = src.row[1], *w2 = src.row[2];
  const int64_t ld = ldx * 4, ld3 = 3 * ld;
  asm volatile(
      DG_ZERO12
      "test %[n], %[n]\n jz 2f\n"
      ".p2align 5\n"
      "1:\n"
      "vmovdqu (%[w0]), %%ymm12\n vmovdqu (%[w1]), %%ymm13\n vmovdqu (%[w2]), %%ymm14\n"
      "vpslld $16, %%ymm12, %%ymm12\n vpslld $16, %%ymm13, %%ymm13\n vpslld $16, %%ymm14, %%ymm14\n"
      DG_ROWS(0)
      "vmovdqa %[mask], %%ymm15\n"
      "vpand (%[w0]), %%ymm15, %%ymm12\n vpand (%[w1]), %%ymm15, %%ymm13\n vpand (%[w2]), %%ymm15, %%ymm14\n"
      DG_ROWS(32)
      "add $64, %[x]\n add $32, %[w0]\n add $32, %[w1]\n add $32, %[w2]\n"
      "dec %[n]\n jnz 1b\n"
      "2:\n"
      DG_STORE12
      : [x] "+r"(x), [w0] "+r"(w0), [w1] "+r"(w1), [w2] "+r"(w2), [n] "+r"(chunks)
      : [ld] "r"(ld), [ld3] "r"(ld3), [acc] "r"(acc), [mask] "m"(kHighHalves)
      : DG_CLOBBERS);
}

inline void kernel_4x3(const Int8Src& src, const float* x, int64_t ldx, int64_t chunks, float* acc) {
  const int8_t *w0 = src.row[0], *w1 = src.row[1], *w2 = src.row[2];
  const int64_t ld = ldx * 4, ld3 = 3 * ld;
  asm volatile(
      DG_ZERO12
      "test %[n], %[n]\n jz 2f\n"
      ".p2align 5\n"
      "1:\n"
      "vpmovsxbd (%[w0]), %%ymm12\n vpmovsxbd (%[w1]), %%ymm13\n vpmovsxbd (%[w2]), %%ymm14\n"
      "vcvtdq2ps %%ymm12, %%ymm12\n vcvtdq2ps %%ymm13, %%ymm13\n vcvtdq2ps %%ymm14, %%ymm14\n"
      DG_ROWS(0)
      "vpmovsxbd 8(%[w0]), %%ymm12\n vpmovsxbd 8(%[w1]), %%ymm13\n vpmovsxbd 8(%[w2]), %%ymm14\n"
      "vcvtdq2ps %%ymm12, %%ymm12\n vcvtdq2ps %%ymm13, %%ymm13\n vcvtdq2ps %%ymm14, %%ymm14\n"
      DG_ROWS(32)
      "add $64, %[x]\n add $16, %[w0]\n add $16, %[w1]\n add $16, %[w2]\n"
      "dec %[n]\n jnz 1b\n"
      "2:\n"
      DG_STORE12
      : [x] "+r"(x), [w0] "+r"(w0), [w1] "+r"(w1), [w2] "+r"(w2), [n] "+r"(chunks)
      : [ld] "r"(ld), [ld3] "r"(ld3), [acc] "r"(acc)
      : DG_CLOBBERS);
}

inline void kernel_4x3(const F32Src& src, const float* x, int64_t ldx, int64_t chunks, float* acc) {
  const float *w0 = src.row[0], *w1 = src.row[1], *w2 = src.row[2];
  const int64_t ld = ldx * 4, ld3 = 3 * ld;
  asm volatile(
      DG_ZERO12
      "test %[n], %[n]\n jz 2f\n"
      ".p2align 5\n"
      "1:\n"
      "vmovups (%[w0]), %%ymm12\n vmovups (%[w1]), %%ymm13\n vmovups (%[w2]), %%ymm14\n"
      DG_ROWS(0)
      "vmovups 32(%[w0]), %%ymm12\n vmovups 32(%[w1]), %%ymm13\n vmovups 32(%[w2]), %%ymm14\n"
      DG_ROWS(32)
      "add $64, %[x]\n add $64, %[w0]\n add $64, %[w1]\n add $64, %[w2]\n"
      "dec %[n]\n jnz 1b\n"
      "2:\n"
      DG_STORE12
      : [x] "+r"(x), [w0] "+r"(w0), [w1] "+r"(w1), [w2] "+r"(w2), [n] "+r"(chunks)
      : [ld] "r"(ld), [ld3] "r"(ld3), [acc] "r"(acc)
      : DG_CLOBBERS);
}

// sums[i][j] = sum over `chunks` chunks of x row i . source row j, then one more chunk from
// `tail` (rows padded to a chunk) where given. x rows: x + i * ldx, chunk c at x + c * CS.
template <int M, int N, class Src>
void dot_block(const float* x, int64_t ldx, const Src& src, int64_t chunks, const Src* tail, float (&sums)[MR][NR]) {
  __m256 acc[M][N];
  int64_t c = 0;
  if constexpr (M == 4 && N == 3) {
    alignas(32) float a[12 * 8];
    kernel_4x3(src, x, ldx, chunks, a);
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) acc[i][j] = _mm256_load_ps(a + 8 * (3 * i + j));
    c = chunks;
  } else {
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < N; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  auto step = [&](const Src& s_, int64_t cw, const float* xc) __attribute__((always_inline)) {
    for (int s = 0; s < 2; ++s) {
      __m256 w[N];
      for (int j = 0; j < N; ++j) w[j] = s_.get(j, cw, s);
      for (int i = 0; i < M; ++i) {
        const __m256 xv = _mm256_loadu_ps(xc + i * ldx + 8 * s);
        for (int j = 0; j < N; ++j) acc[i][j] = _mm256_fmadd_ps(w[j], xv, acc[i][j]);
      }
    }
  };
  for (; c < chunks; ++c) step(src, c, x + c * CS);
  if (tail) step(*tail, 0, x + c * CS);
  // lanes summed: per row, hadd pairs of accumulators
  for (int i = 0; i < M; ++i) {
    __m256 a[3];
    for (int j = 0; j < 3; ++j) a[j] = j < N ? acc[i][j] : _mm256_setzero_ps();
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[2]));
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    alignas(16) float o[4];
    _mm_store_ps(o, r);
    for (int j = 0; j < N; ++j) sums[i][j] = o[j];
  }
}

template <class Src>
using BlockFn = void (*)(const float*, int64_t, const Src&, int64_t, const Src*, float (&)[MR][NR]);

template <class Src>
struct BlockTable {
  BlockFn<Src> fn[MR][NR];
  constexpr BlockTable() : fn{
      {dot_block<1, 1, Src>, dot_block<1, 2, Src>, dot_block<1, 3, Src>},
      {dot_block<2, 1, Src>, dot_block<2, 2, Src>, dot_block<2, 3, Src>},
      {dot_block<3, 1, Src>, dot_block<3, 2, Src>, dot_block<3, 3, Src>},
      {dot_block<4, 1, Src>, dot_block<4, 2, Src>, dot_block<4, 3, Src>}} {}
};
static_assert(MR == 4 && NR == 3, "BlockTable lists the shapes");

// ------------------------------------------------------------------------------------ x prep
// x [M, K] into xp [M, ldx] (ldx = K rounded up to CS, zero-padded); `split`: each run of 16 as
// its 8 even values then its 8 odd ones (the bf16 source's order).
void prepare_x(const float* x, int64_t M, int64_t K, float* xp, int64_t ldx, bool split) {
  const int64_t full = K / CS;
  auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* s = x + m * K;
      float* d = xp + m * ldx;
      if (split) {
        for (int64_t c = 0; c < full; ++c) {
          const __m256 a = _mm256_loadu_ps(s + c * CS), b = _mm256_loadu_ps(s + c * CS + 8);
          // per 128-bit lane: [a0 a2 b0 b2 | a4 a6 b4 b6]; 64-bit quarters reordered -> a0 a2 a4 a6 b0 b2 b4 b6
          const __m256 even = _mm256_shuffle_ps(a, b, 0x88), odd = _mm256_shuffle_ps(a, b, 0xDD);
          _mm256_storeu_ps(d + c * CS, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8)));
          _mm256_storeu_ps(d + c * CS + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xD8)));
        }
        if (full * CS < ldx) {
          float t[CS] = {};
          for (int64_t k = full * CS; k < K; ++k) t[k - full * CS] = s[k];
          for (int i = 0; i < 8; ++i) {
            d[full * CS + i] = t[2 * i];
            d[full * CS + 8 + i] = t[2 * i + 1];
          }
        }
      } else {
        std::memcpy(d, s, K * sizeof(float));
        for (int64_t k = K; k < ldx; ++k) d[k] = 0.f;
      }
    }
  };
  at::parallel_for(0, M, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(K, 1)), rows);
}

// ------------------------------------------------------------------------------------ scales

// --------------------------------------------------------------------------- panel decoders
// decode(n, k0, kl, dst): values [k0, k0 + kl) of W row n into dst (float32); k0, kl multiples
// of the format's unit (8 for int4, 16 for nvfp4, 1 for fp8).

// fp8 e4m3fn codes (zero-extended to 16 bits) -> fp16 bits of value / 256 (see dequant.cpp)
inline __m128i fp8_to_half_bits(__m128i x) {
  const __m128i y = _mm_slli_epi16(x, 7);
  const __m128i h = _mm_add_epi16(y, _mm_and_si128(y, _mm_set1_epi16(0x4000)));
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7F));
  return _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), nan);
}

struct Int4Decoder {
  const int32_t* packed;  // [N, K/8]
  const char* scale;      // [N, K/group]
  ScaleKind kind;
  int64_t K, group, scale_row_bytes;
  void operator()(int64_t n, int64_t k0, int64_t kl, float* dst) const {
    const int32_t* w = packed + n * (K / 8) + k0 / 8;
    const void* sc = scale + n * scale_row_bytes;
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), nib = _mm256_set1_epi32(0xF);
    int64_t k = 0;
    while (k < kl) {  // one group (or the part of it in range) at a time
      const int64_t g = (k0 + k) / group, gend = std::min(kl, (g + 1) * group - k0);
      const float scale_ = scale_at(sc, kind, g);
      // q * s - 8 s in one FMA: (q - 8) s rounded once, the reference's float(value) * scale
      // (8 s is exact), unless the scale is not finite (inf - inf): then multiply
      const __m256 s = _mm256_set1_ps(scale_), minus8s = _mm256_set1_ps(-8.0f * scale_), eight = _mm256_set1_ps(8.0f);
      if (std::isfinite(scale_)) {
        for (; k < gend; k += 8) {
          const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w[k / 8]), shifts), nib);
          _mm256_storeu_ps(dst + k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, minus8s));
        }
      } else {
        for (; k < gend; k += 8) {
          const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w[k / 8]), shifts), nib);
          _mm256_storeu_ps(dst + k, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(q), eight), s));
        }
      }
    }
  }
};

struct Int8Decoder {
  const int8_t* w;  // [N, K]
  const void* scale;
  ScaleKind kind;
  int64_t K;
  void operator()(int64_t n, int64_t k0, int64_t kl, float* dst) const {
    const int8_t* r = w + n * K + k0;
    const float scale_ = scale_at(scale, kind, n);
    const __m256 s = _mm256_set1_ps(scale_);
    int64_t k = 0;
    for (; k + 8 <= kl; k += 8)
      _mm256_storeu_ps(dst + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + k)))), s));
    for (; k < kl; ++k) dst[k] = static_cast<float>(r[k]) * scale_;
  }
};

struct Fp8Decoder {
  const uint8_t* w;  // [N, K]
  const void* scale;
  ScaleKind kind;
  int64_t K;
  void operator()(int64_t n, int64_t k0, int64_t kl, float* dst) const {
    const uint8_t* r = w + n * K + k0;
    const float scale_ = scale_at(scale, kind, n);
    // half(code) * (2^8 scale): one rounding, as float(code) * scale, while 2^8 scale is exact
    const bool fold = std::fabs(scale_) <= FLT_MAX / 256;
    const __m256 s = _mm256_set1_ps(fold ? scale_ * 256.0f : scale_), two8 = _mm256_set1_ps(fold ? 1.0f : 256.0f);
    int64_t k = 0;
    for (; k + 8 <= kl; k += 8) {
      const __m128i h = fp8_to_half_bits(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + k))));
      __m256 v = _mm256_cvtph_ps(h);
      if (!fold) v = _mm256_mul_ps(v, two8);
      _mm256_storeu_ps(dst + k, _mm256_mul_ps(v, s));
    }
    const float* table = fp8_table().v;
    for (; k < kl; ++k) dst[k] = table[r[k]] * scale_;
  }
};

struct Nvfp4Decoder {
  const uint8_t* packed;  // [N, K/2]
  const uint8_t* scale;   // [N, K/16] e4m3fn bits
  float global;
  int64_t K;
  void operator()(int64_t n, int64_t k0, int64_t kl, float* dst) const {
    const uint8_t* w = packed + n * (K / 2) + k0 / 2;
    const uint8_t* sc = scale + n * (K / 16) + k0 / 16;
    const float* table = fp8_table().v;
    const __m256 mags = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256i index28 = _mm256_setr_epi32(0, 1 << 28, 2 << 28, 3 << 28, 4 << 28, 5 << 28, 6 << 28, 7 << 28);
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < kl / 16; ++g) {
      const float step = table[sc[g]] / global;  // the reference's scale / global_scale (float32)
      // the 8 magnitudes times the step, each xor-ed with (index << 28): a code c (sign in bit 3)
      // picks entry c & 7, and xor-ing c << 28 back leaves c's sign in bit 31 (see dequant.cpp)
      const __m256i t = _mm256_xor_si256(_mm256_castps_si256(_mm256_mul_ps(mags, _mm256_set1_ps(step))), index28);
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * g));
      const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
      for (int h = 0; h < 2; ++h) {
        const __m256i c = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(codes, 8) : codes);
        _mm256_storeu_ps(dst + 16 * g + 8 * h,
                         _mm256_castsi256_ps(_mm256_xor_si256(_mm256_permutevar8x32_epi32(t, c), _mm256_slli_epi32(c, 28))));
      }
    }
  }
};

// ------------------------------------------------------------------------------------ driver
struct Plan {
  int64_t kc, nb, mc;  // K chunk (a multiple of CS), N block (a multiple of NR), M block (a multiple of MR)
};

// Work split over threads: tasks over N (in units of NR) or, where N is small, over M.
template <class Task>
void for_tasks(int64_t M, int64_t N, int64_t K, Task task) {
  int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (M * N * K < (int64_t{1} << 18)) threads = 1;  // too small to wake the pool
  const int64_t units = (N + NR - 1) / NR;
  int64_t tn = std::min(threads, units), tm = 1;
  if (tn < threads && M >= 2 * MR * threads) tn = 1, tm = threads;
  if (tn * tm <= 1) return task(0, M, 0, N);
  at::parallel_for(0, tn * tm, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t a = t % tn, b = t / tn;
      const int64_t n0 = std::min(N, a * units / tn * NR), n1 = std::min(N, (a + 1) * units / tn * NR);
      const int64_t mu = (M + MR - 1) / MR;
      const int64_t m0 = std::min(M, b * mu / tm * MR), m1 = std::min(M, (b + 1) * mu / tm * MR);
      if (n0 < n1 && m0 < m1) task(m0, m1, n0, n1);
    }
  });
}

// Writes y [M, N] (ldy = N) from sums: y = (first chunk ? 0 : y) + scale * sums
struct Store {
  float* y;
  int64_t ldy;
  const void* scale;  // per output column (int8), or nullptr
  ScaleKind kind;
  inline void operator()(int64_t m, int64_t n, int mr, int nr, const float (&sums)[MR][NR], bool first) const {
    float s[NR] = {1.f, 1.f, 1.f};
    if (scale)
      for (int j = 0; j < nr; ++j) s[j] = scale_at(scale, kind, n + j);
    for (int i = 0; i < mr; ++i) {
      float* o = y + (m + i) * ldy + n;
      for (int j = 0; j < nr; ++j) o[j] = first ? sums[i][j] * s[j] : o[j] + sums[i][j] * s[j];
    }
  }
};

// Prefetches the x rows the next row block reads ([rows, kl) floats at `next`, ld apart) into
// L1, a share per microkernel of the current row block (step of steps): the first microkernel
// of a row block then does not wait on L2 / L3 for all of its x.
inline void prefetch_share(const float* next, int64_t ld, int rows, int64_t kl, int64_t step, int64_t steps) {
  if (!next) return;
  const int64_t per_row = (kl * 4 + 63) / 64, lines = rows * per_row;
  const int64_t a = step * lines / steps, b = (step + 1) * lines / steps;
  for (int64_t l = a; l < b; ++l)
    _mm_prefetch(reinterpret_cast<const char*>(next + (l / per_row) * ld + (l % per_row) * 16), _MM_HINT_T0);
}

// One row block of x [m, m + mr) against W rows [n0, n1), K values [k0, k0 + kl) (the source
// from src_at(n, nr)), sums into `store`; `next`: the next row block's x (prefetched), or null.
template <class Src, class SrcAt>
inline void row_block(const float* xp, int64_t ldx, int64_t m, int mr, int64_t n0, int64_t n1, int64_t k0, int64_t kl,
                      int64_t chunks, const Store& store, SrcAt src_at, const Src* (*tail_at)(void*, int64_t, int, Src&),
                      void* tail_ctx, const float* next, int next_rows) {
  static constexpr BlockTable<Src> table;
  const int64_t steps = (n1 - n0 + NR - 1) / NR;
  for (int64_t n = n0, step = 0; n < n1; n += NR, ++step) {
    const int nr = static_cast<int>(std::min<int64_t>(NR, n1 - n));
    prefetch_share(next, ldx, next_rows, kl, step, steps);
    const Src src = src_at(n, nr);
    Src tail_storage;
    const Src* tail = tail_at ? tail_at(tail_ctx, n, nr, tail_storage) : nullptr;
    float sums[MR][NR];
    table.fn[mr - 1][nr - 1](xp + m * ldx + k0, ldx, src, chunks, tail, sums);
    store(m, n, mr, nr, sums, k0 == 0);
  }
}

// Direct: W rows converted in registers. make_src(n, nr, k0) -> Src of rows n.. at value k0;
// make_tail(n, nr, k0, kl, storage) -> Src of those rows' values [k0, k0 + kl) padded to CS.
// Blocks: W rows in groups of nb (an nb x kc block of W stays in L2 across the x rows), K in
// chunks of kc, x rows in groups of mc (all by default).
template <class Src, class MakeSrc, class MakeTail>
void gemm_direct(const float* xp, int64_t ldx, int64_t M, int64_t N, int64_t K, const Plan& plan, const Store& store,
                 MakeSrc make_src, MakeTail make_tail) {
  for_tasks(M, N, K, [&](int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
    for (int64_t ms = m_begin; ms < m_end; ms += plan.mc) {
      const int64_t me = std::min(m_end, ms + plan.mc);
      for (int64_t n0 = n_begin; n0 < n_end; n0 += plan.nb) {
        const int64_t n1 = std::min(n_end, n0 + plan.nb);
        for (int64_t k0 = 0; k0 < K; k0 += plan.kc) {
          const int64_t kl = std::min(plan.kc, K - k0), chunks = kl / CS, rem = kl % CS;
          struct TailCtx {
            MakeTail* make;
            int64_t k0, kl;
            alignas(32) unsigned char storage[NR * CS * 4];
          } ctx{&make_tail, k0 + chunks * CS, rem, {}};
          auto tail_at = [](void* c, int64_t n, int nr, Src& out) -> const Src* {
            auto* t = static_cast<TailCtx*>(c);
            out = (*t->make)(n, nr, t->k0, t->kl, t->storage);
            return &out;
          };
          for (int64_t m = ms; m < me; m += MR) {
            const int mr = static_cast<int>(std::min<int64_t>(MR, me - m));
            const int64_t mn = m + MR < me ? m + MR : (n1 < n_end ? ms : -1);  // the next row block
            const float* next = mn >= 0 ? xp + mn * ldx + k0 : nullptr;
            row_block<Src>(xp, ldx, m, mr, n0, n1, k0, kl, chunks, store,
                           [&](int64_t n, int nr) { return make_src(n, nr, k0); }, rem ? +tail_at : nullptr, &ctx, next,
                           static_cast<int>(std::min<int64_t>(MR, me - std::max<int64_t>(mn, 0))));
          }
        }
      }
    }
  });
}

// Direct over a row-major [N, K] weight read as stored (T: uint16_t for bf16, int8_t): each
// block's rows in place, the K tail copied into the zero-padded storage the kernel reads.
template <class Src, class T>
void gemm_direct_stored(const float* xp, int64_t ldx, int64_t M, int64_t N, int64_t K, const Plan& plan, const Store& store,
                        const T* wp) {
  gemm_direct<Src>(
      xp, ldx, M, N, K, plan, store,
      [&](int64_t n, int nr, int64_t k0) {
        Src s;
        for (int j = 0; j < NR; ++j) s.row[j] = wp + (n + std::min(j, nr - 1)) * K + k0;
        return s;
      },
      [&](int64_t n, int nr, int64_t k0, int64_t kl, unsigned char* storage) {
        auto* t = reinterpret_cast<T*>(storage);
        Src s;
        for (int j = 0; j < NR; ++j) {
          T* r = t + j * CS;
          const T* src = wp + (n + std::min(j, nr - 1)) * K + k0;
          for (int64_t k = 0; k < CS; ++k) r[k] = k < kl ? src[k] : 0;
          s.row[j] = r;
        }
        return s;
      });
}

// Panel: a block of W rows x a K chunk decoded into float32 (per thread), then the float32
// kernel over all of the task's x rows.
template <class Decoder>
void gemm_panel(const float* xp, int64_t ldx, int64_t M, int64_t N, int64_t K, const Plan& plan, const Store& store,
                const Decoder& decode) {
  for_tasks(M, N, K, [&](int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
    const int64_t ldp = (std::min(plan.kc, K) + CS - 1) / CS * CS;
    std::vector<float> panel(plan.nb * ldp);
    for (int64_t n0 = n_begin; n0 < n_end; n0 += plan.nb) {
      const int64_t n1 = std::min(n_end, n0 + plan.nb);
      for (int64_t k0 = 0; k0 < K; k0 += plan.kc) {
        const int64_t kl = std::min(plan.kc, K - k0), chunks = (kl + CS - 1) / CS;
        for (int64_t n = n0; n < n1; ++n) {
          float* row = panel.data() + (n - n0) * ldp;
          decode(n, k0, kl, row);
          for (int64_t k = kl; k < chunks * CS; ++k) row[k] = 0.f;
        }
        for (int64_t m = m_begin; m < m_end; m += MR) {
          const int mr = static_cast<int>(std::min<int64_t>(MR, m_end - m));
          const float* next = m + MR < m_end ? xp + (m + MR) * ldx + k0 : nullptr;
          row_block<F32Src>(
              xp, ldx, m, mr, n0, n1, k0, chunks * CS, chunks, store,
              [&](int64_t n, int nr) {
                F32Src src;
                for (int j = 0; j < NR; ++j) src.row[j] = panel.data() + (n - n0 + std::min(j, nr - 1)) * ldp;
                return src;
              },
              nullptr, nullptr, next, static_cast<int>(std::min<int64_t>(MR, m_end - m - MR)));
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------- checks
void check_cpu_contiguous(const at::Tensor& t, const char* fn, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", what, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), fn, ": ", what, " must be contiguous");
}

// x [M, K] float32, out [M, N] float32: checked; returns M
int64_t check_x_out(const at::Tensor& x, const at::Tensor& out, int64_t N, int64_t K, const char* fn) {
  check_cpu_contiguous(x, fn, "x");
  check_cpu_contiguous(out, fn, "out");
  TORCH_CHECK(x.scalar_type() == at::kFloat, fn, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kFloat, fn, ": out must be float32, got ", out.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, fn, ": x must be [M, ", K, "] (K of the weight), got ", x.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == N, fn, ": out must be [", x.size(0), ", ", N,
              "], got ", out.sizes());
  TORCH_CHECK(!out.is_same(x), fn, ": out must not be x");
  return x.size(0);
}

void check_row_scale(const at::Tensor& scale, int64_t rows, const char* fn) {
  check_cpu_contiguous(scale, fn, "scale");
  TORCH_CHECK((scale.dim() == 1 || (scale.dim() == 2 && scale.size(1) == 1)) && scale.size(0) == rows, fn,
              ": scale must be [", rows, "] or [", rows, ", 1] (one per output channel), got ", scale.sizes());
}

// a positive integer from the environment, else the fallback
int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  const long long n = v && *v ? std::atoll(v) : 0;
  return n > 0 ? n : fallback;
}

// K chunk, N block (the W block's chunk, nb rows x kc values of `w_bytes` each, ~block_bytes)
// and M block
Plan make_plan(int64_t K, int64_t w_bytes, int64_t kc, int64_t nb, int64_t block_bytes, int64_t default_kc = 2048) {
  if (kc <= 0) kc = env_int("DGEMMA_GEMM_KC", default_kc);
  kc = std::max<int64_t>(CS, kc / CS * CS);
  if (K > kc) kc = (K + (K + kc - 1) / kc - 1) / ((K + kc - 1) / kc);  // equal chunks
  kc = (kc + CS - 1) / CS * CS;
  const int64_t k = std::min(kc, K);
  if (nb <= 0) nb = env_int("DGEMMA_GEMM_NB", block_bytes / (k * w_bytes + 1));
  nb = std::max<int64_t>(NR, nb / NR * NR);
  // no M blocks by default: an L2-sized block of x measured no faster on 1024-2048 W rows, and
  // 1.13x slower (W re-read from memory per block) on 32768 rows
  int64_t mc = env_int("DGEMMA_GEMM_MC", int64_t{1} << 40);
  mc = std::max<int64_t>(MR, mc / MR * MR);
  return {kc, nb, mc};
}

// panels (float32): 1024 values of K, 256 KB of W rows (measured better than 2048 / 128 KB)
constexpr int64_t kPanelKc = 1024;
int64_t panel_bytes() { return env_int("DGEMMA_GEMM_PANEL_BYTES", 256) << 10; }

const int64_t kDirectInt8Rows = 8;  // int8 with up to this many x rows: the in-register kernel

// x reordered / padded (xp), unless it can be used as it is (natural order, K a multiple of CS)
struct PreparedX {
  std::vector<float> storage;
  const float* data;
  int64_t ld;
  PreparedX(const at::Tensor& x, int64_t K, bool split) {
    const int64_t M = x.size(0);
    ld = (K + CS - 1) / CS * CS;
    if (!split && ld == K && K % 256 != 0) {
      data = x.data_ptr<float>();
      return;
    }
    if (ld % 256 == 0) ld += CS;  // rows a multiple of 1 KB apart: fewer L1 set conflicts
    storage.resize(M * ld);
    prepare_x(x.data_ptr<float>(), M, K, storage.data(), ld, split);
    data = storage.data();
  }
};

}  // namespace

at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& w, at::Tensor out, int64_t kc, int64_t nb) {
  const char* fn = "gemm_bf16";
  check_cpu_contiguous(w, fn, "w");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, fn, ": w must be bfloat16, got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 2, fn, ": w must be 2D [N, K], got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), M = check_x_out(x, out, N, K, fn);
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const Plan plan = make_plan(K, 2, kc, nb, int64_t{128} << 10);
  const PreparedX xp(x, K, /*split=*/true);
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const Store store{out.data_ptr<float>(), N, nullptr, ScaleKind::f32};
  gemm_direct_stored<Bf16Src>(xp.data, xp.ld, M, N, K, plan, store, wp);
  return out;
}

at::Tensor gemm_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, at::Tensor out, int64_t kc, int64_t nb) {
  const char* fn = "gemm_int8";
  check_cpu_contiguous(w, fn, "w");
  TORCH_CHECK(w.scalar_type() == at::kChar, fn, ": w must be int8, got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 2, fn, ": w must be 2D [N, K], got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), M = check_x_out(x, out, N, K, fn);
  check_row_scale(scale, N, fn);
  const ScaleKind kind = scale_kind(scale, fn);
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  // a few rows (decoding): converted in registers; more: decoded once into panels, which
  // measured 1.09-1.11x packed float32 where in-register conversion (6 conversions + 6
  // sign-extensions per 24 FMAs, competing for the FMA pipes) measured 1.18-1.23x
  if (M > kDirectInt8Rows) {
    const Plan plan = make_plan(K, 4, kc, nb, panel_bytes(), kPanelKc);
    const PreparedX xp(x, K, /*split=*/false);
    const Store store{out.data_ptr<float>(), N, nullptr, ScaleKind::f32};
    gemm_panel(xp.data, xp.ld, M, N, K, plan, store, Int8Decoder{w.data_ptr<int8_t>(), scale.data_ptr(), kind, K});
    return out;
  }
  const Plan plan = make_plan(K, 1, kc, nb, int64_t{128} << 10);
  const PreparedX xp(x, K, /*split=*/false);
  const int8_t* wp = w.data_ptr<int8_t>();
  const Store store{out.data_ptr<float>(), N, scale.data_ptr(), kind};
  gemm_direct_stored<Int8Src>(xp.data, xp.ld, M, N, K, plan, store, wp);
  return out;
}

at::Tensor gemm_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t group, at::Tensor out,
                     int64_t kc, int64_t nb) {
  const char* fn = "gemm_int4";
  check_cpu_contiguous(packed, fn, "packed");
  check_cpu_contiguous(scale, fn, "scale");
  TORCH_CHECK(packed.scalar_type() == at::kInt, fn, ": packed must be int32, got ", packed.scalar_type());
  TORCH_CHECK(packed.dim() == 2, fn, ": packed must be 2D [N, K/8], got ", packed.sizes());
  TORCH_CHECK(group > 0 && group % 8 == 0, fn, ": group must be a positive multiple of 8, got ", group);
  const int64_t N = packed.size(0), K = packed.size(1) * 8;
  TORCH_CHECK(K % group == 0, fn, ": K (", K, ") is not a multiple of group ", group);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) == K / group, fn, ": scale must be [", N, ", ",
              K / group, "] (group ", group, "), got ", scale.sizes());
  const ScaleKind kind = scale_kind(scale, fn);
  const int64_t M = check_x_out(x, out, N, K, fn);
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const Plan plan = make_plan(K, 4, kc, nb, panel_bytes(), kPanelKc);
  const PreparedX xp(x, K, /*split=*/false);
  const Store store{out.data_ptr<float>(), N, nullptr, ScaleKind::f32};
  const Int4Decoder decode{packed.data_ptr<int32_t>(), static_cast<const char*>(scale.data_ptr()), kind, K, group,
                           scale.size(1) * static_cast<int64_t>(scale.element_size())};
  gemm_panel(xp.data, xp.ld, M, N, K, plan, store, decode);
  return out;
}

at::Tensor gemm_fp8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, at::Tensor out, int64_t kc, int64_t nb) {
  const char* fn = "gemm_fp8";
  check_cpu_contiguous(w, fn, "w");
  TORCH_CHECK(w.scalar_type() == at::kByte || w.scalar_type() == at::kFloat8_e4m3fn, fn,
              ": w must be float8_e4m3fn or its bits as uint8, got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 2, fn, ": w must be 2D [N, K], got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), M = check_x_out(x, out, N, K, fn);
  check_row_scale(scale, N, fn);
  const ScaleKind kind = scale_kind(scale, fn);
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const Plan plan = make_plan(K, 4, kc, nb, panel_bytes(), kPanelKc);
  const PreparedX xp(x, K, /*split=*/false);
  const Store store{out.data_ptr<float>(), N, nullptr, ScaleKind::f32};
  const Fp8Decoder decode{static_cast<const uint8_t*>(w.data_ptr()), scale.data_ptr(), kind, K};
  gemm_panel(xp.data, xp.ld, M, N, K, plan, store, decode);
  return out;
}

at::Tensor gemm_nvfp4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, double global_scale,
                      at::Tensor out, int64_t kc, int64_t nb) {
  const char* fn = "gemm_nvfp4";
  check_cpu_contiguous(packed, fn, "packed");
  check_cpu_contiguous(scale, fn, "scale");
  TORCH_CHECK(packed.scalar_type() == at::kByte, fn, ": packed must be uint8, got ", packed.scalar_type());
  TORCH_CHECK(scale.scalar_type() == at::kByte || scale.scalar_type() == at::kFloat8_e4m3fn, fn,
              ": scale must be float8_e4m3fn or its bits as uint8, got ", scale.scalar_type());
  TORCH_CHECK(packed.dim() == 2, fn, ": packed must be 2D [N, K/2], got ", packed.sizes());
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(K % 16 == 0, fn, ": K (", K, ") is not a multiple of 16 (nvfp4's group)");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) * 16 == K, fn, ": scale must be [", N, ", ", K / 16,
              "], got ", scale.sizes());
  const int64_t M = check_x_out(x, out, N, K, fn);
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  // chunks of whole groups: kc a multiple of 16 (CS) already
  const Plan plan = make_plan(K, 4, kc, nb, panel_bytes(), kPanelKc);
  const PreparedX xp(x, K, /*split=*/false);
  const Store store{out.data_ptr<float>(), N, nullptr, ScaleKind::f32};
  const Nvfp4Decoder decode{static_cast<const uint8_t*>(packed.data_ptr()), static_cast<const uint8_t*>(scale.data_ptr()),
                            static_cast<float>(global_scale), K};
  gemm_panel(xp.data, xp.ld, M, N, K, plan, store, decode);
  return out;
}

// ------------------------------------------------------------------------- bf16, W as [K, N]
// gemm_bf16_nn(x [M, K] float32, w bf16 [K, N] (row k: the N values of input k), out [M, N]):
// out = x @ w (the soft embedding: probs [tokens, vocab] @ E [vocab, hidden], E as stored).
//
// Outer-product form: a block of W (kc rows x nc columns) is widened once per call into a
// float32 panel (per thread, strips of 16 columns, each strip [kc][16] contiguous), then a 6 x 16
// microkernel per strip and x row block: per k, 6 broadcasts of x, 2 panel loads, 12 FMAs into
// 12 accumulators (ymm0-11). Loops: K chunks outermost (x's [M, kc] chunk stays in L2 across
// all of N), then N blocks (a panel, L2), strips (L1), x row blocks; each chunk's sums are added
// into out (stored by the first). Threads split N (in strips) or, where N is small, M.
// Knobs (environment): DGEMMA_GEMM_NN_KC (default 768), DGEMMA_GEMM_NN_NC (default 256): on
// [256, 32768] @ [32768, 1024] (2 Zen threads, AVX2) 768 x 256 measured 1.00x packed float32,
// 256 x 256 1.05-1.08x, 128 x 256 1.12x (more passes adding into out).
namespace {

constexpr int NN_MR = 6;
constexpr int64_t NN_NR = 16;

#define DG_NN_ROW(xaddr, acc0, acc1)                                                                    \
  "vbroadcastss " xaddr ", %%ymm14\n"                                                                  \
  "vfmadd231ps %%ymm12, %%ymm14, %%ymm" #acc0 "\n vfmadd231ps %%ymm13, %%ymm14, %%ymm" #acc1 "\n"
#define DG_NN_ROW2(xaddr, acc0, acc1)                                                                   \
  "vbroadcastss " xaddr ", %%ymm15\n"                                                                  \
  "vfmadd231ps %%ymm12, %%ymm15, %%ymm" #acc0 "\n vfmadd231ps %%ymm13, %%ymm15, %%ymm" #acc1 "\n"
#define DG_NN_K(poff, xoff)                                                                             \
  "vmovups " #poff "(%[p]), %%ymm12\n vmovups " #poff "+32(%[p]), %%ymm13\n"                           \
  DG_NN_ROW(#xoff "(%[x])", 0, 1) DG_NN_ROW2(#xoff "(%[x],%[ld],1)", 2, 3)                             \
  DG_NN_ROW(#xoff "(%[x],%[ld],2)", 4, 5) DG_NN_ROW2(#xoff "(%[x3])", 6, 7)                            \
  DG_NN_ROW(#xoff "(%[x3],%[ld],1)", 8, 9) DG_NN_ROW2(#xoff "(%[x3],%[ld],2)", 10, 11)

// acc [6][16] = sum over k < kl of x[i, k] * p[k][0..16); x rows ldx floats apart
inline void nn_kernel_6x16(const float* x, int64_t ldx, const float* p, int64_t kl, float* acc) {
  const int64_t ld = ldx * 4;
  const float* x3 = x + 3 * ldx;
  int64_t n4 = kl / 4, n1 = kl % 4;
  asm volatile(
      DG_ZERO12
      "test %[n4], %[n4]\n jz 2f\n"
      ".p2align 5\n"
      "1:\n"
      DG_NN_K(0, 0) DG_NN_K(64, 4) DG_NN_K(128, 8) DG_NN_K(192, 12)
      "add $256, %[p]\n add $16, %[x]\n add $16, %[x3]\n"
      "dec %[n4]\n jnz 1b\n"
      "2:\n"
      "test %[n1], %[n1]\n jz 4f\n"
      "3:\n"
      DG_NN_K(0, 0)
      "add $64, %[p]\n add $4, %[x]\n add $4, %[x3]\n"
      "dec %[n1]\n jnz 3b\n"
      "4:\n"
      DG_STORE12
      : [x] "+r"(x), [x3] "+r"(x3), [p] "+r"(p), [n4] "+r"(n4), [n1] "+r"(n1)
      : [ld] "r"(ld), [acc] "r"(acc)
      : DG_CLOBBERS);
}
#undef DG_NN_K
#undef DG_NN_ROW
#undef DG_NN_ROW2

// fewer rows (the M tail): the same in intrinsics (few enough accumulators for the compiler)
template <int R>
void nn_kernel_rows(const float* x, int64_t ldx, const float* p, int64_t kl, float* acc) {
  __m256 a[R][2];
  for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kl; ++k) {
    const __m256 w0 = _mm256_loadu_ps(p + k * NN_NR), w1 = _mm256_loadu_ps(p + k * NN_NR + 8);
    for (int i = 0; i < R; ++i) {
      const __m256 b = _mm256_broadcast_ss(x + i * ldx + k);
      a[i][0] = _mm256_fmadd_ps(w0, b, a[i][0]);
      a[i][1] = _mm256_fmadd_ps(w1, b, a[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(acc + i * NN_NR, a[i][0]);
    _mm256_storeu_ps(acc + i * NN_NR + 8, a[i][1]);
  }
}

using NnKernel = void (*)(const float*, int64_t, const float*, int64_t, float*);
constexpr NnKernel kNnKernels[NN_MR] = {nn_kernel_rows<1>, nn_kernel_rows<2>, nn_kernel_rows<3>,
                                        nn_kernel_rows<4>, nn_kernel_rows<5>, nn_kernel_6x16};

// columns [n0, n1) of W rows [k0, k0 + kl) into strips of 16 (the last zero-padded)
void nn_pack(const uint16_t* w, int64_t N, int64_t k0, int64_t kl, int64_t n0, int64_t n1, float* panel) {
  for (int64_t n = n0, s = 0; n < n1; n += NN_NR, ++s) {
    float* dst = panel + s * kl * NN_NR;
    const int64_t nr = std::min<int64_t>(NN_NR, n1 - n);
    const uint16_t* src = w + k0 * N + n;
    if (nr == NN_NR) {
      for (int64_t k = 0; k < kl; ++k, src += N, dst += NN_NR) {
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8));
        _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)));
        _mm256_storeu_ps(dst + 8, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16)));
      }
    } else {
      for (int64_t k = 0; k < kl; ++k, src += N, dst += NN_NR)
        for (int64_t j = 0; j < NN_NR; ++j) dst[j] = j < nr ? f32_bits(static_cast<uint32_t>(src[j]) << 16) : 0.f;
    }
  }
}

// out rows [m, m + mr), columns [n, n + nr) (+)= acc
inline void nn_store(float* out, int64_t N, int64_t m, int mr, int64_t n, int64_t nr, const float* acc, bool first) {
  for (int i = 0; i < mr; ++i) {
    float* o = out + (m + i) * N + n;
    const float* a = acc + i * NN_NR;
    if (nr == NN_NR) {
      __m256 v0 = _mm256_loadu_ps(a), v1 = _mm256_loadu_ps(a + 8);
      if (!first) v0 = _mm256_add_ps(v0, _mm256_loadu_ps(o)), v1 = _mm256_add_ps(v1, _mm256_loadu_ps(o + 8));
      _mm256_storeu_ps(o, v0);
      _mm256_storeu_ps(o + 8, v1);
    } else {
      for (int64_t j = 0; j < nr; ++j) o[j] = first ? a[j] : o[j] + a[j];
    }
  }
}

}  // namespace

at::Tensor gemm_bf16_nn(const at::Tensor& x, const at::Tensor& w, at::Tensor out, int64_t kc, int64_t nc) {
  const char* fn = "gemm_bf16_nn";
  check_cpu_contiguous(w, fn, "w");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, fn, ": w must be bfloat16, got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 2, fn, ": w must be 2D [K, N], got ", w.sizes());
  const int64_t K = w.size(0), N = w.size(1), M = check_x_out(x, out, N, K, fn);
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  if (kc <= 0) kc = env_int("DGEMMA_GEMM_NN_KC", 768);
  if (nc <= 0) nc = env_int("DGEMMA_GEMM_NN_NC", 256);
  if (K > kc) kc = (K + (K + kc - 1) / kc - 1) / ((K + kc - 1) / kc);  // equal chunks
  kc = std::min(kc, K);
  nc = std::max<int64_t>(NN_NR, nc / NN_NR * NN_NR);
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();

  auto task = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    const int64_t ncl = std::min(nc, (n1 - n0 + NN_NR - 1) / NN_NR * NN_NR);
    std::vector<float> panel(kc * ncl);
    alignas(32) float acc[NN_MR * NN_NR];
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t kl = std::min(kc, K - k0);
      for (int64_t nb = n0; nb < n1; nb += nc) {
        const int64_t ne = std::min(n1, nb + nc);
        nn_pack(wp, N, k0, kl, nb, ne, panel.data());
        for (int64_t n = nb, s = 0; n < ne; n += NN_NR, ++s) {
          const int64_t nr = std::min<int64_t>(NN_NR, ne - n);
          const float* strip = panel.data() + s * kl * NN_NR;
          for (int64_t m = m0; m < m1; m += NN_MR) {
            const int mr = static_cast<int>(std::min<int64_t>(NN_MR, m1 - m));
            kNnKernels[mr - 1](xp + m * K + k0, K, strip, kl, acc);
            nn_store(op, N, m, mr, n, nr, acc, k0 == 0);
          }
        }
      }
    }
  };
  int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (M * N * K < (int64_t{1} << 18)) threads = 1;
  const int64_t units = (N + NN_NR - 1) / NN_NR;
  int64_t tn = std::min(threads, units), tm = 1;
  if (tn < threads && M >= 2 * NN_MR * threads) tn = 1, tm = threads;
  if (tn * tm <= 1) {
    task(0, M, 0, N);
    return out;
  }
  at::parallel_for(0, tn * tm, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t a = t % tn, b = t / tn;
      const int64_t n0 = std::min(N, a * units / tn * NN_NR), n1 = std::min(N, (a + 1) * units / tn * NN_NR);
      const int64_t mu = (M + NN_MR - 1) / NN_MR;
      const int64_t m0 = std::min(M, b * mu / tm * NN_MR), m1 = std::min(M, (b + 1) * mu / tm * NN_MR);
      if (n0 < n1 && m0 < m1) task(m0, m1, n0, n1);
    }
  });
  return out;
}

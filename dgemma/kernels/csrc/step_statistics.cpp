// One denoising step's statistics from the LM head's raw output, in one pass per row.
//
// The engine needs, per canvas position: the argmax token, the entropy of softmax(z / T), the
// unnormalised probabilities e = exp((z - max z) / T) (to sample accepted positions from) and
// the same in bfloat16 (the input of the self-conditioning matmul), where z = cap * tanh(raw /
// cap) is the softcapped logit. In torch that is ~12 passes over a [canvas, vocab] float32
// tensor (32 MB at vocab 32768); here each row is read once from the LM head's output and
// finished while it sits in L2: softcap + max in one sweep, exp + sums + stores in a second.
//
// Arithmetic matches `model.logits` + `sampler.step_statistics`: raw / cap, tanh, * cap, then
// d = (z - max) / T clamped at EXP_FLOOR, e = exp(d), total = sum e, entropy = log(total) -
// sum(e d) / total (>= 0). tanh and exp are polynomial (Cephes-style, ~2 ulp) rather than the
// SLEEF ones torch uses, and sums are accumulated in 16 lanes, so values agree to float32
// rounding; the argmax is the first maximal index, as torch's.
//
// An optional allowed-token mask (llguidance's packed bitmask: int32 [N, ceil(V / 32)], token t
// allowed iff bit t % 32 of word t // 32 is set) makes every other token's logit -inf after the
// softcap: never the argmax, weight (and bf16 prob) exactly 0, nothing in the sums. A 16-lane
// block is exactly one little-endian uint16 half-word of the mask, read as its __mmask16.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "vec_math.h"

namespace {

using dgemma::bf16_to_float;
using dgemma::exp512;
using dgemma::float_to_bf16;

constexpr float kExpFloor = -87.0f;  // sampler.EXP_FLOOR: keeps exp out of float32 denormals

// tanh: odd polynomial below |x| 0.625 (Cephes tanhf), 1 - 2 / (exp(2|x|) + 1) above.
inline __m512 tanh512(__m512 x) {
  __m512 ax = _mm512_abs_ps(x);
  __m512 z = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
  __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
  __m512 e = exp512(_mm512_add_ps(ax, ax));
  __m512 large = _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  large = _mm512_or_ps(large, _mm512_and_ps(x, _mm512_set1_ps(-0.0f)));  // sign of x
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_LT_OQ), large, small);
}

template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  return bf16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// kMasked: `allowed` holds `mask_stride` uint16 half-words per row (2 per int32 word of the mask).
template <typename T, bool kMasked>
void rows_statistics(const T* raw, int64_t vocab, float cap, const float* temps, float* weights, at::BFloat16* probs,
                     const uint16_t* allowed, int64_t mask_stride, int64_t* argmax, float* entropy, float* total,
                     int64_t begin, int64_t end) {
  const __m512 capv = _mm512_set1_ps(cap);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t row = begin; row < end; ++row) {
    const T* x = raw + row * vocab;
    float* w = weights + row * vocab;
    const uint16_t* m = kMasked ? allowed + row * mask_stride : nullptr;
    // sweep 1: softcapped logits into `w`, per-lane max and first index of it
    __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i best_at = _mm512_setzero_si512();
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (int64_t v = 0; v < vocab; v += 16) {
      __m512 z = load16<T>(x + v);
      if (cap > 0) z = _mm512_mul_ps(tanh512(_mm512_div_ps(z, capv)), capv);
      if constexpr (kMasked) z = _mm512_mask_blend_ps(static_cast<__mmask16>(m[v / 16]), minus_inf, z);
      _mm512_storeu_ps(w + v, z);
      __mmask16 higher = _mm512_cmp_ps_mask(z, best, _CMP_GT_OQ);
      best = _mm512_mask_blend_ps(higher, best, z);
      best_at = _mm512_mask_blend_epi32(higher, best_at, at);
      at = _mm512_add_epi32(at, step);
    }
    const float top = _mm512_reduce_max_ps(best);
    __mmask16 is_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    argmax[row] = _mm512_mask_reduce_min_epi32(is_top, best_at);
    // sweep 2: d = (z - top) / T, e = exp(d), sums; e stored as float32 and bfloat16
    const __m512 topv = _mm512_set1_ps(top), tv = _mm512_set1_ps(temps[row]), floor = _mm512_set1_ps(kExpFloor);
    __m512 sum_e = _mm512_setzero_ps(), sum_ed = _mm512_setzero_ps();
    for (int64_t v = 0; v < vocab; v += 16) {
      __m512 d = _mm512_max_ps(_mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(w + v), topv), tv), floor);
      __m512 e = exp512(d);
      // disallowed: z = -inf, d clamped to the floor; the weight must be 0, not exp(floor). The
      // mask bits rather than a compare on z: one half-word load, and a -inf raw logit of an
      // allowed token (cap 0) keeps exp(floor), as in torch.
      if constexpr (kMasked) e = _mm512_maskz_mov_ps(static_cast<__mmask16>(m[v / 16]), e);
      sum_e = _mm512_add_ps(sum_e, e);
      sum_ed = _mm512_fmadd_ps(e, d, sum_ed);
      _mm512_storeu_ps(w + v, e);
      if (probs) _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + row * vocab + v), float_to_bf16(e));
    }
    const float s = _mm512_reduce_add_ps(sum_e), sd = _mm512_reduce_add_ps(sum_ed);
    total[row] = s;
    // s >= 1 (the top token's e is 1) unless a mask allows nothing: 0 there, not 0 / 0
    entropy[row] = s == 0.0f ? 0.0f : std::max(std::log(s) - sd / s, 0.0f);
  }
}

}  // namespace

// raw [N, V] (bf16 or fp32, V % 16 == 0), temps [N] fp32, weights [N, V] fp32 (written), probs
// [N, V] bf16 or an empty tensor (written when given), allowed [N, ceil(V / 32)] int32 (the
// packed allowed-token bitmask) or an empty tensor (all allowed). Returns argmax [N] int64,
// entropy [N], total [N] (fp32).
std::vector<at::Tensor> step_statistics(const at::Tensor& raw, double cap, const at::Tensor& temps, at::Tensor& weights,
                                        at::Tensor& probs, const at::Tensor& allowed) {
  TORCH_CHECK(raw.dim() == 2 && raw.is_contiguous() && raw.size(1) % 16 == 0, "raw: contiguous [N, V], V % 16 == 0");
  TORCH_CHECK(raw.scalar_type() == at::kBFloat16 || raw.scalar_type() == at::kFloat, "raw: bf16 or fp32");
  TORCH_CHECK(weights.sizes() == raw.sizes() && weights.is_contiguous() && weights.scalar_type() == at::kFloat, "weights");
  const bool with_probs = probs.numel() > 0;
  TORCH_CHECK(!with_probs || (probs.sizes() == raw.sizes() && probs.is_contiguous() && probs.scalar_type() == at::kBFloat16), "probs");
  auto t = temps.to(at::kFloat).contiguous();
  TORCH_CHECK(t.numel() == raw.size(0), "one temperature per row");
  const int64_t rows = raw.size(0), vocab = raw.size(1);
  const bool masked = allowed.defined() && allowed.numel() > 0;
  TORCH_CHECK(!masked || (allowed.dim() == 2 && allowed.size(0) == rows && allowed.size(1) == (vocab + 31) / 32 &&
                          allowed.is_contiguous() && allowed.scalar_type() == at::kInt),
              "allowed: contiguous int32 [N, ceil(V / 32)] or empty");
  // little-endian: tokens 32 w .. 32 w + 15 are the low half-word of word w, the next 16 the high one
  const uint16_t* mask_p = masked ? reinterpret_cast<const uint16_t*>(allowed.data_ptr<int32_t>()) : nullptr;
  const int64_t mask_stride = masked ? 2 * allowed.size(1) : 0;
  auto argmax = at::empty({rows}, raw.options().dtype(at::kLong));
  auto entropy = at::empty({rows}, raw.options().dtype(at::kFloat));
  auto total = at::empty({rows}, raw.options().dtype(at::kFloat));
  at::BFloat16* probs_p = with_probs ? probs.data_ptr<at::BFloat16>() : nullptr;
  auto run = [&](auto kernel, const auto* x, int64_t begin, int64_t end) {
    kernel(x, vocab, static_cast<float>(cap), t.data_ptr<float>(), weights.data_ptr<float>(), probs_p, mask_p, mask_stride,
           argmax.data_ptr<int64_t>(), entropy.data_ptr<float>(), total.data_ptr<float>(), begin, end);
  };
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    if (raw.scalar_type() == at::kBFloat16) {
      const at::BFloat16* x = raw.data_ptr<at::BFloat16>();
      masked ? run(rows_statistics<at::BFloat16, true>, x, begin, end) : run(rows_statistics<at::BFloat16, false>, x, begin, end);
    } else {
      const float* x = raw.data_ptr<float>();
      masked ? run(rows_statistics<float, true>, x, begin, end) : run(rows_statistics<float, false>, x, begin, end);
    }
  });
  return {argmax, entropy, total};
}

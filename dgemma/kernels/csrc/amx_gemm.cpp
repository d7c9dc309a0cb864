// Bfloat16 GEMMs on Intel AMX for the decoder's memory-bound shapes: one layer's MoE block, the
// dense gated MLP, and plain linears (attention projections, LM head, self-conditioning matmul).
//
// Why: at canvas 256 each expert gets ~32 rows per step, so the MoE is a stream over all expert
// weights (768 MB per step for the `mid` model) with little arithmetic per byte. oneDNN, called
// once per expert, streamed them at ~9 GB/s here; these loops walk weights packed in the order
// their AMX tiles consume them (one linear stream per thread), at 16-19 GB/s, and fold routing,
// activation, weighting and the top-k sum into the GEMM epilogues instead of separate passes.
//
// Numerics follow the reference modules in bfloat16: every matmul output is rounded to bfloat16
// as a bf16 torch matmul's is, gelu and `* up` round as bf16 ops, the routing weight multiplies
// in float32 and the top-k sum accumulates in float32 before the final rounding. Only the float32
// accumulation order inside each dot product (and of the top-k sum) differs, so results agree
// to bfloat16 rounding.
//
// Packed weight layouts (built in native.py), B tiles of 16 k-pairs x 16 columns x 2 ("VNNI"):
//   gate/up [E][I/16 items][K/32][gate, up][16][16][2]  (item j: gate and up columns 16j..16j+15)
//   linear  [E][N/32 items][K/32][2 column blocks][16][16][2]

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_math.h"

namespace {

using dgemma::bf16_round;
using dgemma::exp512;
using dgemma::float_to_bf16;

constexpr int kTile = 16;      // rows per tile; columns per tile in float32 output
constexpr int kTileK = 32;     // bf16 values along K per tile row
constexpr int kTileElems = kTile * kTileK;  // 512 bf16 = 1 KB per B tile

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: float32 accumulators; 4-5: activation (A) tiles; 6-7: weight (B) tiles.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTile;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// gelu with the tanh approximation: 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)).
inline __m512 gelu_tanh(__m512 x) {
  __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
  __m512 e = exp512(_mm512_mul_ps(u, _mm512_set1_ps(-2.0f)));
  return _mm512_div_ps(x, _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
}

// Exact gelu: 0.5 x erfc(-x / sqrt 2), with erfc from Numerical Recipes' erfcc (relative error
// < 1.2e-7 everywhere, so the small negative tail keeps its relative precision).
inline __m512 gelu_erf(__m512 x) {
  __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.7071067811865476f));
  __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_set1_ps(0.5f), z, _mm512_set1_ps(1.0f)));
  static const float c[] = {0.17087277f, -0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f,
                            -0.18628806f, 0.09678418f, 0.37409196f, 1.00002368f, -1.26551223f};
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < 10; ++i) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(c[i]));
  __m512 erfc_z = _mm512_mul_ps(t, exp512(_mm512_sub_ps(p, _mm512_mul_ps(z, z))));  // erfc(|x|/sqrt2)
  __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
  __m512 cdf2 = _mm512_mask_sub_ps(erfc_z, positive, _mm512_set1_ps(2.0f), erfc_z);  // 1 + erf(x/sqrt2)
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), cdf2);
}

// C tiles 0..3 += A (tiles 4, 5: rows a, a + 16 rows) x B (tiles 6, 7) over `k_steps` of 32.
// C starts at zero, or from `c_init` (float32 rows of `c_stride` floats: a K-blocked partial sum).
// With one A tile (an odd 16 rows at the end) tiles 1 and 3 are left alone.
template <bool kTwoRowTiles>
inline void tile_gemm(const at::BFloat16* a, int64_t a_stride_bytes, const at::BFloat16* b, int64_t k_steps,
                      const float* c_init = nullptr, int64_t c_stride = 0) {
  if (c_init) {
    const int64_t cs = c_stride * 4;
    _tile_loadd(0, c_init, cs);
    _tile_loadd(2, c_init + kTile, cs);
    if (kTwoRowTiles) {
      _tile_loadd(1, c_init + kTile * c_stride, cs);
      _tile_loadd(3, c_init + kTile * c_stride + kTile, cs);
    }
  } else {
    _tile_zero(0);
    _tile_zero(2);
    if (kTwoRowTiles) {
      _tile_zero(1);
      _tile_zero(3);
    }
  }
  const char* a_rows = reinterpret_cast<const char*>(a);
  const int64_t second = 16 * a_stride_bytes;
  for (int64_t k = 0; k < k_steps; ++k) {
    const at::BFloat16* bk = b + k * 2 * kTileElems;
    _tile_loadd(4, a_rows + k * 64, a_stride_bytes);
    _tile_loadd(6, bk, 64);
    _tile_loadd(7, bk + kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    if (kTwoRowTiles) {
      _tile_loadd(5, a_rows + second + k * 64, a_stride_bytes);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// Tiles 0..3 to `c` (rows of `c_stride` floats): tile 0 at (0, 0), 1 at (16, 0), 2 at (0, 16), 3 at (16, 16).
template <bool kTwoRowTiles>
inline void store_tiles(float* c, int64_t c_stride) {
  const int64_t cs = c_stride * 4;
  _tile_stored(0, c, cs);
  _tile_stored(2, c + kTile, cs);
  if (kTwoRowTiles) {
    _tile_stored(1, c + kTile * c_stride, cs);
    _tile_stored(3, c + kTile * c_stride + kTile, cs);
  }
}

// One 32-column item for rows [row_begin, row_end) (a multiple of 16) of `a`: the product, 32 rows
// at a time, goes to `c` ([32][32] float32) and then to `epilogue(first_row, row_count, c)`.
template <typename Epilogue>
inline void item_rows(const at::BFloat16* a, int64_t a_stride, int64_t row_begin, int64_t row_end, const at::BFloat16* b,
                      int64_t k_steps, float* c, Epilogue&& epilogue) {
  for (int64_t m = row_begin; m < row_end; m += 2 * kTile) {
    const at::BFloat16* am = a + m * a_stride;
    if (m + 2 * kTile <= row_end) {
      tile_gemm<true>(am, a_stride * 2, b, k_steps);
      store_tiles<true>(c, 2 * kTile);
      epilogue(m, 2 * kTile, c);
    } else {
      tile_gemm<false>(am, a_stride * 2, b, k_steps);
      store_tiles<false>(c, 2 * kTile);
      epilogue(m, kTile, c);
    }
  }
}

// act[rows, 16j..16j+15] = bf16(gelu(bf16(a W_gate^T)) * bf16(a W_up^T)) for item j of one expert.
inline void gate_up_item(const at::BFloat16* a, int64_t hidden, int64_t row_begin, int64_t row_end,
                         const at::BFloat16* b, int64_t k_steps, int64_t item, at::BFloat16* act, int64_t inter,
                         bool exact_gelu, float* c) {
  item_rows(a, hidden, row_begin, row_end, b, k_steps, c, [&](int64_t m, int64_t count, const float* tiles) {
    for (int64_t i = 0; i < count; ++i) {  // row i: gate in columns 0..15, up in 16..31
      __m512 g = bf16_round(_mm512_load_ps(tiles + i * 32));
      __m512 u = bf16_round(_mm512_load_ps(tiles + i * 32 + 16));
      __m512 gelu = bf16_round(exact_gelu ? gelu_erf(g) : gelu_tanh(g));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(act + (m + i) * inter + item * kTile), float_to_bf16(_mm512_mul_ps(gelu, u)));
    }
  });
}

struct Routing {
  std::vector<int64_t> start;      // first padded row of each expert, E + 1 entries
  std::vector<int64_t> row_token;  // token of each padded row, -1 for padding
  std::vector<float> row_weight;   // routing weight of each padded row
};

Routing route(const int64_t* index, const float* weights, int64_t tokens, int64_t top_k, int64_t experts) {
  Routing r;
  std::vector<int64_t> count(experts, 0);
  for (int64_t i = 0; i < tokens * top_k; ++i) count[index[i]]++;
  r.start.assign(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) r.start[e + 1] = r.start[e] + (count[e] + kTile - 1) / kTile * kTile;
  r.row_token.assign(r.start[experts], -1);
  r.row_weight.assign(r.start[experts], 0.0f);
  std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
  for (int64_t i = 0; i < tokens * top_k; ++i) {  // token order within each expert, as a stable sort
    int64_t row = fill[index[i]]++;
    r.row_token[row] = i / top_k;
    r.row_weight[row] = weights[i];
  }
  return r;
}

// Rows [0, rows) of x, zero-padded to a multiple of 16 rows (x itself when already one).
at::Tensor padded_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), padded = (rows + kTile - 1) / kTile * kTile;
  if (padded == rows) return x;
  auto out = at::zeros({padded, x.size(1)}, x.options());
  out.narrow(0, 0, rows).copy_(x);
  return out;
}

void check_packed(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.dim() == 7 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), name, ": packed bf16 weight expected");
}

void check_input(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [rows, K]");
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight expects ", k);
}

// The gate/up pass of experts [0, experts) over rows start[e]..start[e + 1] of `a`.
void gate_up_pass(const at::Tensor& a, const std::vector<int64_t>& start, const at::Tensor& gate_up, at::Tensor& act,
                  bool exact_gelu) {
  const int64_t experts = gate_up.size(0), items = gate_up.size(1), k_steps = gate_up.size(2);
  const int64_t hidden = a.size(1), inter = act.size(1), expert_elems = items * k_steps * 2 * kTileElems;
  const at::BFloat16* ap = a.data_ptr<at::BFloat16>();
  const at::BFloat16* w = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* actp = act.data_ptr<at::BFloat16>();
  // each thread owns a range of items and walks every expert: one weight stream per thread
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[2 * kTile * 2 * kTile];
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t item = begin; item < end; ++item)
        gate_up_item(ap, hidden, start[e], start[e + 1], w + e * expert_elems + item * k_steps * 2 * kTileElems, k_steps,
                     item, actp, inter, exact_gelu, c);
    _tile_release();
  });
}

}  // namespace

bool amx_init() {
  // Linux hands out AMX tile state per process on request (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// x [M, K] @ W^T -> [M, N] bf16, W packed [1][N/32][K/32][2][16][16][2]. K above 4096 runs in
// blocks of 2048 with float32 partial sums, so each block of x stays in L2 across columns.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight) {
  check_packed(weight, "weight");
  const int64_t items = weight.size(1), k_steps = weight.size(2), n = items * 2 * kTile, k = k_steps * kTileK;
  check_input(x, k);
  const int64_t rows = x.size(0);
  auto a = padded_rows(x);
  const int64_t padded = a.size(0);
  auto out = at::empty({rows, n}, x.options());
  const at::BFloat16* ap = a.data_ptr<at::BFloat16>();
  const at::BFloat16* w = weight.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t block = k_steps * kTileK > 4096 ? 2048 / kTileK : k_steps;
  at::Tensor partial = block < k_steps ? at::empty({padded, n}, x.options().dtype(at::kFloat)) : at::Tensor();
  float* pp = partial.defined() ? partial.data_ptr<float>() : nullptr;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[2 * kTile * 2 * kTile];
    for (int64_t k0 = 0; k0 < k_steps; k0 += block) {
      const int64_t steps = std::min(block, k_steps - k0);
      const bool last = k0 + steps == k_steps;
      for (int64_t item = begin; item < end; ++item) {
        const at::BFloat16* b = w + (item * k_steps + k0) * 2 * kTileElems;
        for (int64_t m = 0; m < padded; m += 2 * kTile) {
          const bool two = m + 2 * kTile <= padded;
          const at::BFloat16* am = ap + m * k + k0 * kTileK;
          float* pm = pp ? pp + m * n + item * 2 * kTile : nullptr;
          const float* init = k0 > 0 ? pm : nullptr;
          if (two) tile_gemm<true>(am, k * 2, b, steps, init, n); else tile_gemm<false>(am, k * 2, b, steps, init, n);
          if (!last) {
            if (two) store_tiles<true>(pm, n); else store_tiles<false>(pm, n);
            continue;
          }
          if (two) store_tiles<true>(c, 2 * kTile); else store_tiles<false>(c, 2 * kTile);
          const int64_t count = std::min<int64_t>(two ? 2 * kTile : kTile, rows - m);
          for (int64_t i = 0; i < count; ++i)
            for (int nb = 0; nb < 2; ++nb)
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + (m + i) * n + item * 2 * kTile + nb * kTile),
                                  float_to_bf16(_mm512_load_ps(c + i * 32 + nb * kTile)));
        }
      }
    }
    _tile_release();
  });
  return out;
}

// down(gelu(gate(x)) * up(x)): the dense MLP, gate/up packed [1][I/16]..., down [1][H/32]...
at::Tensor gated_mlp(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, bool exact_gelu) {
  check_packed(gate_up, "gate_up");
  check_packed(down, "down");
  check_input(x, gate_up.size(2) * kTileK);
  auto a = padded_rows(x);
  auto act = at::empty({a.size(0), gate_up.size(1) * kTile}, x.options());
  gate_up_pass(a, {0, a.size(0)}, gate_up, act, exact_gelu);
  auto out = amx_linear(act, down);
  return a.size(0) == x.size(0) ? out : out.narrow(0, 0, x.size(0)).contiguous();
}

// One layer's routed experts: x [T, H], top-k expert ids [T, K] and float32 weights [T, K].
at::Tensor moe_forward(const at::Tensor& x, const at::Tensor& top_k_index, const at::Tensor& top_k_weights,
                       const at::Tensor& gate_up, const at::Tensor& down, bool exact_gelu) {
  check_packed(gate_up, "gate_up");
  check_packed(down, "down");
  const int64_t hidden = gate_up.size(2) * kTileK;
  check_input(x, hidden);
  TORCH_CHECK(top_k_index.scalar_type() == at::kLong && top_k_weights.scalar_type() == at::kFloat, "index int64, weights fp32");
  const int64_t tokens = x.size(0), top_k = top_k_index.size(1), experts = gate_up.size(0);
  const int64_t down_items = down.size(1), i_steps = down.size(2), inter = gate_up.size(1) * kTile;
  TORCH_CHECK(down_items * 2 * kTile == hidden && i_steps * kTileK == inter && down.size(0) == experts, "down: shape");

  auto index_c = top_k_index.contiguous();
  auto weights_c = top_k_weights.contiguous();
  TORCH_CHECK(index_c.numel() == 0 || (index_c.min().item<int64_t>() >= 0 && index_c.max().item<int64_t>() < experts),
              "expert index out of range");
  Routing r = route(index_c.data_ptr<int64_t>(), weights_c.data_ptr<float>(), tokens, top_k, experts);
  const int64_t rows = r.start[experts];

  auto routed = at::empty({rows, hidden}, x.options());
  auto act = at::empty({rows, inter}, x.options());
  auto acc = at::zeros({tokens, hidden}, x.options().dtype(at::kFloat));
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::BFloat16* routed_p = routed.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = r.row_token[row];
      if (t >= 0)
        std::memcpy(routed_p + row * hidden, xp + t * hidden, hidden * sizeof(at::BFloat16));
      else
        std::memset(routed_p + row * hidden, 0, hidden * sizeof(at::BFloat16));
    }
  });
  gate_up_pass(routed, r.start, gate_up, act, exact_gelu);

  // down: each thread owns a range of 32-column items of the output and adds every expert's
  // weighted rows into them (no two threads touch the same float)
  const at::BFloat16* actp = act.data_ptr<at::BFloat16>();
  const at::BFloat16* w = down.data_ptr<at::BFloat16>();
  float* accp = acc.data_ptr<float>();
  const int64_t expert_elems = down_items * i_steps * 2 * kTileElems;
  at::parallel_for(0, down_items, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[2 * kTile * 2 * kTile];
    for (int64_t e = 0; e < experts; ++e) {
      for (int64_t item = begin; item < end; ++item) {
        const at::BFloat16* b = w + e * expert_elems + item * i_steps * 2 * kTileElems;
        item_rows(actp, inter, r.start[e], r.start[e + 1], b, i_steps, c, [&](int64_t m, int64_t count, const float* tiles) {
          for (int64_t i = 0; i < count; ++i) {
            const int64_t t = r.row_token[m + i];
            if (t < 0) continue;
            const __m512 weight = _mm512_set1_ps(r.row_weight[m + i]);
            float* out = accp + t * hidden + item * 2 * kTile;
            for (int nb = 0; nb < 2; ++nb) {
              __m512 v = bf16_round(_mm512_load_ps(tiles + i * 32 + nb * kTile));
              _mm512_storeu_ps(out + nb * kTile, _mm512_fmadd_ps(v, weight, _mm512_loadu_ps(out + nb * kTile)));
            }
          }
        });
      }
    }
    _tile_release();
  });
  return acc.to(at::kBFloat16);
}

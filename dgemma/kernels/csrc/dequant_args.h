// Shared by dequant.cpp (AVX2) and dequant_avx512.cpp: the argument checks of each dequantise
// function (so that both builds refuse the same misuse with the same message) and the parallel
// split of a tile's rows.
#pragma once

#include <ATen/core/Tensor.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace dgemma_dequant {

inline void check_out(const at::Tensor& out, const char* fn) {
  TORCH_CHECK(out.device().is_cpu(), fn, ": out must be a CPU tensor");
  TORCH_CHECK(out.dim() == 2, fn, ": out must be 2D [rows, K], got ", out.dim(), "D");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, fn,
              ": out must be float32 or bfloat16, got ", out.scalar_type());
  TORCH_CHECK(out.is_contiguous(), fn, ": out must be contiguous");
}

inline void check_input(const at::Tensor& t, const char* fn, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", what, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), fn, ": ", what, " must be contiguous");
}

// one scale per row: [N] or [N, 1]
inline void check_row_scale(const at::Tensor& scale, int64_t rows, const char* fn) {
  check_input(scale, fn, "scale");
  TORCH_CHECK((scale.dim() == 1 || (scale.dim() == 2 && scale.size(1) == 1)) && scale.size(0) == rows, fn,
              ": scale must be [", rows, "] or [", rows, ", 1] (one per row), got ", scale.sizes());
}

inline void check_int8(const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& out, const char* fn) {
  check_out(out, fn);
  check_input(weight, fn, "weight");
  TORCH_CHECK(weight.scalar_type() == at::kChar, fn, ": weight must be int8, got ", weight.scalar_type());
  TORCH_CHECK(weight.sizes() == out.sizes(), fn, ": weight ", weight.sizes(), " and out ", out.sizes(), " differ in shape");
  check_row_scale(scale, out.size(0), fn);
}

inline void check_fp8(const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& out, const char* fn) {
  check_out(out, fn);
  check_input(weight, fn, "weight");
  TORCH_CHECK(weight.scalar_type() == at::kByte || weight.scalar_type() == at::kFloat8_e4m3fn, fn,
              ": weight must be float8_e4m3fn or its bits as uint8, got ", weight.scalar_type());
  TORCH_CHECK(weight.sizes() == out.sizes(), fn, ": weight ", weight.sizes(), " and out ", out.sizes(), " differ in shape");
  check_row_scale(scale, out.size(0), fn);
}

inline void check_int4(const at::Tensor& packed, const at::Tensor& scale, int64_t group_size, const at::Tensor& out,
                       const char* fn) {
  check_out(out, fn);
  check_input(packed, fn, "packed");
  check_input(scale, fn, "scale");
  const int64_t rows = out.size(0), K = out.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kInt, fn, ": packed must be int32, got ", packed.scalar_type());
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0, fn, ": group_size must be a positive multiple of 8, got ", group_size);
  TORCH_CHECK(K % group_size == 0, fn, ": out's K (", K, ") is not a multiple of group_size ", group_size);
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == rows && packed.size(1) * 8 == K, fn, ": packed must be [", rows,
              ", ", K / 8, "] for out ", out.sizes(), ", got ", packed.sizes());
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == rows && scale.size(1) == K / group_size, fn, ": scale must be [",
              rows, ", ", K / group_size, "] (group ", group_size, "), got ", scale.sizes());
}

inline void check_nvfp4(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& out, const char* fn) {
  check_out(out, fn);
  check_input(packed, fn, "packed");
  check_input(scale, fn, "scale");
  const int64_t rows = out.size(0), K = out.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kByte, fn, ": packed must be uint8, got ", packed.scalar_type());
  TORCH_CHECK(scale.scalar_type() == at::kByte || scale.scalar_type() == at::kFloat8_e4m3fn, fn,
              ": scale must be float8_e4m3fn or its bits as uint8, got ", scale.scalar_type());
  TORCH_CHECK(K % 16 == 0, fn, ": out's K (", K, ") is not a multiple of 16 (nvfp4's group)");
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == rows && packed.size(1) * 2 == K, fn, ": packed must be [", rows,
              ", ", K / 2, "] for out ", out.sizes(), ", got ", packed.sizes());
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == rows && scale.size(1) * 16 == K, fn, ": scale must be [", rows, ", ",
              K / 16, "], got ", scale.sizes());
}

// Rows [0, rows) in parallel chunks of no fewer than ~32K outputs (a small tile stays on the
// calling thread: waking the pool costs more than it saves): chunk(begin, end, out) with out the
// (float32 or bf16) data of row 0.
template <typename F>
void for_chunks(const at::Tensor& out, F chunk) {
  const int64_t rows = out.size(0), K = out.size(1);
  if (rows == 0 || K == 0) return;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / K);
  if (out.scalar_type() == at::kFloat) {
    float* o = out.data_ptr<float>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { chunk(begin, end, o); });
  } else {
    at::BFloat16* o = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { chunk(begin, end, o); });
  }
}

// the same, row(r, out_row) per row
template <typename F>
void for_rows(const at::Tensor& out, F row) {
  const int64_t K = out.size(1);
  for_chunks(out, [&](int64_t begin, int64_t end, auto* o) {
    for (int64_t r = begin; r < end; ++r) row(r, o + r * K);
  });
}

}  // namespace dgemma_dequant

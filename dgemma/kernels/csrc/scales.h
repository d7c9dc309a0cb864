// Shared by dequant.cpp and gemm_avx2.cpp: a float from its bits, one scale read as float32
// whatever its stored dtype (float32, bfloat16 or float16), and the float32 value of each fp8 code.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace dgemma_scales {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

enum class ScaleKind { f32, bf16, f16 };

inline ScaleKind scale_kind(const at::Tensor& s, const char* fn) {
  switch (s.scalar_type()) {
    case at::kFloat: return ScaleKind::f32;
    case at::kBFloat16: return ScaleKind::bf16;
    case at::kHalf: return ScaleKind::f16;
    default: TORCH_CHECK(false, fn, ": scale must be float32, bfloat16 or float16, got ", s.scalar_type());
  }
  return ScaleKind::f32;
}

inline float scale_at(const void* base, ScaleKind kind, int64_t i) {
  switch (kind) {
    case ScaleKind::f32: return static_cast<const float*>(base)[i];
    case ScaleKind::bf16: return bits_to_float(static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16);
    case ScaleKind::f16: return _cvtsh_ss(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.f;
}

// float32 value of each e4m3fn code (c10's conversion: what `.float()` gives the reference)
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
};
inline const Fp8Table& fp8_table() {
  static const Fp8Table table;
  return table;
}

}  // namespace dgemma_scales

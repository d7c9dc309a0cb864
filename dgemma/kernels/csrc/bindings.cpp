// Python bindings of the native CPU kernels (built by dgemma/kernels/native.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

bool amx_init();
at::Tensor moe_forward(const at::Tensor& x, const at::Tensor& top_k_index, const at::Tensor& top_k_weights,
                       const at::Tensor& gate_up, const at::Tensor& down, bool exact_gelu);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight);
at::Tensor gated_mlp(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, bool exact_gelu);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> step_statistics(const at::Tensor& raw, double cap, const at::Tensor& temps, at::Tensor& weights,
                                        at::Tensor& probs, const at::Tensor& allowed);
at::Tensor dequant_int8_avx512(const at::Tensor& weight, const at::Tensor& scale, at::Tensor out);
at::Tensor dequant_fp8_avx512(const at::Tensor& weight, const at::Tensor& scale, at::Tensor out);
at::Tensor dequant_int4_avx512(const at::Tensor& packed, const at::Tensor& scale, int64_t group_size, at::Tensor out);
at::Tensor dequant_nvfp4_avx512(const at::Tensor& packed, const at::Tensor& scale, double global_scale, at::Tensor out);
at::Tensor gemm_int8_avx512(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, at::Tensor out);
at::Tensor gemm_fp8_avx512(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, at::Tensor out);
at::Tensor gemm_int4_avx512(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t group,
                            at::Tensor out);
at::Tensor gemm_nvfp4_avx512(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, double global_scale,
                             at::Tensor out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_init", &amx_init, "request AMX tile state for this process");
  m.def("linear", &amx_linear, "x @ W^T on AMX (bf16, W packed)");
  m.def("gated_mlp", &gated_mlp, "down(gelu(gate(x)) * up(x)) on AMX (bf16)");
  m.def("moe_forward", &moe_forward, "one layer's routed MoE block on AMX (bf16)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, one pass per row (bf16 / fp32)");
  m.def("step_statistics", &step_statistics,
        "argmax, entropy, exp weights of softcapped logits / T, per row; `allowed`: packed int32 token bitmask or empty",
        py::arg("raw"), py::arg("cap"), py::arg("temps"), py::arg("weights"), py::arg("probs"),
        py::arg("allowed") = at::empty({0}, at::kInt));
  // dequant.cpp's dequantise functions (same names and arguments) into a bf16 `out` (dequant_avx512.cpp)
  m.def("dequant_int8", &dequant_int8_avx512, "int8 [N, K] * scale [N, 1] -> out (bf16)", py::arg("weight"),
        py::arg("scale"), py::arg("out"));
  m.def("dequant_fp8", &dequant_fp8_avx512, "float8_e4m3fn (uint8 bits) [N, K] * scale [N, 1] -> out (bf16)",
        py::arg("weight"), py::arg("scale"), py::arg("out"));
  m.def("dequant_int4", &dequant_int4_avx512, "packed int4 (int32 [N, K/8]) * group scales [N, K/group] -> out (bf16)",
        py::arg("packed"), py::arg("scale"), py::arg("group_size"), py::arg("out"));
  m.def("dequant_nvfp4", &dequant_nvfp4_avx512, "packed e2m1 (uint8 [N, K/2]) * fp8 scales [N, K/16] / global -> out (bf16)",
        py::arg("packed"), py::arg("scale"), py::arg("global_scale"), py::arg("out"));
  // gemm_avx2.cpp's GEMMs on stored weights (same names and arguments) for bf16 x and out
  m.def("gemm_int8", &gemm_int8_avx512, "out [M, N] = x [M, K] bf16 @ (w int8 [N, K] * scale [N, 1])^T, bf16", py::arg("x"),
        py::arg("w"), py::arg("scale"), py::arg("out"));
  m.def("gemm_fp8", &gemm_fp8_avx512, "out = x @ (w e4m3fn [N, K] * scale [N, 1])^T, bf16", py::arg("x"), py::arg("w"),
        py::arg("scale"), py::arg("out"));
  m.def("gemm_int4", &gemm_int4_avx512, "out = x @ dequant(packed int32 [N, K/8], scale [N, K/group])^T, bf16", py::arg("x"),
        py::arg("packed"), py::arg("scale"), py::arg("group"), py::arg("out"));
  m.def("gemm_nvfp4", &gemm_nvfp4_avx512, "out = x @ dequant(packed e2m1 [N, K/2], fp8 scales [N, K/16], global)^T, bf16",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("global_scale"), py::arg("out"));
}

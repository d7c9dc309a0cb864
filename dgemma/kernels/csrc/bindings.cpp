// Python bindings of the native CPU kernels (built by dgemma/kernels/native.py).
#include <torch/extension.h>

bool amx_init();
torch::Tensor moe_forward(const torch::Tensor& x, const torch::Tensor& top_k_index, const torch::Tensor& top_k_weights,
                          const torch::Tensor& gate_up, const torch::Tensor& down, bool exact_gelu);
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& weight);
torch::Tensor gated_mlp(const torch::Tensor& x, const torch::Tensor& gate_up, const torch::Tensor& down, bool exact_gelu);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> step_statistics(const at::Tensor& raw, double cap, const at::Tensor& temps, at::Tensor& weights,
                                        at::Tensor& probs, const at::Tensor& allowed);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_init", &amx_init, "request AMX tile state for this process");
  m.def("linear", &amx_linear, "x @ W^T on AMX (bf16, W packed)");
  m.def("gated_mlp", &gated_mlp, "down(gelu(gate(x)) * up(x)) on AMX (bf16)");
  m.def("moe_forward", &moe_forward, "one layer's routed MoE block on AMX (bf16)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, one pass per row (bf16 / fp32)");
  m.def("step_statistics", &step_statistics,
        "argmax, entropy, exp weights of softcapped logits / T, per row; `allowed`: packed int32 token bitmask or empty",
        py::arg("raw"), py::arg("cap"), py::arg("temps"), py::arg("weights"), py::arg("probs"),
        py::arg("allowed") = torch::empty({0}, torch::kInt32));
}

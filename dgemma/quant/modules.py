"""Modules that compute with quantised weights, and the one function that puts them in a model.

A quantised weight's parts live as buffers named as on disk (`formats.py`). A matmul dequantises
one tile of output channels at a time into the activations' dtype and multiplies it, so no
full-precision copy of a weight outlives its tile; an expert is one tile. What is quantised:
attention q/k/v/o, the dense MLP, the MoE experts (most of the bytes). Embeddings (the tied LM
head), routers, norms, the self-conditioning MLP and the vision tower stay in the model dtype.

Do not `.to(dtype)` a model holding these modules: fp8 parts are floating point and would be cast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .formats import QTensor, dequantize, quantize

TILE_ELEMENTS = 1 << 21  # weights dequantised at once by a linear (8 MB in float32)


class QuantWeight(nn.Module):
    """A quantised weight [..., out, in]: its parts as buffers, and how to read them back."""

    def __init__(self, q: QTensor):
        super().__init__()
        self.scheme, self.shape, self.group_size = q.scheme, tuple(q.shape), q.group_size
        for name, tensor in q.parts.items():
            self.register_buffer(name, tensor)

    @property
    def qtensor(self) -> QTensor:
        return QTensor(self.scheme, self.shape, dict(self.named_buffers(recurse=False)), self.group_size)

    @property
    def nbytes(self) -> int:
        return self.qtensor.nbytes

    def extra_repr(self) -> str:
        return f"{self.scheme}, shape={self.shape}, group_size={self.group_size}"


class QuantLinear(QuantWeight):
    """x @ W.T for a quantised W [out, in], a tile of output channels at a time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, (out_features, in_features) = self.qtensor, self.shape
        rows = max(1, min(out_features, TILE_ELEMENTS // in_features))
        if rows >= out_features:
            return F.linear(x, dequantize(q, x.dtype))
        out = x.new_empty(*x.shape[:-1], out_features)
        for start in range(0, out_features, rows):
            end = min(out_features, start + rows)
            out[..., start:end] = F.linear(x, dequantize(q.rows(start, end), x.dtype))
        return out


class QuantExperts(nn.Module):
    """The MoE experts with quantised gate_up [E, 2I, H] and down [E, H, I]: tokens sorted by
    expert, each expert's weights dequantised once for all of its tokens."""

    def __init__(self, gate_up: QTensor, down: QTensor, approximate: str):
        super().__init__()
        self.num_experts = gate_up.shape[0]
        self.approximate = approximate
        self.gate_up_proj = QuantWeight(gate_up)
        self.down_proj = QuantWeight(down)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        routed = x[perm // top_k]
        weights = top_k_weights.reshape(-1)[perm]
        counts = torch.bincount(expert_ids, minlength=self.num_experts).tolist()
        gate_up, down = self.gate_up_proj.qtensor, self.down_proj.qtensor
        out = torch.empty(routed.shape[0], self.down_proj.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = routed[start : start + n]
                gate, up = F.linear(rows, dequantize(gate_up.select(e), x.dtype)).chunk(2, dim=-1)
                out[start : start + n] = F.linear(F.gelu(gate, approximate=self.approximate) * up, dequantize(down.select(e), x.dtype))
            start += n
        out = out * weights.unsqueeze(-1).to(out.dtype)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        return out[inverse].view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


LINEAR_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def quantize_layer(layer: nn.Module, scheme: str, group_size: int | None) -> None:
    """Replace one text layer's linears and experts by quantised ones, in place (each weight is
    quantised and its full-precision tensor dropped before the next)."""
    dtype = layer.input_layernorm.weight.dtype
    for path in LINEAR_TARGETS:
        parent_name, _, child = path.rpartition(".")
        parent = layer.get_submodule(parent_name)
        linear = getattr(parent, child)
        if isinstance(linear, nn.Linear):
            parent._modules[child] = QuantLinear(quantize(linear.weight.detach(), scheme, group_size, dtype))
    experts = layer.experts
    if not isinstance(experts, QuantExperts):
        gate_up = quantize_stacked(lambda e: experts.gate_up_proj[e].detach(), experts.num_experts, scheme, group_size, dtype)
        down = quantize_stacked(lambda e: experts.down_proj[e].detach(), experts.num_experts, scheme, group_size, dtype)
        layer._modules["experts"] = QuantExperts(gate_up, down, experts.approximate)


def quantize_model(net: nn.Module, scheme: str, group_size: int | None) -> nn.Module:
    """Quantise every text layer of a DiffusionGemma in place, layer by layer; returns it."""
    for layer in net.layers:
        quantize_layer(layer, scheme, group_size)
    net.quantization = (scheme, group_size)
    return net


def weight_bytes(net: nn.Module) -> dict[str, int]:
    """Resident bytes of the model's weights by part: experts, attention, dense MLP, embeddings, other."""
    out = {"experts": 0, "attention": 0, "dense": 0, "embeddings": 0, "other": 0}
    for name, tensor in list(net.named_parameters()) + list(net.named_buffers()):
        size = tensor.numel() * tensor.element_size()
        kind = ("experts" if ".experts." in name else "attention" if ".self_attn." in name
                else "dense" if ".mlp." in name else "embeddings" if name.startswith("embed_tokens") else "other")  # fmt: skip
        out[kind] += size
    return out


def quantize_stacked(
    matrix, count: int, scheme: str, group_size: int | None, scale_dtype: torch.dtype = torch.float32
) -> QTensor:
    """Quantise `count` matrices (`matrix(i)`, e.g. one expert each) into one QTensor with a leading
    dim, written into tensors allocated once: one full-precision matrix exists at a time, and no
    list of parts is stacked (which would hold the quantised experts twice)."""
    first = quantize(matrix(0), scheme, group_size, scale_dtype)
    parts = {k: v.new_empty((count, *v.shape)) for k, v in first.parts.items() if k != "weight_shape"}
    for i in range(count):
        q = first if i == 0 else quantize(matrix(i), scheme, group_size, scale_dtype)
        for k, dest in parts.items():
            dest[i] = q.parts[k]
    if "weight_shape" in first.parts:
        parts["weight_shape"] = first.parts["weight_shape"]
    return QTensor(scheme, (count, *first.shape), parts, first.group_size)


@torch.no_grad()
def random_quantized_model(config, scheme: str, group_size: int | None, dtype: torch.dtype, seed: int = 0, std: float = 0.02):
    """A DiffusionGemma with random weights built directly quantised: each matrix (each expert) is
    drawn, quantised and dropped before the next, so memory holds the quantised model plus one
    matrix; the parts that stay unquantised are drawn in `dtype` (benchmarks of the real size)."""
    from ..model.diffusion_gemma import DiffusionGemma

    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    with torch.device("meta"):
        net = DiffusionGemma(config)
    for name, p in list(net.named_parameters()):
        if name.startswith("layers.") and (".experts." in name or any(f".{t}." in name for t in LINEAR_TARGETS)):
            continue  # drawn quantised below
        value = (draw(*p.shape) if p.dim() >= 2 else torch.ones(p.shape)).to(dtype)
        module_name, _, attr = name.rpartition(".")
        net.get_submodule(module_name)._parameters[attr] = nn.Parameter(value, requires_grad=False)
    for name, b in list(net.named_buffers()):
        module_name, _, attr = name.rpartition(".")
        net.get_submodule(module_name)._buffers[attr] = torch.ones(b.shape, dtype=dtype)
    for layer in net.layers:
        for path in LINEAR_TARGETS:
            parent_name, _, child = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, child)
            if linear is not None:
                parent._modules[child] = QuantLinear(quantize(draw(*linear.weight.shape), scheme, group_size, dtype))
        e, two_i, h = layer.experts.gate_up_proj.shape
        gate_up = quantize_stacked(lambda _: draw(two_i, h), e, scheme, group_size, dtype)
        down = quantize_stacked(lambda _: draw(h, two_i // 2), e, scheme, group_size, dtype)
        layer._modules["experts"] = QuantExperts(gate_up, down, layer.experts.approximate)
    net.quantization = (scheme, group_size)
    return net.eval()

"""The engine's copy of the model for the Triton path (`EngineOptions.triton`, chosen by the runner):
every tensor shared with the original, two kinds of module swapped for ones that call the Triton
kernels of kernels/triton_layer.py:

- `TritonAttention`: q, k and v's RMSNorm and RoPE in one pass each (`norm_rope`) instead of the
  norm, the cast and the rotate-half chain; attention itself is the cache pass's (the paged canvas
  kernel for decoder passes). The K/V write into the pool stays the cache's `index_copy_`.
- `TritonExperts`: the MoE block with device-side offsets, the fused gelu * up and the weighted
  top-k sum (`moe_experts`). Quantised experts keep their own module (quant/modules.py, whose GPU
  path is kernels/triton_quant.py).

The reference-exact paths never see this copy.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.diffusion_gemma import Attention, DiffusionGemma, Experts
from . import triton_layer
from .cpu import _swap_in, _tree_copy


class TritonAttention(nn.Module):
    def __init__(self, attn: Attention):
        super().__init__()
        self.attn = attn
        self.spec = attn.spec  # what the stack reads of its layers' attention (the RoPE table per kind)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, cache_pass) -> torch.Tensor:
        a = self.attn
        b, t, _ = x.shape
        d = a.spec.head_dim
        cos, sin = cos.reshape(b * t, d), sin.reshape(b * t, d)
        flat = x.reshape(b * t, -1)
        q = triton_layer.norm_rope(a.q_proj(flat).view(b * t, -1, d), a.q_norm.weight, cos, sin, a.q_norm.eps)
        k_raw = a.k_proj(flat).view(b * t, -1, d)
        v_raw = a.v_proj(flat).view(b * t, -1, d) if a.v_proj is not None else k_raw
        k = triton_layer.norm_rope(k_raw, a.k_norm.weight, cos, sin, a.k_norm.eps)
        v = triton_layer.norm_rope(v_raw, None, None, None, a.v_norm.eps)

        def heads(y: torch.Tensor) -> torch.Tensor:  # [B*T, heads, D] -> [B, heads, T, D]
            return y.view(b, t, -1, d).transpose(1, 2)

        out = cache_pass.attention(layer, a.spec.is_sliding, heads(q), heads(k), heads(v))
        return a.o_proj(out.reshape(b, t, -1))


class TritonExperts(nn.Module):
    def __init__(self, experts: Experts):
        super().__init__()
        self.experts = experts

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return triton_layer.moe_experts(self.experts, x, top_k_index, top_k_weights)


def _triton_module(module: nn.Module) -> nn.Module | None:
    if isinstance(module, Attention):
        return TritonAttention(module)
    if type(module) is Experts:
        return TritonExperts(module)
    return None


@torch.no_grad()
def triton_modules(net: DiffusionGemma) -> DiffusionGemma:
    """A copy of `net` (sharing every tensor) whose attention and experts run the Triton kernels;
    modules with hooks (LoRA adapters) stay as they are."""
    fast = _tree_copy(net)
    for layer in fast.layers:
        _swap_in(layer, _triton_module)
    return fast

"""Layers the text stack and the vision tower share: RMSNorm and the gated MLP's body.

Their own module so that diffusion_gemma.py (which builds the vision tower) and vision.py (which
uses them) both import them from here, and neither imports the other back. Arithmetic follows
`transformers` operation for operation (RMSNorm via pow(-0.5) in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def gated_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(gelu(gate(x)) * up(x)): the dense MLP's and the self-conditioning MLP's body."""
    return mlp.down_proj(F.gelu(mlp.gate_proj(x), approximate=mlp.approximate) * mlp.up_proj(x))


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; `with_scale=False` is the scale-free variant (v_norm, router)."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)

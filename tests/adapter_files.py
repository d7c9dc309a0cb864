"""Random LoRA adapters in PEFT's format for a base config (non-zero A and B, so that an adapter
changes what the model computes), and the same adapter merged into a copy of the base (the
adapters', engine and server tests share them)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from dgemma.kernels.lora import site_shapes
from dgemma.train import lora

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def adapter_tensors(config, rank: int = 4, seed: int = 0, sites=ATTENTION + MLP, std: float = 0.05) -> dict:
    """dgemma-named lora_A / lora_B tensors for every linear of `sites` the base has."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (k, n) in site_shapes(config).items():
        if not name.endswith(sites):
            continue
        out[f"{name}.lora_A.weight"] = torch.randn(rank, k, generator=gen) * std
        out[f"{name}.lora_B.weight"] = torch.randn(n, rank, generator=gen) * std
    return out


def write_adapter(
    path: Path, config, rank: int = 4, alpha: float = 8.0, seed: int = 0, sites=ATTENTION + MLP, std: float = 0.05
) -> Path:
    """A PEFT-format adapter directory at `path`."""
    return lora.write_adapters(path, adapter_tensors(config, rank, seed, sites, std), rank, alpha)


def merged(net, path: Path):
    """A deep copy of `net` with the adapter at `path` folded into its weights (float32)."""
    found = lora.read_adapters(path)
    out = copy.deepcopy(net)
    modules = dict(out.named_modules())
    with torch.no_grad():
        for name in found.names:
            a, b = found.tensors[f"{name}.lora_A.weight"], found.tensors[f"{name}.lora_B.weight"]
            w = modules[name].weight
            w.copy_((w.float() + found.scale * (b.float() @ a.float())).to(w.dtype))
    return out

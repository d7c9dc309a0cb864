"""LoRA adapters, our own (peft depends on transformers, which dgemma never imports at run time).

An adapter is a child module `lora` of an `nn.Linear` plus a forward hook adding
`B(A(x)) * alpha / r`, so the base weight keeps its name and checkpoint mapping, and merging is
`W += alpha / r * B @ A`. B starts at zero: an adapted model starts as the base model.

Default targets are the attention projections and the dense MLP of every layer; everything
else, the router and the experts included, stays frozen (the published LoRA recipe).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from ..model.layout import save_safetensors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TARGET_GROUPS = {
    "attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "mlp": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
}
DEFAULT_TARGETS = ("attention", "mlp")


class LoRA(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.scale = alpha / rank
        a = torch.empty(rank, in_features)
        bound = 1.0 / math.sqrt(in_features)  # the scale nn.Linear's default init gives
        a.uniform_(-bound, bound, generator=generator)
        self.A = nn.Parameter(a)
        self.B = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x.to(self.A.dtype), self.A), self.B) * self.scale

    def delta(self) -> torch.Tensor:
        """The weight update this adapter stands for: alpha / r * B @ A (float32)."""
        return (self.B.float() @ self.A.float()) * self.scale


def _add_lora(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + module.lora(inputs[0]).to(output.dtype)


def resolve_targets(targets: str | tuple[str, ...] | list[str] = DEFAULT_TARGETS) -> tuple[str, ...]:
    """Group names ("attention", "mlp") or module-name suffixes -> module-name suffixes."""
    if isinstance(targets, str):
        targets = tuple(t.strip() for t in targets.split(",") if t.strip())
    out: list[str] = []
    for t in targets:
        out += TARGET_GROUPS.get(t, (t,))
    return tuple(out)


def target_modules(net: nn.Module, targets: tuple[str, ...]) -> dict[str, nn.Linear]:
    """The Linear layers inside `net.layers` whose names end with one of `targets`."""
    found = {
        name: m
        for name, m in net.named_modules()
        if isinstance(m, nn.Linear) and name.startswith("layers.") and name.endswith(targets)
    }
    if not found:
        raise ValueError(f"no Linear layer matches the LoRA targets {', '.join(targets)}")
    return found


def apply_lora(
    net: nn.Module, rank: int, alpha: float | None = None, targets=DEFAULT_TARGETS, seed: int = 0
) -> list[str]:
    """Freeze `net` and attach rank-`rank` adapters to the target layers; returns their names."""
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    alpha = float(alpha if alpha is not None else 2 * rank)
    for p in net.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    names = []
    for name, linear in target_modules(net, resolve_targets(targets)).items():
        if hasattr(linear, "lora"):
            raise ValueError(f"{name} already has a LoRA adapter")
        w = linear.weight
        linear.lora = LoRA(linear.in_features, linear.out_features, rank, alpha, gen).to(w.device)
        linear._lora_hook = linear.register_forward_hook(_add_lora)
        names.append(name)
    net.lora_config = {"r": rank, "lora_alpha": alpha, "target_modules": names}
    return names


def adapters(net: nn.Module) -> dict[str, LoRA]:
    return {name[: -len(".lora")]: m for name, m in net.named_modules() if isinstance(m, LoRA)}


def adapter_tensors(state_dict: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Adapter tensors of a (full) state dict, renamed `<linear>.lora_A.weight` / `.lora_B.weight`."""
    out = {}
    for key, t in state_dict.items():
        if key.startswith(prefix) and (key.endswith(".lora.A") or key.endswith(".lora.B")):
            name, which = key[len(prefix) : -len(".lora.A")], key[-1]
            out[f"{name}.lora_{which}.weight"] = t.detach().float().cpu().contiguous()
    return out


def adapter_state_dict(net: nn.Module) -> dict[str, torch.Tensor]:
    return adapter_tensors(net.state_dict())


def write_adapters(path: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Write adapter_config.json and adapter_model.safetensors (the adapters alone, a few MB)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / ADAPTER_CONFIG).write_text(json.dumps({"format": "dgemma-lora", **config}, indent=2) + "\n")
    save_safetensors(tensors, path / ADAPTER_WEIGHTS)
    return path


def save_adapters(net: nn.Module, path: str | Path, base_model: str | None = None) -> Path:
    return write_adapters(path, adapter_state_dict(net), {**net.lora_config, "base_model": base_model})


def merged_state_dict(state_dict: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A state dict with every `<linear>.lora.{A,B}` pair folded into `<linear>.weight` (new tensors)."""
    out = {k: v for k, v in state_dict.items() if not (k.endswith(".lora.A") or k.endswith(".lora.B"))}
    for key in [k for k in state_dict if k.endswith(".lora.A")]:
        name = key[: -len(".lora.A")]
        w = out[name + ".weight"]
        delta = state_dict[name + ".lora.B"].float() @ state_dict[key].float() * scale
        out[name + ".weight"] = (w.float() + delta).to(w.dtype)
    return out


def load_adapters(net: nn.Module, path: str | Path) -> list[str]:
    """Attach the adapters saved at `path` to `net` (same architecture as the one they were trained on)."""
    path = Path(path)
    try:
        cfg = json.loads((path / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
    except FileNotFoundError as e:
        raise ValueError(f"no LoRA adapter in {path}: {e.filename} is missing") from None
    names = cfg["target_modules"]
    if not adapters(net):
        apply_lora(net, int(cfg["r"]), float(cfg["lora_alpha"]), tuple(names))
    found = adapters(net)
    if sorted(found) != sorted(names):
        raise ValueError(f"{path}: adapters do not match the model's LoRA layers")
    with torch.no_grad():
        for name, m in found.items():
            a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
            if a.shape != m.A.shape or b.shape != m.B.shape:
                raise ValueError(f"{path}: adapter {name} has shape {tuple(a.shape)}, expected {tuple(m.A.shape)}")
            m.A.copy_(a)
            m.B.copy_(b)
    return names


@torch.no_grad()
def merge_lora(net: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and remove it: a plain model again, savable as a checkpoint."""
    for linear in target_modules(net, ("",)).values():
        if not hasattr(linear, "lora"):
            continue
        linear.weight.copy_((linear.weight.float() + linear.lora.delta()).to(linear.weight.dtype))
        linear._lora_hook.remove()
        del linear._lora_hook
        del linear.lora
    if hasattr(net, "lora_config"):
        del net.lora_config
    return net

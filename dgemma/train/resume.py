"""Resumable training checkpoints: where a run keeps them, what they hold, and reading them back.

A checkpoint is `DIR/checkpoints/step-NNNNNN/`: the model in the HF layout (or a LoRA run's
adapters) plus `trainer_state.pt`, which holds the step, the full optimizer state and the run's
arguments as plain dicts, lists, numbers and tensors (no dgemma class is pickled, so a checkpoint
keeps loading when modules move). It is written to a hidden sibling and renamed into place, so a
kill during a save leaves the previous checkpoint intact; the newest `--keep` are kept.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ..config import ModelConfig
from ..model.diffusion_gemma import DiffusionGemma
from . import lora

STATE_FILE = "trainer_state.pt"


def checkpoint_dir(out: Path, step: int) -> Path:
    """Where the checkpoint of `step` of the run writing to `out` lives."""
    return out / "checkpoints" / f"step-{step:06d}"


def staging_dir(target: Path) -> Path:
    """The hidden sibling a checkpoint is written to before it is renamed to `target`."""
    return target.with_name(f".{target.name}.tmp")


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint of the run writing to `out`, or None."""
    ckpts = sorted((out / "checkpoints").glob("step-*/" + STATE_FILE))
    return ckpts[-1].parent if ckpts else None


def full_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, world: int):
    """Full (unsharded, CPU) model and optimizer state dicts; collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=world > 1)
    model_sd = get_model_state_dict(module, options=opts)
    optim_sd = get_optimizer_state_dict(module, optimizer, options=opts) if optimizer is not None else None
    return model_sd, optim_sd


def cpu_net(config: ModelConfig, model_sd: dict[str, torch.Tensor], lora_scale: float | None = None) -> DiffusionGemma:
    """A plain DiffusionGemma from the `net.*` tensors of a full state dict, LoRA adapters folded in."""
    sd = {k[len("net.") :]: v for k, v in model_sd.items() if k.startswith("net.")}
    if lora_scale is not None:
        sd = lora.merged_state_dict(sd, lora_scale)
    with torch.device("meta"):
        net = DiffusionGemma(config)
    net.load_state_dict(sd, assign=True)
    return net.eval()


def write_state(directory: Path, step: int, optimizer_state: dict, args: dict) -> None:
    """The trainer's part of a checkpoint: the step, the optimizer state and the run's arguments."""
    torch.save({"step": step, "optimizer": optimizer_state, "args": args}, directory / STATE_FILE)


def publish(staged: Path, target: Path, keep: int) -> None:
    """Rename a fully written checkpoint into place, then drop all but the newest `keep`."""
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staged, target)
    ckpts = sorted(target.parent.glob("step-*"))
    for old in ckpts[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def checkpoint_args(ckpt: Path) -> dict:
    """The arguments of the run that wrote `ckpt` (read before the model, to check a resume
    matches it; memory-mapped, so the optimizer state is not read)."""
    state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    return dict(state.get("args") or {})


def restore_optimizer(module: torch.nn.Module, optimizer: torch.optim.Optimizer, ckpt: Path) -> int:
    """Load a checkpoint's optimizer state into `optimizer` (sharded or not); returns its step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
    set_optimizer_state_dict(module, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    return int(state["step"])

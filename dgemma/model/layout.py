"""A checkpoint directory's layout: which files hold the weights, how tensors are named on disk,
and how a safetensors file is written.

The facts both loading (model/weights.py) and the quantised-checkpoint code (quant/) need; both
import them from here, so neither imports the other back. Names on disk are the `transformers`
ones: `model.decoder.*` for the text stack, `model.encoder.language_model.layers.N.layer_scalar`
for the encoder's own scalars, `model.encoder.{vision_tower,embed_vision}.*` for the vision tower.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DECODER = "model.decoder."
ENCODER_SCALAR = "model.encoder.language_model.layers.{}.layer_scalar"
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


class WeightsError(ValueError):
    """A checkpoint's weights are missing, misshapen or unreadable."""


def checkpoint_name(param_name: str) -> str:
    """dgemma parameter name -> name on disk."""
    if param_name.endswith(".encoder_layer_scalar"):
        layer = param_name.split(".")[1]
        return ENCODER_SCALAR.format(layer)
    if param_name.startswith("vision."):
        return "model.encoder." + param_name[len("vision.") :]
    return DECODER + param_name


def natural_key(name: str) -> list:
    """Sort key putting layers.10 after layers.9."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def weight_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the file holding it (single file or sharded with an index)."""
    index = path / INDEX_FILE
    single = path / SINGLE_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index: {e}") from None
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.exists():
                raise WeightsError(f"missing shard {shard.name} (listed in {index.name})")
        return files
    if single.exists():
        try:
            with safe_open(single, framework="pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:  # safetensors raises its own error types
            raise WeightsError(f"cannot read {single}: {e}") from None
    raise WeightsError(f"no weights in {path}: expected {SINGLE_FILE} or {INDEX_FILE}")


def _umask() -> int:
    """This process's umask (read, not changed, where /proc says it: changing it races other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, torch.Tensor], target: str | Path) -> Path:
    """safetensors' save_file, then the mode any new file gets (0644 under umask 022):
    save_file writes through a private temporary file, which would leave the weights at 0600
    beside a checkpoint's other files."""
    target = Path(target)
    save_file(tensors, str(target), metadata={"format": "pt"})
    os.chmod(target, 0o666 & ~_umask())
    return target

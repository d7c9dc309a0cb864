"""The device and the dtype a model loads in: the one place "auto" is resolved, for `dgemma.load`
and every command (`--device`, `--dtype`), and the hub's fit check (which plans in that dtype)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# No checkpoint to ask (bench's random --size weights): the released model's dtype.
RELEASE_DTYPE = torch.bfloat16


def resolve_dtype(
    requested: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    checkpoint_dir: str | Path | None = None,
) -> torch.dtype:
    """The dtype the weights are loaded in: the one every command and `dgemma.load` use.

    An explicit dtype (a torch.dtype or one of DTYPES' names) always wins. "auto" (or None): the
    checkpoint's stored dtype (`model.weights.stored_dtype`: config.json, else the safetensors
    headers; bf16 for the released model) on every device: what CUDA graphs and the fast grouped
    matmuls run, and on a CPU as fast as float32 at half the memory (the released model in float32
    would need ~104 GB). float32 when the checkpoint says nothing, and for a float16 checkpoint on a
    CPU (the CPU kernels take bf16 or float32); bfloat16 with no checkpoint (random weights). Tests
    that compare against float32 references ask for float32. A pure function of its arguments and
    the files: no GPU is needed to ask it."""
    if isinstance(requested, torch.dtype):
        if requested not in DTYPES.values():
            raise ValueError(f"unsupported dtype {requested}; choose one of float32, bfloat16, float16")
        return requested
    if requested is None or requested == "auto":
        if checkpoint_dir is None:
            return RELEASE_DTYPE
        from .model.weights import stored_dtype

        stored = stored_dtype(checkpoint_dir) or torch.float32
        if stored == torch.float16 and _device_type(device) != "cuda":
            return torch.float32
        return stored
    if requested not in DTYPES:
        raise ValueError(f"unsupported dtype {requested!r}; choose one of float32, bfloat16, float16 or auto")
    return DTYPES[requested]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def _device_type(device: str | torch.device) -> str:
    """ "cuda" for "cuda", "cuda:1", torch.device("cuda", 1); the type of any other device name."""
    if isinstance(device, torch.device):
        return device.type
    return str(device).split(":", 1)[0].strip()


def parse_device(device: str | torch.device) -> torch.device | str:
    """`device` checked for form (not for being present): a torch.device, or "auto". ValueError,
    one line, for "cuda:x", "cuda:-1" or a name torch does not know."""
    if isinstance(device, torch.device):
        return device
    text = str(device).strip()
    if text == "auto":
        return text
    if text.split(":", 1)[0] == "cuda":
        index = text[len("cuda:") :] if text.startswith("cuda:") else None
        if text != "cuda" and (index is None or re.fullmatch(r"-?[0-9]+", index) is None):
            raise ValueError(f"unknown device {text!r}: a GPU is cuda or cuda:N with N a device index (0, 1, ...)")
        if index is not None and int(index) < 0:
            raise ValueError(f"device {text!r}: the device index must be 0 or more")
        return torch.device("cuda", int(index)) if index is not None else torch.device("cuda")
    try:
        return torch.device(text)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {text!r}: use cpu, cuda, cuda:N or auto") from None


def resolve_device(device: str | torch.device) -> torch.device:
    """The device to load on: `parse_device`'s, "auto" = cuda when torch sees a GPU, else cpu;
    ValueError when CUDA is asked for and absent, or its index is past the devices there are."""
    dev = parse_device(device)
    if dev == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} requested, but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"device {str(device)!r} requested, but this machine has {count} CUDA device"
                f"{'s' * (count != 1)} (cuda:0 .. cuda:{count - 1})"
            )
    return dev

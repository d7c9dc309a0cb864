"""`dgemma merge-lora --quantization SCHEME`: adapters trained on a quantised base (QLoRA) folded
into a quantised checkpoint that `dgemma run` loads as it loads any other.

The adapters learned against the base as the quantised model held it, dequantise(quantise(W)),
not against W. So each adapted weight is quantised as loading quantises it (per tensor, the
scheme and group size of the run), dequantised, given alpha / r * B @ A in float32, and quantised
again by `dgemma quantize`'s writer, a tensor at a time: memory holds one weight, never the model.
Re-quantising rounds the sum to the scheme's grid again, so a delta smaller than half a step is
lost where the unmerged model keeps it: `dgemma merge-lora` then measures what merging cost
(cli/train.py's `closeness`, on one canvas).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..model.layout import checkpoint_name
from ..quant.formats import dequantize, quantize
from ..quant.quant_config import check_group_size
from ..quant.tensor_sources import TensorReader
from ..quant.write import copy_side_files, write_quantized_from
from .lora import AdapterError, AdapterFile, read_adapters


class MergedTensors:
    """A full-precision checkpoint's tensors (TensorReader's interface, read one at a time) with
    the adapters folded into their weights as the quantised base held them (see the module)."""

    def __init__(self, reader: TensorReader, adapter: AdapterFile, scheme: str, group_size: int | None):
        self.reader, self.files, self.scheme, self.group_size = reader, reader.files, scheme, group_size
        self.scale = adapter.scale
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name in adapter.names:
            disk = checkpoint_name(name + ".weight")
            if disk not in reader.files:
                raise AdapterError(f"the adapter targets {name}, which the base checkpoint does not have")
            a, b = adapter.tensors[f"{name}.lora_A.weight"], adapter.tensors[f"{name}.lora_B.weight"]
            if (b.shape[0], a.shape[1]) != reader.shape(disk):
                raise AdapterError(
                    f"the adapter's {name} is {b.shape[0]} x {a.shape[1]}; the base's weight is "
                    f"{' x '.join(map(str, reader.shape(disk)))}: an adapter of another model"
                )
            self.pairs[disk] = (a, b)

    def get(self, name: str) -> torch.Tensor:
        tensor = self.reader.get(name)
        if name not in self.pairs:
            return tensor
        a, b = self.pairs[name]
        held = dequantize(quantize(tensor, self.scheme, self.group_size, tensor.dtype))  # as the QLoRA base held it
        return (held + (b.float() @ a.float()) * self.scale).to(tensor.dtype)

    def get_index(self, name: str, index: int) -> torch.Tensor:
        return self.reader.get_index(name, index)  # experts: never adapted (train/lora.py refuses them)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(name)

    def close(self) -> None:
        self.reader.close()


def merge_quantized(
    base: str | Path,
    adapter_dir: str | Path,
    out: str | Path,
    scheme: str,
    group_size: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write `base` with the adapters at `adapter_dir` folded in, quantised to `scheme`, to `out`."""
    base, group_size = Path(base), check_group_size(scheme, group_size)
    config = json.loads((base / "config.json").read_text())
    if "quantization_config" in config:
        raise AdapterError(
            f"{base} is already quantised: merge-lora --quantization reads the full-precision base the run was "
            "quantised from (its weights are quantised as the run held them, merged, and quantised again)"
        )
    adapter = read_adapters(adapter_dir)
    source = MergedTensors(TensorReader(base), adapter, scheme, group_size)
    return write_quantized_from(
        source, config, out, scheme, group_size, side_files=lambda d: copy_side_files(base, d), progress=progress
    )

"""Sources of a checkpoint's full-precision tensors by their names on disk, read one at a time:
a checkpoint directory's memory-mapped files (`TensorReader`) or random tensors drawn when asked
(`RandomTensors`, the same interface), so the quantiser streams either without holding a model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import safe_open

from ..model.layout import WeightsError, checkpoint_name, weight_files


class TensorReader:
    """Tensors of a checkpoint directory, read one at a time from their memory-mapped files."""

    def __init__(self, path: Path):
        self.files = weight_files(path)
        self.handles: dict[Path, object] = {}

    def _handle(self, name: str):
        f = self.files[name]
        if f not in self.handles:
            try:
                self.handles[f] = safe_open(f, framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise WeightsError(f"cannot read {f}: {e}") from None
        return self.handles[f]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def get_index(self, name: str, index: int) -> torch.Tensor:
        """tensor[index] of a tensor's leading dim, without reading the rest (one expert)."""
        return self._handle(name).get_slice(name)[index]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def close(self) -> None:
        self.handles.clear()


class RandomTensors:
    """A full-precision checkpoint that is not on disk: each tensor (each expert) is drawn when it
    is read, normal(0, std) for matrices and ones for vectors, the same for the same name and
    seed. `dgemma quantize --size real` streams the released model's size through the quantiser
    with it, without its ~52 GB of weights. The interface is TensorReader's."""

    def __init__(self, config, dtype: torch.dtype = torch.bfloat16, seed: int = 0, std: float = 0.02):
        from ..model.diffusion_gemma import DiffusionGemma

        with torch.device("meta"):
            net = DiffusionGemma(config)
        tensors = list(net.named_parameters()) + list(net.named_buffers())
        self.shapes = {checkpoint_name(name): tuple(t.shape) for name, t in tensors}
        self.files = dict.fromkeys(self.shapes)  # the names, as TensorReader.files has them
        self.dtype, self.seed, self.std = dtype, seed, std

    def _draw(self, name: str, shape: tuple[int, ...], index: int | None = None) -> torch.Tensor:
        if len(self.shapes[name]) < 2:
            return torch.ones(shape, dtype=self.dtype)
        key = f"{self.seed}:{name}:{index}".encode()
        gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
        return (torch.randn(shape, generator=gen) * self.std).to(self.dtype)

    def get(self, name: str) -> torch.Tensor:
        return self._draw(name, self.shapes[name])

    def get_index(self, name: str, index: int) -> torch.Tensor:
        return self._draw(name, self.shapes[name][1:], index)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def close(self) -> None:
        pass

"""What a device must hold to serve a model: weights (by quantisation scheme), the KV pool, and the
step buffers at the chosen batch. Whether that fits a device, and what would fit if not, is
hub/fit.py's (`check_fit`: every load, a hub id before its download, `dgemma memory --card`).

Pure arithmetic on the config (parameters counted on the meta device, nothing allocated), so a
plan can be refused before a byte is loaded or downloaded, and `dgemma memory --card` prints the
same plan anywhere. The figures are estimates of what is allocated, not measurements:
weights exactly as the formats store them (compressed-tensors layouts: float32 per-channel
scales, int4 group scales in the model's dtype), a KV pool holding one request of the context
(sliding layers: their window), step buffers from the tensors a decoder pass and a prefill chunk
create at their largest, and a fixed reserve for the CUDA context and allocator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import SLIDING, ModelConfig
from .kv_budget import dtype_bytes
from .paged_cache import kv_bytes_per_token
from .turbo import canvas_kv_bytes

RESERVE = int(1.5 * 2**30)  # CUDA context, cuBLAS / Triton workspaces, allocator slack
QUANTISED = ("experts", "attention", "dense")  # the parts a scheme quantises (quant/modules.py)


@dataclass(frozen=True)
class MemoryPlan:
    weights: dict[str, int]  # bytes by part: experts, attention, dense, embeddings, other
    kv_cache: int
    step_buffers: int
    reserve: int
    scheme: str | None
    batch: int
    context: int

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.kv_cache + self.step_buffers + self.reserve

    def describe(self) -> str:
        gib = 2**30
        w = sum(self.weights.values())
        return (f"weights {w / gib:.1f} GiB ({self.scheme or 'unquantised'}), KV cache {self.kv_cache / gib:.1f} GiB, "
                f"step buffers {self.step_buffers / gib:.1f} GiB (batch {self.batch}), reserve "
                f"{self.reserve / gib:.1f} GiB: {self.total / gib:.1f} GiB")  # fmt: skip


def parameter_counts(config: ModelConfig) -> dict[str, dict[str, tuple[int, int, int]]]:
    """The text stack's matrices by part, counted on the meta device: part -> name -> (rows, cols,
    count) (experts: one expert's matrix, count the experts), plus part "other" as
    {name: (numel, 1, 1)} for vectors, buffers and whatever is not a quantisable matrix (the
    attention's norms included)."""
    from ..model.diffusion_gemma import DiffusionGemma

    with torch.device("meta"):
        net = DiffusionGemma(config)
    parts: dict[str, dict[str, tuple[int, int, int]]] = {"experts": {}, "attention": {}, "dense": {}, "embeddings": {}, "other": {}}
    for name, p in list(net.named_parameters()) + list(net.named_buffers()):
        if name.startswith("layers.") and ".experts." in name:
            parts["experts"][name] = (p.shape[1], p.shape[2], p.shape[0])
        elif name.startswith("layers.") and ".self_attn." in name and name.endswith("_proj.weight"):
            parts["attention"][name] = (*p.shape, 1)
        elif name.startswith("layers.") and ".mlp." in name and name.endswith("_proj.weight"):
            parts["dense"][name] = (*p.shape, 1)
        elif name.startswith("embed_tokens"):
            parts["embeddings"][name] = (*p.shape, 1)
        else:
            parts["other"][name] = (p.numel(), 1, 1)
    return parts


def matrix_bytes(rows: int, cols: int, scheme: str | None, group_size: int | None, dtype_size: int) -> int:
    """Bytes of one [rows, cols] weight as the scheme stores it (formats.quantize: float32
    per-channel scales, group scales in the model's dtype)."""
    if scheme is None:
        return rows * cols * dtype_size
    if scheme in ("fp8", "int8"):  # a byte per value, a float32 scale per output channel
        return rows * cols + rows * 4
    if scheme == "int4":  # 8 values per int32, a scale per group
        return rows * cols // 2 + rows * math.ceil(cols / (group_size or 64)) * dtype_size
    if scheme == "nvfp4":  # 2 values per byte, an e4m3 scale per 16, a float32 global scale
        return rows * cols // 2 + rows * math.ceil(cols / 16) + 4
    raise ValueError(f"unknown quantisation scheme {scheme!r}")


def weight_bytes(config: ModelConfig, scheme: str | None, group_size: int | None, dtype: torch.dtype) -> dict[str, int]:
    size = dtype_bytes(dtype)
    out = {}
    for part, matrices in parameter_counts(config).items():
        quantised = scheme if part in QUANTISED else None
        out[part] = sum(n * matrix_bytes(r, c, quantised, group_size, size) + (8 if quantised == "int4" else 0)
                        for r, c, n in matrices.values())  # int4: its weight_shape (int32 [2]) once per tensor
    return out


def step_buffer_bytes(config: ModelConfig, batch: int, prefill_chunk: int, dtype: torch.dtype, turbo: bool = False) -> int:
    """The largest transient tensors of a step: a decoder pass over `batch` canvases (the LM head's
    [rows, vocab] output and the probabilities, in the model's dtype, plus the float32 statistics
    path's two [rows, vocab] tensors where the Triton kernels do not run) and the hidden states,
    the dense MLP's and the experts' intermediates of the larger of that pass and a prefill chunk.
    With `turbo`, each of the `batch` requests also holds its canvas K/V buffer (engine/turbo.py)."""
    size = dtype_bytes(dtype)
    canvas_kv = batch * canvas_kv_bytes(config, size) if turbo else 0
    rows = batch * config.canvas_length
    vocab_rows = rows * config.vocab_size * (2 * size + 2 * 4)
    tokens = max(rows, prefill_chunk)
    per_token = size * (
        6 * config.hidden_size
        + 3 * config.intermediate_size
        + config.top_k_experts * (3 * config.moe_intermediate_size + config.hidden_size)
        + 2 * config.num_heads * max(spec.head_dim for spec in config.layers)
    )
    return vocab_rows + tokens * per_token + canvas_kv


def kv_bytes(config: ModelConfig, requests: int, context: int, dtype: torch.dtype) -> int:
    """A KV pool that holds `requests` sequences of `context` positions (sliding layers: their window)."""
    per_token = kv_bytes_per_token(config, dtype_bytes(dtype))
    sliding = min(context, config.sliding_window + 2 * config.canvas_length)
    return requests * sum(per_token[kind] * (sliding if kind == SLIDING else context) for kind in per_token)


def plan_memory(
    config: ModelConfig,
    dtype: torch.dtype,
    scheme: str | None = None,
    group_size: int | None = None,
    batch: int = 8,
    context: int | None = None,
    kv_cache_memory: int | None = None,
    prefill_chunk: int = 2048,
    turbo: bool = False,
) -> MemoryPlan:
    """The memory to serve `batch` canvases at once with room for one request of `context`
    positions (default: max_position_embeddings), or a KV pool of `kv_cache_memory` bytes;
    `turbo`: every canvas with its canvas K/V buffer."""
    context = context or config.max_position_embeddings
    kv = kv_cache_memory if kv_cache_memory is not None else kv_bytes(config, 1, context, dtype)
    return MemoryPlan(
        weight_bytes(config, scheme, group_size, dtype), int(kv), step_buffer_bytes(config, batch, prefill_chunk, dtype, turbo),
        RESERVE, scheme, batch, context,
    )  # fmt: skip

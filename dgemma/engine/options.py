"""Engine settings, and how big the KV pools are (pure functions of the model's config and a memory budget)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..inputs.model_inputs import MAX_SOFT_TOKENS

from ..config import GLOBAL, SLIDING, ModelConfig
from .paged_cache import KINDS, kv_bytes_per_token, sliding_blocks_held

DEFAULT_PREFILL_CHUNK = 2048
SIZING_ACTIVE = 8  # requests the sliding pool is sized for when max_active is not set


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs; None fields take a default from the model and device (`resolve`).

    - block_size: positions per KV block (default: the canvas length).
    - kv_cache_memory: bytes for both KV pools (default: a quarter of free memory, at most what
      SIZING_ACTIVE requests of max_position_embeddings need).
    - prefix_cache: reuse cached blocks of earlier prompts and committed blocks.
    - prefill_chunk: prompt tokens encoded per engine step, across requests, so a long prompt is
      interleaved with other requests' decoder steps.
    - max_active: requests admitted at once (each denoises one canvas per step); None: as many
      as the KV blocks allow.
    - batch_invariant: a request's tokens do not depend on what runs beside it or on the prefix
      cache: passes run one request at a time and encoder passes are whole aligned blocks
      (default on CPU). Off: canvases run as one batched decoder pass (default on GPU).
    - cuda_graphs: capture decoder steps as CUDA graphs (default on CUDA; with the Triton
      kernels, one graph per batch-size bucket, replayed for any prefix length).
    - triton: the GPU step kernels (kernels/triton_step.py, triton_attention.py, triton_layer.py:
      full-vocab statistics, sampling from Philox streams on the device, paged canvas attention,
      fused norm + RoPE, the MoE pieces); default on CUDA where triton imports.
      True elsewhere runs them in Triton's interpreter (TRITON_INTERPRET=1: tests only).
    """

    block_size: int | None = None
    kv_cache_memory: int | None = None
    prefix_cache: bool = True
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_active: int | None = None
    batch_invariant: bool | None = None
    cuda_graphs: bool | None = None
    triton: bool | None = None

    def resolve(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> "EngineOptions":
        block = config.canvas_length if self.block_size is None else self.block_size
        if block < 1:
            raise ValueError(f"block_size must be >= 1 (got {block})")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 (got {self.prefill_chunk})")
        if self.max_active is not None and self.max_active < 1:
            raise ValueError(f"max_active must be >= 1 (got {self.max_active})")
        invariant = device.type == "cpu" if self.batch_invariant is None else self.batch_invariant
        # exact passes are whole blocks: a step encodes at least one
        chunk = max(self.prefill_chunk // block * block, block) if invariant else self.prefill_chunk
        memory = self.kv_cache_memory
        if memory is None:
            memory = default_kv_memory(config, dtype, device, self.max_active)
        elif memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive (got {memory})")
        graphs = device.type == "cuda" if self.cuda_graphs is None else self.cuda_graphs
        from ..kernels import triton_step

        kernels = self.triton
        if kernels is None:
            kernels = device.type == "cuda" and triton_step.available(device)
        elif kernels and not triton_step.available(device):
            raise ValueError(f"triton: the Triton step kernels need a CUDA device or TRITON_INTERPRET=1 (device {device})")
        return replace(self, block_size=block, prefill_chunk=chunk, kv_cache_memory=int(memory),
                       batch_invariant=invariant, cuda_graphs=graphs, triton=kernels)  # fmt: skip

    def max_span(self, config: ModelConfig) -> int:
        """Most positions a request encodes in one step: a prefill chunk, a committed canvas
        (plus the re-encoded partial block before it, with batch-invariant passes), or an image
        (a chunk that starts at an image takes all of it: see media.inputs.image_safe_end)."""
        commit = config.canvas_length + (self.block_size - 1 if self.batch_invariant else 0)
        image = MAX_SOFT_TOKENS if config.vision is not None else 0
        return max(self.prefill_chunk, commit, image)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def available_memory(device: torch.device) -> int | None:
    """Free memory the KV cache may draw from: MemAvailable on CPU (Linux), free memory on CUDA."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_kv_memory(config: ModelConfig, dtype: torch.dtype, device: torch.device, max_active: int | None) -> int:
    per_token = sum(kv_bytes_per_token(config, dtype_bytes(dtype)).values())
    enough = (max_active or SIZING_ACTIVE) * config.max_position_embeddings * per_token
    free = available_memory(device)
    share = 0.5 if device.type == "cuda" else 0.25  # the rest: weights, activations, the OS
    return int(min(enough, free * share)) if free else enough


def plan_blocks(config: ModelConfig, options: EngineOptions, dtype: torch.dtype) -> dict[str, int]:
    """Blocks per pool for a resolved `options`.

    Global blocks grow with a sequence, sliding ones are bounded by the window; so the sliding
    pool gets what `max_active` (or SIZING_ACTIVE) requests hold at most at once, twice over (the
    rest stays cached for prefix hits), and the global pool the remaining budget; when the
    budget is smaller than that, both get the same number of blocks.
    """
    b = options.block_size
    per_block = {k: v * b for k, v in kv_bytes_per_token(config, dtype_bytes(dtype)).items()}
    budget = options.kv_cache_memory
    peak = sliding_blocks_held(config.sliding_window, options.max_span(config), b)
    sliding_cap = 2 * (options.max_active or SIZING_ACTIVE) * peak
    if per_block[SLIDING] == 0 or per_block[GLOBAL] == 0:  # a model with one kind only
        kind = GLOBAL if per_block[GLOBAL] else SLIDING
        blocks = {kind: budget // per_block[kind], (SLIDING if kind == GLOBAL else GLOBAL): 0}
    else:
        equal = budget // (per_block[GLOBAL] + per_block[SLIDING])
        if equal <= sliding_cap:
            blocks = {GLOBAL: equal, SLIDING: equal}
        else:
            blocks = {SLIDING: sliding_cap, GLOBAL: (budget - sliding_cap * per_block[SLIDING]) // per_block[GLOBAL]}
    empty = [kind for kind, n in blocks.items() if n < 1 and per_block[kind]]
    if empty:
        raise ValueError(
            f"a KV cache of {budget} bytes holds no KV block of {empty[0]} layers (one block of {b} "
            f"positions in every layer takes {sum(per_block.values())} bytes)"
        )
    return blocks


def kv_report(config: ModelConfig, tokens: int, dtype: torch.dtype, block_size: int | None = None) -> dict:
    """KV bytes of one `tokens`-long request: the paged layout (sliding layers hold their window
    behind a committed canvas and the partial block before it, in whole blocks) against one
    preallocated row of every layer (the dense layout)."""
    b = block_size or config.canvas_length
    per_token = kv_bytes_per_token(config, dtype_bytes(dtype))
    global_blocks = math.ceil(tokens / b)
    sliding_blocks = min(global_blocks, sliding_blocks_held(config.sliding_window, config.canvas_length + b - 1, b))
    paged = {GLOBAL: global_blocks * b * per_token[GLOBAL], SLIDING: sliding_blocks * b * per_token[SLIDING]}
    dense = {kind: tokens * per_token[kind] for kind in KINDS}
    return {
        "tokens": tokens,
        "block_size": b,
        "bytes_per_token": per_token,
        "paged": paged,
        "paged_total": sum(paged.values()),
        "dense": dense,
        "dense_total": sum(dense.values()),
    }

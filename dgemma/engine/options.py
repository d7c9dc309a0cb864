"""Engine settings (`EngineOptions`), resolved once for a model, device and dtype (`resolve`).

How big the KV pools are is kv/budget.py's; which kernels run is kernels/choice.py's."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import ModelConfig
from ..inputs.model_inputs import MAX_SOFT_TOKENS
from .kv.budget import default_kv_memory

DEFAULT_PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs; None fields take a default from the model and device (`resolve`).

    - block_size: positions per KV block (default: the canvas length).
    - kv_cache_memory: bytes for both KV pools (default: half of the free memory on CUDA, a quarter on a CPU, at most what
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

    def resolve(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> EngineOptions:
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
        from ..kernels.choice import triton_runs

        kernels = triton_runs(device, self.triton)
        return replace(
            self,
            block_size=block,
            prefill_chunk=chunk,
            kv_cache_memory=int(memory),
            batch_invariant=invariant,
            cuda_graphs=graphs,
            triton=kernels,
        )

    def max_span(self, config: ModelConfig) -> int:
        """Most positions a request encodes in one step: a prefill chunk, a committed canvas
        (plus the re-encoded partial block before it, with batch-invariant passes), or an image
        (a chunk that starts at an image takes all of it: see media.inputs.image_safe_end)."""
        commit = config.canvas_length + (self.block_size - 1 if self.batch_invariant else 0)
        image = MAX_SOFT_TOKENS if config.vision is not None else 0
        return max(self.prefill_chunk, commit, image)

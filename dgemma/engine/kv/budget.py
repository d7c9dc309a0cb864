"""How big the KV pools are: pure functions of the model's config, the engine's options and a
memory budget (by default a share of the free memory: half on CUDA, a quarter on a CPU, where the
weights and the OS share it)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...config import GLOBAL, SLIDING, ModelConfig
from .paged_cache import kv_bytes_per_token, sliding_blocks_held

SIZING_ACTIVE = 8  # requests the sliding pool is sized for when max_active is not set


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


def plan_blocks(
    config: ModelConfig, dtype: torch.dtype, block_size: int, budget: int, max_span: int, max_active: int | None
) -> dict[str, int]:
    """Blocks per pool for a KV `budget` in bytes (resolved EngineOptions give the other arguments).

    Global blocks grow with a sequence, sliding ones are bounded by the window; so the sliding
    pool gets what `max_active` (or SIZING_ACTIVE) requests hold at most at once, twice over (the
    rest stays cached for prefix hits), and the global pool the remaining budget; when the
    budget is smaller than that, both get the same number of blocks.
    """
    b = block_size
    per_block = {k: v * b for k, v in kv_bytes_per_token(config, dtype_bytes(dtype)).items()}
    peak = sliding_blocks_held(config.sliding_window, max_span, b)
    sliding_cap = 2 * (max_active or SIZING_ACTIVE) * peak
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

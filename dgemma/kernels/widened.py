"""CPU without native bf16: bf16 weights kept in bf16, multiplied in float32 a tile at a time.

On a CPU without AVX-512 BF16 or AMX (AMD Zen 2/3, most laptops) torch's bf16 GEMM falls back to
a slow path: a bf16 checkpoint ran ~27x slower than the same weights in float32 on such a
machine. Casting the model to float32 doubles its memory. Instead the engine runs the network in
float32 (activations, KV cache, norms, attention) and leaves every weight in bf16: a matmul
widens a tile of weight rows (~1 MB in float32, so it stays in cache) and multiplies it with
the float32 GEMM, so no full-precision copy of a weight outlives its tile. Results are the
float32 computation on the bf16 weights (closer to a float64 oracle than bf16 compute).

Where the native AVX2 GEMM runs (`avx2.linear`, csrc/gemm_avx2.cpp) it reads the bf16 weight as
stored and widens it inside its microkernel instead (no tile buffer). `tiled_linear` is the one
tiling loop of the fallback: quantised weights (`quant/modules.py`) use it too, with a tile
dequantised instead of widened.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..model.diffusion_gemma import Experts
from . import avx2
from .avx2 import widen_into

TILE_ELEMENTS = 1 << 18  # weight elements widened at once: 1 MB in float32 (L2-sized on current CPUs)


def tile_rows(in_features: int, tile_elements: int | None = None) -> int:
    """Output channels per tile (TILE_ELEMENTS weights unless given): a multiple of 8 (whole SIMD
    rows), at least 8."""
    return max(8, (tile_elements or TILE_ELEMENTS) // max(1, in_features) // 8 * 8)


def tiled_linear(
    x: torch.Tensor,
    out_features: int,
    weight_tile: Callable[[int, int], torch.Tensor],
    tile_elements: int | None = None,
) -> torch.Tensor:
    """x [..., in] @ W.T -> [..., out], W read a tile of rows at a time: `weight_tile(start, end)`
    returns rows [start, end) of W in x's dtype (widened or dequantised; it may reuse a buffer).

    Each tile's product goes to rows of the transposed output ([out, tokens], contiguous), which
    measured faster here than writing column slices of [tokens, out]; one transposing copy at the
    end (the result is contiguous, as F.linear's: the native statistics kernel needs it)."""
    flat = x.reshape(-1, x.shape[-1])
    rows = tile_rows(x.shape[-1], tile_elements)
    if rows >= out_features:
        return F.linear(x, weight_tile(0, out_features))
    out_t = flat.new_empty(out_features, flat.shape[0])
    flat_t = flat.t().contiguous()  # (a contiguous [in, tokens] operand: ~15% faster GEMMs here)
    for start in range(0, out_features, rows):
        end = min(out_features, start + rows)
        torch.mm(weight_tile(start, end), flat_t, out=out_t[start:end])
    return out_t.t().contiguous().view(*x.shape[:-1], out_features)


def buffered_rows(shape: tuple[int, ...], dtype: torch.dtype, fill: Callable[[int, int, torch.Tensor], torch.Tensor]):
    """`weight_tile` for a weight [out, in] whose rows `fill(start, end, into)` writes (widened or
    dequantised): every tile goes into one buffer, made at the first tile's size."""
    buffer: list[torch.Tensor] = []

    def tile(start: int, end: int) -> torch.Tensor:
        if not buffer:
            buffer.append(torch.empty(min(shape[0], end - start), shape[1], dtype=dtype))
        return fill(start, end, buffer[0][: end - start])

    return tile


def widened_rows(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> Callable[[int, int], torch.Tensor]:
    """`weight_tile` for a bf16 weight [out, in]: rows widened (natively where the kernel runs)."""
    return buffered_rows(weight.shape, dtype, lambda start, end, into: widen_into(weight[start:end], into))


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (float32) @ W.T for a bf16 W [out, in]: the native AVX2 GEMM, which reads W as stored and
    widens it inside its microkernel (`avx2.linear`), where it runs; else tile by tile."""
    out = avx2.linear(x, weight)
    return out if out is not None else tiled_linear(x, weight.shape[0], widened_rows(weight))


def sorted_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    approximate: str,
    gate_up: Callable[[int, torch.Tensor], torch.Tensor],
    down: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The MoE experts on tokens sorted by expert, each expert's weights read once for all of its
    tokens: `gate_up(e, rows)` / `down(e, rows)` multiply expert e's rows by its projection.
    Computed in x's dtype; one gather, one gelu * up and one scatter-add around the GEMMs."""
    num_tokens, top_k = top_k_index.shape
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    token = perm // top_k
    routed = x.index_select(0, token)
    counts = torch.bincount(expert_ids, minlength=num_experts).tolist()
    spans = [(e, end - n, end) for e, (n, end) in enumerate(zip(counts, itertools.accumulate(counts))) if n]
    projected = torch.cat([gate_up(e, routed[a:b]) for e, a, b in spans])
    gate, up = projected.chunk(2, dim=-1)
    act = F.gelu(gate, approximate=approximate).mul_(up)
    out = torch.cat([down(e, act[a:b]) for e, a, b in spans])
    out.mul_(top_k_weights.reshape(-1)[perm].to(out.dtype)[:, None])
    return torch.zeros_like(x).index_add_(0, token, out)


class WidenedLinear(nn.Module):
    """x @ W.T with W [out, in] kept in bf16 and x, the result, in float32."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight.detach()  # shared with the model (a plain attribute, not a parameter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bf16_linear(x.float(), self.weight)


class WidenedSoftEmbed(nn.Module):
    """probs [.., vocab] @ E [vocab, hidden] with E (the embedding table) kept in bf16: the native
    AVX2 GEMM where it runs, else a tile of vocabulary rows at a time, summed into the result."""

    def __init__(self, embedding: torch.Tensor):
        super().__init__()
        self.embedding = embedding.detach()

    def forward(self, probs: torch.Tensor) -> torch.Tensor:
        native = avx2.matmul_nn(probs.float(), self.embedding)  # E read as stored (csrc/gemm_avx2.cpp)
        if native is not None:
            return native
        flat = probs.reshape(-1, probs.shape[-1]).float()
        vocab, hidden = self.embedding.shape
        rows = tile_rows(hidden)
        tile = widened_rows(self.embedding)
        out = flat.new_zeros(flat.shape[0], hidden)
        for start in range(0, vocab, rows):
            end = min(vocab, start + rows)
            out.addmm_(flat[:, start:end], tile(start, end))
        return out.reshape(*probs.shape[:-1], hidden)


class WidenedEmbedding(nn.Module):
    """The token embedding lookup, rows widened to float32 (the table stays bf16)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight = embedding.weight  # shared; the model reads its dtype, shape and rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).float()


class WidenedExperts(nn.Module):
    """`Experts` with bf16 gate_up [E, 2I, H] and down [E, H, I]: tokens sorted by expert, each
    expert's weights widened tile by tile for all of its tokens, float32 compute."""

    def __init__(self, experts: Experts):
        super().__init__()
        self.num_experts, self.approximate = experts.num_experts, experts.approximate
        self.gate_up, self.down = experts.gate_up_proj.detach(), experts.down_proj.detach()

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return sorted_experts(
            x.float(),
            top_k_index,
            top_k_weights,
            self.num_experts,
            self.approximate,
            lambda e, rows: bf16_linear(rows, self.gate_up[e]),
            lambda e, rows: bf16_linear(rows, self.down[e]),
        )


__all__ = [
    "TILE_ELEMENTS",
    "bf16_linear",
    "buffered_rows",
    "sorted_experts",
    "tile_rows",
    "tiled_linear",
    "widened_rows",
    "WidenedLinear",
    "WidenedSoftEmbed",
    "WidenedEmbedding",
    "WidenedExperts",
]

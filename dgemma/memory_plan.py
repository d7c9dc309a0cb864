"""What a device must hold to serve a model: weights (by quantisation scheme), the KV pool, and the
step buffers at the chosen batch (a `Workload`). Whether that fits a device, and what would fit if
not, is hub/fit.py's (`check_fit`: every load, a hub id before its download, `dgemma memory
--card`); `kv_report` is `dgemma memory`'s KV bytes of one request.

Pure arithmetic on the config (parameters counted on the meta device, nothing allocated), so a
plan can be refused before a byte is loaded or downloaded, and `dgemma memory --card` prints the
same plan anywhere. The figures are estimates of what is allocated, not measurements:
weights exactly as the formats store them (compressed-tensors layouts: float32 per-channel
scales, int4 group scales in the model's dtype), a KV pool holding one request of the context
(sliding layers: their window), step buffers from the tensors a decoder pass and a prefill chunk
create at their largest, and a fixed reserve for the CUDA context and allocator.

Split across `tensor_parallel_size` ranks (parallel/plan.py's `ShardPlan`), each rank's plan is
the same arithmetic on what that rank holds: its weights (its query and KV heads, KV heads that do
not split counted on every rank that holds them; its MLP and expert slices, or its whole experts
with expert parallelism; its vocabulary rows of the tied embedding; norms, router and scalars
whole), its heads' share of the KV pool, step buffers of its vocabulary width and intermediate
slices (hidden-size activations replicated), and a reserve of its own. The largest rank decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .config import GLOBAL, SLIDING, ModelConfig
from .engine.kv.budget import dtype_bytes
from .engine.kv.paged_cache import KINDS, kv_bytes_per_token, sliding_blocks_held
from .engine.turbo import canvas_kv_bytes
from .quant import schemes

if TYPE_CHECKING:
    from .parallel.plan import ShardPlan

RESERVE = int(1.5 * 2**30)  # CUDA context, cuBLAS / Triton workspaces, allocator slack
COLLECTIVE_RESERVE = 2**28  # split across ranks: each rank's NCCL communicator buffers (an estimate)
QUANTISED = ("experts", "attention", "dense")  # the parts a scheme quantises (quant/modules.py)


@dataclass(frozen=True)
class Workload:
    """What a plan is for: weights quantised by `scheme` (int4: in groups of `group_size`), `batch`
    canvases at once with room for one request of `context` positions (None: the model's
    max_position_embeddings) or a KV pool of `kv_cache_memory` bytes (each rank's, split), prefill
    chunks of `prefill_chunk` tokens, every canvas with its turbo K/V buffer (`turbo`), split across
    `tensor_parallel_size` ranks (whole experts per rank with `expert_parallel`)."""

    scheme: str | None = None
    group_size: int | None = None
    batch: int = 8
    context: int | None = None
    kv_cache_memory: int | None = None
    prefill_chunk: int = 2048
    turbo: bool = False
    tensor_parallel_size: int = 1
    expert_parallel: bool = False


@dataclass(frozen=True)
class MemoryPlan:
    weights: dict[str, int]  # bytes by part: experts, attention, dense, embeddings, other
    kv_cache: int
    step_buffers: int
    reserve: int
    scheme: str | None
    batch: int
    context: int
    ranks: int = 1  # tensor-parallel size: > 1, this is one rank's plan (`rank`)
    rank: int = 0
    expert_parallel: bool = False
    notes: tuple[str, ...] = ()  # what a reader of the figures should know (quantisation groups a split breaks)

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.kv_cache + self.step_buffers + self.reserve

    def describe(self) -> str:
        gib = 2**30
        w = sum(self.weights.values())
        ranks = (
            f"per rank ({self.ranks} ranks{', expert parallel' if self.expert_parallel else ''}): "
            if self.ranks > 1
            else ""
        )
        return (
            f"{ranks}weights {w / gib:.1f} GiB ({self.scheme or 'unquantised'}), KV cache {self.kv_cache / gib:.1f} GiB, "
            f"step buffers {self.step_buffers / gib:.1f} GiB (batch {self.batch}), reserve "
            f"{self.reserve / gib:.1f} GiB: {self.total / gib:.1f} GiB"
        )


def parameter_counts(config: ModelConfig) -> dict[str, dict[str, tuple[int, int, int]]]:
    """The text stack's matrices by part, counted on the meta device: part -> name -> (rows, cols,
    count) (experts: one expert's matrix, count the experts), plus part "other" as
    {name: (numel, 1, 1)} for vectors, buffers and whatever is not a quantisable matrix (the
    attention's norms included)."""
    from .model.diffusion_gemma import DiffusionGemma

    with torch.device("meta"):
        net = DiffusionGemma(config)
    parts: dict[str, dict[str, tuple[int, int, int]]] = {
        "experts": {},
        "attention": {},
        "dense": {},
        "embeddings": {},
        "other": {},
    }
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
    """Bytes of one [rows, cols] weight as the scheme stores it (quant/schemes.py's table: codes,
    scales per channel or group, a global scale; unquantised: the model's dtype)."""
    if scheme is None:
        return rows * cols * dtype_size
    return schemes.get(scheme).matrix_bytes(rows, cols, group_size, dtype_size)


def _tensor_bytes(scheme: str | None) -> int:
    """Bytes a quantised tensor stores once beside its matrices (int4's weight_shape)."""
    return 0 if scheme is None else schemes.get(scheme).shape_bytes


def weight_bytes(config: ModelConfig, scheme: str | None, group_size: int | None, dtype: torch.dtype) -> dict[str, int]:
    return counted_bytes(parameter_counts(config), scheme, group_size, dtype)


def counted_bytes(
    counts: dict[str, dict[str, tuple[int, int, int]]], scheme: str | None, group_size: int | None, dtype: torch.dtype
) -> dict[str, int]:
    """Bytes by part of `parameter_counts`' matrices (or a rank's: parallel.plan.rank_parameter_counts) as stored."""
    size = dtype_bytes(dtype)
    out = {}
    for part, matrices in counts.items():
        quantised = scheme if part in QUANTISED else None
        out[part] = sum(
            n * matrix_bytes(r, c, quantised, group_size, size) + _tensor_bytes(quantised)
            for r, c, n in matrices.values()
        )
    return out


def step_buffer_bytes(
    config: ModelConfig, batch: int, prefill_chunk: int, dtype: torch.dtype, turbo: bool = False
) -> int:
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


def plan_memory(config: ModelConfig, dtype: torch.dtype, work: Workload = Workload()) -> MemoryPlan:
    """The memory to serve `work` (one rank's plan, the largest, where it is split: `rank_plans`;
    `ShardError` where the size does not split)."""
    if work.tensor_parallel_size != 1:
        return largest(rank_plans(config, dtype, work))
    context = work.context or config.max_position_embeddings
    kv = work.kv_cache_memory if work.kv_cache_memory is not None else kv_bytes(config, 1, context, dtype)
    return MemoryPlan(
        weight_bytes(config, work.scheme, work.group_size, dtype),
        int(kv),
        step_buffer_bytes(config, work.batch, work.prefill_chunk, dtype, work.turbo),
        RESERVE,
        work.scheme,
        work.batch,
        context,
    )


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


# ------------------------------------------------------------------------------- per rank
def largest(plans: list[MemoryPlan]) -> MemoryPlan:
    """The plan that decides whether a split fits: the rank that needs the most (the first of equals)."""
    return max(plans, key=lambda p: (p.total, -p.rank))


def _group(scheme: str | None, group_size: int | None) -> int | None:
    """Inputs per scale of `scheme`'s groups (None: unquantised, or a scale per output channel)."""
    return None if scheme is None else schemes.get(scheme).group.inputs(group_size)


def split_groups(full: dict, ranks: list[dict], scheme: str | None, group_size: int | None) -> tuple[str, ...]:
    """The quantised matrices whose column split leaves some rank a part of a quantisation group
    (int4's groups of `group_size`, nvfp4's of 16), as '<part> <matrix> (<cols> of <whole> columns)':
    a split the loader must replicate or refuse (the released 704 and 2112 halved are not multiples
    of 64). `full`: parameter_counts; `ranks`: each rank's rank_parameter_counts."""
    group = _group(scheme, group_size)
    if group is None:
        return ()
    found: dict[str, None] = {}  # ordered, without repeats
    for counts in ranks:
        for part in QUANTISED:
            for name, (_, cols, _) in counts[part].items():
                whole = full[part][name][1]
                if cols != whole and cols % group:
                    leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
                    found[f"{part} {leaf} ({cols} of {whole} columns)"] = None
    return tuple(found)


def split_note(full: dict, ranks: list[dict], scheme: str | None, group_size: int | None) -> tuple[str, ...]:
    """`split_groups` as a note for the plan, with an int4 group size that keeps every split whole."""
    broken = split_groups(full, ranks, scheme, group_size)
    if not broken:
        return ()
    group, rule = _group(scheme, group_size), schemes.get(scheme).group
    sizes = [g for g in (32, 16, 8) if rule.choosable and g < group and g % rule.multiple == 0]
    smaller = [g for g in sizes if not split_groups(full, ranks, scheme, g)]
    fix = f"; --group-size {smaller[0]} keeps them whole" if smaller else ""
    return (
        f"{scheme}'s groups of {group} do not divide what each rank holds of {', '.join(broken)}: the loader "
        f"places each layer's whole dense MLP on one rank (layer i on rank i mod N; counted split evenly here){fix}",
    )


def rank_plans(config: ModelConfig, dtype: torch.dtype, work: Workload = Workload()) -> list[MemoryPlan]:
    """`plan_memory` for each rank of `work`'s split: its weights
    (parallel.plan.rank_parameter_counts, stored as weight_bytes stores them), a KV pool of its
    heads (replicated heads counted), step buffers of its shapes (`rank_config`: its vocabulary
    width, its MLP and expert slices; with expert parallelism, every routed slot of a token on
    one rank at worst), the reserve and, split, NCCL's buffers. `kv_cache_memory` is each rank's.
    A size that does not split: parallel.plan.ShardError."""
    from .parallel.plan import ShardPlan

    size, scheme, group_size = work.tensor_parallel_size, work.scheme, work.group_size
    shards = ShardPlan.build(config, size, work.expert_parallel)
    if scheme is not None and size > 1:  # a split the loader refuses (groups cut): its one line, here
        from .parallel.shard import RankLayout, scheme_groups

        RankLayout.build(shards, 0, scheme_groups(scheme, group_size))
    context = work.context or config.max_position_embeddings
    counts = [rank_parameter_counts(shards, rank) for rank in range(size)]
    notes = split_note(parameter_counts(config), counts, scheme, group_size) if size > 1 else ()
    reserve = RESERVE + (COLLECTIVE_RESERVE if size > 1 else 0)
    plans = []
    for rank in range(size):
        mine = shards.rank_config(rank)
        kv = work.kv_cache_memory if work.kv_cache_memory is not None else kv_bytes(mine, 1, context, dtype)
        plans.append(
            MemoryPlan(
                counted_bytes(counts[rank], scheme, group_size, dtype),
                int(kv),
                step_buffer_bytes(mine, work.batch, work.prefill_chunk, dtype, work.turbo),
                reserve,
                scheme,
                work.batch,
                context,
                size,
                rank,
                bool(work.expert_parallel),
                notes,
            )
        )
    return plans


def rank_parameter_counts(plan: ShardPlan, rank: int) -> dict[str, dict[str, tuple[int, int, int]]]:
    """`parameter_counts` for what rank `rank` holds: the same parts and names,
    each matrix cut to the rank's rows / columns / experts (replicated KV heads counted on every
    rank that holds them; norms, router and scalars whole on every rank)."""
    c, mine = plan.config, plan.ranks[rank]
    full = parameter_counts(c)
    inter = mine.intermediate[1] - mine.intermediate[0]
    out: dict[str, dict[str, tuple[int, int, int]]] = {part: {} for part in full}
    for part, matrices in full.items():
        for name, (rows, cols, count) in matrices.items():
            fields = name.split(".")
            leaf = fields[-2] if name.endswith(".weight") else fields[-1]
            if name.startswith("embed_tokens"):
                rows = mine.vocab[1] - mine.vocab[0]
            elif part == "attention":
                h = mine.heads[int(fields[1])]
                head_dim = c.layers[int(fields[1])].head_dim
                if leaf == "q_proj":
                    rows = h.num_query * head_dim
                elif leaf in ("k_proj", "v_proj"):
                    rows = h.num_kv * head_dim
                elif leaf == "o_proj":
                    cols = h.num_query * head_dim
            elif part == "dense":
                if leaf == "down_proj":
                    cols = inter
                else:
                    rows = inter
            elif part == "experts":
                count = mine.experts[1] - mine.experts[0]
                moe = mine.moe_intermediate[1] - mine.moe_intermediate[0]
                rows, cols = (2 * moe, cols) if leaf == "gate_up_proj" else (rows, moe)
            elif name.startswith("self_conditioning.") and leaf in ("gate_proj", "up_proj", "down_proj"):
                rows = rows * inter // c.intermediate_size  # "other" holds (numel, 1, 1)
            out[part][name] = (rows, cols, count)
    return out


def rank_weight_bytes(plan: ShardPlan, rank: int, scheme: str | None, group_size: int | None, dtype) -> dict[str, int]:
    """`weight_bytes` for rank `rank`: its weights' bytes by part, as stored
    (quantised parts by `matrix_bytes`; whether a split keeps a quantisation group whole is not
    checked here)."""
    size = dtype_bytes(dtype)
    out = {}
    for part, matrices in rank_parameter_counts(plan, rank).items():
        quantised = scheme if part in QUANTISED else None
        out[part] = sum(
            n * matrix_bytes(r, c, quantised, group_size, size) + _tensor_bytes(quantised)
            for r, c, n in matrices.values()
        )
    return out


def rank_kv_bytes_per_token(plan: ShardPlan, rank: int, dtype_size: int) -> dict[str, int]:
    """K and V bytes one position takes on rank `rank` in every layer of each kind (its KV heads,
    replicated ones included): `paged_cache.kv_bytes_per_token` of its `rank_config`."""
    return kv_bytes_per_token(plan.rank_config(rank), dtype_size)

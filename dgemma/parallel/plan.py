"""What each rank holds of a model split across `size` ranks: pure functions of the config.

Vocabulary: rank r holds the embedding rows (and so the tied head's logits) [start, end) of
`vocab_shard`: a width rounded up to the allowed-token masks' 32-token words, so a rank's slice
of a packed mask is whole words; the last rank's shard is shorter where the vocabulary does not
divide (no padding rows: the sampler's reductions take each rank's own width).

Attention: rank r holds query heads [r H / size, (r + 1) H / size) (Megatron's column split of
q/k/v, row split of o_proj). KV heads are split the same way where `size` divides their count;
where it does not, each rank holds the one KV head its query heads group to (query head h reads
KV head h // (H / Hkv), as SDPA's GQA and `_repeat_kv` do), so that head is replicated on
H / Hkv / (H / size) ranks: the released global layers' 2 KV heads on 4 ranks sit twice each.
A rank whose query heads would group to part of two KV heads cannot be served (`ShardError`).

MLPs (dense and self-conditioning): gate/up rows and down columns [r I / size, (r + 1) I / size).
Experts: each expert's moe_intermediate split the same way, or with expert parallelism whole
experts [r E / size, (r + 1) E / size) per rank. The router, the norms and the scalars are
replicated.

For the memory plans: `ShardPlan.rank_config` (a rank's shapes, to size its KV cache),
`rank_parameter_counts` / `rank_weight_bytes` (engine/memory_plan.py's counts, per rank) and
`rank_kv_bytes_per_token` (replicated KV heads counted on every rank that holds them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ModelConfig


class ShardError(ValueError):
    """A model cannot be split across this many ranks (one line naming what does not divide)."""


def vocab_shard(vocab_size: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rank `rank` of `size` holds (start a multiple of 32)."""
    per = -(-vocab_size // size)
    width = -(-per // 32) * 32
    start = min(vocab_size, rank * width)
    return start, min(vocab_size, start + width)


def _split(total: int, size: int, rank: int) -> tuple[int, int]:
    per = total // size
    return rank * per, (rank + 1) * per


@dataclass(frozen=True)
class HeadShard:
    """One layer's attention heads on one rank: [start, end) of the query and of the KV heads."""

    query: tuple[int, int]
    kv: tuple[int, int]
    replicas: int  # ranks holding each of these KV heads: 1 where the KV heads split

    @property
    def num_query(self) -> int:
        return self.query[1] - self.query[0]

    @property
    def num_kv(self) -> int:
        return self.kv[1] - self.kv[0]


@dataclass(frozen=True)
class RankShard:
    """Everything one rank holds: [start, end) ranges into the full model's dimensions."""

    rank: int
    heads: tuple[HeadShard, ...]  # per layer
    intermediate: tuple[int, int]  # dense MLP and self-conditioning MLP
    moe_intermediate: tuple[int, int]  # of each expert it holds (everything with expert parallelism)
    experts: tuple[int, int]  # the experts it holds (all of them without expert parallelism)
    vocab: tuple[int, int]  # embedding rows, and the logits' columns


@dataclass(frozen=True)
class ShardPlan:
    """A model split across `size` ranks; `ranks[r]` is what rank r holds. Build with `ShardPlan.build`."""

    config: ModelConfig
    size: int
    expert_parallel: bool
    ranks: tuple[RankShard, ...]

    @classmethod
    def build(cls, config: ModelConfig, size: int, expert_parallel: bool = False) -> ShardPlan:
        """The plan, or a one-line `ShardError` naming the first dimension that does not split."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ShardError(f"tensor parallel size must be an integer >= 1 (got {size!r})")
        c = config
        if c.num_heads % size:
            raise ShardError(f"{c.num_heads} attention heads do not split across {size} ranks")
        if c.intermediate_size % size:
            raise ShardError(f"intermediate_size {c.intermediate_size} does not split across {size} ranks")
        if expert_parallel and c.num_experts % size:
            raise ShardError(f"{c.num_experts} experts do not split across {size} ranks (expert parallelism)")
        if not expert_parallel and c.moe_intermediate_size % size:
            raise ShardError(f"moe_intermediate_size {c.moe_intermediate_size} does not split across {size} ranks; "
                             "try expert parallelism")  # fmt: skip
        per_rank = c.num_heads // size
        for i, spec in enumerate(c.layers):
            group = c.num_heads // spec.num_kv_heads  # query heads per KV head
            if spec.num_kv_heads % size and group % per_rank:
                raise ShardError(f"layer {i}: {per_rank} query heads per rank straddle the groups of {group} query "
                                 f"heads that share each of its {spec.num_kv_heads} KV heads ({size} ranks)")  # fmt: skip
        for r in range(size):
            start, end = vocab_shard(c.vocab_size, size, r)
            if end <= start:
                raise ShardError(f"vocabulary of {c.vocab_size} leaves rank {r} of {size} no rows (shards are whole "
                                 "32-token words)")  # fmt: skip
        ranks = []
        for r in range(size):
            heads = []
            for spec in c.layers:
                query = _split(c.num_heads, size, r)
                if spec.num_kv_heads % size == 0:
                    heads.append(HeadShard(query, _split(spec.num_kv_heads, size, r), 1))
                else:
                    group = c.num_heads // spec.num_kv_heads
                    kv = query[0] // group
                    heads.append(HeadShard(query, (kv, kv + 1), group // per_rank))
            ranks.append(RankShard(
                rank=r,
                heads=tuple(heads),
                intermediate=_split(c.intermediate_size, size, r),
                moe_intermediate=(0, c.moe_intermediate_size) if expert_parallel else _split(c.moe_intermediate_size, size, r),
                experts=_split(c.num_experts, size, r) if expert_parallel else (0, c.num_experts),
                vocab=vocab_shard(c.vocab_size, size, r),
            ))  # fmt: skip
        return cls(config, size, bool(expert_parallel), tuple(ranks))

    def rank_config(self, rank: int) -> ModelConfig:
        """The shapes rank `rank` holds, as a ModelConfig: its query and KV heads per layer, its MLP
        and expert widths, its experts and its vocabulary width. For sizing what a rank allocates
        (its KV cache: `DenseKVCache(plan.rank_config(r), ...)`, step buffers); not a model to
        build (its router still scores every expert: `rank_parameter_counts` counts that)."""
        mine = self.ranks[rank]
        layers = tuple(replace(spec, num_kv_heads=h.num_kv) for spec, h in zip(self.config.layers, mine.heads))
        return replace(
            self.config,
            num_heads=mine.heads[0].num_query if mine.heads else self.config.num_heads // self.size,
            layers=layers,
            intermediate_size=mine.intermediate[1] - mine.intermediate[0],
            moe_intermediate_size=mine.moe_intermediate[1] - mine.moe_intermediate[0],
            num_experts=mine.experts[1] - mine.experts[0],
            vocab_size=mine.vocab[1] - mine.vocab[0],
        )


def rank_parameter_counts(plan: ShardPlan, rank: int) -> dict[str, dict[str, tuple[int, int, int]]]:
    """`engine.memory_plan.parameter_counts` for what rank `rank` holds: the same parts and names,
    each matrix cut to the rank's rows / columns / experts (replicated KV heads counted on every
    rank that holds them; norms, router and scalars whole on every rank)."""
    from ..engine.memory_plan import parameter_counts

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
    """`engine.memory_plan.weight_bytes` for rank `rank`: its weights' bytes by part, as stored
    (quantised parts by `matrix_bytes`; whether a split keeps a quantisation group whole is not
    checked here)."""
    from ..engine.kv_budget import dtype_bytes
    from ..engine.memory_plan import QUANTISED, matrix_bytes

    size = dtype_bytes(dtype)
    out = {}
    for part, matrices in rank_parameter_counts(plan, rank).items():
        quantised = scheme if part in QUANTISED else None
        out[part] = sum(n * matrix_bytes(r, c, quantised, group_size, size) + (8 if quantised == "int4" else 0)
                        for r, c, n in matrices.values())  # fmt: skip
    return out


def rank_kv_bytes_per_token(plan: ShardPlan, rank: int, dtype_size: int) -> dict[str, int]:
    """K and V bytes one position takes on rank `rank` in every layer of each kind (its KV heads,
    replicated ones included): `paged_cache.kv_bytes_per_token` of its `rank_config`."""
    from ..engine.paged_cache import kv_bytes_per_token

    return kv_bytes_per_token(plan.rank_config(rank), dtype_size)

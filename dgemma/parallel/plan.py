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

For the memory plans: `ShardPlan.rank_config` (a rank's shapes, to size its KV cache); the
bytes a rank holds are counted in dgemma/memory_plan.py (`rank_parameter_counts`,
`rank_weight_bytes`, `rank_kv_bytes_per_token`: replicated KV heads on every rank that holds them).
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
            raise ShardError(
                f"moe_intermediate_size {c.moe_intermediate_size} does not split across {size} ranks; "
                "try expert parallelism"
            )
        per_rank = c.num_heads // size
        for i, spec in enumerate(c.layers):
            group = c.num_heads // spec.num_kv_heads  # query heads per KV head
            if spec.num_kv_heads % size and group % per_rank:
                raise ShardError(
                    f"layer {i}: {per_rank} query heads per rank straddle the groups of {group} query "
                    f"heads that share each of its {spec.num_kv_heads} KV heads ({size} ranks)"
                )
        for r in range(size):
            start, end = vocab_shard(c.vocab_size, size, r)
            if end <= start:
                raise ShardError(
                    f"vocabulary of {c.vocab_size} leaves rank {r} of {size} no rows (shards are whole 32-token words)"
                )
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
            ranks.append(
                RankShard(
                    rank=r,
                    heads=tuple(heads),
                    intermediate=_split(c.intermediate_size, size, r),
                    moe_intermediate=(0, c.moe_intermediate_size)
                    if expert_parallel
                    else _split(c.moe_intermediate_size, size, r),
                    experts=_split(c.num_experts, size, r) if expert_parallel else (0, c.num_experts),
                    vocab=vocab_shard(c.vocab_size, size, r),
                )
            )
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

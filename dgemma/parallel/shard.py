"""A built model cut to one rank's share of a tensor- (and expert-) parallel split, in place.

Every rank builds (or loads) the same full model and `shard_model` keeps its slices (plan.py
says which): query/key/value by column (heads), o_proj by row; the dense and self-conditioning
MLPs' gate/up by column, down by row; each expert's gate/up halves and down by intermediate, or
with expert parallelism whole experts; the embedding (and so the tied head) by vocabulary rows.
Norms, the router and the scalars stay whole on every rank, so the router's top-k is the same
everywhere.

Each row-split matmul leaves a partial sum on every rank; the model's reduce points
(`Layer.reduce`, `DiffusionGemma.reduce`, `DiffusionGemma.lookup`, identities unsharded) are set
to all-reduce them where they meet: after o_proj, after the dense MLP and after the MoE (each
before its own post-norm: three per layer), after the self-conditioning MLP (before the add),
after the embedding lookup (rows outside the rank's shard are zeros) and after `soft_embed`'s
probs @ E (before the division by the total). Activations are replicated after each, so expert
parallelism needs no all-to-all: each rank runs the routed rows of its own experts and the MoE
all-reduce combines them (Megatron-LM's tensor parallelism; vLLM's `--enable-expert-parallel`).

`lm_head` / `logits` give the rank's own vocabulary columns [.., Vs]: the sampler reduces its
statistics across ranks (sampling.py) and only tests and reference mode gather them
(`gather_logits`).

The reduce points sit in `Layer` and `DiffusionGemma`, outside the linear, MLP and expert modules
that the kernel choice replaces (kernels/cpu.py's packed and widened copies, gpu.py's Triton
modules), so a model sharded before `engine_net` / `triton_modules` keeps them.

Not here: quantised weights (refused), reading shards from disk (the full model is built first),
the vision tower (left whole: rank 0 runs it).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..model.diffusion_gemma import Attention, DiffusionGemma, Experts
from .group import ShardGroup
from .plan import HeadShard, ShardError, ShardPlan


class AllReduce:
    """A reduce point: the sum of every rank's partial `t` (in place on a contiguous `t`)."""

    def __init__(self, group: ShardGroup):
        self.group = group

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(t.contiguous())

    def __deepcopy__(self, memo) -> AllReduce:  # a copied model shares the ranks' group
        return self


class VocabLookup:
    """The embedding lookup over a vocabulary shard [start, end): ids outside it give zero rows,
    and the ranks' rows are summed, so every rank has every id's row (exactly: one non-zero term)."""

    def __init__(self, start: int, end: int, reduce: AllReduce):
        self.start, self.end, self.reduce = start, end, reduce

    def __call__(self, table: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        rows = table(local.masked_fill(outside, 0))
        return self.reduce(rows.masked_fill(outside[..., None], 0))

    def __deepcopy__(self, memo) -> VocabLookup:
        return self


class VocabColumns:
    """Whole-vocabulary rows <-> this rank's columns: `gather` assembles every rank's [.., Vs] into
    [.., vocab] (the reference sampler, AR mode and `canvas_logits` read whole rows); `own` cuts a
    whole row to the rank's [start, end) (their self-conditioning input, whose product the
    sharded `soft_embed` sums over the ranks)."""

    def __init__(self, group: ShardGroup, vocab_size: int, start: int, end: int):
        self.group, self.vocab_size, self.start, self.end = group, vocab_size, start, end

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_logits(logits, self.group, self.vocab_size)

    def own(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[..., self.start : self.end]

    def __deepcopy__(self, memo) -> "VocabColumns":
        return self


class ExpertShard(nn.Module):
    """Expert parallelism: the whole experts [first, first + n) of one layer's MoE (`experts`, an
    `Experts` of n experts, which the kernel choice may replace). Routed (token, slot) pairs whose
    expert another rank holds contribute nothing here; the layer's all-reduce adds theirs."""

    def __init__(self, experts: nn.Module, first: int, count: int):
        super().__init__()
        self.experts = experts
        self.first, self.count = first, count

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        local = top_k_index - self.first
        token, slot = ((local >= 0) & (local < self.count)).nonzero(as_tuple=True)  # (a host sync)
        out = x.new_zeros(x.shape)
        if token.numel():
            part = self.experts(x[token], local[token, slot, None], top_k_weights[token, slot, None])
            out.index_add_(0, token, part.to(out.dtype))
        return out


def _keep(t: torch.Tensor, dim: int, start: int, end: int) -> nn.Parameter:
    """A new parameter holding t[start:end] along `dim` (a copy: the full tensor can be freed)."""
    return nn.Parameter(t.detach().narrow(dim, start, end - start).clone(), requires_grad=t.requires_grad)


def _linear(module: nn.Module, name: str) -> nn.Linear:
    if type(module) is not nn.Linear:
        raise ShardError(f"{name} is a {type(module).__name__}: only unquantised nn.Linear weights are sharded "
                         "(shard before quantising or packing)")  # fmt: skip
    return module


def _cut_rows(lin: nn.Linear, start: int, end: int) -> None:
    lin.weight = _keep(lin.weight, 0, start, end)
    lin.out_features = end - start


def _cut_cols(lin: nn.Linear, start: int, end: int) -> None:
    lin.weight = _keep(lin.weight, 1, start, end)
    lin.in_features = end - start


def _shard_attention(attn: Attention, heads: HeadShard, name: str) -> None:
    d = attn.spec.head_dim
    (q0, q1), (k0, k1) = heads.query, heads.kv
    _cut_rows(_linear(attn.q_proj, f"{name}.q_proj"), q0 * d, q1 * d)
    _cut_rows(_linear(attn.k_proj, f"{name}.k_proj"), k0 * d, k1 * d)
    if attn.v_proj is not None:  # (global layers: V is K's projection)
        _cut_rows(_linear(attn.v_proj, f"{name}.v_proj"), k0 * d, k1 * d)
    _cut_cols(_linear(attn.o_proj, f"{name}.o_proj"), q0 * d, q1 * d)
    attn.num_heads = heads.num_query
    attn.spec = replace(attn.spec, num_kv_heads=heads.num_kv)


def _shard_mlp(mlp: nn.Module, span: tuple[int, int], name: str) -> None:
    """gate/up by output rows, down by input columns: gelu(gate) * up is per intermediate unit."""
    _cut_rows(_linear(mlp.gate_proj, f"{name}.gate_proj"), *span)
    _cut_rows(_linear(mlp.up_proj, f"{name}.up_proj"), *span)
    _cut_cols(_linear(mlp.down_proj, f"{name}.down_proj"), *span)


def _shard_experts(experts: nn.Module, plan: ShardPlan, rank: int, name: str) -> nn.Module:
    """The layer's experts cut to the rank's intermediate slice, or its whole experts (returned
    wrapped in an `ExpertShard`)."""
    if type(experts) is not Experts:
        raise ShardError(f"{name} is a {type(experts).__name__}: only unquantised Experts are sharded")
    mine = plan.ranks[rank]
    if plan.expert_parallel:
        e0, e1 = mine.experts
        experts.gate_up_proj = _keep(experts.gate_up_proj, 0, e0, e1)
        experts.down_proj = _keep(experts.down_proj, 0, e0, e1)
        experts.num_experts = e1 - e0
        return ExpertShard(experts, e0, e1 - e0)
    i = plan.config.moe_intermediate_size
    s, e = mine.moe_intermediate
    gate_up = experts.gate_up_proj.detach()  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I)
    experts.gate_up_proj = nn.Parameter(torch.cat([gate_up[:, s:e], gate_up[:, i + s : i + e]], dim=1),
                                        requires_grad=experts.gate_up_proj.requires_grad)  # fmt: skip
    experts.down_proj = _keep(experts.down_proj, 2, s, e)  # [E, H, I]
    return experts


@torch.no_grad()
def shard_model(net: DiffusionGemma, group: ShardGroup, expert_parallel: bool = False) -> DiffusionGemma:
    """Cut `net` (the full model, the same on every rank: unquantised float weights, not yet
    packed) to rank `group.rank`'s share, in place, and set its reduce points to all-reduce over
    `group`; returns `net`, with `net.shards` (the group) and `net.shard_plan`. A size that does
    not split is a one-line `ShardError` before anything is cut."""
    if net.shards is not None:
        raise ShardError("the model is already sharded")
    if net.quantization is not None:
        raise ShardError(f"sharding {net.quantization[0]} weights is not supported yet: shard the unquantised model")
    if net.lm_head_kernel is not None or net.soft_embed_kernel is not None:
        raise ShardError("the model has kernel replacements: shard the loaded model, then choose its kernels")
    plan = ShardPlan.build(net.config, group.size, expert_parallel)
    net.shards, net.shard_plan = group, plan
    if group.size == 1:
        return net
    mine = plan.ranks[group.rank]
    reduce = AllReduce(group)
    v0, v1 = mine.vocab
    net.embed_tokens.weight = _keep(net.embed_tokens.weight, 0, v0, v1)
    net.embed_tokens.num_embeddings = v1 - v0
    for i, layer in enumerate(net.layers):
        _shard_attention(layer.self_attn, mine.heads[i], f"layers.{i}.self_attn")
        _shard_mlp(layer.mlp, mine.intermediate, f"layers.{i}.mlp")
        layer.experts = _shard_experts(layer.experts, plan, group.rank, f"layers.{i}.experts")
        layer.reduce = reduce
    _shard_mlp(net.self_conditioning, mine.intermediate, "self_conditioning")
    net.reduce = reduce
    net.lookup = VocabLookup(v0, v1, reduce)
    columns = VocabColumns(group, net.config.vocab_size, v0, v1)
    net.gather_vocab, net.own_vocab = columns.gather, columns.own
    return net


def gather_logits(logits: torch.Tensor, group: ShardGroup, vocab_size: int) -> torch.Tensor:
    """Every rank's logits [.., Vs] gathered into the full [.., vocab] (tests, reference mode):
    each shard padded to the widest, all-gathered, cut back and concatenated in rank order."""
    if group.size == 1:
        return logits
    from .plan import vocab_shard

    spans = [vocab_shard(vocab_size, group.size, r) for r in range(group.size)]
    width = max(e - s for s, e in spans)
    mine = spans[group.rank][1] - spans[group.rank][0]
    if logits.shape[-1] != mine:
        raise ValueError(f"rank {group.rank} holds {mine} logits' columns, got {logits.shape[-1]}")
    padded = torch.nn.functional.pad(logits, (0, width - mine))
    every = group.all_gather(padded)
    return torch.cat([every[r, ..., : e - s] for r, (s, e) in enumerate(spans)], dim=-1)


def soft_embed_from_logits(net: DiffusionGemma, logits: torch.Tensor) -> torch.Tensor:
    """`net.soft_embed_from_logits` over vocabulary-sharded logits [.., Vs]: softmax with the
    ranks' max (one all-reduce) and total (another), then the sharded `soft_embed`."""
    group = net.shards
    if group is None or group.size == 1:
        return net.soft_embed_from_logits(logits)
    top = group.all_reduce(logits.amax(dim=-1, keepdim=True).float().contiguous(), op="max")
    weights = torch.exp(logits.float() - top)
    total = group.all_reduce(weights.sum(dim=-1).contiguous())
    return net.soft_embed(weights, total)

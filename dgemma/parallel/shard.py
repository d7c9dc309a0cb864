"""A built model cut to one rank's share of a tensor- (and expert-) parallel split, in place.

Each rank keeps its slices of the full model (plan.py says which; `shard_model` cuts a model in
memory, `ShardedLoad` reads only the slices from disk): query/key/value by column (heads), o_proj by row; the dense and self-conditioning
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
statistics across ranks (engine/sharded/sampling.py) and only tests and reference mode gather them
(`gather_logits`).

The reduce points sit in `Layer` and `DiffusionGemma`, outside the linear, MLP and expert modules
that the kernel choice replaces (kernels/cpu.py's packed and widened copies, gpu.py's Triton
modules), so a model sharded before `engine_net` / `triton_modules` keeps them.

What a rank holds of each of the full model's tensors is one `Cut` (spans along one dim, or
all of it, or nothing) from `RankLayout`: `shard_model` applies it to a model in memory, and
`ShardedLoad` to a model built on the meta device while model/weights.py reads each tensor's
slice from its file, so no rank ever holds the whole model; both give the same tensors.

Quantised weights are split in their own layout, as the float ones are. Quantising a rank's
slice gives exactly the slice of the whole quantised weight when the quantiser's statistics are
the whole's: int4's group scales are their groups' own, where every rank's columns are whole
groups; fp8 / int8 take each output channel's largest magnitude, which a column split takes as
the max of the ranks' (one all-reduce of [out] per matrix); nvfp4's global scale is the whole 2D
weight's (per expert): one all-reduce of a number per matrix (per expert) for a row or column
split. Where a split would cut a group (the released dense MLP's 2112 / 2 = 1056 inputs per rank
are not whole int4 groups of 64), that layer's dense MLP is held whole by one rank (layer i by
rank i mod N, so the ranks hold about the same) and the others' `Elsewhere` gives zeros to the
layer's all-reduce: exact (x + 0 = x), no extra collective, nobody computes it twice. The experts
are not placed so (a layer's MoE on one rank would leave the others idle): a split that cuts
their groups (704 / 2 = 352 is 5.5 groups of 64) is a one-line `ShardError` saying to use expert
parallelism (whole experts: nothing cut) or a group size that divides; so is an o_proj whose
per-rank heads cut a group. Pre-quantised checkpoints (quant/read.py) are cut part by part:
rows with their scales, columns with whole groups of scales (quant/pack.py's `cut_qtensor`),
each module (each expert, in per-expert files) read whole and cut at once; float tensors are
read as slices.

Not here: the vision tower (left whole: rank 0 runs it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..kernels.cpu import release_freed_memory
from ..model.diffusion_gemma import DiffusionGemma, Experts
from ..quant import schemes
from ..quant.formats import check_scheme, quantize, scale_amax
from ..quant.modules import LINEAR_TARGETS, QuantExperts, QuantLinear, quantize_stacked
from .group import ShardGroup
from .plan import ShardError, ShardPlan


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

    def __deepcopy__(self, memo) -> VocabColumns:
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


@dataclass(frozen=True)
class Cut:
    """What a rank holds of one of the full model's tensors: its spans [start, end) along `dim`,
    concatenated in order (an expert's gate and up halves are two spans); no spans: all of it."""

    dim: int = 0
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def whole(self) -> bool:
        return not self.spans

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This cut of `t`: a copy where it cuts (the full tensor can be freed), `t` where whole."""
        if self.whole:
            return t
        if t.is_meta:  # (copying meta tensors imports torch._dynamo: seconds of a process's start)
            shape = list(t.shape)
            shape[self.dim] = sum(e - s for s, e in self.spans)
            return torch.empty(shape, dtype=t.dtype, device="meta")
        pieces = [t.narrow(self.dim, s, e - s) for s, e in self.spans]
        return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, self.dim)

    def index(self, span: tuple[int, int]) -> tuple[slice, ...]:
        """One span as an index (what safetensors' `get_slice(name)[...]` reads)."""
        return (slice(None),) * self.dim + (slice(*span),)


WHOLE = Cut()

# groups(name, inputs) -> (inputs that share one scale, scheme) of the row-parallel weight `name`
# (whose full input size is `inputs`), or None where its columns may be cut anywhere
Groups = Callable[[str, int], "tuple[int, str] | None"]


def no_groups(name: str, inputs: int) -> None:
    return None


def scheme_groups(scheme: str, group_size: int | None) -> Groups:
    """`Groups` of a model quantised to `scheme` while loading (its group rule: int4's groups,
    nvfp4's 16 inputs); a scheme with a scale per output channel (fp8, int8) has none: a column
    split keeps its channels (`_whole_amax`)."""
    known = schemes.find(scheme)  # an unknown name: refused where it is quantised, with the choices
    inputs = known.group.inputs(group_size) if known is not None else None
    return (lambda name, full: (inputs, scheme)) if inputs else no_groups


def stored_groups(stored) -> Groups:
    """`Groups` of a pre-quantised checkpoint's weights (quant/read.py's `QuantizedWeights`), each
    by its config group (a per-channel int4 weight's one group is its whole row)."""

    def groups(name: str, inputs: int) -> tuple[int, str] | None:
        if name not in stored:
            return None
        g = stored.group(name)
        rule = schemes.get(g.scheme).group
        return None if rule.per_channel else (rule.fixed or g.group_size or inputs, g.scheme)

    return groups


@dataclass(frozen=True)
class RankLayout:
    """Rank `rank`'s share of every tensor of the full model under `plan` (`cut`), and the layers
    whose dense MLP one rank holds whole because a split would cut its quantisation groups
    (`owners`: layer -> rank). Build with `RankLayout.build`."""

    plan: ShardPlan
    rank: int
    owners: dict[int, int] = field(default_factory=dict)

    @classmethod
    def build(cls, plan: ShardPlan, rank: int, groups: Groups = no_groups) -> RankLayout:
        """The layout, or a one-line `ShardError` where a split would cut the quantisation groups
        (`groups`) of an o_proj or of the experts (whose fix is expert parallelism or a group size)."""
        c, owners = plan.config, {}
        for i, spec in enumerate(c.layers if plan.size > 1 else ()):
            width = plan.ranks[0].heads[i].num_query * spec.head_dim
            g = groups(f"layers.{i}.self_attn.o_proj.weight", c.num_heads * spec.head_dim)
            if g and width % g[0]:
                raise ShardError(
                    f"layers.{i}.self_attn.o_proj: the {width} inputs each of {plan.size} ranks holds are "
                    f"not whole {g[1]} groups of {g[0]}: choose a group size that divides {width}"
                )
            g = groups(f"layers.{i}.mlp.down_proj.weight", c.intermediate_size)
            if g and (c.intermediate_size // plan.size) % g[0]:
                owners[i] = i % plan.size
            moe = c.moe_intermediate_size // plan.size
            g = None if plan.expert_parallel else groups(f"layers.{i}.experts.down_proj", c.moe_intermediate_size)
            if g and moe % g[0]:
                raise ShardError(
                    f"layers.{i}.experts: the {moe} of each expert's intermediate each of {plan.size} ranks "
                    f"holds are not whole {g[1]} groups of {g[0]}: use expert parallelism, or a group size "
                    f"that divides {moe}"
                )
        return cls(plan, rank, owners)

    def cut(self, name: str) -> Cut | None:
        """What this rank holds of the full model's tensor `name` (WHOLE: all of it), or None: another
        rank holds it (a dense MLP placed whole)."""
        if self.plan.size == 1:
            return WHOLE
        mine, c, f = self.plan.ranks[self.rank], self.plan.config, name.split(".")
        if name == "embed_tokens.weight":
            return Cut(0, (mine.vocab,))
        if f[0] == "layers" and len(f) >= 4:
            i, module, leaf = int(f[1]), f[2], f[3]
            if module == "self_attn" and leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
                h, d = mine.heads[i], c.layers[i].head_dim
                span = (h.query[0] * d, h.query[1] * d) if leaf in ("q_proj", "o_proj") else (h.kv[0] * d, h.kv[1] * d)
                return Cut(1 if leaf == "o_proj" else 0, (span,))
            if module == "mlp":
                if i in self.owners:
                    return WHOLE if self.owners[i] == self.rank else None
                return Cut(1 if leaf == "down_proj" else 0, (mine.intermediate,))
            if module == "experts":
                if self.plan.expert_parallel:
                    return Cut(0, (mine.experts,))
                (s, e), n = mine.moe_intermediate, c.moe_intermediate_size
                return Cut(1, ((s, e), (n + s, n + e))) if leaf == "gate_up_proj" else Cut(2, ((s, e),))
        if f[0] == "self_conditioning" and f[1] in ("gate_proj", "up_proj", "down_proj"):
            return Cut(1 if f[1] == "down_proj" else 0, (mine.intermediate,))
        return WHOLE

    def target(self, name: str) -> str:
        """Where the full model's tensor `name` sits in the cut one (whole experts: inside `ExpertShard`)."""
        f = name.split(".")
        if self.plan.size > 1 and self.plan.expert_parallel and f[0] == "layers" and len(f) >= 4 and f[2] == "experts":
            return ".".join([*f[:3], "experts", *f[3:]])
        return name


class Elsewhere(nn.Module):
    """A layer's dense MLP that another rank (`owner`) holds whole, because a split would cut its
    quantisation groups: zeros here, so the layer's all-reduce adds the owner's output unchanged
    (x + 0 = x: exact, bit for bit what one process computes with the owner's kernels)."""

    def __init__(self, owner: int):
        super().__init__()
        self.owner = owner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    def extra_repr(self) -> str:
        return f"held by rank {self.owner}"


def _linear(module: nn.Module, name: str) -> nn.Linear:
    if type(module) is not nn.Linear:
        raise ShardError(
            f"{name} is a {type(module).__name__}: only unquantised nn.Linear weights are cut "
            "(shard the unquantised model, with quantization=..., before packing)"
        )
    return module


def _check_cuttable(net: DiffusionGemma, layout: RankLayout) -> None:
    """A module the cut cannot resize (quantised, packed) is a ShardError before anything is cut."""
    for i, layer in enumerate(net.layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if getattr(layer.self_attn, proj) is not None:
                _linear(getattr(layer.self_attn, proj), f"layers.{i}.self_attn.{proj}")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            _linear(getattr(layer.mlp, proj, None), f"layers.{i}.mlp.{proj}")
        if type(layer.experts) is not Experts:
            raise ShardError(
                f"layers.{i}.experts is a {type(layer.experts).__name__}: only unquantised Experts are cut"
            )
    for proj in ("gate_proj", "up_proj", "down_proj"):
        _linear(getattr(net.self_conditioning, proj), f"self_conditioning.{proj}")


def _cut(net: DiffusionGemma, layout: RankLayout, group: ShardGroup) -> None:
    """Cut `net` (the full model, float or on the meta device) to `layout`'s shares, in place, and
    set its reduce points."""
    plan, rank = layout.plan, layout.rank
    mine = plan.ranks[rank]
    for i, owner in layout.owners.items():
        if owner != rank:
            net.layers[i].mlp = Elsewhere(owner)
    for name, p in list(net.named_parameters()):
        cut = layout.cut(name)
        if cut is not None and not cut.whole:
            module_name, _, attr = name.rpartition(".")
            net.get_submodule(module_name)._parameters[attr] = nn.Parameter(
                cut.of(p.detach()), requires_grad=p.requires_grad
            )
    for module in net.modules():
        if type(module) is nn.Linear:
            module.out_features, module.in_features = module.weight.shape
    net.embed_tokens.num_embeddings = mine.vocab[1] - mine.vocab[0]
    reduce = AllReduce(group)
    for i, layer in enumerate(net.layers):
        attn, heads = layer.self_attn, mine.heads[i]
        attn.num_heads = heads.num_query
        attn.spec = replace(attn.spec, num_kv_heads=heads.num_kv)
        if plan.expert_parallel:
            e0, e1 = mine.experts
            layer.experts.num_experts = e1 - e0
            layer.experts = ExpertShard(layer.experts, e0, e1 - e0)
        layer.reduce = reduce
    net.reduce = reduce
    v0, v1 = mine.vocab
    net.lookup = VocabLookup(v0, v1, reduce)
    columns = VocabColumns(group, net.config.vocab_size, v0, v1)
    net.gather_vocab, net.own_vocab = columns.gather, columns.own


def _whole_amax(w: torch.Tensor, scheme: str, cut: Cut | None, group: ShardGroup) -> torch.Tensor | None:
    """`formats.scale_amax` of the whole weight this rank's `w` is `cut` from: the max of the ranks'
    (one all-reduce) where the cut splits what it is taken over (the scheme's `amax_dims`: fp8 /
    int8 the columns of an output channel; nvfp4 any cut of a 2D weight); None where `w`'s own
    is the whole's (int4's groups; whole experts; fp8 / int8 rows)."""
    if cut is None or cut.whole or cut.dim - w.dim() not in schemes.get(scheme).amax_dims:
        return None
    amax = scale_amax(w, scheme)
    return group.all_reduce(amax.reshape(-1).contiguous(), op="max").view(amax.shape)


def quantize_shard_layer(
    net: DiffusionGemma, index: int, layout: RankLayout, group: ShardGroup, scheme: str, group_size: int | None
) -> None:
    """`quant.modules.quantize_layer` for this rank's cut of layer `index`: each weight quantised
    with the whole weight's statistics (`_whole_amax`), so the rank holds exactly its cut of what
    one process quantises. Every rank calls it for the same layers in the same order (the
    all-reduces pair up)."""
    layer = net.layers[index]
    dtype = layer.input_layernorm.weight.dtype
    for path in LINEAR_TARGETS:
        parent_name, _, child = path.rpartition(".")
        parent = layer.get_submodule(parent_name)
        linear = getattr(parent, child, None)
        if type(linear) is not nn.Linear:  # a K=V layer's v_proj; an MLP another rank holds
            continue
        w = linear.weight.detach()
        amax = _whole_amax(w, scheme, layout.cut(f"layers.{index}.{path}.weight"), group)
        parent._modules[child] = QuantLinear(quantize(w, scheme, group_size, dtype, amax))
    holder = layer.experts if isinstance(layer.experts, ExpertShard) else layer
    experts = holder.experts
    if type(experts) is Experts:
        q = {}
        for which in ("gate_up_proj", "down_proj"):
            w = getattr(experts, which).detach()
            amax = _whole_amax(w, scheme, layout.cut(f"layers.{index}.experts.{which}"), group)
            q[which] = quantize_stacked(lambda e, w=w: w[e], experts.num_experts, scheme, group_size, dtype, amax)
        holder._modules["experts"] = QuantExperts(q["gate_up_proj"], q["down_proj"], experts.approximate)
    release_freed_memory()


@torch.no_grad()
def shard_model(
    net: DiffusionGemma,
    group: ShardGroup,
    expert_parallel: bool = False,
    quantization: tuple[str, int | None] | None = None,
) -> DiffusionGemma:
    """Cut `net` (the full model, the same on every rank: unquantised float weights, not yet
    packed) to rank `group.rank`'s share, in place, and set its reduce points to all-reduce over
    `group`; with `quantization` (scheme, group size), then quantise the rank's share (exactly
    its cut of the whole quantised model). Returns `net`, with `net.shards` (the group),
    `net.shard_plan` and `net.shard_layout`. A size that does not split is a one-line
    `ShardError` before anything is cut."""
    if net.shards is not None:
        raise ShardError("the model is already sharded")
    if net.quantization is not None:
        raise ShardError(
            f"sharding a model already quantised to {net.quantization[0]} is not supported: shard the "
            "unquantised model with quantization=(scheme, group size)"
        )
    if net.lm_head_kernel is not None or net.soft_embed_kernel is not None:
        raise ShardError("the model has kernel replacements: shard the loaded model, then choose its kernels")
    scheme, group_size = quantization if quantization is not None else (None, None)
    if scheme is not None:
        group_size = schemes.get(scheme).group.chosen(group_size)
        check_scheme(scheme, group_size)
    plan = ShardPlan.build(net.config, group.size, expert_parallel)
    layout = RankLayout.build(plan, group.rank, scheme_groups(scheme, group_size) if scheme else no_groups)
    if group.size > 1:
        _check_cuttable(net, layout)
        _cut(net, layout, group)
    net.shards, net.shard_plan, net.shard_layout = group, plan, layout
    if scheme is not None:
        for i in range(len(net.layers)):
            quantize_shard_layer(net, i, layout, group, scheme, group_size)
        net.quantization = (scheme, group_size)
    return net


class ShardedLoad:
    """How model/weights.py's `load_weights` reads one rank's share of a checkpoint, so that no
    rank holds the whole model: it builds the model on the meta device and `cut`s it (each
    parameter then has its share's size), reads each tensor's `held` slice from its file
    (safetensors' `get_slice`), and quantises each layer as read (`quantize_layer`) or reads a
    pre-quantised module's cut (`read_quantized`). The tensors are `shard_model`'s of the full
    model (the same `RankLayout`)."""

    def __init__(self, group: ShardGroup, expert_parallel: bool = False):
        self.group, self.expert_parallel = group, expert_parallel
        self.layout: RankLayout | None = None

    def cut(
        self, model: DiffusionGemma, quantization: tuple[str, int | None] | None = None, stored=None
    ) -> DiffusionGemma:
        """`model` (the full model on the meta device) cut to this rank's shapes, in place.
        `quantization`: the (scheme, group size) it is quantised to while loading; `stored`: the
        checkpoint's quantised weights (quant/read.py); their groups a split keeps whole."""
        plan = ShardPlan.build(model.config, self.group.size, self.expert_parallel)
        groups = (
            stored_groups(stored) if stored is not None else scheme_groups(*quantization) if quantization else no_groups
        )
        self.layout = RankLayout.build(plan, self.group.rank, groups)
        if self.group.size > 1:
            _cut(model, self.layout, self.group)
        model.shards, model.shard_plan, model.shard_layout = self.group, plan, self.layout
        return model

    def held(self, name: str) -> tuple[str, Cut] | None:
        """Where the full model's tensor `name` goes in the cut model and what of it to read; None:
        this rank holds none of it."""
        cut = self.layout.cut(name)
        return None if cut is None else (self.layout.target(name), cut)

    def quantize_layer(self, model: DiffusionGemma, index: int, scheme: str, group_size: int | None) -> None:
        quantize_shard_layer(model, index, self.layout, self.group, scheme, group_size)

    def read_quantized(self, stored, name: str):
        """This rank's cut of the pre-quantised weight `name` (a QTensor), read module by module."""
        cut = self.layout.cut(name)
        return stored[name] if cut.whole else stored.read(name, cut.dim, cut.spans)


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

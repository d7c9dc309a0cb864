"""The sharded model (dgemma/parallel/shard.py, plan.py) on the worker's ranks: every rank builds
the same random full model (same seed), runs it whole, then cuts a copy to its share and runs
that; the gathered logits of encode -> decode (without and with self-conditioning) -> encode ->
decode match the whole model's (float32, rtol = atol = 1e-4: the reduction order differs) and
the router picks the same experts. Plus the plan's splits, its one-line refusals and its per-rank
byte counts (equal to what a sharded model holds)."""

from __future__ import annotations

import copy
import re

import torch

from dgemma.config import GLOBAL, SLIDING
from dgemma.dense.kv_cache import DenseKVCache
from dgemma.memory_plan import rank_kv_bytes_per_token, rank_weight_bytes
from dgemma.model.checkpoint import make_config, random_model
from dgemma.model.presets import PRESETS
from dgemma.parallel.group import ShardGroup
from dgemma.parallel.plan import ShardError, ShardPlan
from dgemma.parallel.shard import gather_logits, shard_model, soft_embed_from_logits
from dgemma.quant.modules import weight_bytes as held_bytes

TOL = dict(rtol=1e-4, atol=1e-4)
LAYERS = [SLIDING, SLIDING, GLOBAL, SLIDING, GLOBAL]

# Sliding layers 4 heads / 2 KV heads (split), K=V global layers with 1 KV head (replicated on 2
# ranks), a vocabulary that 64 does not divide (shards 512 + 491), top-2 of 4 experts.
GQA = dict(
    vocab_size=1003,
    hidden_size=32,
    num_layers=5,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    global_head_dim=16,
    num_global_kv_heads=1,
    intermediate_size=64,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=16,
    sliding_window=4,
    canvas_length=8,
    layer_types=LAYERS,
    max_position_embeddings=256,
)
# The released model's divisibility (intermediate 2112 -> 1056, moe 704 -> 352 per rank; 8 query
# heads, KV heads 4 sliding / 2 global: split) at a small hidden size; vocabulary 1000.
RELEASED = dict(
    vocab_size=1000,
    hidden_size=32,
    num_layers=3,
    num_heads=8,
    num_kv_heads=4,
    head_dim=4,
    global_head_dim=8,
    num_global_kv_heads=2,
    intermediate_size=2112,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=704,
    sliding_window=4,
    canvas_length=8,
    layer_types=[SLIDING, GLOBAL, GLOBAL],
    max_position_embeddings=256,
)


def _passes(net, cache_config, group: ShardGroup | None, seed: int = 1) -> dict[str, torch.Tensor]:
    """Full logits [B, T, vocab] of prompt encode, canvas decode without then with self-conditioning,
    canvas encode (commit), next canvas decode; the self-conditioning input; the router's top-k."""
    vocab = net.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (2, 6), generator=gen)
    canvas = torch.randint(0, vocab, (2, net.config.canvas_length), generator=gen)
    canvas2 = torch.randint(0, vocab, (2, net.config.canvas_length), generator=gen)
    previous = torch.randn(2, net.config.canvas_length, vocab, generator=gen) * 3  # a previous step's logits
    picks: list[torch.Tensor] = []
    hooks = [layer.router.register_forward_hook(lambda m, i, out: picks.append(out[2].clone())) for layer in net.layers]

    def full(logits):
        return logits if group is None else gather_logits(logits, group, vocab)

    out = {}
    cache = DenseKVCache(cache_config, 2, 6 + 2 * net.config.canvas_length, "cpu", net.dtype)
    try:
        with torch.no_grad():
            plan = cache.plan_encoder(6)
            out["prompt"] = full(net.logits(net.encode(prompt, plan)))
            cache.commit(plan)
            out["canvas"] = full(net.logits(net.decode(canvas, cache.plan_decoder(canvas.shape[1]), None)))
            if group is None:
                soft = net.soft_embed_from_logits(previous)
            else:
                v0, v1 = net.shard_plan.ranks[group.rank].vocab
                soft = soft_embed_from_logits(net, previous[..., v0:v1])
            out["soft"] = soft
            out["conditioned"] = full(net.logits(net.decode(canvas, cache.plan_decoder(canvas.shape[1]), soft)))
            plan = cache.plan_encoder(canvas.shape[1])
            out["commit"] = full(net.logits(net.encode(canvas, plan)))
            cache.commit(plan)
            out["next"] = full(net.logits(net.decode(canvas2, cache.plan_decoder(canvas2.shape[1]), soft)))
    finally:
        for h in hooks:
            h.remove()
    out["experts"] = torch.cat(picks)
    return out


def _compare(shape: dict, group: ShardGroup, expert_parallel: bool, seed: int = 0, kernels: str | None = None) -> None:
    """`kernels`: the CPU kernel choice applied after sharding ("packed": kernels/cpu.py's packed
    copy, float32; "widened": a bf16 model run widened to float32, compared with the whole model's
    widened copy)."""
    from dgemma.kernels.cpu import packed_copy, supported, widened_copy

    config = make_config(**shape)
    whole = random_model(config, seed=seed, std=0.15)
    if kernels == "packed" and not supported(torch.float32):
        return
    if kernels == "widened":
        whole = whole.to(torch.bfloat16)
    want = _passes(widened_copy(whole) if kernels == "widened" else whole, config, None)
    net = shard_model(copy.deepcopy(whole), group, expert_parallel)
    plan = net.shard_plan
    net = {"packed": packed_copy, "widened": widened_copy}.get(kernels, lambda n: n)(net)
    got = _passes(net, plan.rank_config(group.rank), group)
    assert want["prompt"].abs().max() > 1.0, "logits too small to test anything"
    for key in ("prompt", "canvas", "soft", "conditioned", "commit", "next"):
        w, g = want[key], got[key]
        assert g.shape == w.shape, f"{key}: {tuple(g.shape)} != {tuple(w.shape)}"
        err = (g - w).abs().max().item()
        assert torch.allclose(g, w, **TOL), f"{key}: max |difference| {err:.3g}"
    assert torch.equal(got["experts"], want["experts"]), "the sharded router picked other experts"
    assert not torch.equal(want["canvas"], want["conditioned"]), "self-conditioning changed nothing"


def _sizes(net, plan: ShardPlan, rank: int) -> None:
    """What the sharded model holds is what the plan counts for its rank."""
    held = held_bytes(net)  # (it counts the attention's norms as attention, the plan as "other")
    planned = rank_weight_bytes(plan, rank, None, None, torch.float32)
    assert sum(held.values()) == sum(planned.values()), f"held {held} != planned {planned}"
    for part in ("experts", "dense", "embeddings"):
        assert held[part] == planned[part], f"{part}: held {held} != planned {planned}"


def check_gqa_tensor_parallel(group: ShardGroup) -> None:
    _compare(GQA, group, expert_parallel=False)


def check_gqa_expert_parallel(group: ShardGroup) -> None:
    _compare(GQA, group, expert_parallel=True, seed=1)


def check_released_divisibility(group: ShardGroup) -> None:
    _compare(RELEASED, group, expert_parallel=False, seed=2)


def check_kernels_after_sharding(group: ShardGroup) -> None:
    """The CPU kernel choice (engine_net's packed or widened copy) of a sharded model keeps its reduce
    points: replaced linears, MLPs, experts, embedding lookup and vocabulary matmuls included."""
    _compare(GQA, group, expert_parallel=False, seed=3, kernels="packed")
    _compare(GQA, group, expert_parallel=True, seed=3, kernels="packed")
    _compare(GQA, group, expert_parallel=True, seed=4, kernels="widened")


def check_shards_hold_what_the_plan_counts(group: ShardGroup) -> None:
    for shape, ep in ((GQA, False), (GQA, True), (RELEASED, False)):
        config = make_config(**shape)
        net = shard_model(random_model(config, seed=0), group, ep)
        _sizes(net, net.shard_plan, group.rank)
        mine = net.shard_plan.ranks[group.rank]
        assert net.embed_tokens.weight.shape[0] == mine.vocab[1] - mine.vocab[0]
        assert net.layers[2].self_attn.k_proj.weight.shape[0] == mine.heads[2].num_kv * config.layers[2].head_dim


def check_unsharded_is_unchanged(group: ShardGroup) -> None:
    """A one-rank group cuts nothing and the model's results are bit-identical."""
    config = make_config(**GQA)
    whole = random_model(config, seed=0, std=0.15)
    net = shard_model(copy.deepcopy(whole), ShardGroup.single())
    assert net.shard_plan.size == 1 and net.embed_tokens.weight.shape[0] == config.vocab_size
    want, got = _passes(whole, config, None), _passes(net, config, None)
    for key, w in want.items():
        assert torch.equal(got[key], w), key


def check_plan_splits(group: ShardGroup) -> None:
    """The released model's plans: KV heads split on 2 ranks, global ones replicated on 4."""
    real = make_config(**PRESETS["real"])
    two = ShardPlan.build(real, 2)
    r1 = two.ranks[1]
    glob = [i for i, s in enumerate(real.layers) if s.kind == GLOBAL]
    slide = [i for i, s in enumerate(real.layers) if s.kind == SLIDING]
    assert r1.heads[glob[0]].query == (8, 16) and r1.heads[glob[0]].kv == (1, 2) and r1.heads[glob[0]].replicas == 1
    assert r1.heads[slide[0]].kv == (4, 8)
    assert r1.intermediate == (1056, 2112) and r1.moe_intermediate == (352, 704) and r1.experts == (0, 128)
    four = ShardPlan.build(real, 4)
    assert [four.ranks[r].heads[glob[0]].kv for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert all(four.ranks[r].heads[glob[0]].replicas == 2 for r in range(4))
    assert [four.ranks[r].heads[slide[0]].kv for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    ep = ShardPlan.build(real, 4, expert_parallel=True)
    assert [ep.ranks[r].experts for r in range(4)] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert ep.ranks[3].moe_intermediate == (0, 704)
    assert two.ranks[0].vocab == (0, 131072) and two.ranks[1].vocab == (131072, 262144)
    # KV bytes per token per rank (bf16): 2 of 8 sliding KV heads of 256, 1 of 2 global of 512 (replicated)
    kv = rank_kv_bytes_per_token(four, 0, 2)
    n_slide, n_glob = len(slide), len(glob)
    assert kv == {SLIDING: n_slide * 2 * 2 * 256 * 2, GLOBAL: n_glob * 2 * 1 * 512 * 2}
    # 4 ranks' weights: the replicated parts 4 times, the rest once
    full = sum(rank_weight_bytes(ShardPlan.build(real, 1), 0, None, None, torch.bfloat16).values())
    per_rank = [sum(rank_weight_bytes(four, r, None, None, torch.bfloat16).values()) for r in range(4)]
    assert len(set(per_rank)) == 1 and full / 4 < per_rank[0] < full / 3.5


def check_plan_refusals(group: ShardGroup) -> None:
    """Sizes that cannot be split: one line each, naming what does not divide."""
    from dataclasses import replace

    base = make_config(**GQA)
    six = replace(base, num_heads=6, layers=tuple(replace(s, num_kv_heads=3) for s in base.layers))
    cases = [
        (base, 3, False, r"4 attention heads do not split across 3 ranks"),
        (replace(base, intermediate_size=66), 4, False, r"intermediate_size 66 does not split across 4 ranks"),
        (
            replace(base, moe_intermediate_size=18),
            4,
            False,
            r"moe_intermediate_size 18 does not split across 4 ranks; try expert parallelism",
        ),
        (replace(base, num_experts=6), 4, True, r"6 experts do not split across 4 ranks \(expert parallelism\)"),
        (
            six,
            2,
            False,
            (
                r"layer 0: 3 query heads per rank straddle the groups of 2 query heads that share each "
                r"of its 3 KV heads \(2 ranks\)"
            ),
        ),
        (replace(base, vocab_size=32), 2, False, r"vocabulary of 32 leaves rank 1 of 2 no rows"),
        (base, 0, False, r"tensor parallel size must be an integer >= 1 \(got 0\)"),
    ]
    for config, size, ep, message in cases:
        try:
            ShardPlan.build(config, size, ep)
        except ShardError as e:
            assert "\n" not in str(e) and re.search(message, str(e)), str(e)
        else:
            raise AssertionError(f"no ShardError for {message}")
    assert ShardPlan.build(replace(base, moe_intermediate_size=18), 2, True).ranks[1].experts == (2, 4)
    net = shard_model(random_model(base, seed=0), group)
    try:
        shard_model(net, group)
    except ShardError as e:
        assert str(e) == "the model is already sharded"
    else:
        raise AssertionError("sharded twice")

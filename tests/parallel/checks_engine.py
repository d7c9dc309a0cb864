"""The engine on a model cut across the worker's ranks: `generate` on every rank (the same
prompts and seeds: each rank's scheduler replica makes the same decisions) gives the tokens the
whole model gives in one process, in default mode, with expert parallelism and with turbo, on the
shipped dgemma-tiny (trained, so its decisions have margins a random model's lack)."""

from __future__ import annotations

import copy
from functools import lru_cache

import torch

import dgemma
from dgemma.api import Model
from dgemma.parallel.group import ShardGroup
from dgemma.parallel.shard import shard_model

PROMPTS = ["def add(a, b):\n    return", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]


@lru_cache(maxsize=1)
def _tiny() -> Model:
    return dgemma.load(dtype="float32")


def _sharded(group: ShardGroup, expert_parallel: bool = False) -> Model:
    whole = _tiny()
    return Model(shard_model(copy.deepcopy(whole.net), group, expert_parallel), whole.generation_config, whole.tokenizer)


def _same_tokens(group: ShardGroup, expert_parallel: bool = False, seed=(3, 4, 5), **knobs) -> None:
    whole, cut = _tiny(), _sharded(group, expert_parallel)
    ids = [whole.tokenizer.encode(p) for p in PROMPTS]
    seed = list(seed) if isinstance(seed, tuple) else seed
    want = whole.generate(ids, max_new_tokens=48, seed=seed, **knobs)
    got = cut.generate(ids, max_new_tokens=48, seed=seed, **knobs)
    assert got.sequences == want.sequences, (got.sequences, want.sequences)
    assert got.decoder_passes == want.decoder_passes
    every = group.all_gather(torch.tensor([sum(map(len, got.sequences)), sum(got.decoder_passes)]))
    assert bool((every == every[0]).all()), every  # every rank produced the same answer


def check_generate_default_mode(group: ShardGroup) -> None:
    _same_tokens(group)


def check_generate_expert_parallel(group: ShardGroup) -> None:
    _same_tokens(group, expert_parallel=True)


def check_generate_turbo(group: ShardGroup) -> None:
    _same_tokens(group, turbo=True)


def _logprobs(model: Model, prompt: list[int], seed: int) -> list:
    """The committed tokens' log probabilities (3 alternatives) of one request run on the engine."""
    from dgemma.engine.engine import Engine, Request

    engine = Engine(model.engine_net)
    engine.add(Request(prompt, model.generation_config.with_overrides(max_new_tokens=16), seed, top_logprobs=3))
    out = []
    while engine.has_work:
        out += [lp for e in engine.step() if getattr(e, "logprobs", None) for lp in e.logprobs]
    return out


def check_engine_logprobs(group: ShardGroup) -> None:
    whole, cut = _tiny(), _sharded(group)
    prompt = whole.tokenizer.encode(PROMPTS[0])
    want, got = _logprobs(whole, prompt, 7), _logprobs(cut, prompt, 7)
    assert len(got) == len(want) == 16
    for a, b in zip(got, want):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4, (a, b)
        assert [t for t, _ in a.top] == [t for t, _ in b.top], (a.top, b.top)


def check_generate_reference_mode(group: ShardGroup) -> None:
    """The reference sampler reads whole logits rows (gathered from the ranks) and draws from
    torch's global stream, seeded the same on every rank."""
    _same_tokens(group, seed=11, sampling="reference")


def check_canvas_logits_and_ar_mode(group: ShardGroup) -> None:
    whole, cut = _tiny(), _sharded(group)
    ids = [whole.tokenizer.encode(p) for p in PROMPTS[:2]]
    canvas = [[5 + i for i in range(whole.config.canvas_length)]] * 2
    previous = torch.randn(2, whole.config.canvas_length, whole.config.vocab_size, generator=torch.Generator().manual_seed(0))
    want = whole.canvas_logits(ids, canvas, self_conditioning_logits=previous)
    got = cut.canvas_logits(ids, canvas, self_conditioning_logits=previous)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert whole.generate(ids, max_new_tokens=12, mode="ar").sequences == cut.generate(ids, max_new_tokens=12, mode="ar").sequences


def check_load_tensor_parallel(group: ShardGroup) -> None:
    """`dgemma.load(tensor_parallel_size=2)` on each rank: the same tokens as the whole model at a
    given seed; with no seed, rank 0's random seeds reach every rank (their answers agree)."""
    whole = _tiny()
    cut = dgemma.load(dtype="float32", tensor_parallel_size=2)
    assert cut.net.shards.size == 2 and cut.net.embed_tokens.weight.shape[0] == 2048
    ids = [whole.tokenizer.encode(p) for p in PROMPTS[:2]]
    assert cut.generate(ids, max_new_tokens=24, seed=[1, 2]).sequences == whole.generate(ids, max_new_tokens=24, seed=[1, 2]).sequences
    mine = cut.generate(ids, max_new_tokens=24).sequences
    every = [None] * group.size
    torch.distributed.all_gather_object(every, mine)
    assert every[0] == every[1]
    try:
        dgemma.load(dtype="float32", tensor_parallel_size=3)
    except ValueError as e:
        assert str(e) == "4 attention heads do not split across 3 ranks", e
    else:
        raise AssertionError("tensor_parallel_size=3 was accepted")

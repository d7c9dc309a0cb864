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


def _same_tokens(group: ShardGroup, expert_parallel: bool = False, **knobs) -> None:
    whole, cut = _tiny(), _sharded(group, expert_parallel)
    ids = [whole.tokenizer.encode(p) for p in PROMPTS]
    want = whole.generate(ids, max_new_tokens=48, seed=[3, 4, 5], **knobs)
    got = cut.generate(ids, max_new_tokens=48, seed=[3, 4, 5], **knobs)
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

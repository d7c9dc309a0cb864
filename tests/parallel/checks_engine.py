"""The engine on a model cut across the worker's ranks: `generate` on every rank (the same
prompts and seeds: each rank's scheduler replica makes the same decisions) gives the tokens the
whole model gives in one process, in default mode, with expert parallelism, with turbo and in
reference mode, on the shipped dgemma-tiny (trained, so its decisions have margins a random
model's lack), and every decision the whole model's sampler made on the way clears 1e-4
(margins.py: argmax gaps, CDF margins of the sampled tokens, the entropy-bound cut, the stopping
rule's confidence test, turbo's freeze test), so that rounding cannot be what makes them agree.
The engine's other features on the cut model: the prefix cache across calls, continuous batching
of streams started at different steps (one batched decoder pass), drafts, infill."""

from __future__ import annotations

import copy
from functools import cache, lru_cache

import torch
from margins import FLOOR, measured

import dgemma
from dgemma.api import Model
from dgemma.engine.events import Block, Draft
from dgemma.parallel.group import ShardGroup
from dgemma.parallel.shard import shard_model

PROMPTS = ["def add(a, b):\n    return", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]
# what each mode's whole-model run must have measured (reference mode's multinomial draws cannot be)
EXACT = ("argmax", "argmax_logit", "sample", "accept", "accept_order", "confidence")
REFERENCE = ("argmax", "argmax_logit", "accept", "accept_order", "confidence")
TURBO = (*EXACT, "freeze", "dormant")


@lru_cache(maxsize=1)
def _tiny() -> Model:
    return dgemma.load(dtype="float32")


def _fresh(model: Model, **options) -> Model:
    """The same network with an engine of its own (empty prefix cache, zero stats), with `options`."""
    out = Model(model.net, model.generation_config, model.tokenizer)
    if options:
        out.configure_engine(**options)
    return out


def _sharded(group: ShardGroup, expert_parallel: bool = False) -> Model:
    whole = _tiny()
    return Model(
        shard_model(copy.deepcopy(whole.net), group, expert_parallel), whole.generation_config, whole.tokenizer
    )


@cache
def _whole_generate(seed, knobs: tuple, tokens: int = 48) -> tuple:
    """The whole model's `generate` of PROMPTS (`tokens` new: 48 is two canvases) and the margins
    of its decisions (cached: expert parallelism and the load check compare with default mode's run)."""
    whole = _tiny()
    ids = [whole.tokenizer.encode(p) for p in PROMPTS]
    with measured() as margins:
        out = whole.generate(
            ids, max_new_tokens=tokens, seed=list(seed) if isinstance(seed, tuple) else seed, **dict(knobs)
        )
    return out, margins


def _same_tokens(
    group: ShardGroup,
    expert_parallel: bool = False,
    seed=(3, 4, 5),
    kinds=EXACT,
    tokens: int = 48,
    cut: Model | None = None,
    **knobs,
) -> None:
    whole, cut = _tiny(), cut or _sharded(group, expert_parallel)
    want, margins = _whole_generate(seed, tuple(sorted(knobs.items())), tokens)
    margins.assert_above(FLOOR, kinds, what=f"whole model, seed {seed}, {knobs}")
    ids = [whole.tokenizer.encode(p) for p in PROMPTS]
    got = cut.generate(ids, max_new_tokens=tokens, seed=list(seed) if isinstance(seed, tuple) else seed, **knobs)
    assert got.sequences == want.sequences, (got.sequences, want.sequences)
    assert got.decoder_passes == want.decoder_passes
    every = group.all_gather(torch.tensor([sum(map(len, got.sequences)), sum(got.decoder_passes)]))
    assert bool((every == every[0]).all()), every  # every rank produced the same answer


def check_generate_default_mode(group: ShardGroup) -> None:
    _same_tokens(group)


def check_generate_expert_parallel(group: ShardGroup) -> None:
    _same_tokens(group, expert_parallel=True)


def check_generate_turbo(group: ShardGroup) -> None:
    _same_tokens(group, kinds=TURBO, tokens=32, turbo=True)


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
    _same_tokens(group, seed=11, kinds=REFERENCE, tokens=32, sampling="reference")


def check_canvas_logits_and_ar_mode(group: ShardGroup) -> None:
    whole, cut = _tiny(), _sharded(group)
    ids = [whole.tokenizer.encode(p) for p in PROMPTS[:2]]
    canvas = [[5 + i for i in range(whole.config.canvas_length)]] * 2
    previous = torch.randn(
        2, whole.config.canvas_length, whole.config.vocab_size, generator=torch.Generator().manual_seed(0)
    )
    want = whole.canvas_logits(ids, canvas, self_conditioning_logits=previous)
    got = cut.canvas_logits(ids, canvas, self_conditioning_logits=previous)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (
        whole.generate(ids, max_new_tokens=12, mode="ar").sequences
        == cut.generate(ids, max_new_tokens=12, mode="ar").sequences
    )


def check_load_tensor_parallel(group: ShardGroup) -> None:
    """`dgemma.load(tensor_parallel_size=2)` on each rank: the rank's vocabulary share; with no
    seed, rank 0's random seeds reach every rank (their answers agree); a size that cannot split
    is one line."""
    cut = dgemma.load(dtype="float32", tensor_parallel_size=2)
    assert cut.net.shards.size == 2 and cut.net.embed_tokens.weight.shape[0] == 2048
    # (its tokens at a seed: check_generate_int4 compares a model loaded this way with one process)
    mine = cut.generate([cut.tokenizer.encode(PROMPTS[0])], max_new_tokens=16).sequences
    every = [None] * group.size
    torch.distributed.all_gather_object(every, mine)
    assert every[0] == every[1]
    try:
        dgemma.load(dtype="float32", tensor_parallel_size=3)
    except ValueError as e:
        assert str(e) == "4 attention heads do not split across 3 ranks", e
    else:
        raise AssertionError("tensor_parallel_size=3 was accepted")


# ---------------------------------------------------------------- the engine's features on the cut model
def _same_events(got: list, want: list, what: str) -> None:
    """Stream events equal: drafts' canvases, accepted and frozen positions and blocks exactly,
    drafts' entropies within 1e-4 (they carry 4 decimals: values a rounding apart may show one
    unit apart), blocks' tokens and passes exactly."""
    assert len(got) == len(want), f"{what}: {len(got)} events vs {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert type(a) is type(b), f"{what}: event {i} is a {type(a).__name__}, want a {type(b).__name__}"
        if isinstance(a, Draft):
            assert (a.block, a.step, a.canvas, a.accepted, a.frozen) == (
                b.block,
                b.step,
                b.canvas,
                b.accepted,
                b.frozen,
            ), (what, i, a, b)
            gap = max(abs(x - y) for x, y in zip(a.entropy, b.entropy))
            assert len(a.entropy) == len(b.entropy) and gap <= 1e-4 * (1 + 1e-6), (
                f"{what}: event {i}: entropies {gap:.3g} apart"
            )
        else:
            assert (a.block, a.tokens, a.done, a.decoder_passes) == (b.block, b.tokens, b.done, b.decoder_passes), (
                what,
                i,
                a,
                b,
            )


def check_prefix_cache(group: ShardGroup) -> None:
    """Two calls on one model whose prompts share two blocks: the second finds them in the
    prefix cache, on the cut model as in one process (the same cached tokens), with the same tokens."""
    whole, cut = _fresh(_tiny()), _sharded(group)
    stack = PROMPTS[2] + "        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n"
    stack += "    def pop(self):\n        return self.items.pop()\n\n    def peek(self):\n        return self.items[-1]\n\n    def size(self):\n"
    first, second = (
        whole.tokenizer.encode(stack + tail) for tail in ("        return len(self.items)\n", "        n = 0\n")
    )
    block = whole.engine.scheduler.options.block_size
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 2 * block, f"the prompts share {shared} tokens, fewer than 2 blocks of {block}"

    def two_calls(model: Model) -> tuple:
        outs = [model.generate([p], max_new_tokens=16, seed=[s]).sequences for p, s in ((first, 1), (second, 2))]
        return outs, model.engine.stats.cached_tokens, model.engine.stats.prompt_tokens

    with measured() as margins:
        want = two_calls(whole)
    margins.assert_above(FLOOR, EXACT, what="whole model, prefix cache")
    got = two_calls(cut)
    assert got == want, (got, want)
    assert want[1] >= shared // block * block, f"{want[1]} cached tokens; the prompts share {shared}"


def _interleaved(model: Model, ids: list[list[int]]) -> tuple[list[list], int]:
    """Three draft streams of different lengths on one engine, started 3 and 6 steps apart and
    read in turn: each one's events, and the most requests the engine ran at once."""
    lengths, seeds = (48, 32, 16), (3, 4, 5)
    streams, events, most = [], [[] for _ in ids], 0
    for step in range(10_000):
        if step in (0, 3, 6) and len(streams) < len(ids):
            k = len(streams)
            streams.append(model.stream(ids[k], drafts=True, seed=seeds[k], max_new_tokens=lengths[k]))
        live = [k for k, s in enumerate(streams) if s is not None]
        if not live and len(streams) == len(ids):
            return events, most
        for k in live:
            try:
                events[k].append(next(streams[k]))
            except StopIteration:
                streams[k] = None
        most = max(most, len(model.engine.scheduler.running))
    raise AssertionError("the streams did not end")


def check_continuous_batching(group: ShardGroup) -> None:
    """Streams of 48, 32 and 16 tokens joining one engine at different steps, their canvases in
    one batched decoder pass (batch_invariant off, as on a GPU): every draft and block equals the
    whole model's doing the same."""
    whole, cut = _fresh(_tiny(), batch_invariant=False), _sharded(group)
    cut.configure_engine(batch_invariant=False)
    ids = [whole.tokenizer.encode(p) for p in PROMPTS]
    with measured() as margins:
        want, most = _interleaved(whole, ids)
    margins.assert_above(FLOOR, EXACT, what="whole model, interleaved streams")
    assert most == 3, f"at most {most} requests ran at once"
    got, _ = _interleaved(cut, ids)
    for k, (a, b) in enumerate(zip(got, want)):
        _same_events(a, b, f"stream {k}")


def check_stream_drafts_turbo(group: ShardGroup) -> None:
    """`stream(drafts=True, turbo=True)` with the default (batch-invariant) engine: every draft
    (canvas, accepted and frozen positions, entropies) and block equals the whole model's.
    (Exact drafts: check_continuous_batching.)"""
    whole, cut = _tiny(), _sharded(group)
    prompt = whole.tokenizer.encode(PROMPTS[1])
    with measured() as margins:
        want = list(whole.stream(prompt, drafts=True, seed=10, max_new_tokens=32, turbo=True))
    margins.assert_above(FLOOR, TURBO, what="whole model, turbo drafts")
    assert sum(isinstance(e, Draft) for e in want) > 3 and isinstance(want[-1], Block), want
    assert any(any(e.frozen) for e in want[:-1]), "turbo froze no position"
    _same_events(list(cut.stream(prompt, drafts=True, seed=10, max_new_tokens=32, turbo=True)), want, "turbo drafts")


def check_infill(group: ShardGroup) -> None:
    """`infill` (a canvas whose suffix positions are fixed, one request per candidate length,
    the most likely by mean log probability): the same text, length and scores (within 1e-4)
    as the whole model, with the best score more than 1e-4 above the next."""
    whole, cut = _tiny(), _sharded(group)
    prefix, suffix = "def area(width, height):\n    return ", "\n\n\ndef perimeter(width, height):\n"
    with measured() as margins:
        want = whole.infill(prefix, suffix, lengths=(3, 11), seed=5)
    margins.assert_above(FLOOR, EXACT, what="whole model, infill")
    ranked = sorted(want.scores.values(), reverse=True)
    assert ranked[0] - ranked[1] > FLOOR, want.scores
    got = cut.infill(prefix, suffix, lengths=(3, 11), seed=5)
    assert (got.text, got.tokens, got.span_length) == (want.text, want.tokens, want.span_length), (got, want)
    assert got.scores.keys() == want.scores.keys() and all(
        abs(got.scores[n] - want.scores[n]) < 1e-4 for n in want.scores
    ), (got, want)


def check_generate_int4(group: ShardGroup) -> None:
    """dgemma-tiny quantised to int4 while loading, cut across the ranks as it loads (each rank
    quantises its own slices): the tokens of the whole int4 model, its decisions' margins above 1e-4."""
    whole = dgemma.load(dtype="float32", quantization="int4")
    cut = dgemma.load(dtype="float32", quantization="int4", tensor_parallel_size=2)
    ids = [whole.tokenizer.encode(p) for p in PROMPTS[:2]]
    with measured() as margins:
        want = whole.generate(ids, max_new_tokens=32, seed=[3, 4])
    margins.assert_above(FLOOR, EXACT, what="whole int4 model, seeds 3, 4")
    got = cut.generate(ids, max_new_tokens=32, seed=[3, 4])
    assert got.sequences == want.sequences and got.decoder_passes == want.decoder_passes, (
        got.sequences,
        want.sequences,
    )

"""Grammars on a model cut by vocabulary: every rank walks the same canvas from the same grammar
state, reading the pass's weights through `PassRows` (each shard's top-k gathered once per pass,
one gather per position the candidates do not settle), never a gathered [C, V]; the tokens equal
the whole model's in one process, in default mode and with turbo, on the shipped dgemma-tiny."""

from __future__ import annotations

import contextlib

import torch
from checks_engine import PROMPTS, _sharded, _tiny

from dgemma.engine.constraints.grammar import CANDIDATES, held_rows, pass_rows
from dgemma.engine.host.step import turbo_rows
from dgemma.engine.sampler import pack_token_mask
from dgemma.engine.sharded import sampling
from dgemma.parallel.group import ShardGroup
from dgemma.parallel.plan import vocab_shard

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"[~^|]{4,12}"  # tokens the code prompts' passes rarely rank in their top 64: the fallback runs


@contextlib.contextmanager
def _gathers():
    """The shapes every `ShardGroup.all_gather` gathers meanwhile (this rank's part)."""
    shapes, gather = [], ShardGroup.all_gather

    def recording(self, t):
        shapes.append(tuple(t.shape))
        return gather(self, t)

    ShardGroup.all_gather = recording
    try:
        yield shapes
    finally:
        ShardGroup.all_gather = gather


def _same_tokens(group: ShardGroup, kind: str, spec, seed: list[int], **knobs) -> list[tuple]:
    whole, cut = _tiny(), _sharded(group)
    ids = [whole.tokenizer.encode(p) for p in PROMPTS[: len(seed)]]
    want = whole.generate(ids, max_new_tokens=32, seed=seed, grammar=whole.compile_grammar(kind, spec), **knobs)
    with _gathers() as shapes:
        got = cut.generate(ids, max_new_tokens=32, seed=seed, grammar=cut.compile_grammar(kind, spec), **knobs)
    assert got.sequences == want.sequences, (got.sequences, want.sequences)
    assert got.decoder_passes == want.decoder_passes
    every = group.all_gather(torch.tensor([sum(map(len, got.sequences)), sum(got.decoder_passes)]))
    assert bool((every == every[0]).all()), every  # every rank produced the same answer
    c, vocab = whole.config.canvas_length, whole.config.vocab_size
    biggest = max(torch.Size(s).numel() for s in shapes)
    assert biggest <= c * CANDIDATES * 2 < c * vocab // group.size, f"an all_gather of {biggest} values per rank"
    return shapes


def _walked(shapes: list[tuple], c: int) -> tuple[int, int]:
    """(candidate gathers, fallback rounds) among the recorded gathers."""
    return shapes.count((c, CANDIDATES, 2)), shapes.count((3,))


def check_grammar_generate(group: ShardGroup) -> None:
    """A JSON schema and a regex: the same tokens and passes as one process; the walks read the
    candidates (and, for the regex, the whole-row fallback) through the gathers, no [C, V] one."""
    c = _tiny().config.canvas_length
    candidates, _ = _walked(_same_tokens(group, "json_schema", SCHEMA, [3, 4]), c)
    assert candidates > 0, "the schema's walks never read the candidates"
    candidates, rounds = _walked(_same_tokens(group, "regex", REGEX, [5]), c)
    assert candidates > 0 and rounds > 0, (candidates, rounds)


def check_grammar_generate_turbo(group: ShardGroup) -> None:
    """Turbo's walk (frozen positions hold their token) on the sharded rows: the same tokens."""
    c = _tiny().config.canvas_length
    candidates, _ = _walked(_same_tokens(group, "json_schema", SCHEMA, [3, 4], turbo=True), c)
    assert candidates > 0, "turbo's walks never read the candidates"


def check_grammar_walk_on_random_weights(group: ShardGroup) -> None:
    """`refine` on random weights (the fallback runs too) reads the same tokens from the sharded
    `PassRows` as from the full rows, and turbo's held rows equal the [C, V] weights
    `turbo_rows` builds; the fallback alone: ties across the shards to the lower id, None
    where no allowed token weighs, and ranks asking for different positions raise."""
    model = _tiny()
    c, vocab = model.config.canvas_length, model.config.vocab_size
    start, end = vocab_shard(vocab, group.size, group.rank)
    first_end = vocab_shard(vocab, group.size, 0)[1]
    grammar = model.compile_grammar("regex", r"[a-z]{2,9}( [0-9]{1,4}){2,6}")
    g = torch.Generator().manual_seed(0)
    full = torch.rand(c, vocab, generator=g)
    full[3, 40] = full[3, first_end + 1] = full[3, 7] = 5.0  # a tie across the shards
    full[4, 9] = 0.0
    local = full[:, start:end].contiguous()
    for row, allowed, answer in (
        (3, [first_end + 1, 40, 7, 100], 7),
        (3, [first_end + 1, 40, 100], 40),
        (4, [9], None),
    ):
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[allowed] = True
        assert sampling.sharded_best_allowed_at(local, group, start, row, pack_token_mask(mask)) == answer, (
            row,
            allowed,
        )
    try:
        sampling.sharded_best_allowed_at(
            local, group, start, group.rank, pack_token_mask(torch.ones(vocab, dtype=torch.bool))
        )
    except sampling.WalkDivergedError as e:
        assert str(e) == f"grammar walks diverged across ranks: positions {list(range(group.size))}", e
    else:
        raise AssertionError("diverged walks were not noticed")
    with _gathers() as shapes:
        _random_walks(group, model, grammar, c, vocab, start, end, g)
    assert _walked(shapes, c)[1] > 0, "the fallback never ran"


def _random_walks(group, model, grammar, c, vocab, start, end, g) -> None:
    for trial in range(6):
        full = torch.rand(c, vocab, generator=g) ** 8
        full[:, torch.randperm(vocab, generator=g)[: vocab // 2]] = 0.0  # zero weights: None answers
        argmax = torch.randint(0, vocab, (c,), generator=g)
        local = full[:, start:end].contiguous()
        whole_walk, cut_walk = (model.grammars.canvas(grammar, c) for _ in range(2))
        want = whole_walk.refine(argmax, full)
        got = cut_walk.refine(argmax, sampling.sharded_pass_rows(local, group, start))
        assert torch.equal(got, want), (trial, got.tolist(), want.tolist())
        assert torch.equal(whole_walk(None).allowed, cut_walk(None).allowed), trial  # the next pass's masks
        # turbo: positions frozen on their tokens, the others computed this pass
        frozen = torch.rand(c, generator=g) < 0.4
        live = (~frozen).nonzero().squeeze(-1)
        frozen_tokens = (frozen, argmax.clone())
        want = model.grammars.canvas(grammar, c).refine(argmax, turbo_rows(full[live], live, frozen_tokens, c))
        rows = turbo_rows(sampling.sharded_pass_rows(local[live], group, start), live, frozen_tokens, c)
        assert torch.equal(model.grammars.canvas(grammar, c).refine(argmax, rows), want), trial
        held = held_rows(pass_rows(full[live]), live.tolist(), {int(p): int(argmax[p]) for p in frozen.nonzero()}, c)
        assert torch.equal(model.grammars.canvas(grammar, c).refine(argmax, held), want), trial

"""Seeded canvases: warm starts (the reference's decoder_input_ids), fixed positions, infill and editing."""

import re

import pytest
import torch

import dgemma
from checkpoints import cut


@pytest.mark.slow
@pytest.mark.parity
def test_warm_start_matches_reference_decoder_input_ids(ref_gqa):
    """With nothing fixed, a canvas that starts from given tokens gives exactly the tokens of
    transformers' generate(..., decoder_input_ids=...), whose random canvas is drawn all the same."""
    path, ref = ref_gqa
    model = dgemma.load(path)
    c, vocab = model.config.canvas_length, model.config.vocab_size
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        prompt = torch.randint(0, vocab, (2, 9), generator=g)
        start = torch.randint(0, vocab, (2, c), generator=g)
        torch.manual_seed(seed)
        expected = ref.generate(prompt, max_new_tokens=2 * c, decoder_input_ids=start.clone())
        torch.manual_seed(seed)
        got = model.generate(prompt.tolist(), max_new_tokens=2 * c, sampling="reference", canvas=start.tolist())
        assert got.sequences == [cut(r[9:], 2 * c) for r in expected.sequences.tolist()]
        torch.manual_seed(seed)
        cold = model.generate(prompt.tolist(), max_new_tokens=2 * c, sampling="reference")
        assert cold.sequences != got.sequences  # the start mattered


def test_warm_start_in_the_engine_starts_from_the_given_canvas(ref_gqa):
    path, _ = ref_gqa
    model = dgemma.load(path)
    c = model.config.canvas_length
    start = [5] * c
    drafts = [
        ev for ev in model.stream([1, 2, 3], drafts=True, seed=0, canvas=start, max_denoising_steps=1, max_new_tokens=c)
    ]
    cold = [ev for ev in model.stream([1, 2, 3], drafts=True, seed=0, max_denoising_steps=1, max_new_tokens=c)]
    assert drafts[0].canvas != cold[0].canvas
    with pytest.raises(ValueError, match=re.escape("canvas 0 must be a list of 8 entries (token ids)")):
        model.generate([[1, 2]], canvas=[[1, 2]])


# ------------------------------------------------------------------------------------ fixed positions
from dgemma.engine.constraints import CanvasConstraints, FirstCanvas  # noqa: E402
from dgemma.engine.constraints.infill import edit_plan, infill_plan, snap_spans  # noqa: E402
from dgemma.engine.events import Block, Draft  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return dgemma.load()  # the shipped model: its infills are text, not noise


@pytest.mark.slow
def test_fixed_positions_never_change_in_drafts_or_the_block(tiny):
    c, vocab = tiny.config.canvas_length, tiny.config.vocab_size
    fixed = {0: 5, 7: 100, 8: 101, 20: 3000, 31: 42}
    seeded = FirstCanvas(CanvasConstraints.build(c, vocab, fixed=fixed))
    events = list(
        tiny.stream("import os\n", drafts=True, seed=3, constraints=seeded, max_new_tokens=2 * c, eos_token_ids=[])
    )
    firsts = [ev for ev in events if getattr(ev, "block", None) == 0]
    assert any(isinstance(ev, Draft) for ev in firsts)
    for ev in firsts:
        tokens = ev.canvas if isinstance(ev, Draft) else ev.tokens
        assert all(tokens[p] == t for p, t in fixed.items())
    second = next(ev for ev in events if isinstance(ev, Block) and ev.block == 1)
    assert [second.tokens[p] for p in fixed] != list(fixed.values())  # later canvases are free


def test_span_is_denoised_with_the_suffix_in_the_canvas(tiny):
    """The first pass over an infill canvas sees the suffix: its argmax equals one decoder pass
    over that canvas (the span's start tokens as the engine drew them)."""
    prefix, suffix = "def area(r):\n", "    return 3.14159 * r * r\n"
    c = tiny.config.canvas_length
    plan = infill_plan(
        tiny.tokenizer.encode(prefix), tiny.tokenizer.encode(suffix, add_special_tokens=False), 6, c, 1, 0
    )
    first = next(iter(tiny.infill_stream(prefix, suffix, span_length=6, seed=0, max_denoising_steps=1)))
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, tiny.config.vocab_size, (c,), generator=g)  # the engine's first draw
    canvas = [t if t >= 0 else int(start[i]) for i, t in enumerate(plan.canvas)]
    logits = tiny.canvas_logits([plan.prompt], [canvas])[0]
    assert first.canvas[:6] == logits.argmax(-1).tolist()[:6]
    assert first.canvas[6:] == plan.canvas[6:]


@pytest.mark.slow
def test_infill_picks_a_length_and_reports_scores(tiny):
    r = tiny.infill("def area(r):\n", "\n    return a\n", seed=0, max_denoising_steps=8)
    assert r.span_length in r.scores and len(r.scores) > 3 and r.span_length == max(r.scores, key=r.scores.get)
    assert all(s <= 0 for s in r.scores.values()) and len(r.tokens) == r.span_length


@pytest.mark.parametrize("seed", range(4))
def test_edit_keeps_everything_outside_the_snapped_spans(tiny, seed):
    text = "def greet(name):\n    print('héllo, ' + name)  # ünïcode\n    return len(name)\n"
    a = int(torch.randint(0, 30, (1,), generator=torch.Generator().manual_seed(seed)))
    spans = [(a, a + 3), (a + 10, a + 12)]
    r = tiny.edit(text, spans, seed=seed, max_denoising_steps=8)
    _, offsets = tiny.tokenizer.encode_with_offsets(text)
    starts, ends = {o[0] for o in offsets}, {o[1] for o in offsets}
    assert all(s in starts and e in ends for s, e in r.spans)  # snapped to token boundaries
    assert all(any(s <= x and y <= e for s, e in r.spans) for x, y in spans)  # outward
    pieces, at = [], 0
    for (s, e), new in zip(r.spans, r.replacements):
        pieces += [text[at:s], new]
        at = e
    assert r.text == "".join(pieces) + text[at:]
    assert r.text.encode().startswith(text[: r.spans[0][0]].encode()) and r.text.endswith(text[r.spans[-1][1] :])


def test_snap_spans_to_token_boundaries():
    offsets = [(0, 3), (3, 5), (5, 6), (6, 7), (7, 9), (9, 10), (9, 10), (10, 11)]  # token 5-6: one 2-byte character
    assert snap_spans([(4, 6)], offsets, 11) == [(1, 3)]
    assert snap_spans([(9, 10)], offsets, 11) == [(5, 7)]  # a character split over two tokens takes both
    assert snap_spans([(0, 1), (2, 4)], offsets, 11) == [(0, 2)]  # touching after snapping: merged
    for bad, words in [
        ([(5, 5)], "0 <= start < end"),
        ([(0, 12)], "0 <= start < end"),
        ([(0, 4), (3, 6)], "overlap"),
        ([(1,)], "pair of character offsets"),
    ]:
        with pytest.raises(ValueError, match=words):
            snap_spans(bad, offsets, 11)


def test_plans_and_their_limits():
    plan = infill_plan([2, 9], [11, 12], 3, 8, eos=1, pad=0)
    assert plan.prompt == [2, 9] and plan.canvas == [-1, -1, -1, 11, 12, 1, 0, 0] and plan.free == [(0, 3)]
    with pytest.raises(ValueError, match="span_length must be 1 to 7"):
        infill_plan([2], [5], 8, 8, 1, 0)
    plan = edit_plan([2], list(range(10, 20)), [(2, 4), (6, 7)], 8, eos=1, pad=0)
    assert (
        plan.prompt == [2, 10, 11] and plan.canvas == [-1, -1, 14, 15, -1, 17, 18, 19] and plan.free == [(0, 2), (4, 5)]
    )
    with pytest.raises(ValueError, match="more than one canvas"):
        edit_plan([2], list(range(30)), [(0, 2), (9, 12)], 8, 1, 0)


# ------------------------------------------------------------------------------------ dgemma run --suffix
def test_run_with_suffix_prints_the_span(tiny, capsys, tmp_path):
    from dgemma.cli import main

    prefix, suffix = "def area(r):\n", "    return a\n"
    assert main(["run", prefix, "--suffix", suffix, "--seed", "0", "--span-length", "5", "--steps", "8"]) == 0
    expected = tiny.infill(prefix, suffix, span_length=5, seed=0, max_denoising_steps=8).text
    assert capsys.readouterr().out == expected + "\n"
    (tmp_path / "suffix.py").write_text(suffix)
    assert (
        main(
            [
                "run",
                prefix,
                "--suffix-file",
                str(tmp_path / "suffix.py"),
                "--seed",
                "0",
                "--span-length",
                "5",
                "--steps",
                "8",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--suffix", "y", "--mode", "ar"], "does not go with --mode ar"),
        (["--suffix", "y", "--span-length", "40"], "span_length must be 1 to 31"),
        (["--suffix", "y", "--suffix-file", "f"], "not both"),
        (["--span-length", "3"], "needs --suffix"),
        (["--suffix", "y", "--show-canvas"], "needs --span-length"),
        (["--suffix-file", "/no/such/file"], "cannot read"),
    ],
)
def test_run_suffix_errors(argv, words, capsys):
    from dgemma.cli import main

    assert main(["run", "x", *argv]) == 2
    assert words in capsys.readouterr().err


# ------------------------------------------------------------------------------------ the server's suffix
import openai  # noqa: E402

from servers import MODEL  # noqa: E402  (conftest.py serves the tiny random `model` once a session: `server`, `client`)


@pytest.mark.slow
def test_suffix_is_insert_mode(model, client):  # noqa: F811
    prefix, suffix = "def f(x):\n", "\n    return y\n"
    r = client.completions.create(
        model=MODEL,
        prompt=prefix,
        suffix=suffix,
        max_tokens=16,
        seed=3,
        extra_body={"span_length": 5, "max_denoising_steps": 4},
    )
    expected = model.infill(prefix, suffix, span_length=5, seed=3, max_denoising_steps=4)
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 5
    chosen = client.completions.create(
        model=MODEL, prompt=prefix, suffix=suffix, max_tokens=8, seed=3, extra_body={"max_denoising_steps": 4}
    )
    want = model.infill(prefix, suffix, lengths=[1, 2, 3, 4, 6, 8], seed=3, max_denoising_steps=4)
    assert chosen.choices[0].text == want.text and chosen.usage.completion_tokens == want.span_length
    stream = client.completions.create(
        model=MODEL,
        prompt=prefix,
        suffix=suffix,
        max_tokens=16,
        seed=3,
        stream=True,
        extra_body={"span_length": 5, "max_denoising_steps": 4},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected.text


def test_fixed_canvas_tokens(model, client):  # noqa: F811
    c = model.config.canvas_length
    canvas = [None] * c
    canvas[3], canvas[10] = 100, 101
    r = client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7],
        max_tokens=c,
        seed=1,
        extra_body={"canvas": canvas, "max_denoising_steps": 4, "ignore_eos": True},
    )
    ids = model.tokenizer.encode(r.choices[0].text, add_special_tokens=False)
    fixed = FirstCanvas(CanvasConstraints.build(c, model.config.vocab_size, fixed={3: 100, 10: 101}))
    out = model.generate(
        [[5, 6, 7]], max_new_tokens=c, seed=1, max_denoising_steps=4, eos_token_ids=[], constraints=[fixed]
    )
    assert out.sequences[0][3] == 100 and out.sequences[0][10] == 101
    assert r.choices[0].text == model.tokenizer.decode(out.sequences[0]) and ids


BAD_INSERTS = [
    ({"suffix": "x", "span_length": 0}, "span_length"),
    ({"suffix": "x", "span_length": 99}, "span_length"),
    ({"suffix": "x", "span_length": 6, "max_tokens": 3}, "span_length"),
    ({"span_length": 4}, "span_length"),
    ({"suffix": "x", "n": 2}, "n"),
    ({"suffix": "x", "logprobs": 1}, "logprobs"),
    ({"suffix": "x", "guided_regex": "a+"}, "guided_regex"),
    ({"canvas": [1, 2]}, "canvas"),
    ({"canvas": ["a"] + [None] * 31}, "canvas[0]"),
    ({"canvas": [None] * 32}, "canvas"),
    ({"canvas": [10**9] + [None] * 31}, "canvas[0]"),
]


@pytest.mark.parametrize("extra, param", BAD_INSERTS)
def test_bad_infill_requests_are_400s(client, extra, param):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="def f():", max_tokens=extra.pop("max_tokens", 16), extra_body=extra
        )
    assert e.value.body["param"] == param, e.value.body


def test_one_rule_for_candidate_span_lengths():
    """The API, the CLI and the server's insert mode all ask infill.candidate_lengths."""
    from dgemma.engine.constraints.infill import DEFAULT_LENGTHS, candidate_lengths

    assert candidate_lengths(32) == list(DEFAULT_LENGTHS)
    assert candidate_lengths(8) == [1, 2, 3, 4, 6]  # 1 to canvas_length - 1
    assert candidate_lengths(32, max_tokens=5, max_candidates=3) == [1, 3, 4]  # thinned: shortest, longest, between
    assert candidate_lengths(32, max_candidates=1) == [6]
    assert candidate_lengths(32, span_length=31) == [31]
    for bad in (0, 32, True, 2.0, "3"):
        with pytest.raises(ValueError, match="span_length must be 1 to 31"):
            candidate_lengths(32, span_length=bad)
    with pytest.raises(ValueError, match="span_length=6 is more than max_tokens=3"):
        candidate_lengths(32, span_length=6, max_tokens=3)
    with pytest.raises(ValueError, match="no candidate span length"):
        candidate_lengths(32, lengths=[40, 50])


def test_one_rule_for_a_given_canvas():
    """A warm-start canvas (API) and a fixed `canvas` field (server) are checked by canvas_row."""
    from dgemma.engine.constraints import CanvasError, canvas_row

    assert canvas_row([1, None, 3], 3, 10, nulls=True) == [1, None, 3]
    assert canvas_row(torch.tensor([1, 2, 3]), 3, 10) == [1, 2, 3]
    cases = [
        (dict(row=[1, 2], nulls=True), "canvas", "list of 3 entries"),
        (dict(row=["a", None, None], nulls=True), "canvas[0]", "or null"),
        (dict(row=[1, None, 3]), "canvas[1]", "token id in [0, 10)"),
        (dict(row=[1, 2, 10]), "canvas[2]", "token id in [0, 10)"),
        (dict(row=[1, True, 3]), "canvas[1]", "token id"),
        (dict(row=7), "canvas", "got int"),
    ]
    for kwargs, param, message in cases:
        with pytest.raises(CanvasError, match=re.escape(message)) as e:
            canvas_row(kwargs.pop("row"), 3, 10, **kwargs)
        assert e.value.param == param

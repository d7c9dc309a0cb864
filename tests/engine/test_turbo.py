"""Turbo denoising (engine/turbo.py): what freezes stays frozen, the active-rows pass is the full
pass restricted to those rows, the random draws are an exact pass's, and off changes nothing.

Semantic tests run on the shipped dgemma-tiny (trained: its positions converge and freeze); the
exact-path invariants stay in the existing parity and batch-invariance tests, untouched."""

import re

import pytest
import torch

import dgemma
from dgemma.config import ConfigError, TurboSettings
from dgemma.engine.client import EngineClient
from dgemma.engine.constraints import CanvasConstraints
from dgemma.engine.engine import Engine, EngineOptions, Request
from dgemma.engine.events import Block, Draft
from dgemma.engine.host import turbo as host_turbo
from dgemma.engine.kv.paged_cache import PagedKVCache, SequenceBlocks
from dgemma.engine.prefill import prefill
from dgemma.engine.turbo import TurboPass, TurboState, canvas_kv_bytes, dormant, freeze
from dgemma.loading import default_model_dir

PROMPTS = ["def fib(n):\n", "import os\n", "class Stack:\n    def push(self, x):\n"]


@pytest.fixture(scope="module")
def tiny():
    return dgemma.load(default_model_dir(), dtype="float32")


def test_turbo_off_is_the_exact_path_and_counts_every_position(tiny):
    plain = tiny.generate(PROMPTS, max_new_tokens=40, seed=[1, 2, 3])
    off = tiny.generate(PROMPTS, max_new_tokens=40, seed=[1, 2, 3], turbo=False)
    assert off.sequences == plain.sequences and off.decoder_passes == plain.decoder_passes
    c = tiny.config.canvas_length
    assert off.decoder_positions == [p * c for p in off.decoder_passes]


def test_turbo_computes_fewer_positions_and_answers_alike(tiny):
    exact = tiny.generate(PROMPTS, max_new_tokens=64, seed=[1, 2, 3])
    turbo = tiny.generate(PROMPTS, max_new_tokens=64, seed=[1, 2, 3], turbo=True)
    c = tiny.config.canvas_length
    assert all(pos < passes * c for pos, passes in zip(turbo.decoder_positions, turbo.decoder_passes))
    assert sum(turbo.decoder_positions) * 1.5 < sum(exact.decoder_positions)
    other = tiny.generate(PROMPTS, max_new_tokens=64, seed=[11, 12, 13])

    def agree(a, b):
        return sum(x == y for s, t in zip(a.sequences, b.sequences) for x, y in zip(s, t))

    assert agree(turbo, exact) > agree(other, exact)  # an approximation of the exact answer, not another draw


def test_nothing_frozen_is_token_for_token_the_exact_pass(tiny):
    """With a freeze entropy of 0 nothing here freezes (no position reaches entropy 0) and with a
    dormant entropy of 0 nothing rests: every pass computes every row through the turbo pass (keys
    from the buffer), and the answer is the exact one, draw for draw."""
    exact = tiny.generate(PROMPTS, max_new_tokens=40, seed=[4, 5, 6])
    turbo = tiny.generate(
        PROMPTS, max_new_tokens=40, seed=[4, 5, 6], turbo=True, turbo_freeze_entropy=0.0, turbo_dormant_entropy=0.0
    )
    assert turbo.sequences == exact.sequences and turbo.decoder_passes == exact.decoder_passes


def _run(model, prompt, seed, **knobs):
    engine = Engine(model.engine_net, EngineOptions(prefix_cache=False))
    req = Request(model.tokenizer.encode(prompt), model.generation_config.with_overrides(**knobs), seed)
    EngineClient(engine).finish([req])
    return req


def test_every_pass_draws_what_an_exact_pass_draws(tiny):
    """Same seed, same number of passes (max steps, never confident): the requests' generators
    end in the same state, so turbo and exact differ only by the approximation."""
    knobs = dict(max_new_tokens=32, max_denoising_steps=6, confidence_threshold=1e-12)
    exact = _run(tiny, "import os\n", 9, **knobs)
    turbo = _run(tiny, "import os\n", 9, turbo=True, turbo_freeze_entropy=10.0, turbo_freeze_passes=1, **knobs)
    assert exact.passes == 6
    assert turbo.passes == exact.passes or turbo.turbo.all_frozen()
    if turbo.passes == exact.passes:
        assert torch.equal(turbo.generator.get_state(), exact.generator.get_state())
    # all frozen ends the block early: then it drew exactly as many per pass as it ran
    fresh = torch.Generator().manual_seed(9)
    torch.randint(0, tiny.config.vocab_size, (tiny.config.canvas_length,), generator=fresh)  # the first canvas
    for _ in range(turbo.passes):
        torch.rand(tiny.config.canvas_length, generator=fresh)
        torch.randint(0, tiny.config.vocab_size, (tiny.config.canvas_length,), generator=fresh)
    assert torch.equal(turbo.generator.get_state(), fresh.get_state())


def test_a_frozen_position_never_changes_and_is_what_commits(tiny):
    events = list(tiny.stream("def fib(n):\n", drafts=True, seed=3, max_new_tokens=64, turbo=True))
    drafts = [e for e in events if isinstance(e, Draft)]
    blocks = [e for e in events if isinstance(e, Block)]
    assert any(any(d.frozen) for d in drafts)
    for block in blocks:
        mine = [d for d in drafts if d.block == block.block]
        for before, after in zip(mine, mine[1:]):
            for i, was in enumerate(before.frozen):
                if was:
                    assert after.frozen[i] and after.canvas[i] == before.canvas[i]
        last = mine[-1]
        for i, t in enumerate(block.tokens):
            if last.frozen[i]:
                assert t == last.canvas[i]


def test_fixed_positions_keep_their_tokens(tiny):
    c, vocab = tiny.config.canvas_length, tiny.config.vocab_size
    fixed = {0: 5, 7: 11, c - 1: 1}
    constraints = CanvasConstraints.build(c, vocab, fixed=fixed)
    out = tiny.generate(
        ["import os\n"], max_new_tokens=c, seed=2, constraints=[constraints], turbo=True, eos_token_ids=[]
    )
    assert all(out.sequences[0][i] == t for i, t in fixed.items())


def test_a_grammar_holds_and_only_a_prefix_freezes(tiny):
    grammar = tiny.compile_grammar("regex", "[a-z]{3,40}")
    events = list(tiny.stream("import os\n", drafts=True, seed=1, grammar=grammar, max_new_tokens=24, turbo=True))
    text = tiny.tokenizer.decode([t for e in events if isinstance(e, Block) for t in e.tokens])
    assert re.fullmatch("[a-z]{3,40}", text), text
    for d in events:
        if isinstance(d, Draft) and d.frozen:
            k = d.frozen.index(False) if False in d.frozen else len(d.frozen)
            assert not any(d.frozen[k:]), d.frozen


def test_logprobs_come_back_for_every_committed_token(tiny):
    req = Request(
        tiny.tokenizer.encode("def fib(n):\n"),
        tiny.generation_config.with_overrides(max_new_tokens=32, turbo=True),
        5,
        top_logprobs=2,
    )
    events = list(EngineClient(Engine(tiny.engine_net, EngineOptions(prefix_cache=False))).run([req]))
    for block in [e for e in events if isinstance(e, Block)]:
        assert block.logprobs is not None and len(block.logprobs) == len(block.tokens)
        for token, lp in zip(block.tokens, block.logprobs):
            assert lp.token == token and lp.logprob <= 0.0 and len(lp.top) <= 2


def test_batched_requests_answer_as_alone(tiny):
    together = tiny.generate(PROMPTS, max_new_tokens=40, seed=[7, 8, 9], turbo=True)
    for i, prompt in enumerate(PROMPTS):
        alone = tiny.generate([prompt], max_new_tokens=40, seed=[7 + i], turbo=True)
        assert (
            alone.sequences[0] == together.sequences[i] and alone.decoder_positions[0] == together.decoder_positions[i]
        )


def test_batched_turbo_runs_one_pass_a_step_and_with_nothing_frozen_is_the_batched_exact_pass(monkeypatch):
    """batch_invariant=False (the GPU default): a step's turbo canvases share one decoder pass,
    each one's active rows padded to the most; with nothing frozen that pass is the batched exact
    pass, token for token (the same shapes and masks)."""
    model = dgemma.load(default_model_dir(), dtype="float32")
    model.configure_engine(batch_invariant=False, prefix_cache=False)
    exact = model.generate(PROMPTS, max_new_tokens=40, seed=[4, 5, 6])
    same = model.generate(
        PROMPTS, max_new_tokens=40, seed=[4, 5, 6], turbo=True, turbo_freeze_entropy=0.0, turbo_dormant_entropy=0.0
    )
    assert same.sequences == exact.sequences and same.decoder_passes == exact.decoder_passes
    net, calls = model.engine_net, []
    decode = net.decode
    monkeypatch.setattr(net, "decode", lambda canvas, *a, **k: calls.append(canvas.shape[0]) or decode(canvas, *a, **k))
    turbo = model.generate(PROMPTS, max_new_tokens=40, seed=[4, 5, 6], turbo=True)
    assert max(calls) == len(PROMPTS) and len(calls) < sum(turbo.decoder_passes)  # canvases batched per pass
    c = model.config.canvas_length
    assert sum(turbo.decoder_positions) < sum(turbo.decoder_passes) * c


def test_infill_with_turbo(tiny):
    result = tiny.infill("def add(a, b):\n", "\n\nprint(add(1, 2))\n", span_length=8, seed=1, turbo=True)
    assert result.text is not None


def test_reference_sampling_refuses_turbo(tiny):
    with pytest.raises(ValueError, match="reference.*turbo"):
        tiny.generate(["import os\n"], max_new_tokens=8, seed=1, sampling="reference", turbo=True)


@pytest.mark.parametrize(
    "knob,value",
    [
        ("turbo_freeze_passes", 0),
        ("turbo_freeze_entropy", -1.0),
        ("turbo_refresh_every", -2),
        ("turbo", "yes"),
        ("turbo_dormant_entropy", -0.5),
        ("turbo_dormant_entropy", float("nan")),
        ("turbo_dormant_entropy", float("inf")),
    ],
)
def test_bad_knobs_are_refused_by_name(tiny, knob, value):
    with pytest.raises(ConfigError, match=knob):
        tiny.generate(["import os\n"], max_new_tokens=8, seed=1, **{knob: value})


# ------------------------------------------------------------------------------------ the pure parts
def test_freeze_rule():
    s = TurboSettings(freeze_passes=2, freeze_entropy=0.1)
    frozen = torch.tensor([False, False, False, True])
    streak = torch.tensor([1, 1, 0, 5])
    previous = torch.tensor([4, 4, 4, 9])
    argmax = torch.tensor([4, 5, 4, 9])
    accepted = torch.tensor([True, True, False, False])
    entropy = torch.tensor([0.01, 0.01, 0.01, 3.0])
    out, new_streak = freeze(frozen, streak, previous, argmax, accepted, entropy, s)
    assert out.tolist() == [True, False, False, True]  # same token twice; changed; re-noised; stays
    assert new_streak[:3].tolist() == [2, 1, 0]
    high = freeze(frozen, streak, previous, argmax, accepted, torch.full((4,), 0.5), s)[0]
    assert high.tolist() == [False, False, False, True]  # too uncertain to freeze


def test_freeze_prefix_only_and_after_an_end_of_answer():
    s = TurboSettings(freeze_passes=1, freeze_entropy=1.0)
    ready = torch.tensor([True, False, True, True])
    args = (
        torch.zeros(4, dtype=torch.bool),
        torch.zeros(4, dtype=torch.long),
        torch.tensor([7, 7, 1, 7]),
        torch.tensor([7, 7, 1, 7]),
        ready,
        torch.zeros(4),
    )
    assert freeze(*args, s, prefix_only=True)[0].tolist() == [True, False, False, False]
    assert freeze(*args, s, eos_ids=(1,))[0].tolist() == [True, False, True, True]
    eos_first = (
        args[0],
        args[1],
        torch.tensor([1, 7, 7, 7]),
        torch.tensor([1, 7, 7, 7]),
        torch.tensor([True, False, False, False]),
        args[5],
    )
    assert freeze(*eos_first, s, eos_ids=(1,))[0].tolist() == [True, True, True, True]


def test_dormant_rule():
    frozen = torch.tensor([False, False, False, True, False])
    streak = torch.tensor([0, 1, 0, 3, 0])
    entropy = torch.tensor([2.0, 2.0, 0.5, 2.0, 3.0])
    rested = torch.tensor([False, False, False, False, True])
    # noise above the threshold rests; accepted last pass, below it, frozen, or rested last pass: computed
    assert dormant(frozen, streak, entropy, rested, 1.5).tolist() == [True, False, False, False, False]
    assert dormant(frozen, streak, entropy, None, 1.5).tolist() == [True, False, False, False, True]
    assert not dormant(frozen, streak, entropy, None, 0.0).any()  # 0: none rests
    alone = torch.tensor([False, True, True, True, True])  # the only position left would rest: it is computed
    assert not dormant(alone, torch.zeros(5, dtype=torch.long), entropy, None, 1.0).any()


def _recorded_decisions(monkeypatch):
    """Every turbo decision as (request, resting [C], result, (frozen before, a full pass, the block's
    last allowed pass))."""
    seen, decide = [], host_turbo.decide_request

    def spy(ops, r, live, resting, *args):
        before = (r.turbo.frozen.clone(), r.turbo.passes == 0, r.block_ends(False))
        res = decide(ops, r, live, resting, *args)
        seen.append((r, resting.clone(), res, before))
        return res

    monkeypatch.setattr(host_turbo, "decide_request", spy)
    return seen


def test_resting_positions_are_not_computed_nor_accepted_and_a_block_ends_on_a_full_pass(tiny, monkeypatch):
    seen = _recorded_decisions(monkeypatch)
    rested = tiny.generate(PROMPTS, max_new_tokens=64, seed=[1, 2, 3], turbo=True, turbo_dormant_entropy=1.0)
    decisions = list(seen)
    seen.clear()
    awake = tiny.generate(PROMPTS, max_new_tokens=64, seed=[1, 2, 3], turbo=True, turbo_dormant_entropy=0.0)
    assert not any(bool(d.any()) for _, d, _, _ in seen)
    assert sum(rested.decoder_positions) < sum(awake.decoder_positions)
    assert any(bool(d.any()) for _, d, _, _ in decisions)
    eos, last = set(tiny.generation_config.eos_token_ids), {}
    for r, resting, res, (frozen, full_pass, last_pass) in decisions:
        assert not bool((resting & res.accepted).any())  # no fresh sample: never accepted
        ends = [q for q, t in enumerate(res.argmax.tolist()) if res.turbo.frozen[q] and t in eos]
        for p in (resting & res.turbo.frozen).nonzero().flatten().tolist():
            assert ends and ends[0] < p  # frozen only behind a frozen end of answer
        c = resting.numel()
        assert res.positions == (c if full_pass else int((~frozen & ~resting).sum()))  # the pass skipped them
        if not full_pass:
            assert not bool((resting & last[id(r)]).any())  # none rests twice in a row
        if res.stop or last_pass:
            assert not resting.any()  # what commits was computed
        last[id(r)] = resting


def test_with_a_grammar_nothing_rests(tiny, monkeypatch):
    seen = _recorded_decisions(monkeypatch)
    grammar = tiny.compile_grammar("regex", "[a-z ]{3,60}")
    tiny.generate(["import os\n"], max_new_tokens=32, seed=1, grammar=grammar, turbo=True, turbo_dormant_entropy=0.1)
    assert seen and not any(bool(d.any()) for _, d, _, _ in seen)


def test_the_active_rows_pass_is_the_full_pass_restricted_to_them(tiny):
    """Keys of every position computed from the same inputs: the A active rows' hidden states
    equal the full pass's rows (float32; kernels may differ by row count)."""
    net, cfg = tiny.engine_net, tiny.config
    c = cfg.canvas_length
    cache = PagedKVCache(cfg, {"sliding_attention": 8, "full_attention": 8}, 32, net.device, net.dtype)
    row = SequenceBlocks()
    prompt = tiny.tokenizer.encode("def fib(n):\n    if n < 2:\n")
    row.tables = {kind: list(range(2)) for kind in row.tables}
    prefill(net, cache, [row], [prompt])
    g = torch.Generator().manual_seed(0)
    canvas = torch.randint(0, cfg.vocab_size, (1, c), generator=g)
    soft = torch.randn(1, c, cfg.hidden_size, generator=g)
    with torch.no_grad():
        full = net.decode(canvas, cache.plan_decoder(c, [row]), soft)
        state = TurboState.fresh(c, net.device)
        state.ensure_buffers(cfg, net.dtype, net.device)
        everything = torch.arange(c)
        whole = net.decode(canvas, TurboPass(cache.plan_decoder(c, [row]), everything[None], [state]), soft)
        torch.testing.assert_close(whole, full)
        rows = torch.tensor([0, 3, 4, 17, c - 1])
        part = net.decode(canvas[:, rows], TurboPass(cache.plan_decoder(c, [row]), rows[None], [state]), soft[:, rows])
    torch.testing.assert_close(part, full[:, rows], rtol=1e-5, atol=1e-5)


def test_the_canvas_buffer_is_counted():
    from dgemma.model.checkpoint import make_config
    from dgemma.model.presets import PRESETS

    real = make_config(**PRESETS["real"])
    assert 50e6 < canvas_kv_bytes(real, 2) < 64e6  # ~55 MB in bf16 at the released size


def test_images_with_turbo(vision_checkpoint):
    """An image prompt: with nothing frozen, turbo's answer is the exact one; with freezing on,
    it runs and computes fewer positions (the image lives in the prefix the canvas attends to)."""
    from PIL import Image

    model = dgemma.load(vision_checkpoint, dtype="float32")
    image = Image.new("RGB", (48, 32), (200, 30, 30))
    inputs = model.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "what is it?"}]}],
        max_soft_tokens=70,
    )
    exact = model.generate([inputs], max_new_tokens=24, seed=2)
    same = model.generate(
        [inputs], max_new_tokens=24, seed=2, turbo=True, turbo_freeze_entropy=0.0, turbo_dormant_entropy=0.0
    )
    assert same.sequences == exact.sequences
    frozen = model.generate(
        [inputs], max_new_tokens=24, seed=2, turbo=True, turbo_freeze_passes=1, turbo_freeze_entropy=100.0
    )
    assert frozen.decoder_positions[0] < frozen.decoder_passes[0] * model.config.canvas_length

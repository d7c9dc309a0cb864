"""Engine v2: the paged KV cache, prefix caching, chunked prefill, admission under a small pool.

Every test compares against a run that cannot be affected by what is checked: a cold engine
(empty cache, or prefix cache off) or the dense one-pass encode of the reference path.
"""

import pytest
import torch

import dgemma
from dgemma.config import GLOBAL, SLIDING
from dgemma.dense.kv_cache import DenseKVCache
from dgemma.engine.client import EngineClient
from dgemma.engine.engine import Engine, EngineOptions, Request
from dgemma.engine.kv.paged_cache import SequenceBlocks
from dgemma.engine.prefill import prefill
from dgemma.engine.request import RequestStatus

PREFIX = [(7 * i + 3) % 120 + 5 for i in range(45)]  # 5 full blocks of 8 (ref_gqa's canvas) and a partial one


def solo(model, prompt, seed, options=None, **knobs):
    """The request alone in a fresh engine without a prefix cache: the cold run."""
    engine = Engine(model.engine_net, options or EngineOptions(prefix_cache=False))
    return EngineClient(engine).finish([Request(list(prompt), config(model, **knobs), seed)])[0]


def config(model, **knobs):
    return model.generation_config.with_overrides(**{"max_new_tokens": 30, "entropy_bound": 1.0, **knobs})


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["ref_gqa", "ref_wide"])
def test_shared_prefix_encodes_only_the_suffix_and_matches_a_cold_run(request, shape):
    model = dgemma.load(request.getfixturevalue(shape)[0])
    block = model.config.canvas_length
    first, second = PREFIX + [9, 10, 11], PREFIX + [12, 13]
    engine = Engine(model.engine_net)
    client = EngineClient(engine)
    client.finish([Request(first, config(model), 1)])
    before = engine.stats.encoded_tokens
    warm = client.finish([Request(second, config(model), 2)])[0]
    warm_encoded = engine.stats.encoded_tokens - before

    cold_engine = Engine(model.engine_net, EngineOptions(prefix_cache=False))
    cold = EngineClient(cold_engine).finish([Request(second, config(model), 2)])[0]
    cached = len(PREFIX) // block * block
    assert warm.cached_tokens == cached >= 2 * block and cold.cached_tokens == 0
    assert cold_engine.stats.encoded_tokens - warm_encoded == cached  # only the suffix (and commits) encoded
    assert warm.tokens == cold.tokens and warm.decoder_passes == cold.decoder_passes


@pytest.mark.slow
def test_committed_blocks_are_cached_for_the_next_turn(ref_gqa):
    """A follow-up prompt holding an earlier prompt and its output reuses both (chat history)."""
    model = dgemma.load(ref_gqa[0])
    engine = Engine(model.engine_net)
    client = EngineClient(engine)
    turn1 = client.finish([Request(PREFIX, config(model, eos_token_ids=[]), 3)])[0]
    history = PREFIX + turn1.tokens[: 2 * model.config.canvas_length] + [5, 6, 7]
    turn2 = client.finish([Request(history, config(model), 4)])[0]
    # the prompt's full blocks and the committed blocks after it (the last canvas is never encoded)
    assert turn2.cached_tokens >= (len(PREFIX) + model.config.canvas_length) // 8 * 8
    assert turn2.tokens == solo(model, history, 4).tokens


@pytest.mark.slow
def test_sliding_layers_release_blocks_the_window_no_longer_sees(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    engine = Engine(model.engine_net)
    engine.add(Request(PREFIX, config(model, max_new_tokens=60, eos_token_ids=[]), 0))
    window, block = model.config.sliding_window, engine.options.block_size
    seen = 0
    while engine.has_work:
        engine.step()
        for req in engine.scheduler.running:
            tables = req.kv.tables
            held = [b for b in tables[SLIDING] if b >= 0]
            assert len(tables[GLOBAL]) == len(tables[SLIDING]) and all(b >= 0 for b in tables[GLOBAL])
            # what is held covers the window behind the cache length, and no block wholly before it
            first_needed = max(0, req.kv.length // block * block - (window - 1)) // block
            assert all(b < 0 for b in tables[SLIDING][:first_needed])
            assert len(held) <= engine.scheduler.blocks.sliding_peak(len(tables[GLOBAL]))
            seen = max(seen, len(tables[GLOBAL]) - len(held))
    assert seen >= 8  # many blocks were released while the global layers kept theirs
    usage = engine.kv_usage()
    assert usage[SLIDING]["used"] == usage[GLOBAL]["used"] == 0  # all back after the end


@pytest.mark.slow
def test_diverging_requests_never_touch_each_others_blocks(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    engine = Engine(model.engine_net)
    client = EngineClient(engine)
    client.finish([Request(PREFIX + [1, 2, 3], config(model), 0)])  # caches the shared prefix
    prompts = [PREFIX + [20, 21, 22, 23], PREFIX + [30, 31]]
    knobs = dict(max_new_tokens=40, eos_token_ids=[])
    reqs = [Request(p, config(model, **knobs), 10 + i, drafts=True) for i, p in enumerate(prompts)]
    shared = None
    snapshot = None
    tables_seen = []
    events = client.run(reqs)
    for _ in events:
        running = engine.scheduler.running
        if len(running) == 2:
            a, b = (r.kv.tables[GLOBAL] for r in running)
            n = len(PREFIX) // 8
            shared = a[:n]
            assert a[:n] == b[:n]  # the cached prefix, read by both
            assert not set(a[n:]) & set(b[n:])  # everything after it private to each
            tables_seen.append((list(a), list(b)))
            if snapshot is None:
                keys = engine.runner.cache.keys[5]  # a global layer
                snapshot = keys[torch.tensor(shared)].clone()
    assert tables_seen and snapshot is not None
    keys = engine.runner.cache.keys[5]
    assert torch.equal(keys[torch.tensor(shared)], snapshot)  # nobody wrote into the shared blocks
    for req, prompt in zip(reqs, prompts):
        assert req.tokens == solo(model, prompt, req.seed, **knobs).tokens


@pytest.mark.slow
def test_a_pool_that_fills_up_makes_requests_wait_and_evicts_yet_outputs_equal_solo_runs(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    per_block = 8 * sum(2 * s.num_kv_heads * s.head_dim * 4 for s in model.config.layers)
    # 16 blocks per pool; a request needs 6 to 10: one or two run at a time, the others wait, and
    # the blocks the finished ones left cached are evicted for new ones
    engine = Engine(model.engine_net, EngineOptions(kv_cache_memory=16 * per_block))
    knobs = dict(max_new_tokens=40, eos_token_ids=[])
    prompts = [PREFIX[: 20 + 5 * i] + [i + 1] * 3 for i in range(6)]
    reqs = [Request(p, config(model, **knobs), 100 + i) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add(r)
    most_running = 0
    while engine.has_work:
        engine.step()
        most_running = max(most_running, len(engine.scheduler.running))
        usage = engine.kv_usage()
        assert all(u["used"] <= u["total"] for u in usage.values())
    pools = engine.scheduler.blocks.pools
    assert most_running < len(reqs)  # admission waited for blocks
    assert pools[GLOBAL].evictions > 0  # and cached blocks were reused
    assert sum(r.cached_tokens for r in reqs) > 0  # while prefix hits still happened
    for r, p in zip(reqs, prompts):
        assert r.tokens == solo(model, p, r.seed, **knobs).tokens


def test_a_request_that_can_never_fit_is_refused_clearly(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    engine = Engine(model.engine_net, EngineOptions(kv_cache_memory=200_000))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add(Request(PREFIX * 6, config(model, max_new_tokens=200), 0))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.add(Request([5] * 1020, config(model, max_new_tokens=30), 0))


@pytest.mark.parametrize("shape", ["ref_gqa", "ref_wide"])
@torch.no_grad()
def test_chunked_prefill_equals_a_one_pass_encode(request, shape):
    """Block-sized passes over the paged cache against one pass over the dense cache (float32)."""
    model = dgemma.load(request.getfixturevalue(shape)[0])
    net, c = model.net, model.config.canvas_length
    prompt = torch.randint(0, model.config.vocab_size, (83,), generator=torch.Generator().manual_seed(1)).tolist()
    dense = DenseKVCache(model.config, 1, len(prompt) + c)
    one_pass = net.logits(net.encode(torch.tensor([prompt]), dense.plan_encoder(len(prompt))))
    dense.lengths = [len(prompt)]
    canvas = torch.randint(0, model.config.vocab_size, (1, c), generator=torch.Generator().manual_seed(2))
    dense_canvas = net.logits(net.decode(canvas, dense.plan_decoder(c), None))

    engine = Engine(net, EngineOptions(block_size=8))
    kv, blocks = SequenceBlocks(), engine.scheduler.blocks
    blocks.admit(0, kv, [], len(prompt))
    blocks.allocate(0, kv, len(prompt))
    last = prefill(net, engine.runner.cache, [kv], [prompt], pass_tokens=8)  # 11 passes
    assert (net.logits(last) - one_pass[0, -1]).abs().max() < 1e-5
    # and a canvas decoded after either cache (one more stack of float32 rounding: |logits| ~ 10 here)
    paged_canvas = net.logits(net.decode(canvas, engine.runner.cache.plan_decoder(c, [kv]), None))
    assert (paged_canvas - dense_canvas).abs().max() < 5e-5


@pytest.mark.parametrize("statistics", ["native", "torch"])
def test_fixed_tokens_never_change_and_masked_tokens_are_never_sampled(ref_gqa, statistics):
    from dgemma.engine.constraints import CanvasConstraints

    model = dgemma.load(ref_gqa[0])
    c, vocab = model.config.canvas_length, model.config.vocab_size
    allowed_set = [11, 12, 13, 14]
    fixed = {0: 99, 5: 100}
    constraints = CanvasConstraints.build(
        c, vocab, fixed=fixed, allowed={p: allowed_set for p in range(1, c) if p != 5}
    )
    engine = Engine(model.engine_net)
    if statistics == "torch":
        engine.runner.ops.native = None
    elif engine.runner.ops.native is None:
        pytest.skip("the native kernels do not run on this CPU (no AVX-512 BF16); the torch case covers the rest")
    # every free position is accepted every step (huge bound): the canvas after a step is all samples
    req = Request(
        PREFIX,
        config(model, max_new_tokens=3 * c, eos_token_ids=[], entropy_bound=1e6),
        5,
        drafts=True,
        constraints=constraints,
    )
    engine.add(req)
    drafts = 0
    while engine.has_work:
        for ev in engine.step():
            if isinstance(ev, dgemma.Draft):
                drafts += 1
                assert [ev.canvas[p] for p in fixed] == list(fixed.values())
                assert all(t in allowed_set for p, t in enumerate(ev.canvas) if p not in fixed)
        if req.canvas is not None and req.status is not RequestStatus.FINISHED:
            sampled = req.canvas.tolist()
            assert all(sampled[p] == t for p, t in fixed.items())
            assert all(t in allowed_set for p, t in enumerate(sampled) if p not in fixed)
    assert drafts >= 3
    for b in range(3):
        block = req.tokens[b * c : (b + 1) * c]
        assert [block[p] for p in fixed] == list(fixed.values())
        assert all(t in allowed_set for p, t in enumerate(block) if p not in fixed)


def test_constraints_are_validated(ref_gqa):
    from dgemma.engine.constraints import CanvasConstraints

    c, vocab = 8, 128
    with pytest.raises(ValueError, match="outside the canvas"):
        CanvasConstraints.build(c, vocab, fixed={8: 1})
    with pytest.raises(ValueError, match="not a token id"):
        CanvasConstraints.build(c, vocab, fixed={0: 128})
    with pytest.raises(ValueError, match="bans every token"):
        CanvasConstraints.build(c, vocab, allowed={2: []})
    with pytest.raises(ValueError, match="not allowed there"):
        CanvasConstraints.build(c, vocab, fixed={2: 5}, allowed={2: [6]})


@pytest.mark.slow
def test_two_streams_read_in_turn_share_one_engine(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    a = model.stream(PREFIX, seed=1, max_new_tokens=30, entropy_bound=1.0)
    b = model.stream(PREFIX[:20], seed=2, max_new_tokens=30, entropy_bound=1.0)
    tokens = {"a": [], "b": []}
    for name, stream in [("a", a), ("b", b)] * 40:
        ev = next(stream, None)
        if ev is not None:
            tokens[name] += ev.tokens
    assert tokens["a"] == solo(model, PREFIX, 1).tokens
    assert tokens["b"] == solo(model, PREFIX[:20], 2).tokens


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_32k_prompt_generates_while_a_short_request_keeps_receiving_blocks():
    """scripts/long_context.py: 32768 prompt tokens prefilled 2048 per step (16 steps); the short
    request that arrived after it commits blocks (8 steps each) before that prefill ends."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "scripts/long_context.py", "--prompt-tokens", "32768"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    print(run.stdout)  # the figures docs/performance.md quotes
    assert re.search(r"long prompt: 32768 tokens, time to first block [\d.]+ s", run.stdout)
    meanwhile = int(re.search(r"short request: (\d+) of (\d+) blocks committed while", run.stdout).group(1))
    assert meanwhile >= 1
    assert re.search(r"peak memory \(process RSS\): \d+ MB", run.stdout)


def test_memory_report_for_the_released_model_at_128k(capsys):
    """`dgemma memory`: sliding layers bounded by their window, global layers linear (bf16)."""
    from dgemma.cli import main

    assert main(["memory", "--size", "real", "--tokens", "131072"]) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[1]: line.split()
        for line in out.splitlines()
        if line.split()[1:2] in (["full_attention"], ["sliding_attention"])
    }
    total = next(line.split() for line in out.splitlines() if line.startswith("total"))
    assert float(rows["full_attention"][3]) == float(rows["full_attention"][4]) == 2.5  # linear: 20 KiB per token
    assert float(rows["sliding_attention"][3]) < 0.4 < 25.0 == float(rows["sliding_attention"][4])  # the window only
    assert 2.5 < float(total[2]) < 3.0 and float(total[3]) == 27.5
    assert main(["memory", "--size", "nope"]) == 2


@torch.no_grad()
def test_several_rows_in_one_pass_equal_each_row_alone(ref_wide):
    """The padded multi-row passes (batched decoder steps, GPU default) against one row at a time."""
    model = dgemma.load(ref_wide[0])
    net, c = model.net, model.config.canvas_length
    engine = Engine(net, EngineOptions(batch_invariant=False, prefix_cache=False))
    blocks, cache = engine.scheduler.blocks, engine.runner.cache
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (37, 9, 20)]

    def sequences(owner):
        kvs = [SequenceBlocks() for _ in prompts]
        for i, (kv, p) in enumerate(zip(kvs, prompts)):
            blocks.admit(owner + i, kv, [], len(p))
            blocks.allocate(owner + i, kv, len(p))
        return kvs

    together, alone = sequences(0), sequences(10)
    last_together = prefill(net, cache, together, prompts)  # one ragged encoder pass
    last_alone = torch.cat([prefill(net, cache, [kv], [p]) for kv, p in zip(alone, prompts)])
    assert (last_together - last_alone).abs().max() < 1e-5
    canvas = torch.randint(0, model.config.vocab_size, (3, c), generator=g)
    batched = net.logits(net.decode(canvas, cache.plan_decoder(c, together), None))
    for i, kv in enumerate(alone):
        single = net.logits(net.decode(canvas[i : i + 1], cache.plan_decoder(c, [kv]), None))
        assert (batched[i] - single[0]).abs().max() < 5e-5


@pytest.mark.slow
def test_a_request_status_moves_waiting_running_finished(ref_gqa):
    """The scheduler alone moves a request's status, and says why it finished."""
    model = dgemma.load(ref_gqa[0])
    engine = Engine(model.engine_net, EngineOptions(max_active=1))
    first = Request(PREFIX[:10], config(model, max_new_tokens=8, eos_token_ids=[]), 1)
    second = Request(PREFIX[:12], config(model, max_new_tokens=8, eos_token_ids=[]), 2)
    third = Request(PREFIX[:9], config(model, max_new_tokens=8), 3)
    for req in (first, second, third):
        engine.add(req)
        assert req.status is RequestStatus.WAITING and req.finish_reason is None
    engine.cancel(third.request_id)
    engine.step()
    assert first.status is RequestStatus.RUNNING  # admitted: one at a time (max_active=1)
    assert second.status is RequestStatus.WAITING
    assert third.status is RequestStatus.FINISHED and third.finish_reason == "cancelled"
    while engine.has_work:
        engine.step()
    assert [r.status for r in (first, second)] == [RequestStatus.FINISHED] * 2
    assert first.finish_reason == second.finish_reason == "length" and len(first.tokens) == 8

"""The engine on its GPU kernel path (`EngineOptions(triton=True)`), run on CPU by Triton's
interpreter: the Triton step statistics, Philox sampling and paged canvas attention inside real
generations, and the bucketed CUDA-graph logic replayed eagerly (`eager_capture`).

What a CPU can check: a one-step first block (the first pass's argmax over the first canvas,
which both paths draw alike) is exactly the torch path's; the Philox path is
batch-invariant and its own stream; a bucket's static inputs, refilled for another group and other
prefix lengths, give the eager step's outputs. A real graph capture needs CUDA (scripts/gpu_check.py)."""

import os
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

import dgemma  # noqa: E402
from dgemma.engine.fused.graphs import DecoderGraphs, eager_capture  # noqa: E402
from dgemma.kernels import triton_canvas  # noqa: E402
from dgemma.model.checkpoint import byte_tokenizer, make_config, random_model, save_checkpoint  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402

if not triton_canvas.INTERPRETED:
    pytest.skip("triton was imported before TRITON_INTERPRET was set: the kernels need a GPU", allow_module_level=True)

PROMPTS = [[5, 9, 14, 3, 7, 1, 2, 8, 30, 31, 4], list(range(40, 87)), [11, 12]]  # 11, 47 (several blocks), 2 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The "test" size (3 layers, canvas 8, 4 experts) with random weights: the interpreter runs
    every kernel program by program, and the fused layer is a dozen kernels."""
    config = make_config(**PRESETS["test"])
    path = save_checkpoint(
        random_model(config, seed=3, std=0.5),
        tmp_path_factory.mktemp("triton-engine") / "ckpt",
        tokenizer=byte_tokenizer(),
    )
    return dgemma.load(path)


def run(model, prompts, seed=7, **knobs):
    return model.generate(prompts, seed=seed, eos_token_ids=[], **knobs).sequences


@pytest.mark.slow
def test_one_step_blocks_equal_the_torch_path(model):
    """A first block of one step is the argmax of one pass over the first canvas, which both
    paths draw from the request's generator (later canvases differ: the torch path's sampling
    draws advance that generator, the Philox path's do not)."""
    c = model.config.canvas_length
    model.configure_engine(triton=False, block_size=8)
    expected = [run(model, PROMPTS, max_new_tokens=c, max_denoising_steps=1, seed=s) for s in range(2)]
    model.configure_engine(triton=True, block_size=8)
    assert [run(model, PROMPTS, max_new_tokens=c, max_denoising_steps=1, seed=s) for s in range(2)] == expected


@pytest.mark.slow
def test_philox_path_is_batch_invariant_and_its_own_stream(model):
    """Together equals alone (each request draws from its own Philox stream), and the stream is
    not the torch generator's."""
    c = model.config.canvas_length
    model.configure_engine(triton=True, block_size=8)
    together = run(model, PROMPTS, max_new_tokens=c, max_denoising_steps=3)
    assert together == [run(model, [p], max_new_tokens=c, max_denoising_steps=3)[0] for p in PROMPTS]
    model.configure_engine(triton=False, block_size=8)
    assert run(model, PROMPTS, max_new_tokens=c, max_denoising_steps=3) != together


@pytest.mark.slow
def test_a_bucket_replays_for_other_groups_and_prefix_lengths(model):
    """Requests of three prefix lengths stepped through one captured 4-row device step (refilled
    each time, with padded rows) equal the eager device step on the same requests; its attention
    reading the pool in place equals gathered SDPA."""
    from dgemma.config import GenerationConfig
    from dgemma.engine.fused.step import eager_step

    model.configure_engine(triton=True, block_size=8, batch_invariant=False)
    engine = model.engine
    runner = engine.runner
    c, vocab = model.config.canvas_length, model.config.vocab_size
    rows = [engine.encode_prefix(p) for p in PROMPTS]
    graphs = DecoderGraphs(buckets=(4,), capture=eager_capture)
    g = torch.Generator().manual_seed(0)
    gen = GenerationConfig(max_denoising_steps=8)

    for group in ([rows[1]], [rows[2], rows[0], rows[1]]):
        soft = torch.randn(len(group), c, model.config.hidden_size, generator=g).to(runner.net.dtype) * 0.1
        reqs = [
            SimpleNamespace(
                kv=kv,
                config=gen,
                step=2,
                seed=i,
                passes=i,
                block_passes=1,
                history=None,
                active_constraints=None,
                adapter_slot=-1,  # no adapter
                canvas=torch.randint(0, vocab, (c,), generator=g),
                soft=soft[i],
            )
            for i, kv in enumerate(group)
        ]
        replayed = graphs.run(runner.ops, reqs)
        eager = eager_step(runner.ops, reqs, None)
        for a, b in zip(replayed, eager):
            a = a[: b.shape[0]]
            assert a.shape == b.shape
            if a.dtype in (torch.long, torch.bool):
                assert torch.equal(a, b)
            else:  # padded rows change a matmul's blocking, hence float32 rounding (relative to the scale)
                assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))
        canvas = torch.stack([r.canvas for r in reqs])
        temps = torch.full((len(group) * c, 1), 0.7)
        paged = runner.ops.decoder_step(canvas, soft, temps, runner.cache.plan_canvas(c, group))
        gathered = runner.ops.decoder_step(canvas, soft, temps, runner.cache.plan_decoder(c, group))
        # vs SDPA: float32 rounding of another attention order (a near-tie of this random model may flip a token)
        assert (paged[0] == gathered[0]).float().mean() > 0.95
        assert torch.allclose(paged[4], gathered[4], rtol=1e-3, atol=1e-4 * max(1.0, gathered[4].abs().max().item()))
    assert list(graphs.captured) == [4]  # one capture served both groups
    assert graphs.run(runner.ops, [SimpleNamespace(kv=rows[0])] * 5) is None  # larger than the bucket: eager
    for kv in rows:
        engine.release_prefix(kv)


@pytest.mark.slow
def test_a_chunks_decisions_survive_the_next_replay(model, monkeypatch):
    """A group larger than the largest bucket runs as chunks replaying one graph in turn: each
    chunk's decisions (canvas, argmax, the drafts' entropies, self-conditioning) are copied out
    of the graph's outputs, so the next chunk's replay does not overwrite what its drafts show."""
    from dgemma.config import GenerationConfig
    from dgemma.engine.engine import Request
    from dgemma.engine.fused.paths import FusedPath

    model.configure_engine(triton=True, block_size=8, batch_invariant=False)
    engine, c = model.engine, model.config.canvas_length
    runner = engine.runner
    runner.graphs = DecoderGraphs(buckets=(2,), capture=eager_capture)
    gen = GenerationConfig(max_new_tokens=c, max_denoising_steps=2, eos_token_ids=())
    for k, prompt in enumerate([PROMPTS[0], PROMPTS[2], [20, 21, 22]]):
        engine.add(Request(prompt, gen, 11 + k, drafts=True))
    seen = []
    real = FusedPath.run

    def noting(path, group, copy_out=False):  # each chunk's results as they were when it ran
        results = real(path, group, copy_out)
        seen.append([[t.clone() for t in (r.canvas, r.argmax, r.entropy, r.soft)] for r in results])
        return results

    monkeypatch.setattr(FusedPath, "run", noting)
    plan = engine.scheduler.schedule()
    results = runner.run(plan)
    assert [len(chunk) for chunk in seen] == [2, 1]  # both replay the 2-row graph
    for before, res in zip([r for chunk in seen for r in chunk], results):
        for a, b in zip(before, (res.canvas, res.argmax, res.entropy, res.soft)):
            assert torch.equal(a, b)
    model.configure_engine(triton=True, block_size=8, batch_invariant=False)  # a fresh engine for the next test


@pytest.mark.slow
def test_a_steps_encoder_work_is_one_prefill(model, monkeypatch):
    """Without batch invariance, a step's prompt chunks and committed blocks (no images) are
    encoded together: one prefill call per step, each row after its own prefix."""
    from dgemma.engine import prefill as prefill_pass

    calls = []
    real = prefill_pass.prefill
    monkeypatch.setattr(
        prefill_pass,
        "prefill",
        lambda net, cache, rows, *a, **k: calls.append(len(rows)) or real(net, cache, rows, *a, **k),
    )
    model.configure_engine(triton=True, block_size=8, batch_invariant=False)
    c = model.config.canvas_length
    steps = model.engine.stats.steps
    prompts = [PROMPTS[0], PROMPTS[2], [20, 21, 22]]
    out = model.generate(prompts, seed=5, eos_token_ids=[], max_new_tokens=2 * c, max_denoising_steps=1)
    assert len(calls) <= model.engine.stats.steps - steps and max(calls) == len(prompts)
    assert all(len(s) == 2 * c for s in out.sequences)


def test_the_option_needs_a_device_that_runs_the_kernels(model, monkeypatch):
    monkeypatch.setattr(triton_canvas, "INTERPRETED", False)
    model.configure_engine(triton=True)
    with pytest.raises(ValueError, match="need a CUDA device or TRITON_INTERPRET=1"):
        _ = model.engine
    model.configure_engine(triton=None)
    assert model.engine.runner.triton is False  # default: CUDA only


@pytest.mark.slow
def test_turbo_on_the_triton_path(model):
    """Turbo through the Triton kernels (A active query rows against C canvas keys, Philox draws
    per request): with nothing frozen it is the exact Triton path token for token; with freezing
    it computes fewer positions."""
    c = model.config.canvas_length
    model.configure_engine(triton=True, block_size=8)
    knobs = dict(max_new_tokens=c, max_denoising_steps=3, eos_token_ids=[])
    exact = model.generate(PROMPTS[:2], seed=7, **knobs)
    # nothing can freeze in 3 passes (an entropy of exactly 0 would freeze with freeze_entropy 0) nor rest
    same = model.generate(PROMPTS[:2], seed=7, turbo=True, turbo_freeze_passes=10, turbo_dormant_entropy=0.0, **knobs)
    assert same.sequences == exact.sequences
    frozen = model.generate(PROMPTS[:2], seed=7, turbo=True, turbo_freeze_passes=1, turbo_freeze_entropy=100.0, **knobs)
    assert sum(frozen.decoder_positions) < sum(frozen.decoder_passes) * c

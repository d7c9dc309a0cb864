"""Turbo denoising on the device path (engine/fused/turbo.py, kernels/triton_turbo.py), on a CPU
by Triton's interpreter: the plan kernel against engine/turbo.py's rules, the attention's canvas
keys read by slot and the sampler's uniforms at a turbo pass's positions against the torch code
they replace, and whole generations: the device pass (eager, and replaying bucketed graphs as
fake CUDA graphs) gives the eager turbo step's tokens (engine/host/turbo.py) and skips the same
positions."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

import dgemma  # noqa: E402
from dgemma.config import TurboSettings  # noqa: E402
from dgemma.engine.fused import paths as fused_paths  # noqa: E402
from dgemma.engine.fused.graphs import DecoderGraphs, eager_capture  # noqa: E402
from dgemma.engine.turbo import TurboState  # noqa: E402
from dgemma.kernels import triton_attention, triton_canvas, triton_step, triton_turbo  # noqa: E402
from dgemma.model.checkpoint import byte_tokenizer, make_config, random_model, save_checkpoint  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402

if not triton_canvas.INTERPRETED:
    pytest.skip("triton was imported before TRITON_INTERPRET was set: the kernels need a GPU", allow_module_level=True)


def test_the_plan_is_the_turbo_states_rows_and_rests():
    """turbo_plan's computed positions and resting ones equal TurboState.query_rows' (engine/turbo.py),
    on full passes, passes where positions rest, and ones where none may; the rows' reads are the
    inputs at those positions, padded with the last."""
    g = torch.Generator().manual_seed(0)
    n, c, a = 5, 16, 16
    frozen = torch.rand(n, c, generator=g) < 0.3
    frozen[4] = True  # nothing to compute but a full pass
    streak = torch.randint(0, 3, (n, c), generator=g) * (torch.rand(n, c, generator=g) < 0.5)
    entropy = torch.rand(n, c, generator=g) * 2
    rested = torch.rand(n, c, generator=g) < 0.2
    full = torch.tensor([1, 0, 0, 0, 1], dtype=torch.int32)
    may = [True, True, False, True, True]
    threshold = torch.tensor([0.8 if m else float("inf") for m in may])
    threshold[3] = 5.0  # none above it: nothing rests
    slot = torch.tensor([3, 0, 2, 1, 4], dtype=torch.int32)
    positions = torch.arange(n * c, dtype=torch.int32).view(n, c) + 100
    temps = torch.rand(n * c, generator=g)
    canvas = torch.randint(0, 50, (n, c), generator=g)
    plan = triton_turbo.turbo_plan(
        (frozen, streak, entropy, rested), full, threshold, (slot, positions, temps, canvas), c, a
    )
    rows, index, live, resting, writes, pos_a, temps_a, canvas_a = plan
    for i in range(n):
        state = TurboState(
            frozen[i], streak[i], torch.zeros(c, dtype=torch.long), entropy[i], [1], passes=1 - int(full[i])
        )
        state.rested = rested[i]
        want_rows, want_resting = state.query_rows(
            TurboSettings(dormant_entropy=float(threshold[i]) if may[i] else 0.0), may[i]
        )
        k = want_rows.numel()
        assert rows[i, :k].tolist() == want_rows.tolist() and bool((rows[i, k:] == rows[i, k - 1]).all())
        assert torch.equal(resting[i], want_resting)
        assert torch.equal(live[i], torch.zeros(c, dtype=torch.bool).index_fill(0, want_rows, True) & ~frozen[i])
        assert [int(index[i, p]) for p in want_rows] == list(range(k))
        assert writes.view(n, a)[i].tolist() == (int(slot[i]) * c + rows[i]).tolist()
        assert torch.equal(pos_a[i], positions[i][rows[i]]) and torch.equal(canvas_a[i], canvas[i][rows[i]])
        assert torch.equal(temps_a.view(n, a)[i], temps.view(n, c)[i][rows[i]])


def test_the_attention_reads_each_rows_canvas_keys_from_its_slot():
    """paged_canvas_attention with `canvas_rows` equals the call with those slots' keys gathered."""
    g = torch.Generator().manual_seed(1)
    n, h, hkv, a, c, d, blocks, bs = 2, 4, 2, 3, 8, 16, 6, 4
    q = torch.randn(n, h, a, d, generator=g)
    pool_k, pool_v = torch.randn(5, hkv, c, d, generator=g), torch.randn(5, hkv, c, d, generator=g)
    k_pool, v_pool = torch.randn(blocks, bs, hkv, d, generator=g), torch.randn(blocks, bs, hkv, d, generator=g)
    tables = torch.tensor([[0, 2, -1], [1, 3, 4]], dtype=torch.int32)
    lo, start = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([6, 11], dtype=torch.int32)
    slots = torch.tensor([4, 1], dtype=torch.int32)
    got = triton_attention.paged_canvas_attention(
        q, pool_k, pool_v, k_pool, v_pool, tables, lo, start, canvas_rows=slots
    )
    want = triton_attention.paged_canvas_attention(
        q, pool_k[slots.long()], pool_v[slots.long()], k_pool, v_pool, tables, lo, start
    )
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="canvas_rows must be int32"):
        triton_attention.paged_canvas_attention(
            q, pool_k, pool_v, k_pool, v_pool, tables, lo, start, canvas_rows=slots.long()
        )


def test_a_turbo_pass_samples_with_the_uniforms_of_its_positions():
    """sample_drawn at a turbo pass's rows draws each row's uniform at its canvas position (what
    an exact pass draws there): sample_rows over the Philox uniforms gathered at those positions."""
    g = torch.Generator().manual_seed(2)
    n, c, a, vocab = 2, 8, 4, 300
    weights = torch.rand(n * a, vocab, generator=g) ** 4
    seeds = torch.tensor([triton_step.seed_bits(s) for s in (5, 2**64 - 1)], dtype=torch.long)
    passes = torch.tensor([3, 7], dtype=torch.long)
    rows = torch.tensor([[1, 4, 6, 6], [0, 2, 3, 7]])
    uniforms, _ = triton_step.philox_draws(seeds, passes, c, vocab)
    want = triton_step.sample_rows(weights, None, uniforms.gather(1, rows).reshape(-1))
    assert torch.equal(triton_step.sample_drawn(weights, seeds, passes, c, positions=rows), want)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The "test" size (3 layers, canvas 8) with random weights, in float32: the two paths'
    tokens are compared exactly."""
    config = make_config(**PRESETS["test"])
    path = save_checkpoint(
        random_model(config, seed=3, std=0.5),
        tmp_path_factory.mktemp("triton-turbo") / "ckpt",
        tokenizer=byte_tokenizer(),
    )
    return dgemma.load(path, dtype="float32")


PROMPTS = [[5, 9, 14, 3, 7, 1, 2, 8, 30, 31, 4], list(range(40, 87)), [11, 12]]


def generate(model):
    c = model.config.canvas_length
    knobs = dict(max_new_tokens=2 * c, max_denoising_steps=6, eos_token_ids=[])
    turbo = dict(turbo=True, turbo_freeze_passes=1, turbo_freeze_entropy=2.0, turbo_dormant_entropy=0.5)
    return model.generate(PROMPTS, seed=7, **knobs, **turbo)


@pytest.mark.slow
def test_the_device_turbo_pass_gives_the_eager_turbo_steps_tokens(model, monkeypatch):
    """The device pass, eager and replaying bucketed graphs (fake CUDA graphs: a graph a request,
    several replaying in a step, several row buckets as positions freeze and rest), gives engine/host/turbo.py's tokens and
    computes the same positions, fewer than every position of every pass."""
    c = model.config.canvas_length
    model.configure_engine(triton=True, block_size=8, batch_invariant=False)
    device = generate(model)
    pool = model.engine.runner.fused_turbo.pool
    assert pool is not None and pool.slots == DecoderGraphs.BUCKETS[-1]  # the requests held canvas K/V slots
    model.configure_engine(triton=True, block_size=8, batch_invariant=False)
    graphs = model.engine.runner.graphs = DecoderGraphs(buckets=(1,), capture=eager_capture)  # a graph a request
    replayed = generate(model)
    assert len({a for _, a in graphs.turbo_steps}) > 1  # row buckets as positions froze and rested
    assert not graphs.failures
    monkeypatch.setattr(fused_paths, "fits_the_device", lambda r: False)
    model.configure_engine(triton=True, block_size=8, batch_invariant=False)
    eager = generate(model)
    assert model.engine.runner.fused_turbo.pool is None
    assert device.sequences == replayed.sequences == eager.sequences
    assert device.decoder_positions == replayed.decoder_positions == eager.decoder_positions
    assert sum(device.decoder_positions) < sum(device.decoder_passes) * c
    model.configure_engine(triton=True, block_size=8, batch_invariant=False)

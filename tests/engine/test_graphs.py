"""engine/fused/graphs.py on a CPU: the CUDA-graph buckets of the decoder step.

A real capture needs CUDA (scripts/gpu_check.py). Here `cuda_capture` runs against fakes of
torch.cuda's stream, graph and pool calls (enough to show which stream is current after a capture
fails, and that a failed capture does not poison the pool for the next one), and the bucket logic
runs the tiny model's Triton step under the interpreter with `eager_capture` (a replay recomputes
the step from the static inputs)."""

import logging
import os
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from dgemma.engine.fused.graphs import DecoderGraphs, cuda_capture, eager_capture  # noqa: E402


# ------------------------------------------------------------------ cuda_capture against fakes
class FakeStream:
    def __init__(self, name: str):
        self.name = name

    def wait_stream(self, other):
        pass

    def __repr__(self):
        return f"<stream {self.name}>"


class FakeCuda:
    """torch.cuda's current stream, streams, graphs and the caching allocator's pool recording,
    as far as a capture touches them. A graph's `capture_end` raises (like an illegal operation
    inside the capture: cudaStreamEndCapture fails) while `fail_end` is set, and then, as in
    torch, before the allocator stops recording into the pool."""

    def __init__(self):
        self.default = self.current = FakeStream("default")
        self.streams = 0
        self.pools = 0
        self.recording: set = set()  # pools the allocator records a capture into
        self.fail_end = False
        self.captures = []  # (pool, stream) of each capture_begin
        cuda = self

        class Graph:
            def capture_begin(self, pool=None, **kwargs):
                if pool in cuda.recording:  # CUDACachingAllocator::beginAllocateToPool
                    raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
                cuda.recording.add(pool)
                cuda.captures.append((pool, cuda.current))
                self.pool = pool

            def capture_end(self):
                if cuda.fail_end:
                    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
                cuda.recording.discard(self.pool)  # endAllocateToPool

            def replay(self):
                pass

        self.Graph = Graph

    def Stream(self):
        self.streams += 1
        return FakeStream(f"side {self.streams}")

    def current_stream(self, device=None):
        return self.current

    def set_stream(self, stream):
        self.current = stream

    def stream(self, stream):
        return FakeStreamContext(self, stream)

    def graph_pool_handle(self):
        self.pools += 1
        return (0, self.pools)

    def end_allocate_to_pool(self, device, pool):
        if pool not in self.recording:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.recording.discard(pool)


class FakeStreamContext:
    """torch.cuda.StreamContext as it runs on a CUDA machine: the stream is current from
    __enter__ until __exit__ (and stays current if __exit__ is never called)."""

    def __init__(self, cuda: FakeCuda, stream: FakeStream):
        self.cuda, self.stream, self.previous = cuda, stream, None

    def __enter__(self):
        self.previous = self.cuda.current
        self.cuda.set_stream(self.stream)

    def __exit__(self, *exc):
        self.cuda.set_stream(self.previous)


@pytest.fixture
def fake_cuda(monkeypatch):
    cuda = FakeCuda()
    for name, value in {
        "CUDAGraph": cuda.Graph,
        "Stream": cuda.Stream,
        "current_stream": cuda.current_stream,
        "set_stream": cuda.set_stream,
        "stream": cuda.stream,
        "graph_pool_handle": cuda.graph_pool_handle,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "current_device": lambda: 0,
    }.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", cuda.end_allocate_to_pool, raising=False)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)  # made from the fake Stream
    return cuda


def test_a_failed_capture_restores_the_stream_and_spares_the_pool(fake_cuda):
    """capture_end raising (an illegal op inside the capture) leaves the previous stream current,
    and the next capture (another bucket) still captures, into a pool nobody is recording to."""
    graphs = DecoderGraphs(buckets=(1, 2))
    steps = []

    def step():
        steps.append(fake_cuda.current)
        return (torch.zeros(2),)

    fake_cuda.fail_end = True
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        cuda_capture(step, graphs)
    assert fake_cuda.current is fake_cuda.default  # not the capture stream
    assert len(steps) == 2 and fake_cuda.default not in steps  # warm-up and capture on a side stream

    fake_cuda.fail_end = False
    _, outputs = cuda_capture(step, graphs)
    assert fake_cuda.current is fake_cuda.default and not fake_cuda.recording
    assert len(fake_cuda.captures) == 2 and outputs[0].shape == (2,)


def test_a_step_that_raises_inside_the_capture_restores_the_stream(fake_cuda):
    graphs = DecoderGraphs()
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 2:  # the captured run, not the warm-up
            raise RuntimeError("a host sync inside the step")
        return (torch.zeros(1),)

    with pytest.raises(RuntimeError, match="a host sync inside the step"):
        cuda_capture(step, graphs)
    assert fake_cuda.current is fake_cuda.default and not fake_cuda.recording


def test_a_capture_that_succeeds_shares_the_pool_and_leaves_the_stream(fake_cuda):
    graphs = DecoderGraphs()
    for _ in range(2):
        cuda_capture(lambda: (torch.zeros(1),), graphs)
    assert fake_cuda.current is fake_cuda.default
    assert [pool for pool, _ in fake_cuda.captures] == [(0, 1), (0, 1)] and fake_cuda.pools == 1


# ------------------------------------------------------------------ buckets on the tiny model
from dgemma.engine.engine import Engine, EngineOptions  # noqa: E402
from dgemma.model.checkpoint import make_config  # noqa: E402
from dgemma.model.diffusion_gemma import DiffusionGemma  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402

PROMPTS = [[5, 9, 14, 3, 7, 1, 2, 8, 30, 31, 4], list(range(40, 87)), [11, 12]]  # 11, 47, 2 tokens


@pytest.fixture(scope="module")
def engine():
    """The "test" size (canvas 8, vocab 384) with random weights on the Triton path: the
    interpreter runs a kernel program per row, so the steps here are few and small."""
    pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
    from dgemma.kernels import triton_canvas

    if not triton_canvas.INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET was set: the kernels need a GPU")
    torch.manual_seed(0)
    net = DiffusionGemma(make_config(**PRESETS["test"]))
    for p in net.parameters():
        p.requires_grad_(False)
        if p.dim() >= 2:
            p.normal_(0, 0.05)
    engine = Engine(net.eval(), EngineOptions(triton=True, block_size=8, batch_invariant=False, kv_cache_memory=2**24))
    with torch.no_grad():
        engine.rows = [engine.encode_prefix(p) for p in PROMPTS]
    yield engine
    for kv in engine.rows:
        engine.release_prefix(kv)


def requests(engine, kvs, seed: int, allowed: torch.Tensor | None = None) -> list:
    """Requests mid-canvas as the device step reads them (engine/fused/inputs.py, engine/fused/step.py):
    a random canvas and self-conditioning input, their own seeds, steps and stop histories."""
    from dgemma.config import GenerationConfig

    cfg = engine.runner.config
    c, g = cfg.canvas_length, torch.Generator().manual_seed(seed)
    out = []
    for i, kv in enumerate(kvs):
        gen = GenerationConfig(max_denoising_steps=8, entropy_bound=0.3 + 0.1 * i, stability_threshold=1 + i % 2)
        fixed = torch.full((c,), -1, dtype=torch.long)
        fixed[i] = 7 + i  # one fixed position a request
        constraints = SimpleNamespace(fixed=fixed, allowed=None if allowed is None else allowed[i * c : (i + 1) * c])
        out.append(
            SimpleNamespace(
                kv=kv,
                config=gen,
                step=i + 1,
                seed=seed * 10 + i,
                passes=3 * i,
                block_passes=i,
                canvas=torch.randint(0, cfg.vocab_size, (c,), generator=g),
                soft=(torch.randn(c, cfg.hidden_size, generator=g) * 0.1).to(engine.runner.net.dtype)
                if i != 1
                else None,
                history=None if i % 2 else torch.randint(0, cfg.vocab_size, (4, c), generator=g),
                active_constraints=constraints,
                adapter_slot=-1,  # no LoRA adapter
            )
        )
    return out


def random_masks(engine, rows: int, seed: int) -> torch.Tensor:
    """int32 [rows, ceil(V / 32)] as `Runner.allowed_masks` packs them: each token allowed with
    probability 1/2 (bit t % 32 of word t // 32)."""
    vocab = engine.runner.config.vocab_size
    words = -(-vocab // 32)
    bits = torch.zeros(rows, words * 32, dtype=torch.bool)
    bits[:, :vocab] = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(seed)) < 0.5
    packed = (bits.view(rows, words, 32).long() << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def assert_same(replayed, eager, n: int):
    """A replay's outputs (the bucket's rows) against the eager step's (the group's own)."""
    c = eager[0].shape[1]
    for a, b in zip(replayed, eager, strict=True):
        a = a[: n * c] if a.dim() == 2 and a.shape[0] != b.shape[0] and b.shape[0] == n * c else a[: b.shape[0]]
        assert a.shape == b.shape
        if a.dtype in (torch.long, torch.bool):
            assert torch.equal(a, b)
        else:  # padded rows change a matmul's blocking, hence its float32 rounding (relative to the scale:
            # the self-conditioning input sums embeddings, its small entries carry the large ones' error)
            assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))


def eager_step(engine, group, allowed=None):
    from dgemma.engine.fused.step import eager_step as step

    return step(engine.runner.ops, group, allowed)


@pytest.mark.slow
@torch.no_grad()
def test_a_failed_bucket_runs_eagerly_and_the_others_keep_replaying(engine, caplog):
    """A capture that fails for the 2-row bucket only: that bucket returns None (eager) for good,
    logged once with the reason and recorded in `failures`; bucket 1 keeps replaying, and its
    replay is the eager device step (decisions and histories included)."""
    runner, rows = engine.runner.ops, engine.rows
    attempts = []

    def flaky(step, graphs):
        attempts.append(len(attempts))
        if len(attempts) == 2:  # the second capture: the 2-row bucket's (runs below)
            raise RuntimeError("operation not permitted when stream is capturing")
        return eager_capture(step, graphs)

    graphs = DecoderGraphs(buckets=(1, 2), capture=flaky)
    with caplog.at_level(logging.WARNING, logger="dgemma"):
        assert graphs.run(runner, requests(engine, rows[:1], 0)) is not None
        assert graphs.run(runner, requests(engine, rows[:2], 1)) is None
        assert graphs.run(runner, requests(engine, rows[1:3], 2)) is None  # not captured again
        group = requests(engine, rows[1:2], 3)
        assert_same(graphs.run(runner, group), eager_step(engine, group), 1)
    assert len(attempts) == 2 and list(graphs.captured) == [1]
    assert graphs.failures == {(2, False): "RuntimeError: operation not permitted when stream is capturing"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "for 2 rows" in warnings[0]
    assert "RuntimeError: operation not permitted when stream is capturing" in warnings[0]


@pytest.mark.slow
@torch.no_grad()
def test_masked_and_unmasked_steps_replay_in_their_own_graphs(engine):
    """A request with allowed-token masks replays a masked graph (its padded row allows every
    token) and equals the eager masked step; an unmasked group in the same bucket afterwards gets
    its own graph and equals the eager unmasked step (padding rows: other groups' sizes)."""
    runner, rows = engine.runner.ops, engine.rows
    graphs = DecoderGraphs(buckets=(2,), capture=eager_capture)
    c = runner.config.canvas_length
    allowed = random_masks(engine, c, 5)
    group = requests(engine, rows[2:3], 5, allowed)
    replayed = graphs.run(runner, group, allowed)
    assert_same(replayed, eager_step(engine, group, allowed), 1)
    picked = replayed[1][0]  # the argmax canvas
    assert int(picked[0]) == 7  # the fixed token
    assert bool(((allowed[torch.arange(c), picked // 32] >> (picked % 32)) & 1)[1:].all())  # every free argmax allowed
    assert bool((graphs.steps[(2, True)].allowed[c:] == -1).all())  # the padded row allows everything

    group = requests(engine, rows[:2], 6)
    assert_same(graphs.run(runner, group), eager_step(engine, group), 2)
    assert set(graphs.steps) == {(2, True), (2, False)} and list(graphs.captured) == [2] and not graphs.failures


def test_groups_larger_than_the_largest_bucket_are_the_callers_to_split():
    graphs = DecoderGraphs(buckets=(2, 1), capture=eager_capture)
    assert graphs.buckets == (1, 2) and graphs.largest == 2
    assert [graphs.bucket(n) for n in (1, 2, 3)] == [1, 2, None]
    assert graphs.run(None, [SimpleNamespace(kv=None)] * 3) is None and not graphs.steps
    assert DecoderGraphs().largest == 8


@pytest.mark.slow
def test_gpu_check_fails_a_graph_timing_whose_capture_failed(monkeypatch):
    """scripts/gpu_check.py's table timed `None` (~0 ms per graph step) when a bucket did not
    capture; now the timing raises with the capture's reason (the table prints it as failed)."""
    import importlib.util
    from pathlib import Path

    from dgemma.engine.engine import Engine, EngineOptions

    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    def failing_capture(step, graphs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(gpu_check, "eager_capture", failing_capture)
    net = gpu_check.tiny_model(torch.device("cpu"), torch.bfloat16)
    engine = Engine(net, EngineOptions(triton=True, block_size=8, batch_invariant=False, kv_cache_memory=2**24))
    kv = engine.encode_prefix(list(range(3, 14)))
    with pytest.raises(RuntimeError, match="no CUDA graph for batch 1: RuntimeError: operation not permitted"):
        gpu_check.step_ms(engine, kv, 1, graphs=True, iters=1)
    assert gpu_check.step_ms(engine, kv, 1, graphs=False, iters=1) > 0

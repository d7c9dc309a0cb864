"""The GPU step never makes the host wait, proved on a CPU (tests/host_sync.py: the meta device,
a dispatch mode refusing host syncs and host copies, Triton launches stubbed).

- The decoder step (what a CUDA graph captures) makes no host sync and no copy from the host.
- A step's encoder passes (prompt chunks, committed blocks), its preparation and the sampler's
  decisions (acceptance, sampling, the stop rule) make no host sync and only non-blocking copies.
- A whole engine step reads the device once (the stop flags), whatever the batch size.
- Every step-reachable module's host reads are where a reason says they may be (a static check).
Each holds in bf16, with and without quantised experts, with a constrained request in the batch.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")

from dgemma.config import GenerationConfig
from dgemma.engine.constraints import CanvasConstraints
from dgemma.engine.engine import Engine, EngineOptions, Request
from dgemma.engine.fused.graphs import DecoderGraphs, eager_capture
from dgemma.engine.step_plan import DecodeResult
from dgemma.model.checkpoint import make_config
from dgemma.model.diffusion_gemma import DiffusionGemma
from dgemma.model.presets import PRESETS
from host_sync import DEVICE, HostSync, count_host_reads, no_host_sync, stub_triton_launches, to_device

SEED_MAX = 2**64 - 1


def meta_engine(scheme: str | None) -> Engine:
    """The "test" size model in bf16 (quantised experts and linears with `scheme`) on the meta
    device, with the GPU path's kernels (Triton, paged attention in place)."""
    torch.manual_seed(0)
    config = make_config(**PRESETS["test"])
    if scheme is None:
        net = DiffusionGemma(config).to(torch.bfloat16)
    else:
        from dgemma.quant.modules import random_quantized_model

        net = random_quantized_model(config, scheme, 16 if scheme == "int4" else None, torch.bfloat16)
    to_device(net.eval())
    options = EngineOptions(
        triton=True, cuda_graphs=False, block_size=8, batch_invariant=False, prefix_cache=False, kv_cache_memory=2**24
    )
    return Engine(net, options)


def add_requests(engine: Engine) -> list[Request]:
    """Three requests: two plain (one with the largest seed) and one whose canvas is constrained by
    an allowed-token mask on every position (what a grammar or a tool call sends)."""
    cfg = engine.runner.config
    gen = GenerationConfig(max_new_tokens=4 * cfg.canvas_length, max_denoising_steps=8)
    allowed = torch.zeros(cfg.canvas_length, cfg.vocab_size, dtype=torch.bool)
    allowed[:, 10:50] = True
    masked = CanvasConstraints.build(cfg.canvas_length, cfg.vocab_size, allowed=allowed, fixed={0: 12})
    requests = [
        Request(list(range(3, 14)), gen, SEED_MAX),
        Request(list(range(20, 37)), gen, 7, constraints=masked),
        Request(list(range(40, 45)), gen, 2**63),
    ]
    for r in requests:
        engine.add(r)
    return requests


def forced_results(group, decisions) -> list[DecodeResult]:
    """What `HostPath.results` gives, with every block ending (the meta device holds no values):
    the next step then encodes each committed block."""
    c = decisions.canvas.shape[1]
    return [
        DecodeResult(r, decisions.canvas[i], torch.full((c,), 12), decisions.soft_next[i], decisions.histories[i], True)
        for i, r in enumerate(group)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", [None, "int4", "fp8"])
def test_engine_steps_make_no_host_sync(scheme):
    """Three steps of the engine on the meta device: prompts encoded, canvases denoised, blocks
    committed and encoded again, the decoder step checked on its own (no copy from the host at all)."""
    engine = meta_engine(scheme)
    runner = engine.runner
    requests = add_requests(engine)
    encoded, decoded = 0, 0
    with stub_triton_launches(), torch.no_grad():
        for _ in range(3):
            plan = engine.scheduler.schedule()
            with no_host_sync("non_blocking") as guard:
                runner._encode(plan.encode)
                results = []
                for _, group in runner.groups(plan.decode):
                    canvas = torch.stack([r.canvas for r in group])
                    temps, soft, allowed = (
                        runner.ops.temperatures(group),
                        runner.ops.soft_inputs(group),
                        runner.ops.allowed_masks(group),
                    )
                    pass_plan = runner.cache.plan_canvas(engine.runner.config.canvas_length, [r.kv for r in group])
                    with no_host_sync("none"):  # the captured part
                        outputs = runner.ops.decoder_step(canvas, soft, temps, pass_plan, allowed)
                    results += forced_results(group, runner.host.decide(group, *outputs))
            assert guard.h2d_copies > 0  # the guard saw the step's inputs go to the device
            encoded += len(plan.encode)
            decoded += len(results)
            engine.scheduler.update(plan, results)
    assert encoded >= 6 and decoded == 9  # prompts, then committed blocks (with a prefix) encoded
    assert all(r.block == 3 for r in requests)


@pytest.mark.parametrize("scheme", [None, "int4"])
def test_prefix_encode_and_masked_decoder_step_make_no_host_sync(scheme):
    """The encode of a prompt and of a block after it (non-blocking copies of the plan only), then a
    batched decoder step with an allowed-token mask on one request (no copy at all): what failed on
    main at the RoPE frequencies' copy, and with quantised experts at their bincount."""
    engine = meta_engine(scheme)
    runner, cfg = engine.runner, engine.runner.config
    c = cfg.canvas_length
    with stub_triton_launches(), torch.no_grad():
        with no_host_sync("non_blocking"):
            rows = [engine.encode_prefix(list(range(3, 3 + n))) for n in (5, 13)]
            plan = runner.cache.plan_canvas(c, rows)
            allowed = torch.full((2 * c, -(-cfg.vocab_size // 32)), -1, dtype=torch.int32)
            allowed[c:, 1:] = 0
            allowed = allowed.to(DEVICE, non_blocking=True)
            canvas = torch.zeros(2, c, dtype=torch.long).to(DEVICE, non_blocking=True)
            temps = torch.full((2 * c, 1), 0.7).to(DEVICE, non_blocking=True)
            soft = torch.zeros(2, c, cfg.hidden_size, dtype=torch.bfloat16, device=DEVICE)
        with no_host_sync("none"):
            argmax, entropy, weights, total, soft_next = runner.ops.decoder_step(canvas, soft, temps, plan, allowed)
    assert argmax.shape == (2, c) and weights.shape == (2 * c, cfg.vocab_size) and soft_next.dtype == torch.bfloat16


def test_the_guard_catches_what_main_did():
    """The defects the guard found, each caught: RoPE frequencies copied from the host on every
    pass, bincount in the quantised experts, a blocking copy, reading a value."""
    x = torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(HostSync, match="blocking copy from the host"):
        with no_host_sync("non_blocking"):
            torch.arange(4).to(DEVICE)
    with pytest.raises(HostSync, match="copy from the host"):
        with no_host_sync("none"):
            torch.arange(4).to(DEVICE, non_blocking=True)
    for op in (
        lambda: torch.bincount(x),
        lambda: x.nonzero(),
        lambda: x.sum().item(),
        lambda: x.tolist(),
        lambda: bool(x[0]),
    ):
        with pytest.raises(HostSync, match="host sync"):
            with no_host_sync():
                op()
    with pytest.raises(HostSync, match="implicit copy"):
        with no_host_sync():
            x + torch.arange(4)
    with no_host_sync():  # a host scalar tensor is an argument, not a copy
        x * torch.tensor(2)


def test_a_step_reads_the_device_once():
    """The host-operation budget of a step: one read (the stop flags) per group, whatever the batch
    size, while no block ends (a block's commit reads its tokens; drafts and log probabilities,
    when asked for, read theirs)."""
    engine = meta_engine(None)
    add_requests(engine)
    assert_steady_reads(engine, 1)


def assert_steady_reads(engine: Engine, per_step: int) -> None:
    """The steps after the first (prompts encoded, first passes) read the device `per_step` times each."""
    with stub_triton_launches(), torch.no_grad():
        with count_host_reads():
            engine.step()
        for _ in range(2):
            with count_host_reads() as reads:
                engine.step()
            assert reads.count == per_step, reads.where


@pytest.mark.parametrize("graphs", [False, True])
def test_a_turbo_step_on_the_device_reads_once_and_its_pass_never_syncs(monkeypatch, graphs):
    """Turbo requests on the device path (engine/fused/turbo.py): the pass (what a graph
    captures: the plan, the fused network over the computed rows, statistics, sampling, the
    decisions) makes no sync and no copy from the host, and a whole engine step reads the device
    once (stop flags and the next pass's counts together), whatever the batch."""
    from dgemma.engine.fused import turbo as device_turbo

    engine = meta_engine(None)
    if graphs:
        engine.runner.graphs = DecoderGraphs(buckets=(1, 2), capture=eager_capture)  # groups of 2 and 1
    real = device_turbo.run_turbo_step

    def guarded(ops, pool, step, active):
        with no_host_sync("none"):
            return real(ops, pool, step, active)

    monkeypatch.setattr(device_turbo, "run_turbo_step", guarded)
    cfg = engine.runner.config
    gen = GenerationConfig(max_new_tokens=4 * cfg.canvas_length, max_denoising_steps=8, turbo=True)
    for i, start in enumerate((3, 20, 40)):
        engine.add(Request(list(range(start, start + 9)), gen, i))
    assert_steady_reads(engine, 2 if graphs else 1)  # graphs: one read a chunk
    assert sorted(r.turbo.slot for r in engine.scheduler.running) == [0, 1, 2]


@pytest.mark.slow
def test_a_grammar_request_adds_only_its_own_reads():
    """A grammar request in the batch (the shipped model's tokenizer, a regex): its decoder step
    takes the grammar's masks with no sync, and the step's reads are the stop flags plus the
    grammar's own on the host (the pass's argmax canvas it refines, and at most one read of
    each position's candidates), never one per rejected token or per plain request."""
    import dgemma

    model = dgemma.load()
    engine = Engine(
        to_device(model.net.to(torch.bfloat16).eval()),
        EngineOptions(
            triton=True,
            cuda_graphs=False,
            block_size=8,
            batch_invariant=False,
            prefix_cache=False,
            kv_cache_memory=2**24,
        ),
    )
    c = model.config.canvas_length
    gen = GenerationConfig(max_new_tokens=2 * c, max_denoising_steps=4)
    grammar = model.compile_grammar("regex", "[a-z]{3,40}")
    engine.add(Request([5, 6, 7], gen, 1, constraints=model.grammars.canvas(grammar, c)))
    for seed in (2, 3, 4):
        engine.add(Request([8, 9, 10, 11], gen, seed))
    runner = engine.runner
    runner.graphs = DecoderGraphs(
        buckets=(4,), capture=eager_capture
    )  # the plain rows replay; the grammar's runs eagerly
    with stub_triton_launches(), torch.no_grad():
        with count_host_reads():
            engine.step()  # prompts encoded, first passes (the grammar reads its first draft)
        for _ in range(2):
            plan = engine.scheduler.schedule()
            groups = [group for _, group in runner.groups(plan.decode)]
            assert [[r.refines for r in g] for g in groups] == [[True], [False] * 3]  # the walk decides on the host
            group = groups[0]
            with no_host_sync("non_blocking"):
                canvas, allowed = torch.stack([r.canvas for r in group]), runner.ops.allowed_masks(group)
                temps, soft = runner.ops.temperatures(group), runner.ops.soft_inputs(group)
                pass_plan = runner.cache.plan_canvas(c, [r.kv for r in group])
            assert allowed is not None
            with no_host_sync("none"):
                runner.ops.decoder_step(canvas, soft, temps, pass_plan, allowed)
            with count_host_reads() as reads:  # the whole step: the plain rows' stop flags, the grammar's own reads
                engine.scheduler.update(plan, runner.run(plan))
            assert 3 <= reads.count <= 4, reads.where


# ---------------------------------------------------------------------------------- static check
ROOT = Path(__file__).resolve().parents[2] / "dgemma"
STEP_MODULES = [
    "engine/runner.py",
    "engine/fused/graphs.py",
    "engine/sampler.py",
    "engine/kv/paged_cache.py",
    "engine/prefill.py",
    "model/diffusion_gemma.py",
    "model/rope.py",
    "model/attention.py",
    "kernels/fused.py",
    "kernels/lora.py",
    "kernels/triton_lora.py",
    "kernels/triton_step.py",
    "kernels/triton_canvas.py",
    "kernels/triton_layer.py",
    "kernels/triton_attention.py",
    "kernels/triton_quant.py",
    "quant/modules.py",
    "engine/turbo.py",
    "engine/host/turbo.py",
    "engine/host/step.py",
    "engine/step_ops.py",
    "engine/paths.py",
    "engine/fused/paths.py",
    "engine/fused/step.py",
    "engine/fused/inputs.py",
    "engine/fused/ar.py",
    "kernels/triton_ar.py",
    "kernels/triton_turbo.py",
    "engine/fused/turbo.py",
    "kernels/triton_norms.py",
    "kernels/triton_moe.py",
]
HOST_READS = {"item", "tolist", "cpu", "numpy", "nonzero", "bincount", "unique", "masked_select"}
# (module, function): why it may read the device on the host
ALLOWED = {
    ("engine/host/step.py", "results"): "the step's one read: the stop flags",
    ("engine/fused/paths.py", "run"): "a fused path's one read: stop flags (turbo: with the next pass's counts)",
    ("engine/fused/ar.py", "_generate"): "AR: the prompt's first tokens, then one read of tokens per read-back batch",
    ("engine/host/step.py", "_refine"): "a grammar's walk runs on the host: constrained requests only",
    ("engine/host/step.py", "_sample"): "the CPU path samples only the accepted positions (nonzero on the host); "
    "turbo: the sampled rows",
    ("model/diffusion_gemma.py", "grouped_matmul"): "torch's loop fallback where F.grouped_mm has no kernel (float32)",
    ("quant/modules.py", "_differentiable"): "training only (autograd recording): the experts' row counts",
    ("engine/sampler.py", "row_logprobs"): "log probabilities: only for requests asking (block ends, turbo freezes)",
    # turbo is opt-in and eager: its active rows set the pass's shapes, so the host must know them each pass
    ("engine/turbo.py", "query_rows"): "turbo: the rows this pass computes (a shape)",
    ("engine/turbo.py", "freeze"): "turbo: where a frozen end of answer lies",
    ("engine/host/turbo.py", "turbo_step"): "turbo: the rows the sampler decides (their count is a shape)",
    ("engine/host/turbo.py", "decide_request"): "turbo: the stop flag, the positions that froze",
    ("engine/host/step.py", "turbo_rows"): "turbo with a grammar: the frozen rows of the walk's weights",
}


def _host_reads(path: Path):
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in HOST_READS:
                yield fn.name, node.func.attr, node.lineno


def test_step_modules_read_the_device_only_where_allowed():
    """Every `.item()`, `.tolist()`, `.cpu()`, `nonzero`, `bincount`... in the modules a step reaches
    sits in a function with a stated reason (a new one must argue for itself here)."""
    found, used = {}, set()
    for rel in STEP_MODULES:
        for fn, attr, line in _host_reads(ROOT / rel):
            if (rel, fn) not in ALLOWED:
                found.setdefault(f"{rel}:{line} {fn}", attr)
            used.add((rel, fn))
    assert not found, f"host reads in the step's modules without a reason: {found}"
    assert set(ALLOWED) <= used, f"reasons for reads that are gone (remove them): {set(ALLOWED) - used}"

"""The decode paths (engine/paths.py): which path a request takes, and how a step groups them. On a
GPU the grouping decides each batch, and so the numerics: these pin today's composition and order."""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from dgemma.engine.paths import group_requests


def path(name: str) -> SimpleNamespace:
    return SimpleNamespace(name=name)


HOST, FUSED, FUSED_TURBO, HOST_TURBO = (path(n) for n in ("host", "fused", "fused turbo", "host turbo"))
ORDER = (HOST, FUSED, FUSED_TURBO, HOST_TURBO)


def requests(kinds: str) -> tuple[list, dict]:
    """One request a letter: h host, f fused, t fused turbo, u host turbo (in that order of arrival)."""
    of = {"h": HOST, "f": FUSED, "t": FUSED_TURBO, "u": HOST_TURBO}
    made = [SimpleNamespace(request_id=i, kind=k) for i, k in enumerate(kinds)]
    return made, {r.request_id: of[r.kind] for r in made}


def grouped(kinds: str, batch_invariant: bool, largest: int | None) -> list[tuple[str, list[int]]]:
    made, chosen = requests(kinds)
    groups = group_requests(made, lambda r: chosen[r.request_id], ORDER, batch_invariant, largest)
    return [(p.name, [r.request_id for r in group]) for p, group in groups]


def test_batch_invariant_runs_a_request_a_group_default_steps_first_in_arrival_order():
    assert grouped("hufth", True, None) == [
        ("host", [0]),
        ("fused", [2]),
        ("host", [4]),
        ("fused turbo", [3]),
        ("host turbo", [1]),
    ]


def test_batched_runs_each_paths_requests_in_chunks_then_host_turbo_in_one_group():
    # with graphs: chunks of the largest bucket
    assert grouped("hffffuhttfuh", False, 2) == [
        ("host", [0, 6]),
        ("host", [11]),
        ("fused", [1, 2]),
        ("fused", [3, 4]),
        ("fused", [9]),
        ("fused turbo", [7, 8]),
        ("host turbo", [5, 10]),
    ]
    # without graphs: every path's requests at once (the size is the largest group's)
    assert grouped("hffffuhttfuh", False, None) == [
        ("host", [0, 6, 11]),
        ("fused", [1, 2, 3, 4, 9]),
        ("fused turbo", [7, 8]),
        ("host turbo", [5, 10]),
    ]
    assert grouped("", False, None) == [] and grouped("uu", False, 8) == [("host turbo", [0, 1])]


@pytest.mark.slow
def test_the_runner_asks_fused_turbo_host_turbo_fused_then_host():
    """On the Triton path (meta device): a plain request takes the fused path, one whose stop
    history is longer than the device keeps the host path; a turbo request takes the fused turbo
    path (it gets a slot), one asking for log probabilities the host's turbo step; each path is
    chosen once per request per step."""
    pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
    from dgemma.config import GenerationConfig
    from dgemma.engine.engine import Engine, EngineOptions, Request
    from dgemma.model.checkpoint import make_config
    from dgemma.model.diffusion_gemma import DiffusionGemma
    from dgemma.model.presets import PRESETS
    from host_sync import stub_triton_launches, to_device

    torch.manual_seed(0)
    net = to_device(DiffusionGemma(make_config(**PRESETS["test"])).to(torch.bfloat16).eval())
    options = EngineOptions(triton=True, cuda_graphs=False, block_size=8, batch_invariant=False, kv_cache_memory=2**24)
    engine = Engine(net, options)
    gen = GenerationConfig(max_new_tokens=16, max_denoising_steps=4)
    made = [
        Request([3, 4, 5], gen, 1),
        Request([3, 4, 6], gen.with_overrides(stability_threshold=9), 2),
        Request([3, 4, 7], gen.with_overrides(turbo=True), 3),
        Request([3, 4, 8], gen.with_overrides(turbo=True), 4, top_logprobs=2),
    ]
    for r in made:
        engine.add(r)
    runner = engine.runner
    with stub_triton_launches(), torch.no_grad():
        plan = engine.scheduler.schedule()
        runner._encode(plan.encode)
        asked = []
        for p in (runner.fused_turbo, runner.host_turbo, runner.fused, runner.host):
            accepts = p.accepts
            p.accepts = lambda r, accepts=accepts, name=p.name: (asked.append((name, r.request_id)), accepts(r))[1]
        chosen = runner.choose(plan.decode)
    names = {r.request_id: chosen[r.request_id].name for r in made}
    assert [names[r.request_id] for r in made] == ["fused", "host", "fused turbo", "host turbo"]
    assert len(asked) == len({(n, i) for n, i in asked})  # no path asked twice about a request

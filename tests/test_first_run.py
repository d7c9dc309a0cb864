"""The first run on a fresh machine (issue 48): `dgemma run` and `dgemma chat` start on torch's
kernels while the native ones build in the background (the other commands build them first);
what runs is said as what runs, the same by `serve` and `bench` (kernels/cpu.py `describe`).
The build machinery itself: tests/kernels/test_native_build.py; the figure: scripts/first_run.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import dgemma
from dgemma.kernels import avx2, cpu, native
from processes import processes_with

ROOT = Path(__file__).resolve().parents[1]


def test_run_and_chat_build_in_the_background_the_others_wait(monkeypatch):
    from dgemma import cli
    from dgemma.cli import chat, memory, run

    policies = {}
    for module, name in ((run, "cmd_run"), (chat, "cmd_chat"), (memory, "cmd_memory")):
        monkeypatch.setattr(
            module, name, lambda args, name=name: policies.setdefault(name, native.build_policy()) and 0
        )
    monkeypatch.delenv(native.POLICY_VARIABLE, raising=False)
    for argv in (["run", "x"], ["chat"], ["memory"]):
        assert cli.main(argv) == 0
        assert native.POLICY_VARIABLE not in os.environ  # the command's choice ends with it
    assert policies == {"cmd_run": "background", "cmd_chat": "background", "cmd_memory": "wait"}
    monkeypatch.setenv(native.POLICY_VARIABLE, "0")  # the user's choice wins
    policies.clear()
    assert cli.main(["run", "x"]) == 0 and policies == {"cmd_run": "off"}


def test_describe_says_what_runs_and_what_builds(monkeypatch):
    """A bf16 model on a CPU without native bf16 (the widened path, as dgemma-tiny runs on an AVX2
    CPU): no oneDNN GEMM is named (none runs), nothing is said of what the CPU lacks, and the
    AVX2 GEMM is named as building while it builds."""
    net = cpu.widened_copy(dgemma.load().net)
    building = SimpleNamespace(module=lambda wait=None: None, building=lambda: True, what=avx2.KERNELS.what)
    monkeypatch.setattr(avx2, "KERNELS", building)
    text = cpu.describe(net)
    assert text.startswith(
        "bf16 weights widened to float32 a tile at a time for torch's GEMMs (this CPU has no native bf16)"
    )
    assert text.endswith("(building in the background: dgemma's native AVX2 GEMM and dequantisation kernels)")
    assert "oneDNN" not in text and "lacks" not in text
    monkeypatch.undo()
    if avx2.extension() is not None:
        assert cpu.describe(net).startswith(
            "bf16 weights widened to float32 inside the native AVX2 GEMMs (this CPU has no native bf16)"
        )


@pytest.mark.slow
@pytest.mark.subprocess
def test_serve_says_the_kernels_bench_reports(tmp_path):
    """`dgemma serve` opens with what runs (the line `dgemma bench` reports, from one function),
    never a line of what this CPU lacks."""
    from serve_process import ServeProcess

    with ServeProcess([]) as server:
        output = server.output
    (line,) = [line for line in output.splitlines() if line.startswith("dgemma: kernels: ")]
    model = dgemma.load()
    assert line == f"dgemma: kernels: {cpu.describe(model.engine_net)}"
    assert "lacks" not in output and " off:" not in output


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_first_run_prints_its_text_while_the_kernels_build(tmp_path):
    """On empty caches `dgemma run` answers on torch's kernels and says that the native ones build
    in the background (and, when it ends first, that they still do: the next run has them). Not
    timed: scripts/first_run.py measures the first text and the longest silence."""
    if not (avx2.KERNELS.cpu_flags <= native.cpu_flags() or native.KERNELS.cpu_flags <= native.cpu_flags()):
        pytest.skip("no native kernels for this CPU (no AVX2/FMA/F16C)")
    extensions = tmp_path / "extensions"
    env = {**os.environ, "HOME": str(tmp_path), "TORCH_EXTENSIONS_DIR": str(extensions)}
    for name in (native.POLICY_VARIABLE, native.REBUILD_VARIABLE, "DGEMMA_CPU_ISA"):
        env.pop(name, None)
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "dgemma",
                "run",
                "def fibonacci(n):",
                "--max-new-tokens",
                "16",
                "--steps",
                "4",
                "--threads",
                "1",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        for pid in processes_with("TORCH_EXTENSIONS_DIR", str(extensions)):  # a compiler must not outlive the test
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
    lines = done.stderr.splitlines()
    started = [
        line for line in lines if line.startswith("building dgemma's") and " in the background on one core " in line
    ]
    assert len(started) >= 1, done.stderr
    assert not [
        line for line in lines if "(about" in line and "cached afterwards" in line
    ]  # no build in the foreground
    assert all(
        ("are built (" in line) or ("are still building in the background" in line)
        for line in lines
        if line.startswith("dgemma's native")
    )

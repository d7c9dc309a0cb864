"""The benchmark scripts still run: the GPU one is only ever run for real in rare sessions with a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_smoke_run_on_cpu():
    cmd = [sys.executable, "scripts/gpu_bench.py", "--device", "cpu", "--size", "tiny", "--prompt-len", "64", "--quick"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert any(line.split()[:1] == ["1"] and "n/a" in line for line in lines), run.stdout  # batch 1 eager row
    assert "engine, batch 1, prompt 64, 128 new tokens, 16 fixed steps" in run.stdout
    assert "32 decoder passes" in run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_bench_without_a_gpu_says_so():
    run = subprocess.run([sys.executable, "scripts/gpu_bench.py", "--size", "tiny"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr and "Traceback" not in run.stderr

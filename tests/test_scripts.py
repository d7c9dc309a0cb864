"""The benchmark scripts still run: the GPU one is only ever run for real in rare sessions with a GPU."""

import json
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
    assert "engine, batch 1, prompt 64, 64 new tokens, 16 fixed steps" in run.stdout  # 2 canvases of 32
    assert "32 decoder passes" in run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_bench_quantised_smoke_run_on_cpu():
    cmd = [sys.executable, "scripts/gpu_bench.py", "--device", "cpu", "--size", "tiny", "--prompt-len", "64", "--quick",
           "--quantization", "int4"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "of int4 (+ bf16) weights" in run.stdout and "output tok/s" in run.stdout


def test_gpu_bench_without_a_gpu_says_so():
    run = subprocess.run([sys.executable, "scripts/gpu_bench.py", "--size", "tiny"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr and "Traceback" not in run.stderr


def test_dgemma_bench_reports_every_peer_with_ratios(capsys):
    from dgemma.cli import main

    argv = ["bench", "--size", "tiny", "--prompt-len", "32", "--new-tokens", "128", "--runs", "1", "--no-warmup", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["peer"]: r for r in report["rows"]}
    assert set(rows) == {"dgemma", "dgemma-ar", "transformers"}
    assert rows["dgemma"]["tokens_per_forward"] == 32 / 16  # canvas 32, 16 fixed steps, no EOS
    assert rows["dgemma-ar"]["tokens_per_forward"] == 1
    assert rows["transformers"]["tokens_per_forward"] == 32 / 16
    for peer in ("dgemma", "dgemma-ar"):
        r = rows[peer]
        assert r["x_vs_transformers"] == pytest.approx(r["output_tok_s"] / rows["transformers"]["output_tok_s"])
    assert all(r["output_tok_s"] > 0 and r["ms_per_step"] > 0 for r in rows.values())
    assert "kernels: " in report["setup"] and "GEMMs" in report["setup"]  # which kernels the figures are for
    # weights by part, the engine's packed copies of them (float32 on oneDNN: one per weight), RSS
    packed = float(report["memory"].split("packed copies ")[1].split(" GiB")[0])
    assert packed > 0 and "RSS after the runs" in report["memory"]


def test_dgemma_bench_refuses_a_size_that_does_not_fit(monkeypatch, capsys):
    from dgemma import bench
    from dgemma.cli import main

    monkeypatch.setattr(bench, "available_memory", lambda device: 8 << 30)
    assert main(["bench", "--size", "real"]) != 0
    err = capsys.readouterr().err
    assert "25.3 B parameters" in err and "8 GiB available" in err and "Traceback" not in err


def test_canvas_frames_script_shows_noise_resolving():
    run = subprocess.run([sys.executable, "scripts/canvas_frames.py", "--prompt", "import os\nimport sys", "--seed", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    frames = run.stdout.split("--- block 1, step")[1:]
    assert len(frames) >= 3 and "░" in frames[0] and "=== block 1 committed" in run.stdout
    assert frames[0].count("░") > frames[-1].split("===")[0].count("░")  # fewer re-noised positions by the end

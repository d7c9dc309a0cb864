"""The benchmark scripts still run: the GPU check is only ever run for real in rare sessions with a GPU."""

import gzip
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.subprocess
def test_gpu_check_smoke_run_on_cpu(tmp_path):
    """scripts/gpu_check.py --smoke: every check and every measuring section on the Triton
    interpreter: the step table (the long prompt encoded in chunks the sliding reservation
    binds), the profile of a graph replay, the engine's decode rates, the PTX file, one line per
    target of the open GPU issues, the figures' JSON; each section's seconds."""
    run = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    out = run.stdout
    assert out.count("PASS") == 8 and "FAIL" not in out and "all checks passed" in out
    for what in (
        "step statistics",
        "sampling",
        "norm + rope",
        "MoE block",
        "one decoder pass",
        "paged attention",
        "graph replay",
    ):
        assert what in out
    # (a) the table: both prompts in bf16 (96 tokens in 6 chunks of 16: past the 5 sliding blocks of 8 one chunk holds)
    rows = [line.split() for line in out.splitlines()]
    assert [r[:3] for r in rows if len(r) == 7 and r[2] == "1"] == [
        ["bf16", "24", "1"],
        ["bf16", "96", "1"],
        ["nvfp4", "24", "1"],
    ]
    assert "bf16     96 prefix encoded in" in out and "(6 chunks)" in out
    # (c) the profile of one graph replay, bf16 and nvfp4: its top 15 kernels, GB/s where the weights are attributed
    for scheme in ("bf16", "nvfp4"):
        assert f"{scheme}: one graph replay at batch 1, prompt 24:" in out
    profile = out.split("bf16: one graph replay")[1].split("[")[0].splitlines()[2:]
    assert len(profile) == 15 and any(
        "aten::mm" in line and line.split()[-1].replace(".", "").isdigit() for line in profile
    )
    # (b) decode rates through benchmark.run_dgemma: AR at batch 1, the default and turbo at the larger batch
    for line in (
        "bf16 dgemma-ar batch 1: decode",
        "bf16 dgemma batch 2: decode",
        "bf16 dgemma-turbo batch 2: decode",
        "nvfp4 dgemma batch 1: decode",
    ):
        assert line in out
    assert "ms a token" in out and out.count("tokens after the first block over the time after it") == 4
    # (d) the PTX file (nothing is compiled under the interpreter), (e) a line per target
    assert (
        "PTX: none (the Triton interpreter compiles nothing)" in out and (tmp_path / "quant_gemm_ptx.txt.gz").is_file()
    )
    targets = [line for line in out.splitlines() if line.startswith("  issue 4")]
    assert len(targets) == 11 and sum("met (" in t for t in targets) >= 5  # "met (..)" or "NOT met (..)": measured
    for section in (
        "kernels vs torch",
        "build bf16",
        "step table bf16",
        "profile nvfp4",
        "engine decode bf16",
        "PTX",
        "targets",
    ):
        assert re.search(rf"^\[\d+\.\d s\] {section}$", out, re.M), section
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["step"]["bf16 96 1"] > 0 and len(report["targets"]) == 11 and report["failed"] == []


def test_gpu_check_writes_the_ptx_of_every_compiled_variant(tmp_path):
    """The PTX section reads Triton's JIT cache (device_caches: the compiled kernels by key, then
    the key cache, target, backend, binder), through autotuner-like wrappers; a CPU compiles
    nothing, so the cache is faked here."""
    gpu_check = load_gpu_check()
    compiled = SimpleNamespace(
        asm={"ptx": ".version 8.7\n.target sm_90a\nld.global.v4.u32"}, metadata=SimpleNamespace(num_warps=4)
    )
    jit = SimpleNamespace(
        __name__="_quant_matmul_kernel",
        device_caches={0: ({"key-a": compiled, "key-b": compiled}, {}, "sm90", None, None)},
    )
    uncompiled = SimpleNamespace(__name__="_idle", device_caches={})
    assert [(n, k) for n, k, _ in gpu_check.compiled_kernels([SimpleNamespace(fn=jit), uncompiled])] == [
        ("_quant_matmul_kernel", "key-a"),
        ("_quant_matmul_kernel", "key-b"),
    ]
    settings = SimpleNamespace(out=tmp_path, schemes=["nvfp4"])
    report = {}
    gpu_check.quant_functions = lambda: [jit]
    gpu_check.write_ptx(settings, report)
    text = gzip.open(tmp_path / "quant_gemm_ptx.txt.gz", "rt").read()
    assert text.count("// ===== _quant_matmul_kernel  num_warps=4") == 2 and "ld.global.v4.u32" in text
    assert report["ptx"]["variants"] == 2 and not gpu_check.FAILED


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.subprocess
def test_gpu_check_without_a_gpu_says_so():
    run = subprocess.run(
        [sys.executable, "scripts/gpu_check.py"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.slow
def test_dgemma_bench_reports_every_peer_with_ratios(capsys):
    from dgemma.cli import main

    argv = [
        "bench",
        "--size",
        "tiny",
        "--prompt-len",
        "32",
        "--new-tokens",
        "128",
        "--runs",
        "1",
        "--no-warmup",
        "--json",
    ]
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
    memory = report["memory_bytes"]
    assert memory["weights"]["packed copies"] > 0 and "packed copies" in report["memory"]
    assert memory["kv_reserved"] > 0 and 0 < memory["rss_now"] <= memory["peak_rss"]


@pytest.mark.slow
@pytest.mark.subprocess
def test_cpu_speed_compares_rows_within_each_round():
    """scripts/cpu_speed.py (the AVX2-only measurement): every row ran, in the kernels it names
    (as an AVX2-only CPU picks them), and the widened bf16 row holds half the weights."""
    argv = [
        sys.executable,
        "scripts/cpu_speed.py",
        "--size",
        "tiny",
        "--rounds",
        "1",
        "--rows",
        "float32,bfloat16",
        "--steps",
        "2",
        "--new-tokens",
        "32",
        "--prompt-len",
        "32",
        "--emulate-avx2",
        "--json",
    ]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    rows = {r["row"]: r for r in report["rows"]}
    assert report["mode"].startswith("emulated") and report["cpu"] and set(rows) == {"float32", "bfloat16"}
    assert rows["float32"]["vs_float32"] == 1 and rows["bfloat16"]["ms_per_step"] > 0
    assert rows["bfloat16"]["vs_float32"] == pytest.approx(
        rows["bfloat16"]["ms_per_step"] / rows["float32"]["ms_per_step"]
    )
    assert "widened to float32" in rows["bfloat16"]["kernels"] and "widened" not in rows["float32"]["kernels"]
    assert all("torch statistics" in r["kernels"] for r in rows.values())  # no AVX-512 kernels under the emulation
    # float32 carries a packed copy of every weight besides; bf16 has half the bytes and none
    assert rows["bfloat16"]["weights_gib"] < 0.3 * rows["float32"]["weights_gib"]
    bad = subprocess.run(
        [sys.executable, "scripts/cpu_speed.py", "--rows", "bfloat16,int3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--rows takes" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
@pytest.mark.subprocess
def test_step_breakdown_times_a_quantised_model_per_module():
    argv = [
        sys.executable,
        "scripts/step_breakdown.py",
        "--size",
        "tiny",
        "--quantization",
        "int4",
        "--steps",
        "1",
        "--prompt-len",
        "32",
        "--modules",
    ]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tiny bfloat16 int4" in run.stdout and "experts (QuantExperts)" in run.stdout


def test_dgemma_bench_refuses_a_size_that_does_not_fit(monkeypatch, capsys):
    from dgemma.cli import main
    from dgemma.engine.kv import budget

    monkeypatch.setattr(budget, "available_memory", lambda device: 8 << 30)  # dgemma.benchmark asks it there
    assert main(["bench", "--size", "real"]) != 0
    err = capsys.readouterr().err
    assert "25.3 B parameters" in err and "8 GiB available" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.subprocess
def test_canvas_frames_script_shows_noise_resolving():
    run = subprocess.run(
        [sys.executable, "scripts/canvas_frames.py", "--prompt", "import os\nimport sys", "--seed", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    frames = run.stdout.split("--- block 1, step")[1:]
    assert len(frames) >= 3 and "░" in frames[0] and "=== block 1 committed" in run.stdout
    assert frames[0].count("░") > frames[-1].split("===")[0].count("░")  # fewer re-noised positions by the end


@pytest.mark.slow
@pytest.mark.subprocess
def test_turbo_quality_compares_every_setting_with_exact(tmp_path):
    """scripts/turbo_quality.py at its smallest: a row per setting, exact's work is a full canvas per
    pass, agreements are shares, and a malformed --settings entry is refused in one line."""
    out = tmp_path / "turbo.json"
    argv = [
        sys.executable,
        "scripts/turbo_quality.py",
        "--prompts",
        "2",
        "--seeds",
        "1",
        "--max-new-tokens",
        "16",
        "--settings",
        "default",
        "f1=1,,",
        "--ceiling",
        "--json",
        str(out),
    ]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert (
        list(rows) == ["exact", "exact, other seed", "default", "f1"]
        and rows["f1"]["knobs"]["turbo_freeze_passes"] == 1
    )
    exact = rows["exact"]  # an exact pass computes every one of dgemma-tiny's 32 canvas positions
    assert exact["tokens_per_forward"]["value"] * exact["positions_per_token"]["value"] == pytest.approx(32)
    assert "agreement" not in exact and all(0 <= rows[k]["agreement"]["value"] <= 1 for k in list(rows)[1:])
    assert all(r["nll"]["value"] > 0 and r["tok_s"] > 0 for r in rows.values()) and len(report["answers"]["f1"][0]) == 2
    assert run.stdout.count("| exact") == 2 and "(noise floor)" in run.stdout and "torch thread(s)" in run.stdout
    ceiling = report["ceiling"]  # exact streamed again gives the batched answers; the bound lies between
    assert ceiling["identical"] == ceiling["answers"] == 2
    assert (
        ceiling["stale"]
        <= ceiling["fresh"]
        < ceiling["exact"]
        == round(exact["positions_per_token"]["value"] * exact["length"]["value"] * 2)
    )
    bad = subprocess.run(
        [sys.executable, "scripts/turbo_quality.py", "--settings", "f1=1,x,"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "turbo_freeze_entropy takes float" in bad.stderr and "Traceback" not in bad.stderr

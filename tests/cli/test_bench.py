"""`dgemma bench`: a quick check that says what it will do, shows progress and ends within a minute;
random weights built on the device asked for, a checkpoint only for the peer that reads one, a KV
pool of the bench's own size, and timings that cover what the runner really runs."""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dgemma.benchmark import BenchEngine, RunResult, random_model, random_weights, run_dgemma
from dgemma.config import GLOBAL, SLIDING
from dgemma.model.checkpoint import make_config
from dgemma.model.diffusion_gemma import DiffusionGemma
from dgemma.model.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.subprocess
def test_bench_quick_prints_its_plan_first_and_finishes_within_a_minute():
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "dgemma.cli", "bench", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    took = time.monotonic() - start
    assert run.returncode == 0, run.stderr[-3000:]
    err, out = run.stderr, run.stdout
    assert (
        err.index("dgemma bench --quick: --size tiny")
        < err.index("building random bfloat16 weights of --size tiny on cpu")
        < err.index("warm-up: dgemma")
    )
    assert "4 fixed steps" in err and "estimate ~" in err and "round 1/1: dgemma" in err  # plan, estimate, progress
    assert "dgemma-ar" in out and "ms_per_step" in out and "tokens [" not in out  # the table alone on stdout
    assert took < 60, f"bench --quick took {took:.0f} s"


def test_bench_flags_say_their_defaults_and_explicit_flags_beat_the_preset():
    from dgemma.cli.bench import add_cli, resolve_settings

    parser = argparse.ArgumentParser()
    add_cli(subparsers := parser.add_subparsers())
    for action in subparsers.choices["bench"]._actions:
        if action.dest != "help":
            assert action.help and "default" in action.help, action.option_strings
    args = parser.parse_args(["bench", "--size", "mid"])
    resolve_settings(args, 256)  # canvas 256: the commands in docs/performance.md keep 512 + 768 tokens
    assert (args.prompt_len, args.new_tokens, args.steps, args.runs) == (512, 768, 16, 3)
    assert args.peers == ["default", "ar", "reference"]
    args = parser.parse_args(["bench", "--quick", "--steps", "8", "--peers", "default"])
    resolve_settings(args, 32)
    assert (args.prompt_len, args.new_tokens, args.steps, args.runs, args.peers) == (32, 64, 8, 1, ["default"])


@pytest.mark.slow
@pytest.mark.triton
def test_encoder_seconds_cover_every_prefill_and_commit_pass_of_the_triton_network(monkeypatch):
    """With the Triton kernels the runner runs a copy of the model (kernels/fused.py): a timer on
    `engine_net.encode` never fired and encoder_seconds was 0, so ms_per_step held prefill and
    the commits. Every encode pass the runner makes is now inside encoder_seconds."""
    model = random_model("test", "cpu", torch.bfloat16)
    model.configure_engine(triton=True, batch_invariant=False)
    from dgemma.kernels.fused import FusedGemma

    passes = []

    def timed(encode):
        def timed_encode(self, *args, **kwargs):
            start = time.perf_counter()
            out = encode(self, *args, **kwargs)
            passes.append(time.perf_counter() - start)
            return out

        return timed_encode

    # the runner's copy: the fused network where the fused layers serve the model (kernels/fused.py),
    # else the model's class with the Triton modules swapped in
    for cls in (DiffusionGemma, FusedGemma):
        monkeypatch.setattr(cls, "encode", timed(cls.__dict__["encode"]))
    c = model.config.canvas_length
    result = run_dgemma(model, [list(range(5, 25)), list(range(7, 20))], 2 * c, 2, False, "diffusion")
    assert len(passes) == 2  # both prompts in one pass, then the first committed block (both rows at once)
    assert sum(passes) <= result.encoder_seconds < result.seconds
    # vLLM's decode rate: tokens after both rows' first block, over the time after it
    assert result.tokens == 2 * 2 * c and result.tokens_after_first == 2 * c
    assert result.ttft <= result.decode_start < result.seconds
    assert result.decode_tps == pytest.approx(result.tokens_after_first / (result.seconds - result.decode_start))


def test_bench_engine_holds_the_batch_at_once_and_no_more():
    model = random_model("test", "cpu", torch.float32)
    c = model.config.canvas_length  # 8, the block
    bench = BenchEngine.build(model, 3, 20, 3 * c)
    assert bench.tokens == 20 + 2 * c  # the prompt and every block but the last
    pools = bench.engine.kv_usage()
    assert pools[GLOBAL]["total"] == pools[SLIDING]["total"] == 3 * -(-bench.tokens // c)  # not a share of the memory
    prompts = [list(range(5, 25))] * 3
    result = run_dgemma(model, prompts, 3 * c, 2, False, "diffusion", engine=bench)
    assert result.tokens == 3 * 3 * c and result.decoder_passes == 3 * 2  # all three ran together, 2 passes a block
    again = run_dgemma(model, prompts, 3 * c, 2, False, "diffusion", engine=bench)  # reused: nothing left behind
    assert again.tokens == result.tokens and bench.engine.kv_usage()[GLOBAL]["used"] == 0
    with pytest.raises(ValueError, match="holds 3 requests of 36 positions; the run has 4"):
        run_dgemma(model, prompts + prompts[:1], 3 * c, 2, False, "diffusion", engine=bench)


def test_with_cuda_graphs_the_first_run_of_a_batch_warms_up_untimed():
    """The graphs a run replays are captured by an untimed warm-up the first time an engine runs
    that batch size (turbo or not), never in a timed run: counted here in decoder passes (on a
    CPU the captures themselves fall back to eager steps)."""
    model = random_model("test", "cpu", torch.float32)
    model.configure_engine(cuda_graphs=True, batch_invariant=False)
    c = model.config.canvas_length
    bench = BenchEngine.build(model, 2, 20, 2 * c)
    prompts = [list(range(5, 25)), list(range(6, 26))]
    passes = []
    for turbo in (None, None, {}):
        before = bench.engine.stats.decoder_passes
        result = run_dgemma(model, prompts, 2 * c, 2, False, "diffusion", turbo=turbo, engine=bench)
        passes.append(bench.engine.stats.decoder_passes - before)
        assert result.tokens == 2 * 2 * c and result.decoder_passes == 2 * 2  # the timed run: 2 canvases of 2 passes
    # 2 rows x 2 canvases x 2 passes timed; the first default run warms up with one pass of one
    # canvas per row, turbo's first with a whole canvas (its active rows change from pass to pass)
    assert passes == [8 + 2, 8, 8 + 4]
    assert bench.warm == {(2, False), (2, True)}


@pytest.mark.parametrize("scheme", ["fp8", "int4"])  # bf16 and nvfp4: the CLI's test below
def test_random_weights_of_the_released_size_are_built_on_the_device_asked_for(scheme):
    """Built where they run (the meta device here: shapes only), never drawn on the CPU first
    (int4's weight_shape, two integers the kernels read on the host, stays there)."""
    net = random_weights(make_config(**PRESETS["real"]), "meta", torch.bfloat16, scheme)
    tensors = [
        t for name, t in list(net.named_parameters()) + list(net.named_buffers()) if not name.endswith("weight_shape")
    ]
    assert {t.device.type for t in tensors} == {"meta"}
    assert net.embed_tokens.weight.dtype == torch.bfloat16 and net.embed_tokens.weight.shape == (262144, 2816)
    assert (getattr(net, "quantization", None) or (None,))[0] == scheme


def test_bench_of_the_real_size_builds_on_its_device_and_writes_no_checkpoint_without_the_reference(
    monkeypatch, capsys
):
    """`dgemma bench --size real --device meta`: the weights are built on that device and no
    checkpoint is written (the old path built a float32 copy on the CPU and wrote ~50 GB before
    its first step). The runs go through run_dgemma and its bench engine, also on meta; only the
    engine's steps and the AR loop are faked (meta tensors hold no values)."""
    from dgemma import benchmark
    from dgemma.cli import main
    from dgemma.engine.events import Finished
    from dgemma.model import checkpoint

    written, runs = [], []
    monkeypatch.setattr(checkpoint, "save_checkpoint", lambda *a, **k: written.append(a))

    def fake_steps(engine, requests, on_step=None):
        runs.append(("diffusion", {t.device.type for t in engine.runner.net.parameters()}))
        return [Finished(r.request_id, "length", [5] * r.config.max_new_tokens, 48, 16.0) for r in requests]

    def fake_ar(model, prompts, new_tokens, progress):
        runs.append(("ar", {t.device.type for t in model.engine_net.parameters()}))
        return RunResult("dgemma-ar", 1.0, 0.1, new_tokens, new_tokens, 0.0, 1.0, len(prompts))

    monkeypatch.setattr(benchmark, "_drain", fake_steps)
    monkeypatch.setattr(benchmark, "_run_ar", fake_ar)
    for scheme in ([], ["--quantization", "nvfp4"]):
        argv = [
            "bench",
            "--size",
            "real",
            "--device",
            "meta",
            "--peers",
            "default,ar",
            "--runs",
            "1",
            "--no-warmup",
            "--json",
        ]
        assert main(argv + scheme) == 0, capsys.readouterr().err
        out, err = capsys.readouterr()
        assert f"building random {'nvfp4' if scheme else 'bfloat16'} weights of --size real on meta" in err
        memory = json.loads(out)["memory_bytes"]
        # weights at the released size; a KV pool for one request of 512 + 768 tokens (encoded: 512 + 512)
        assert sum(memory["weights"].values()) > (40 if not scheme else 12) * 2**30
        assert 0 < memory["kv_reserved"] < 2**30
    assert not written
    assert runs == [("diffusion", {"meta"}), ("ar", {"meta"})] * 2


def test_a_checkpoint_is_written_only_for_the_reference_peer(tmp_path):
    from dgemma.cli.bench import bench_model

    args = SimpleNamespace(
        model=None,
        size="test",
        tensor_parallel_size=1,
        force=False,
        quantization=None,
        group_size=None,
        dtype="float32",
    )
    model, path = bench_model(args, torch.device("cpu"), torch.float32, ["default", "ar"], tmp_path, lambda _: None)
    assert path is None and not any(tmp_path.iterdir()) and model.net.embed_tokens.weight.device.type == "cpu"
    model, path = bench_model(
        args, torch.device("cpu"), torch.float32, ["default", "reference"], tmp_path, lambda _: None
    )
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()

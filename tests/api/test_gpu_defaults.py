"""The GPU defaults, checked without a GPU: `--dtype auto` is the checkpoint's stored dtype on every
device (float32 for a float16 checkpoint on a CPU), decided by one function (`dgemma.devices.resolve_dtype`) that every command uses;
`--device cuda:N` is parsed and checked, and the engine makes its device the current one
(Triton kernels and CUDA graphs run on the current device)."""

from __future__ import annotations

import argparse
import json
import re
import types

import pytest
import torch

import dgemma
from dgemma import devices, loading
from dgemma.cli import build_parser, main
from dgemma.devices import dtype_name, parse_device, resolve_device, resolve_dtype
from dgemma.engine import engine as engine_module
from dgemma.engine.engine import Engine, EngineOptions, make_current
from dgemma.model import weights
from dgemma.model.layout import save_safetensors
from dgemma.model.weights import stored_dtype


def checkpoint(path, config: dict | None = None, tensors: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "diffusion_gemma"}))
    if tensors is not None:
        save_safetensors(tensors, path / "model.safetensors")
    return path


@pytest.fixture
def bf16_checkpoint(tmp_path):
    return checkpoint(tmp_path / "bf16", {"model_type": "diffusion_gemma", "dtype": "bfloat16"})


# ------------------------------------------------------------------------------ resolve_dtype
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 1), torch.device("cuda")])
def test_auto_is_the_checkpoints_dtype_on_cuda(bf16_checkpoint, device):
    assert resolve_dtype("auto", device, bf16_checkpoint) == torch.bfloat16
    assert resolve_dtype(None, device, bf16_checkpoint) == torch.bfloat16


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_auto_is_the_checkpoints_dtype_off_cuda_too(bf16_checkpoint, tmp_path, device):
    assert resolve_dtype("auto", device, bf16_checkpoint) == torch.bfloat16
    assert resolve_dtype() == torch.bfloat16  # no checkpoint to ask: the release's dtype
    fp16 = checkpoint(tmp_path / "fp16", {"model_type": "diffusion_gemma", "dtype": "float16"})
    assert resolve_dtype("auto", device, fp16) == torch.float32  # the CPU kernels take bf16 or float32
    assert resolve_dtype("auto", "cuda", fp16) == torch.float16


def test_an_explicit_dtype_always_wins(bf16_checkpoint):
    assert resolve_dtype("float32", "cuda:1", bf16_checkpoint) == torch.float32
    assert resolve_dtype("float16", "cuda", bf16_checkpoint) == torch.float16
    assert resolve_dtype("bf16", "cpu", bf16_checkpoint) == torch.bfloat16
    assert resolve_dtype(torch.float16, "cpu", bf16_checkpoint) == torch.float16
    assert resolve_dtype("bfloat16") == torch.bfloat16  # the old one-argument form


@pytest.mark.parametrize("bad", ["int8", "float64", "", "BF16x"])
def test_a_bad_dtype_is_a_one_line_error(bad):
    with pytest.raises(ValueError) as e:
        resolve_dtype(bad, "cuda", None)
    assert "\n" not in str(e.value) and "float32, bfloat16, float16 or auto" in str(e.value)
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype(torch.int8, "cpu")


def test_stored_dtype_from_config_json(tmp_path):
    cases = {
        "top": ({"dtype": "float16"}, torch.float16),
        "torch_dtype": ({"torch_dtype": "bfloat16"}, torch.bfloat16),
        "text_config": ({"text_config": {"dtype": "bfloat16"}}, torch.bfloat16),
        "prefixed": ({"dtype": "torch.float16"}, torch.float16),
        "float32": ({"dtype": "float32"}, torch.float32),
    }
    for name, (config, want) in cases.items():
        path = checkpoint(tmp_path / name, config)
        assert stored_dtype(path) == want, name
        assert resolve_dtype("auto", "cuda:0", path) == want, name


def test_stored_dtype_from_the_safetensors_headers(tmp_path):
    plain = checkpoint(
        tmp_path / "plain",
        {"dtype": "auto"},
        {"a.weight": torch.zeros(2, 2, dtype=torch.bfloat16), "b.weight": torch.zeros(2, dtype=torch.bfloat16)},
    )
    assert stored_dtype(plain) == torch.bfloat16
    # a quantised checkpoint: packed codes and (float32) scales say nothing of the unquantised parts
    quant = {
        f"layers.{i}.q_proj.{part}": t
        for i in range(3)
        for part, t in (
            ("weight_packed", torch.zeros(2, 1, dtype=torch.int32)),
            ("weight_scale", torch.ones(2, 1)),
            ("weight_global_scale", torch.ones(1)),
            ("input_scale", torch.ones(1)),
        )
    }
    quant.update(
        {
            "embed_tokens.weight": torch.zeros(4, 2, dtype=torch.float16),
            "norm.weight": torch.ones(2, dtype=torch.float16),
        }
    )
    path = checkpoint(tmp_path / "quant", {"quantization_config": {}}, quant)
    assert stored_dtype(path) == torch.float16
    assert resolve_dtype("auto", "cuda:1", path) == torch.float16
    # sharded
    shards = tmp_path / "sharded"
    checkpoint(shards, {})
    save_safetensors({"a": torch.zeros(2, dtype=torch.bfloat16)}, shards / "s1.safetensors")
    save_safetensors({"b": torch.zeros(2, dtype=torch.bfloat16)}, shards / "s2.safetensors")
    (shards / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
    )
    assert stored_dtype(shards) == torch.bfloat16


def test_nothing_to_go_by(tmp_path):
    empty = checkpoint(tmp_path / "empty", {})
    assert stored_dtype(empty) is None
    assert resolve_dtype("auto", "cuda", empty) == torch.float32
    assert resolve_dtype("auto", "cuda", None) == torch.bfloat16  # random weights: the release's dtype


def test_the_shipped_model_is_stored_in_bf16():
    d = dgemma.default_model_dir()
    assert resolve_dtype("auto", "cuda", d) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", d) == torch.bfloat16
    assert dtype_name(torch.bfloat16) == "bfloat16"


# ------------------------------------------------------------------------------ devices
@pytest.mark.parametrize(
    "text, want",
    [
        ("cpu", torch.device("cpu")),
        ("cuda", torch.device("cuda")),
        ("cuda:1", torch.device("cuda", 1)),
        (" cuda:0 ", torch.device("cuda", 0)),
        ("auto", "auto"),
    ],
)
def test_device_names(text, want):
    assert parse_device(text) == want


@pytest.mark.parametrize(
    "text, words",
    [
        ("cuda:x", "cuda or cuda:N"),
        ("cuda:", "cuda or cuda:N"),
        ("cuda:-1", "0 or more"),
        ("gpu", "cpu, cuda, cuda:N or auto"),
        ("cuda1", "cpu, cuda, cuda:N or auto"),
    ],
)
def test_bad_device_names_are_one_line_errors(text, words):
    with pytest.raises(ValueError) as e:
        parse_device(text)
    assert "\n" not in str(e.value) and words in str(e.value) and repr(text.strip()) in str(e.value)


def test_cuda_devices_are_checked_against_the_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available on this machine"):
        resolve_device("cuda:1")
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=re.escape("has 1 CUDA device (cuda:0 .. cuda:0)")):
        resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda")


# ------------------------------------------------------------------------------ dgemma.load
def test_load_on_cpu_takes_the_stored_dtype_unless_told():
    assert dgemma.load(device="cpu").net.embed_tokens.weight.dtype == torch.bfloat16
    assert dgemma.load(dtype="float32").dtype == torch.float32


class Loaded(Exception):
    pass


def test_load_on_cuda_n_takes_the_checkpoints_dtype_and_makes_the_device_current(monkeypatch):
    """dgemma.load(device="cuda:1") as far as the weights, with a CUDA machine faked."""
    calls = []
    monkeypatch.setattr(devices, "resolve_device", lambda d: parse_device(d))
    monkeypatch.setattr(engine_module, "make_current", lambda d: calls.append(("current", d)))

    def fake_load_weights(config, path, device, dtype, quantization, group_size):
        calls.append(("weights", device, dtype))
        raise Loaded

    monkeypatch.setattr(weights, "load_weights", fake_load_weights)
    with pytest.raises(Loaded):
        dgemma.load(device="cuda:1")
    assert calls == [("current", torch.device("cuda", 1)), ("weights", torch.device("cuda", 1), torch.bfloat16)]
    calls.clear()
    with pytest.raises(Loaded):
        dgemma.load(device="cuda:1", dtype="float32")
    assert calls[-1] == ("weights", torch.device("cuda", 1), torch.float32)


# ------------------------------------------------------------------------------ the commands
COMMANDS = {"run": ["run", "hi"], "chat": ["chat"], "serve": ["serve"], "bench": ["bench"]}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_defaults_to_auto_and_takes_cuda_n(command):
    parser = build_parser()
    args = parser.parse_args(COMMANDS[command])
    assert args.dtype == "auto" and args.device == "cpu"
    args = parser.parse_args(COMMANDS[command] + ["--device", "cuda:1", "--dtype", "bfloat16"])
    assert args.device == "cuda:1" and args.dtype == "bfloat16"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_help_says_what_auto_is(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "auto = the checkpoint's stored dtype" in text and "bfloat16 for the released model" in text
    assert "cuda:N" in text


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("device, words", [("cuda:x", "unknown device 'cuda:x'"), ("cuda:-1", "0 or more")])
def test_a_bad_device_is_a_one_line_error(command, device, words, capsys):
    assert main(COMMANDS[command] + ["--device", device]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dgemma: error:") and words in err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_cuda_without_a_gpu_is_a_one_line_error(command, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(COMMANDS[command] + ["--device", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA is not available" in err


def test_bench_routes_its_dtype_through_resolve_dtype(monkeypatch, capsys):
    """`dgemma bench --model DIR --device cuda:1` loads in the checkpoint's dtype (a CUDA machine faked)."""
    seen = {}
    monkeypatch.setattr(devices, "resolve_device", lambda d: parse_device(d))

    def fake_load(path, device, dtype, quantization, group_size, force=False):
        seen.update(device=device, dtype=dtype)
        raise Loaded

    monkeypatch.setattr(loading, "load", fake_load)
    model = str(dgemma.default_model_dir())
    with pytest.raises(Loaded):
        main(["bench", "--model", model, "--device", "cuda:1", "--peers", "default"])
    assert seen == {"device": torch.device("cuda", 1), "dtype": torch.bfloat16}
    assert "cuda:1 bfloat16" in capsys.readouterr().err  # the plan line names the resolved dtype
    with pytest.raises(Loaded):
        main(["bench", "--model", model, "--device", "cpu", "--peers", "default"])
    assert seen["dtype"] == torch.bfloat16  # the shipped model's stored dtype, on a CPU too


def test_serve_plans_memory_in_the_checkpoints_dtype(monkeypatch):
    """`dgemma serve --device cuda:1`'s fit check (the one every load makes) plans in the dtype the
    load will choose, against cuda:1's memory (a CUDA machine faked)."""
    from dgemma import memory_plan
    from dgemma.cli.common import resolve_model

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def properties(index):
        seen["index"] = index
        return types.SimpleNamespace(total_memory=2**40)

    def plan(config, dtype, *rest):
        seen.setdefault("dtype", dtype)
        raise Loaded

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(memory_plan, "plan_memory", plan)
    args = argparse.Namespace(
        model=None,
        device="cuda:1",
        dtype="auto",
        quantization=None,
        group_size=None,
        max_active=8,
        max_context=None,
        kv_cache_memory=None,
        prefill_chunk=2048,
    )
    with pytest.raises(Loaded):
        resolve_model(args)
    assert seen == {"index": 1, "dtype": torch.bfloat16}
    seen.clear()
    with pytest.raises(Loaded):
        resolve_model(argparse.Namespace(**dict(vars(args), dtype="float16")))
    assert seen["dtype"] == torch.float16


# ------------------------------------------------------------------------------ the engine's device
@pytest.fixture
def cuda_calls(monkeypatch):
    """torch.cuda.set_device recorded, the current device faked as cuda:0."""
    calls = []
    current = [0]

    def set_device(device):
        calls.append(torch.device(device))
        current[0] = torch.device(device).index

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    return calls


def test_make_current(cuda_calls):
    make_current(torch.device("cpu"))
    make_current(torch.device("cuda"))  # no index: whichever is current already
    assert cuda_calls == []
    make_current(torch.device("cuda", 1))
    make_current(torch.device("cuda", 1))  # already current: no call
    make_current(torch.device("cuda", 0))
    assert cuda_calls == [torch.device("cuda", 1), torch.device("cuda", 0)]


class NetOnCuda1:
    """A network that reports cuda:1 and stops the engine's construction right after its device."""

    device = torch.device("cuda", 1)
    dtype = torch.bfloat16

    @property
    def config(self):
        raise Loaded


def test_an_engine_for_a_network_on_cuda1_makes_cuda1_current_first(cuda_calls):
    with pytest.raises(Loaded):
        Engine(NetOnCuda1())
    assert cuda_calls == [torch.device("cuda", 1)]


def test_the_engine_makes_its_device_current_when_built_and_when_stepped(monkeypatch):
    model = dgemma.load()
    calls = []
    real = engine_module.make_current
    monkeypatch.setattr(engine_module, "make_current", lambda d: (calls.append(d), real(d)))
    model.configure_engine(EngineOptions(kv_cache_memory=2**22))
    engine = model.engine
    assert calls == [torch.device("cpu")]
    model.generate([[5, 6, 7]], max_new_tokens=4, seed=0)
    assert len(calls) > 1 and set(calls) == {torch.device("cpu")}
    assert engine.device == torch.device("cpu")

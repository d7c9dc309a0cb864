"""`dgemma finetune --quantization` end to end (issue 55, items 2 and 4 and its "Bad input" lines):
a QLoRA run writes PEFT adapters only (its base stays quantised), a kill during a save leaves the
last checkpoint intact and the resumed run ends bit-identical to an uninterrupted one, quantised
base included; every bad input is one line, exit 2, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dgemma.cli import main
from dgemma.model.checkpoint import byte_tokenizer, make_config, random_model, save_checkpoint
from dgemma.model.presets import PRESETS
from dgemma.train import lora, resume
from dgemma.train.resume import STATE_FILE, latest_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A random checkpoint of the "test" size (GQA, sliding and global layers, 4 experts) with a
    byte tokenizer, and a small SFT set beside it."""
    root = tmp_path_factory.mktemp("qlora")
    save_checkpoint(
        random_model(make_config(**PRESETS["test"]), seed=5, std=0.1), root / "base", tokenizer=byte_tokenizer()
    )
    records = [{"prompt": f"{i} + {i} =", "completion": f" {2 * i}"} for i in range(24)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def swap(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with `flag`'s value replaced."""
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def without(argv: list[str], flag: str) -> list[str]:
    """`argv` without `flag` and its value."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 2 :]


def finetune(base: Path, out: Path, *extra: str) -> list[str]:
    return [
        "finetune",
        "--model",
        str(base / "base"),
        "--data",
        str(base / "sft.jsonl"),
        "--out",
        str(out),
        "--quantization",
        "int4",
        "--group-size",
        "32",
        "--lora-rank",
        "4",
        "--steps",
        "4",
        "--save-every",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "24",
        "--warmup",
        "0",
        "--lr",
        "1e-2",
        "--eval-fraction",
        "0",
        "--threads",
        "1",
        *extra,
    ]


def test_a_qlora_run_killed_during_a_save_resumes_bit_identically(base, tmp_path, monkeypatch, capsys):
    assert main(finetune(base, tmp_path / "full")) == 0
    full = load_file(str(tmp_path / "full" / lora.ADAPTER_WEIGHTS))
    assert not (tmp_path / "full" / "model.safetensors").exists()  # a quantised base: the adapters only
    assert "adapters only" in capsys.readouterr().err
    state = torch.load(tmp_path / "full" / "checkpoints" / "step-000004" / STATE_FILE, weights_only=True)
    assert state["args"]["quantization"] == "int4" and state["args"]["group_size"] == 32
    start = lora.read_adapters(tmp_path / "full" / "checkpoints" / "step-000002").tensors
    assert any(not torch.equal(v, full[k]) for k, v in lora.peft_tensors(start).items())  # it trained

    # killed while writing step 4's checkpoint: its files half written, step 2's untouched
    real_write = resume.write_state

    def killed(directory, step, *rest):
        if step == 4:
            (directory / "half").write_bytes(b"\0" * 10)
            raise RuntimeError("killed during the save")
        return real_write(directory, step, *rest)

    monkeypatch.setattr(resume, "write_state", killed)
    with pytest.raises(RuntimeError, match="killed"):
        main(finetune(base, tmp_path / "crash"))
    monkeypatch.setattr(resume, "write_state", real_write)
    ckpts = tmp_path / "crash" / "checkpoints"
    assert latest_checkpoint(tmp_path / "crash") == ckpts / "step-000002"
    assert sorted(p.name for p in ckpts.iterdir()) == [".step-000004.tmp", "step-000002"]
    step2 = lora.read_adapters(ckpts / "step-000002").tensors
    assert all(torch.equal(step2[k], start[k]) for k in start)  # the last checkpoint is intact

    assert main(finetune(base, tmp_path / "crash")) == 0  # the same command resumes from step 2
    assert "resuming from" in capsys.readouterr().err
    resumed = load_file(str(tmp_path / "crash" / lora.ADAPTER_WEIGHTS))
    assert resumed.keys() == full.keys() and all(torch.equal(resumed[k], full[k]) for k in full)

    # resuming on another base (scheme) is refused in one line, nothing written
    code = main(swap(swap(finetune(base, tmp_path / "crash"), "--quantization", "nvfp4"), "--steps", "6"))
    err = capsys.readouterr().err
    assert code == 2 and "was trained with --quantization int4" in err and err.count("\n") == 1


def _bad_inputs(base: Path, tmp: Path) -> dict[str, tuple[list[str], str, dict]]:
    """name -> (argv, what the line says, environment)."""
    other = random_model(make_config(**{**PRESETS["test"], "hidden_size": 32}), seed=1)
    lora.apply_lora(other, 4, 8.0)
    lora.save_adapters(other, tmp / "other_adapter")
    (tmp / "latin1.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    (tmp / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (tmp / "broken.jsonl").write_text('{"text": "fine"}\nthis is not json\n')
    plain = finetune(base, tmp / "out")

    cases = {
        "adapter of another model": (plain + ["--adapter", str(tmp / "other_adapter")], "this base needs", {}),
        "a target the model lacks": (plain + ["--lora-targets", "attention,gate_up"], "no such linear layer", {}),
        "experts as a target": (plain + ["--lora-targets", "experts"], "routed experts are not supported", {}),
        "rank 0": (swap(plain, "--lora-rank", "0"), "--lora-rank must be positive", {}),
        "rank 0 on a quantised base": (without(plain, "--lora-rank"), "is frozen", {}),
        "data not UTF-8 (JSONL)": (swap(plain, "--data", str(tmp / "latin1.jsonl")), "latin1.jsonl:1: not UTF-8", {}),
        "data not UTF-8 (text)": (swap(plain, "--data", str(tmp / "latin1.txt")), "latin1.txt: not UTF-8", {}),
        "data not JSONL": (swap(plain, "--data", str(tmp / "broken.jsonl")), "broken.jsonl:2: not valid JSON", {}),
        "a plan that does not fit": (plain, "does not fit this device's 0.2 GiB", {"DGEMMA_DEVICE_MEMORY": "200MiB"}),
    }
    if not torch.cuda.is_available():
        cases["a device it cannot run on"] = (plain + ["--device", "cuda"], "no CUDA device here", {})
    return cases


def test_bad_inputs_are_one_line_exit_2_and_write_nothing(base, tmp_path, monkeypatch, capsys):
    cases = _bad_inputs(base, tmp_path)
    for name, (argv, says, env) in cases.items():
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, (name, err)
        assert err.startswith("dgemma: error:") and err.count("\n") == 1 and says in err, (name, err)
        assert not (tmp_path / "out").exists(), name  # nothing written


def test_a_pre_quantised_checkpoint_trains_as_stored(base, tmp_path, capsys):
    """A checkpoint `dgemma quantize` wrote is read as stored (no --quantization needed); naming
    another scheme is refused in one line, nothing written."""
    from dgemma.quant.write import write_quantized

    stored = write_quantized(base / "base", tmp_path / "stored", "int4", 32)
    argv = swap(without(finetune(base, tmp_path / "out"), "--quantization"), "--model", str(stored))
    assert main(without(argv, "--group-size") + ["--steps", "2"]) == 0
    assert "base int4" in capsys.readouterr().err
    assert (tmp_path / "out" / lora.ADAPTER_WEIGHTS).exists() and not (tmp_path / "out" / "model.safetensors").exists()
    assert main(swap(argv, "--out", str(tmp_path / "other")) + ["--quantization", "nvfp4"]) == 2
    err = capsys.readouterr().err
    assert "already quantised (int4)" in err and err.count("\n") == 1 and not (tmp_path / "other").exists()

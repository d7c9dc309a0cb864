"""`dgemma merge-lora --quantization` (issue 55, item 6): QLoRA adapters folded into a quantised
checkpoint that loads as any other; its logits close to the unmerged run's, far closer than the
base's without the adapters; bad inputs one line, exit 2, nothing written."""

from __future__ import annotations

import re

import pytest
import torch

import dgemma
from adapter_files import write_adapter
from dgemma.cli import main
from dgemma.cli.train import closeness
from dgemma.loading import default_model_dir
from dgemma.train.lora import load_adapters

LINE = re.compile(r"relative L2 ([0-9.e+-]+), max \|difference\| ([0-9.e+-]+)")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return write_adapter(
        tmp_path_factory.mktemp("adapter"), dgemma.load().config, rank=4, alpha=8.0, std=0.05
    )  # changes the logits ~11%


@pytest.mark.parametrize("scheme, kept", [("int8", 0.1), ("int4", 0.5)])
def test_merged_checkpoint_loads_and_keeps_the_adapters_effect(tmp_path, capsys, adapter, scheme, kept):
    out = tmp_path / "merged"
    assert main(["merge-lora", "--adapter", str(adapter), "--out", str(out), "--quantization", scheme]) == 0
    printed = capsys.readouterr().out
    assert f"quantised to {scheme}" in printed
    rel = float(LINE.search(printed).group(1))
    merged = dgemma.load(out)
    assert merged.net.quantization[0] == scheme and merged.generate([[5, 6, 7]], max_new_tokens=8, seed=0).sequences
    # the adapters' own effect: the quantised base alone against the unmerged run
    base = dgemma.load(default_model_dir(), dtype="float32", quantization=scheme)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, base.config.vocab_size, (1, 16), generator=gen).tolist()
    canvas = torch.randint(3, base.config.vocab_size, (1, base.config.canvas_length), generator=gen)
    without = base.canvas_logits(prompt, canvas)
    load_adapters(base.net, adapter)
    unmerged = base.canvas_logits(prompt, canvas)
    effect = float((unmerged - without).norm() / without.norm())
    # merging kept most of what the adapters change (int8's grid keeps ~97% of it here; int4's ~66%: a
    # delta under half a step rounds away, docs/training.md)
    assert rel < kept * effect, (rel, effect)
    assert closeness(default_model_dir(), adapter, out, scheme)[0] == pytest.approx(rel, rel=1e-2)


def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys, adapter):
    quantised = tmp_path / "q8"
    assert main(["quantize", "--quantization", "int8", "--out", str(quantised)]) == 0
    other = write_adapter(tmp_path / "other", dgemma.load(tmp_path / "q8").config, rank=2)
    capsys.readouterr()
    cases = [
        (["--model", str(quantised), "--adapter", str(adapter)], "is already quantised"),
        (["--adapter", str(tmp_path / "nowhere")], "no LoRA adapter in"),
    ]
    for flags, words in cases:
        out = tmp_path / "out"
        code = main(["merge-lora", *flags, "--out", str(out), "--quantization", "int4"])
        err = capsys.readouterr().err
        assert code == 2 and words in err and err.count("\n") == 1 and not out.exists(), err
    assert other.exists()

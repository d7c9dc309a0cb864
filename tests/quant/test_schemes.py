"""The table of schemes (dgemma/quant/schemes.py): each built-in entry says what the formats
store and the kernels read; a scheme registered in the table is a choice of every command's
--quantization, is counted by the memory plan and is planned and picked by the fit check."""

import argparse
import math

import pytest
import torch

from dgemma.cli import build_parser, main
from dgemma.hub.fit import CheckpointFacts, FitRequest, auto_order, check_fit, plan_for
from dgemma.memory_plan import Workload, parameter_counts, plan_memory
from dgemma.model.checkpoint import make_config
from dgemma.model.presets import PRESETS
from dgemma.quant import schemes
from dgemma.quant.formats import QuantError, check_scheme, quantize
from dgemma.quant.schemes import GroupRule, Scheme

TOY = "toy2"
KERNELS = schemes.__file__.replace("quant/schemes.py", "kernels/csrc/")


@pytest.fixture
def toy():
    """A 2-bit scheme (groups of 32 inputs, a bf16 scale each) in the table for one test, and
    gone afterwards: the table is as it was."""
    before = schemes.names()
    scheme = Scheme(
        TOY,
        bits=2,
        kind="int",
        strategy="group",
        disk_format="pack-quantized",
        group=GroupRule(fixed=32),
        scale_bytes=2,
        main_part="weight_packed",
        parts=("weight_packed", "weight_scale"),
        codes_per_element=16,
    )
    schemes.register(scheme)
    yield scheme
    schemes.unregister(TOY)
    assert schemes.names() == before and schemes.find(TOY) is None


def option_choices(parser: argparse.ArgumentParser, option: str = "--quantization") -> dict[str, list[str] | None]:
    """Each command's choices for `option` (None: the flag takes any value)."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return {
        name: action.choices
        for name, command in commands.items()
        for action in command._actions
        if option in action.option_strings
    }


@pytest.mark.parametrize("name", schemes.BUILTIN)
def test_each_built_in_entry_is_what_the_formats_store(name):
    """The parts, the codes' part and the bytes the table says are quantize's, and the native
    functions it names are defined by both CPU extensions."""
    scheme = schemes.get(name)
    w = torch.randn(6, 128)
    q = quantize(w, name, scheme.group.chosen(None), torch.bfloat16)
    assert tuple(q.parts) == scheme.parts and scheme.main_part in q.parts
    assert q.parts[scheme.main_part].shape[-1] * scheme.codes_per_element == 128
    assert scheme.matrix_bytes(6, 128, None, 2) + scheme.shape_bytes == q.nbytes
    for source in ("dequant.cpp", "bindings.cpp"):
        text = open(KERNELS + source).read()
        assert f'"dequant_{scheme.kernels.cpu}"' in text and f'"gemm_{scheme.kernels.cpu}"' in text


def test_the_table_refuses_a_second_entry_of_a_name_and_keeps_the_built_in_ones():
    with pytest.raises(QuantError, match="exists already"):
        schemes.register(schemes.INT4)
    with pytest.raises(QuantError, match="built-in"):
        schemes.unregister("int4")
    with pytest.raises(QuantError, match="unknown quantization scheme 'toy2'; choose one of fp8, int8, int4, nvfp4"):
        check_scheme(TOY)
    assert auto_order() == (None, "fp8", "int8", "int4", "nvfp4")


def test_a_registered_scheme_is_a_choice_of_every_command(toy, capsys):
    parser = build_parser()
    listed = {name: c for name, c in option_choices(parser).items() if c is not None}
    assert {"run", "serve", "chat", "bench", "memory"} <= set(listed)
    assert all(TOY in c for c in listed.values()), listed
    assert option_choices(parser, "--quantize-embeddings") == {"quantize": ["fp8", "int8"]}  # no embedding format
    # dgemma memory --card: the plan and the fit, by the command
    assert main(["memory", "--size", "test", "--card", "4GiB", "--quantization", TOY]) == 0
    out = capsys.readouterr().out
    assert f"{TOY} weights" in out and out.strip().endswith("fits")


def test_a_scheme_is_gone_from_the_choices_once_removed(toy):
    schemes.unregister(TOY)
    assert all(TOY not in (c or ()) for c in option_choices(build_parser()).values())
    schemes.register(toy)  # the fixture removes it


def test_the_memory_plan_counts_a_registered_scheme(toy):
    config = make_config(**PRESETS["test"])
    plan = plan_memory(config, torch.bfloat16, Workload(scheme=TOY))
    counts = parameter_counts(config)
    for part in ("experts", "attention", "dense"):  # 2 bits a weight, a bf16 scale per 32 inputs
        want = sum(n * (r * c // 4 + r * math.ceil(c / 32) * 2) for r, c, n in counts[part].values())
        assert plan.weights[part] == want
    int4 = plan_memory(config, torch.bfloat16, Workload(scheme="int4"))
    assert (
        plan.weights["experts"] < int4.weights["experts"] and plan.weights["embeddings"] == int4.weights["embeddings"]
    )


def test_the_fit_check_plans_and_auto_picks_a_registered_scheme(toy, tmp_path):
    assert auto_order()[-1] == TOY  # auto tries it last
    config = make_config(**PRESETS["test"])
    facts = CheckpointFacts("test", tmp_path, config)
    flags = ("--quantization", "--force")

    def request(quantization, memory=None):
        return FitRequest(torch.device("cuda"), lambda _: torch.bfloat16, quantization, memory=memory, flags=flags)

    smallest = plan_for(facts, torch.bfloat16, TOY, request(TOY)).total
    nvfp4 = plan_for(facts, torch.bfloat16, "nvfp4", request("nvfp4")).total
    assert smallest < nvfp4
    memory = (smallest + nvfp4) // 2  # only the toy scheme fits
    fit = check_fit(facts, request("auto", memory))
    assert fit.fits and fit.scheme == TOY and fit.plan.scheme == TOY
    assert check_fit(facts, request(TOY, memory)).fits
    refused = check_fit(facts, request(None, memory), force=True)
    assert not refused.fits and f"--quantization {TOY}" in refused.message

"""Memory planning for a device (dgemma/memory_plan.py): weight bytes equal what a built model
holds, unquantised and quantised; a plan that cannot fit a card is refused with what would fit;
`dgemma memory --card`."""

import pytest
import torch

from dgemma.cli import main
from dgemma.hub import FitError, FitRequest
from dgemma.hub.fit import CheckpointFacts, check_fit
from dgemma.memory_plan import Workload, plan_memory, weight_bytes
from dgemma.model.checkpoint import make_config
from dgemma.model.diffusion_gemma import DiffusionGemma
from dgemma.model.presets import PRESETS
from dgemma.quant.modules import quantize_model
from dgemma.quant.modules import weight_bytes as held_bytes

GIB = 2**30


@pytest.mark.parametrize("scheme", [None, "fp8", "int8", "int4", "nvfp4"])
def test_planned_weight_bytes_are_what_the_model_holds(scheme):
    config = make_config(**PRESETS["test"])
    net = DiffusionGemma(config).to(torch.bfloat16)
    if scheme is not None:
        quantize_model(net, scheme, 16 if scheme == "int4" else None)
    planned = weight_bytes(config, scheme, 16, torch.bfloat16)
    held = held_bytes(net)
    assert sum(planned.values()) == sum(held.values())
    assert planned["experts"] == held["experts"] and planned["embeddings"] == held["embeddings"]


@pytest.mark.slow
def test_the_released_model_on_a_24_gb_card(tmp_path):
    config = make_config(**PRESETS["real"])
    card = 24 * 10**9
    facts = CheckpointFacts("real", tmp_path, config)
    flags = ("--quantization", "--max-context", "--max-active", "--force")

    def fit(scheme, context=8192):
        request = FitRequest(
            torch.device("cuda"),
            lambda _: torch.bfloat16,
            scheme,
            None,
            8,
            context,
            memory=card,
            memory_source="--card",
            flags=flags,
        )
        return check_fit(facts, request)

    int4 = fit("int4")  # fits
    assert int4.fits and int4.scheme == "int4" and int4.plan.total <= card
    assert 13 * GIB < sum(int4.plan.weights.values()) < 15 * GIB  # docs/quantization.md measured 13.49 GiB
    assert sum(plan_memory(config, torch.bfloat16, Workload(batch=8, context=8192)).weights.values()) > 45 * GIB
    with pytest.raises(
        FitError,
        match=r"does not fit this device's 22\.4 GiB \(--card\): weights .* it would fit with "
        r"--quantization int4 .*; --force loads it anyway",
    ):
        fit(None)
    with pytest.raises(FitError, match="--max-context"):
        fit("int4", context=None)  # the full 131072 positions
    assert fit("auto").scheme == "int4"  # the best scheme that fits


@pytest.mark.slow
def test_memory_card_command(capsys):
    code = main(["memory", "--size", "real", "--card", "24GB", "--quantization", "int4", "--max-context", "8192"])
    out = capsys.readouterr().out
    assert code == 0 and "weights: experts" in out and out.strip().endswith("fits")
    code = main(["memory", "--size", "real", "--card", "24GB", "--max-context", "8192"])
    out = capsys.readouterr().out
    assert code == 1 and "does not fit" in out and "--quantization int4" in out


# ------------------------------------------------------------------ fine-tuning (issue 55, item 4)
def test_finetune_plan_counts_what_a_qlora_model_holds():
    """The plan's base is what the quantised model holds, its trained parameters the adapters'."""
    from dgemma.train import lora
    from dgemma.train.plan import FinetuneWork, plan_finetune

    config = make_config(**PRESETS["test"])
    net = DiffusionGemma(config)
    quantize_model(net, "int4", 32)
    lora.apply_lora(net, 8)
    plan = plan_finetune(config, FinetuneWork("int4", 32, 8, weight_dtype=torch.float32, act_dtype=torch.float32))
    held = held_bytes(net)
    adapters = sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert sum(plan.base.values()) == sum(held.values()) - 4 * adapters  # (held counts the adapters too)
    assert plan.base["experts"] == held["experts"] and plan.base["embeddings"] == held["embeddings"]
    assert plan.trained_parameters == adapters and plan.adapters == 16 * adapters  # weight, grad, two moments
    full = plan_finetune(config, FinetuneWork(None, lora_rank=0, weight_dtype=torch.float32))
    assert full.trained_parameters == sum(p.numel() for p in DiffusionGemma(config).parameters())


def test_the_released_model_fine_tunes_on_a_24_gb_card_int4_rank_16_2048_tokens():
    """Issue 55's target, planned: at most 22 GiB on a GPU; activation checkpointing is what makes it fit."""
    from dataclasses import replace

    from dgemma.train.plan import FinetuneWork, finetune_fixes, plan_finetune

    config = make_config(**PRESETS["real"])
    work = FinetuneWork("int4", None, 16, seq_len=2048)
    plan = plan_finetune(config, work)
    assert plan.total <= 22 * GIB
    assert 12 * GIB < plan.parts["base (int4)"] < 15 * GIB and plan.parts["adapters and optimizer"] < 0.4 * GIB
    unchecked = plan_finetune(config, replace(work, checkpointing=False))
    assert unchecked.total > 24 * GIB  # every layer's activations of 2,048 tokens kept: it would not fit
    bf16 = plan_finetune(config, FinetuneWork(None, None, 16, seq_len=2048))
    assert bf16.total > 45 * GIB
    fixes = finetune_fixes(config, FinetuneWork("fp8", None, 16, seq_len=8192), 24 * 10**9)
    assert fixes and fixes[0].startswith("--quantization int4 --seq-len")


def test_memory_finetune_command(capsys):
    argv = ["memory", "--finetune", "--size", "real", "--quantization", "int4", "--lora-rank", "16"]
    assert main([*argv, "--seq-len", "2048", "--card", "24GB"]) == 0
    out = capsys.readouterr().out
    for part in ("base: experts", "adapters and optimizer", "activation checkpoints", "one layer's recompute"):
        assert part in out
    assert "loss chunk" in out and "CUDA context" in out and "planned, not measured" in out
    assert out.strip().splitlines()[-1].startswith("fits:")
    assert main([*argv, "--seq-len", "8192", "--card", "20GB"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("does not fit") and "it would fit with --seq-len" in last
    assert main(["memory", "--finetune", "--size", "tiny", "--lora-targets", "experts"]) == 2
    assert "routed experts are not supported" in capsys.readouterr().err

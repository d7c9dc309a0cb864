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

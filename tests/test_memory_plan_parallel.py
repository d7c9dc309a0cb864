"""Memory plans per rank (dgemma/memory_plan.py's `rank_plans`, hub/fit.py's tensor-parallel fit,
`dgemma memory --tensor-parallel-size`): at size 1 today's plan exactly; split, each rank's share
of the weights (halved where a dimension splits, replicated where it does not), of the KV pool
(replicated KV heads counted) and of the step buffers; the largest rank decides the fit, and a
plan that does not fit per rank is refused before any weights are read."""

import json
import types

import pytest
import torch

from dgemma.cli import main
from dgemma.hub import FitError, FitRequest
from dgemma.hub.fit import CheckpointFacts, check_fit, rank_plans_for
from dgemma.hub.resolve import resolve_checkpoint
from dgemma.memory_plan import (
    COLLECTIVE_RESERVE,
    RESERVE,
    Workload,
    kv_bytes,
    largest,
    plan_memory,
    rank_kv_bytes_per_token,
    rank_plans,
    rank_weight_bytes,
    step_buffer_bytes,
    weight_bytes,
)
from dgemma.model.checkpoint import config_json, make_config
from dgemma.model.presets import PRESETS
from dgemma.parallel.plan import ShardError, ShardPlan

GIB = 2**30
BF16 = torch.bfloat16
FLAGS = ("--quantization", "--max-context", "--max-active", "--tensor-parallel-size", "--force")


@pytest.fixture(scope="module")
def real():
    return make_config(**PRESETS["real"])


def request(memory: int, size: int = 1, scheme=None, context=8192, flags=FLAGS, **extra) -> FitRequest:
    return FitRequest(
        torch.device("cuda"),
        lambda _: BF16,
        scheme,
        None,
        8,
        context,
        memory=memory,
        memory_source="--card",
        flags=flags,
        tensor_parallel_size=size,
        **extra,
    )


def test_size_one_is_todays_plan():
    config = make_config(**PRESETS["test"])
    for scheme in (None, "int4"):
        today = plan_memory(config, BF16, Workload(scheme, 16, batch=4, context=256))
        assert plan_memory(config, BF16, Workload(scheme, 16, batch=4, context=256, tensor_parallel_size=1)) == today
        (one,) = rank_plans(config, BF16, Workload(scheme, 16, 4, 256, tensor_parallel_size=1))
        assert (one.weights, one.kv_cache, one.step_buffers, one.reserve) == (
            today.weights,
            today.kv_cache,
            today.step_buffers,
            RESERVE,
        )
        assert "per rank" not in today.describe() and today.ranks == 1


def test_real_weights_halve_at_two_ranks_but_norms_and_router_stay_whole(real):
    full = weight_bytes(real, None, None, BF16)
    plans = rank_plans(real, BF16, Workload(None, None, 8, 8192, tensor_parallel_size=2))
    for plan in plans:
        for part in ("experts", "attention", "dense", "embeddings"):
            assert 2 * plan.weights[part] == full[part], part  # 16 heads, 8 / 2 KV heads, 2112, 704, 262144 halve
        self_conditioning = 3 * real.hidden_size * real.intermediate_size * 2  # its MLP splits; the rest does not
        assert plan.weights["other"] == full["other"] - self_conditioning // 2
        assert plan.weights["other"] > full["other"] // 2  # norms, router, scalars: whole on every rank
        assert plan.reserve == RESERVE + COLLECTIVE_RESERVE and "per rank (2 ranks)" in plan.describe()
    # the released text stack: 47 GiB (50.5 GB) in bf16 (~52 GB with the vision tower); 23.5 GiB a rank
    assert 46 * GIB < sum(full.values()) < 48 * GIB
    assert 0.5 < sum(plans[0].weights.values()) / sum(full.values()) < 0.501
    # step buffers: the logits' [rows, vocab / 2] halve; hidden-size activations do not
    whole = step_buffer_bytes(real, 8, 2048, BF16)
    assert whole / 2 < plans[0].step_buffers < whole * 0.55


def test_four_ranks_replicate_the_global_layers_kv_heads(real):
    shards = ShardPlan.build(real, 4)
    full = rank_kv_bytes_per_token(ShardPlan.build(real, 1), 0, 2)
    for rank in range(4):
        mine = rank_kv_bytes_per_token(shards, rank, 2)
        assert mine["sliding_attention"] * 4 == full["sliding_attention"]  # 8 KV heads: 2 a rank
        assert mine["full_attention"] * 2 == full["full_attention"]  # 2 KV heads: each on 2 ranks
        assert sum(mine.values()) * 4 > sum(full.values())
    plans = rank_plans(real, BF16, Workload(None, None, 8, 131072, tensor_parallel_size=4))
    assert plans[0].kv_cache * 4 > kv_bytes(real, 1, 131072, BF16)  # the global layers' heads dominate
    assert plans[0].kv_cache == kv_bytes(shards.rank_config(0), 1, 131072, BF16)


def test_expert_parallelism_counts_whole_experts(real):
    full = weight_bytes(real, "int4", None, BF16)["experts"]
    with pytest.raises(
        ShardError,
        match=r"^layers\.0\.experts: the 352 of each expert's intermediate .* groups of 64: "
        r"use expert parallelism, or a group size that divides 352$",
    ):
        rank_plans(
            real, BF16, Workload("int4", None, 8, 8192, tensor_parallel_size=2)
        )  # the loader refuses that split: so does the plan
    split = rank_plans(real, BF16, Workload("int4", 32, 8, 8192, tensor_parallel_size=2))[
        0
    ]  # groups of 32 divide 352 and 1056
    whole = rank_plans(real, BF16, Workload("int4", None, 8, 8192, tensor_parallel_size=2, expert_parallel=True))[0]
    matrices = real.num_layers * 2  # gate_up_proj and down_proj: each stores its int4 weight_shape (8 bytes) once
    assert 2 * whole.weights["experts"] == full + 8 * matrices  # 64 whole experts a rank: their groups whole
    assert not split.notes and any("dense down_proj (1056 of 2112 columns)" in note for note in whole.notes)
    assert "places each layer's whole dense MLP on one rank" in whole.notes[0] and "--group-size 32" in whole.notes[0]
    for shards, plan, group in ((ShardPlan.build(real, 2), split, 32), (ShardPlan.build(real, 2, True), whole, None)):
        assert plan.weights == rank_weight_bytes(shards, 0, "int4", group, BF16)  # parallel/plan.py's own count
    assert whole.step_buffers > split.step_buffers  # a rank may run every routed slot of a token at full width
    assert "expert parallel" in whole.describe()


def test_the_largest_rank_decides():
    config = make_config(**dict(PRESETS["test"], vocab_size=1000))  # shards of 512 and 488 rows
    plans = rank_plans(config, torch.float32, Workload(None, None, 4, 256, tensor_parallel_size=2))
    assert plans[0].weights["embeddings"] == 512 * 64 * 4 and plans[1].weights["embeddings"] == 488 * 64 * 4
    assert plans[0].total > plans[1].total and largest(plans) is plans[0]
    assert plan_memory(config, torch.float32, Workload(None, None, 4, 256, tensor_parallel_size=2)) == plans[0]


def test_unsplittable_sizes_are_one_line(real, capsys):
    with pytest.raises(ShardError, match="^16 attention heads do not split across 3 ranks$"):
        check_fit(CheckpointFacts("real", None, real), request(24 * 10**9, 3))
    for extra in ([], ["--card", "24GB"]):
        assert main(["memory", "--size", "real", "--tensor-parallel-size", "3", *extra]) == 2
        err = capsys.readouterr().err
        assert err == "dgemma: error: 16 attention heads do not split across 3 ranks\n"
    assert main(["memory", "--size", "real", "--tensor-parallel-size", "0", "--card", "24GB"]) == 2
    assert "--tensor-parallel-size must be positive" in capsys.readouterr().err


def memory_command(capsys, *args: str) -> tuple[int, str]:
    code = main(["memory", "--size", "real", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def total_line(out: str) -> list[float]:
    return [float(x) for x in next(line for line in out.splitlines() if line.strip().startswith("total")).split()[1:]]


def test_memory_command_two_24_gb_cards(capsys):
    code, out = memory_command(capsys, "--card", "24GB", "--tensor-parallel-size", "2", "--quantization", "int4")
    assert code == 2 and "use expert parallelism, or a group size that divides 352" in out  # the loader's refusal
    code, out = memory_command(
        capsys, "--card", "24GB", "--tensor-parallel-size", "2", "--quantization", "int4", "--expert-parallel"
    )
    assert code == 0 and "per rank (2 ranks, expert parallel)" in out and "ranks 0-1" in out
    assert "note: int4's groups of 64 do not divide" in out and out.strip().splitlines()[-1].startswith("fits: rank 0")
    (int4,) = total_line(out)
    assert 12 < int4 < 14  # 6.8 GiB of weights, a 131072-position KV pool, 8 canvases' buffers
    code, out = memory_command(
        capsys, "--card", "24GB", "--tensor-parallel-size", "2"
    )  # bf16: 23.5 GiB of weights a rank
    assert (
        code == 1
        and "does not fit: --size real does not fit this device's 22.4 GiB (--card, tensor-parallel size 2)" in out
    )
    assert "it would fit with --quantization fp8 (" in out and "--tensor-parallel-size 4 (" in out
    code, out = memory_command(capsys, "--card", "24GB", "--tensor-parallel-size", "2", "--quantization", "auto")
    assert code == 0 and "fp8 weights" in out


def test_memory_command_four_16_gb_cards(capsys):
    code, out = memory_command(capsys, "--card", "16GB", "--tensor-parallel-size", "4", "--max-context", "8192")
    assert code == 1 and "ranks 0-3" in out and "--max-active 4 (" in out  # 11.8 GiB of weights a rank
    code, out = memory_command(
        capsys, "--card", "16GB", "--tensor-parallel-size", "4", "--max-context", "8192", "--max-active", "4"
    )
    assert code == 0 and total_line(out)[0] < 14.9
    code, out = memory_command(
        capsys, "--card", "16GB", "--tensor-parallel-size", "4", "--expert-parallel", "--quantization", "fp8"
    )
    assert code == 0 and "per rank (4 ranks, expert parallel)" in out
    code, out = memory_command(capsys, "--tensor-parallel-size", "4", "--tokens", "131072")  # the KV report, a rank's
    assert "per rank (4 ranks)" in out and " 10240 " in out  # the global layers: 1 of 2 KV heads, not half of one


def test_fit_refuses_per_rank_before_loading(real, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**config_json(real), "dtype": "bfloat16"}))  # no weights at all
    with pytest.raises(
        FitError,
        match=r"\(--card, tensor-parallel size 2\): per rank \(2 ranks\): weights 23\.5 GiB .* "
        r"--tensor-parallel-size 4 \(.* GiB per rank\)",
    ):
        resolve_checkpoint(tmp_path, fit=request(24 * 10**9, 2))
    checkpoint = resolve_checkpoint(tmp_path, fit=request(24 * 10**9, 2, "int4", expert_parallel=True))
    assert checkpoint.fit.fits and checkpoint.fit.plan.ranks == 2 and checkpoint.quantization == "int4"
    api = request(24 * 10**9, 2, flags=())  # dgemma.load's words
    with pytest.raises(
        FitError, match=r"quantization='fp8' .* or tensor_parallel_size=4 .*; force=True loads it anyway"
    ):
        check_fit(CheckpointFacts("real", tmp_path, real), api)
    forced = check_fit(CheckpointFacts("real", tmp_path, real), api, force=True)
    assert not forced.fits and "tensor-parallel size 2" in forced.message


def test_ranks_on_one_cpu_share_its_memory(tmp_path):
    config = make_config(**PRESETS["test"])
    facts = CheckpointFacts("test", tmp_path, config)
    cpu = FitRequest(torch.device("cpu"), lambda _: torch.float32, memory=2**31, tensor_parallel_size=2)
    fit = check_fit(facts, cpu)
    assert fit.fits and fit.memory == 2**30 and fit.where == "DGEMMA_DEVICE_MEMORY shared by 2 ranks"
    assert fit.plan.ranks == 2 and all(p.reserve == 2**29 for p in rank_plans_for(facts, torch.float32, None, cpu))


def test_a_prequantised_checkpoint_is_cut_by_each_ranks_share(real):
    stored = 14 * GIB
    quant = types.SimpleNamespace(scheme="int4", group_size=64)
    facts = CheckpointFacts("real-int4", None, real, quant, {"all": ("U8", (stored,))})
    plans = rank_plans_for(facts, BF16, None, request(24 * 10**9, 2, expert_parallel=True))
    share = sum(
        rank_plans(real, BF16, Workload("int4", 64, 8, 8192, tensor_parallel_size=2, expert_parallel=True))[
            0
        ].weights.values()
    )
    whole = sum(weight_bytes(real, "int4", 64, BF16).values())
    assert [p.weights for p in plans] == [{"stored": stored * share // whole}] * 2 and plans[0].scheme == "int4"

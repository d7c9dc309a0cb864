"""The fused layer's MoE kernels (dgemma/kernels/triton_moe.py), run on CPU by Triton's interpreter,
against the torch code they replace: Router.forward, the expert grouping of Experts.forward
(torch.sort + searchsorted), and the grouped GEMMs (rows gathered by token, gelu(gate) * up in the
epilogue, rows scattered back) with every weight format, against Experts.forward."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

from dgemma.kernels import triton_moe as tm  # noqa: E402
from dgemma.kernels import triton_quant as tq  # noqa: E402
from dgemma.model.checkpoint import make_config  # noqa: E402
from dgemma.model.diffusion_gemma import Experts, Router  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402
from dgemma.quant.formats import dequantize, quantize  # noqa: E402

if not tm.INTERPRETED:
    pytest.skip("triton_moe was imported before TRITON_INTERPRET was set", allow_module_level=True)


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@torch.no_grad()
def test_router_topk_is_router_forward(dtype):
    cfg = make_config(**PRESETS["mid"])  # 32 experts, top 4
    router = Router(cfg)
    router.proj.weight.data = rand(*router.proj.weight.shape, seed=1, scale=0.05)
    router.per_expert_scale.data = rand(cfg.num_experts, seed=2).abs() + 0.5
    router = router.to(dtype)
    x = rand(37, cfg.hidden_size, seed=3, dtype=dtype)
    probs, want_w, want_i = router(x)
    r_in = router.norm(x) * router.scale * router.root_size  # what triton_norms.post_attention hands over
    got_w, got_i = tm.router_topk(r_in, router.proj.weight, router.per_expert_scale, cfg.top_k_experts)
    got_i = got_i.long()
    # the same experts but where two hold the same probability (bf16 logits tie; torch's order
    # among equals is its own): then the same probabilities in the same order
    assert torch.equal(probs.gather(1, got_i), probs.gather(1, want_i))
    same = (got_i == want_i).all(1)
    assert float(same.float().mean()) > 0.9
    assert (got_w[same] - want_w[same]).abs().max() <= 1e-6 * want_w.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 37])
@torch.no_grad()
def test_the_split_router_is_the_one_launch_router_bit_for_bit(dtype, tokens):
    """Few tokens split the router's K over programs (issue 54: an AR token's router ran on one CTA):
    the chunks' sums added in the same order give the same bits as one program a token block, so
    whether a step splits never moves an expert choice; with 1 token the split is the default."""
    cfg = make_config(**PRESETS["mid"])
    h, e, k = cfg.hidden_size, cfg.num_experts, cfg.top_k_experts
    assert h > tm.ROUTER_K_CHUNK  # several chunks
    w = rand(e, h, seed=1, scale=0.05, dtype=dtype)
    scale = rand(e, seed=2).abs() + 0.5
    x = rand(tokens, h, seed=3, dtype=dtype)
    one_w, one_i = tm.router_topk(x, w, scale, k, split=False)
    split_w, split_i = tm.router_topk(x, w, scale, k, split=True)
    default_w, default_i = tm.router_topk(x, w, scale, k)
    assert torch.equal(one_i, split_i) and torch.equal(one_w, split_w)
    assert torch.equal(default_i, split_i) and torch.equal(default_w, split_w)
    logits = (x.float() @ w.float().T).to(dtype).float()  # the experts are the top-k of the logits
    assert torch.equal(logits.gather(1, one_i.long()), logits.topk(k).values)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")  # numpy's, under the interpreter: the point
@pytest.mark.parametrize("split", [False, True], ids=["one-launch", "split-k"])
@torch.no_grad()
def test_a_nan_router_row_still_picks_experts(split):
    """A token whose router logits are NaN (a NaN hidden state) matches no expert id in the top-k's
    search: its picks are clamped to E - 1, so the per-expert scale is read within the table and
    every (token, slot) pair has an expert whose GEMM writes its row (issue 54: `pick` was 128,
    past the 128 experts). The other tokens are routed as without it."""
    e, h, k = 16, 300, 4  # three K chunks when split
    w, scale = rand(e, h, seed=1, scale=0.2), rand(e, seed=2).abs() + 0.5
    x = rand(5, h, seed=3)
    clean_w, clean_i = tm.router_topk(x, w, scale, k, split=split)
    x[2] = float("nan")
    top_w, top_i = tm.router_topk(x, w, scale, k, split=split)
    assert ((top_i >= 0) & (top_i < e)).all() and (top_i[2] == e - 1).all()
    assert top_w[2].isnan().all()
    others = [0, 1, 3, 4]
    assert torch.equal(top_i[others], clean_i[others]) and torch.equal(top_w[others], clean_w[others])


def test_moe_align_groups_pairs_by_expert_in_pair_order():
    ids = torch.randint(0, 16, (300, 4), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    ids[:, 0] = 3  # a crowded expert; others empty
    pairs, ends = tm.moe_align(ids, 20)
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    assert torch.equal(pairs.long(), order)
    assert torch.equal(ends.long(), torch.cumsum(torch.bincount(flat, minlength=20), 0))


SCHEMES = ["plain", "fp8", "int8", "int4", "nvfp4"]


def weight(scheme: str, shape, dtype, seed=5):
    full = rand(*shape, seed=seed, scale=0.05)
    if scheme == "plain":
        return full.to(dtype), full.to(dtype).float()
    q = quantize(full, scheme, 32 if scheme == "int4" else None, dtype)
    return q, dequantize(q, dtype).float()


@pytest.mark.parametrize("scheme", SCHEMES)
@torch.no_grad()
def test_grouped_gemm_gathers_scatters_and_gates_like_experts_forward(scheme):
    """The MoE block's two grouped GEMMs (gate|up with gelu * up in the epilogue, rows gathered
    by token; down, rows scattered to pair order), then the weighted sum: Experts.forward's
    result, with the experts' weights of each format (bf16; one expert gets no token)."""
    cfg = make_config(**PRESETS["test"])  # 4 experts, top 2
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gate_up, gate_up_full = weight(scheme, (e, 2 * i, h), torch.bfloat16, seed=7)
    down, down_full = weight(scheme, (e, h, i), torch.bfloat16, seed=8)
    experts = Experts(cfg)
    experts.gate_up_proj.data, experts.down_proj.data = gate_up_full, down_full
    experts = experts.to(torch.bfloat16)
    t = 23
    x = rand(t, h, seed=9, dtype=torch.bfloat16)
    idx = torch.randint(0, e - 1, (t, cfg.top_k_experts), generator=torch.Generator().manual_seed(10))  # expert 3 idle
    idx[:, 1] = (idx[:, 0] + 1) % (e - 1)
    wts = torch.rand(t, cfg.top_k_experts, generator=torch.Generator().manual_seed(11))
    want = experts(x, idx, wts)
    y = tm.moe(x, idx.to(torch.int32), tq.gemm_weight(gate_up), tq.gemm_weight(down), cfg.gelu_approximate)
    got = (y.view(t, cfg.top_k_experts, h).float() * wts[..., None]).sum(1).to(torch.bfloat16)
    assert rel(got, want) < 1.5e-2  # bf16 throughout: the two paths round the same values

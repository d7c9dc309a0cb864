"""The fused layer kernels (dgemma/kernels/triton_layer.py), run on CPU by Triton's interpreter,
against the torch chains they replace: RMSNorm -> apply_rope -> index_copy_ into the paged pool,
and Experts.forward's gelu * up and weighted top-k sum.

float32: within 1e-5 of the torch chain. bf16: the kernels round once, at the store, so their
result is the float32 computation rounded to nearest even (<= 1/2 bf16 ulp of it, checked
element-wise), and no further from float32 than the torch chain, which rounds after each op.

TRITON_INTERPRET must be set before triton is first imported, so conftest.py sets it for the
whole pytest process (and this file again, run on its own). Tiny shapes keep the interpreter fast."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / triton_layer are imported

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

from dgemma.config import GLOBAL, LayerSpec  # noqa: E402
from dgemma.kernels import triton_layer as tk  # noqa: E402
from dgemma.model import rope  # noqa: E402
from dgemma.model.diffusion_gemma import Experts  # noqa: E402
from dgemma.model.layers import RMSNorm  # noqa: E402

if not tk.INTERPRETED:
    pytest.skip(
        "triton_layer was imported before TRITON_INTERPRET was set: its kernels need a GPU", allow_module_level=True
    )

EPS = 1e-6


def rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def bf16_ulps(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|y - ref| in bf16 ulps of ref (float32): 8 significant bits, ulp = 2^(e - 8) for |ref| = m 2^e."""
    _, e = torch.frexp(ref.float())
    return (y.float() - ref.float()).abs() / torch.exp2(e.float() - 8)


def max_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return (y.float() - ref.float()).abs().max().item()


def tables(t: int, d: int, dtype: torch.dtype, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Hand-made [T, D] tables: an angle per (token, pair), both halves alike (as rope.cos_sin)."""
    angles = rand(t, d // 2, seed=seed, scale=3.0).repeat(1, 2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def torch_chain(x, weight, cos, sin, dtype=None):
    """RMSNorm(with_scale) then rope.apply_rope, as Attention.project runs them; dtype: compute
    it all in that dtype instead (float32: the reference the bf16 results are judged against)."""
    if dtype is not None:
        x, weight = x.to(dtype), None if weight is None else weight.to(dtype)
        cos, sin = (None, None) if cos is None else (cos.to(dtype), sin.to(dtype))
    norm = RMSNorm(x.shape[-1], EPS, with_scale=weight is not None)
    if weight is not None:
        norm.weight.data = weight.clone()
    with torch.no_grad():
        y = norm(x)
        return y if cos is None else rope.apply_rope(y[None], cos[None], sin[None])[0]


def check_bf16(y, x, weight, cos, sin):
    """y (bf16) is the float32 computation rounded to nearest, and no worse than torch's chain."""
    ref = torch_chain(x, weight, cos, sin, dtype=torch.float32)
    ulps = bf16_ulps(y, ref)
    assert ulps.max().item() <= 0.501, ulps.max().item()
    assert max_err(y, ref) <= max_err(torch_chain(x, weight, cos, sin), ref)


def test_available_under_the_interpreter():
    assert tk.HAVE_TRITON and tk.INTERPRETED
    assert tk.available("cpu") and tk.available(torch.device("cpu"))


# -------------------------------------------------------------------------------- norm_rope
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [True, False], ids=["scale", "noscale"])
@pytest.mark.parametrize("with_rope", [True, False], ids=["rope", "norope"])
def test_norm_rope_matches_torch_chain(dtype, with_weight, with_rope):
    t, heads, d = 5, 3, 16
    x = rand(t, heads, d, seed=1, dtype=dtype, scale=2.0)
    weight = rand(d, seed=2).abs() + 0.5 if with_weight else None
    cos, sin = tables(t, d, dtype) if with_rope else (None, None)
    y = tk.norm_rope(x, weight, cos, sin, EPS)
    assert y.shape == x.shape and y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, torch_chain(x, weight, cos, sin), rtol=1e-5, atol=1e-5)
    else:
        check_bf16(y, x, weight, cos, sin)


def proportional_tables(t: int, dtype: torch.dtype) -> tuple[LayerSpec, torch.Tensor, torch.Tensor]:
    """A global layer's "proportional" RoPE (a quarter of the pairs rotate) at scattered positions."""
    spec = LayerSpec(
        GLOBAL,
        head_dim=128,
        num_kv_heads=2,
        rope_theta=1e6,
        rope_type="proportional",
        partial_rotary_factor=0.25,
        rope_factor=1.0,
    )
    positions = torch.tensor([[0, 1, 7, 300, 4095][:t]])
    cos, sin = rope.cos_sin(positions, rope.inv_freq(spec), dtype)
    return spec, cos[0], sin[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_large_head_real_tables_and_pool(dtype):
    t = 4
    spec, cos, sin = proportional_tables(t, dtype)
    heads, d = spec.num_kv_heads, spec.head_dim
    assert (cos[:, d // 4 : d // 2] == 1).all()  # the unrotated pairs are there
    x = rand(t, heads, d, seed=3, dtype=dtype)
    weight = (rand(d, seed=4) * 0.1 + 1).to(dtype)  # a bf16 model's norm weight
    keys = rand(3, 4, heads, d, seed=6, dtype=dtype)  # [num_blocks, block_size, Hkv, D]
    before = keys.clone()
    slots = torch.tensor([9, 2, 11, 4])
    y = tk.norm_rope(x, weight, cos, sin, EPS, pool=keys.view(-1, heads, d), slots=slots)
    if dtype == torch.float32:
        torch.testing.assert_close(y, torch_chain(x, weight, cos, sin), rtol=1e-5, atol=1e-5)
    else:
        check_bf16(y, x, weight, cos, sin)
    expected = before.view(-1, heads, d).index_copy(0, slots, y).view_as(keys)
    assert torch.equal(keys, expected)


def test_norm_rope_strided_view_and_out():
    t, heads, d = 6, 2, 16
    qkv = rand(t, 3 * heads * d + 8, seed=7)  # a fused projection: k is a column slice of it
    x = qkv[:, heads * d : 2 * heads * d].unflatten(-1, (heads, d))
    assert not x.is_contiguous()
    cos, sin = tables(t, d, torch.float32)
    big = torch.zeros(heads, t, d)  # out as a transposed view, like [Hkv, T, D].transpose(0, 1)
    out = big.transpose(0, 1)
    y = tk.norm_rope(x, None, cos, sin, EPS, out=out)
    assert y is out
    torch.testing.assert_close(big.transpose(0, 1), torch_chain(x.contiguous(), None, cos, sin), rtol=1e-5, atol=1e-5)
    xi = x.clone()
    tk.norm_rope(xi, None, cos, sin, EPS, out=xi)  # in place
    torch.testing.assert_close(xi, y, rtol=0, atol=0)


@pytest.mark.parametrize(
    "x_dtype,pool_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
)
def test_norm_rope_pool_write_touches_only_its_slots(x_dtype, pool_dtype):
    t, heads, d = 7, 2, 16
    x = rand(t, heads, d, seed=8, dtype=x_dtype)
    weight = rand(d, seed=9)
    cos, sin = tables(t, d, x_dtype)
    keys = rand(5, 8, heads, d, seed=10, dtype=pool_dtype)
    before = keys.clone()
    slots = torch.randperm(40, generator=torch.Generator().manual_seed(11))[:t]
    slots[3] = -1  # a padding token: no write
    y = tk.norm_rope(x, weight, cos, sin, EPS, pool=keys.view(-1, heads, d), slots=slots)
    flat, old = keys.view(-1, heads, d), before.view(-1, heads, d)
    written = slots[slots >= 0]
    assert torch.equal(flat[written], y[slots >= 0].to(pool_dtype))  # y as stored, cast (nearest even)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[untouched], old[untouched])


# ----------------------------------------------------------------------------------- MoE tails
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_mul(approximate, dtype):
    gate_up = rand(13, 2 * 24, seed=12, dtype=dtype, scale=3.0)  # I = 24: a partial column block
    h = tk.gelu_mul(gate_up, approximate)
    assert h.shape == (13, 24) and h.dtype == dtype
    gate, up = gate_up.float().chunk(2, dim=-1)
    ref = F.gelu(gate, approximate=approximate) * up
    if dtype == torch.float32:
        torch.testing.assert_close(h, ref, rtol=1e-5, atol=1e-5)
    else:  # one rounding of the exact value, up to float32's cancellation in 1 + erf (g << 0)
        assert bf16_exact(h, exact_gelu_mul(gate_up, approximate), slack=1e-7 * (gate * up).abs())
        g16, u16 = gate_up.chunk(2, dim=-1)
        assert max_err(h, ref) <= max_err(F.gelu(g16, approximate=approximate) * u16, ref)


def exact_gelu_mul(gate_up: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(gate) * up in float64 by forms without cancellation: 0.5 g (1 + tanh z) = g sigmoid(2z),
    1 + erf(x) = erfc(-x) (0.5 g (1 + tanh) in float64 still cancels for g < -6)."""
    g, u = gate_up.double().chunk(2, dim=-1)
    if approximate == "tanh":
        act = g * torch.sigmoid(2 * 0.7978845608028654 * (g + 0.044715 * g**3))
    else:
        act = 0.5 * g * torch.special.erfc(-g * 0.7071067811865476)
    return act * u


def bf16_exact(y: torch.Tensor, ref: torch.Tensor, slack: torch.Tensor) -> bool:
    """Each element of y within 1/2 bf16 ulp of ref (float64), give or take slack."""
    ulp = torch.exp2(torch.frexp(ref.float())[1].double() - 8)
    return bool(((y.double() - ref).abs() <= 0.501 * ulp + slack.double()).all())


def routing(n: int, num_experts: int, top_k: int, empty: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, never `empty`, expert 0 in two tokens of three (uneven)."""
    g = torch.Generator().manual_seed(seed)
    others = [e for e in range(1, num_experts) if e != empty]
    rows = []
    for t in range(n):
        pick = [others[i] for i in torch.randperm(len(others), generator=g)[:top_k].tolist()]
        if t % 3 != 2:
            pick[int(torch.randint(top_k, (1,), generator=g))] = 0
        rows.append(pick)
    weights = torch.rand(n, top_k, generator=g) + 0.1
    return torch.tensor(rows), weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("top_k", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_topk_matches_torch_tail(top_k, dtype):
    n, h = 9, 20
    index, weights = routing(n, 5, top_k, empty=3, seed=13)
    _, perm = torch.sort(index.reshape(-1))
    y = rand(n * top_k, h, seed=14, dtype=dtype)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    ref = (y * weights.reshape(-1)[perm].unsqueeze(-1))[inverse].view(n, top_k, -1).sum(dim=1).to(dtype)
    out = tk.combine_topk(y, inverse, weights.reshape(-1), top_k)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out, ref, rtol=1e-5 if dtype == torch.float32 else 0, atol=1e-6 if dtype == torch.float32 else 0
    )
    wide = tk.combine_topk(y, inverse.int(), weights.reshape(-1), top_k, out_dtype=torch.float32)
    exact = (y.float() * weights.reshape(-1)[perm].unsqueeze(-1))[inverse].view(n, top_k, -1).sum(dim=1)
    torch.testing.assert_close(wide, exact, rtol=1e-5, atol=1e-6)


def make_experts(num_experts: int, hidden: int, inter: int, approximate: str, dtype: torch.dtype) -> Experts:
    cfg = SimpleNamespace(
        num_experts=num_experts, hidden_size=hidden, moe_intermediate_size=inter, gelu_approximate=approximate
    )
    experts = Experts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.copy_(rand(num_experts, 2 * inter, hidden, seed=15, scale=hidden**-0.5))
        experts.down_proj.copy_(rand(num_experts, hidden, inter, seed=16, scale=inter**-0.5))
    return experts.to(dtype)


@pytest.mark.parametrize("top_k,approximate", [(2, "tanh"), (3, "none")])
def test_moe_experts_float32_matches_forward(top_k, approximate):
    experts = make_experts(5, 16, 24, approximate, torch.float32)
    index, weights = routing(9, 5, top_k, empty=3, seed=17)
    x = rand(9, 16, seed=18)
    with torch.no_grad():
        ref = experts(x, index, weights)
        out = tk.moe_experts(experts, x, index, weights)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k", [2, 3])
def test_moe_experts_bfloat16(top_k):
    """Against Experts.forward in bf16: within 2 bf16 ulps of the output's scale (they differ only
    in gelu * up's roundings), and no further than it from the float32 forward on the same values."""
    experts = make_experts(5, 16, 24, "tanh", torch.bfloat16)
    index, weights = routing(9, 5, top_k, empty=3, seed=19)
    x = rand(9, 16, seed=20, dtype=torch.bfloat16)
    with torch.no_grad():
        ref16 = experts(x, index, weights)
        out = tk.moe_experts(experts, x, index, weights)
        ref32 = experts.float()(x.float(), index, weights)
    assert out.dtype == torch.bfloat16
    scale = ref32.abs().max().item()
    assert max_err(out, ref16) <= 2 * 2**-8 * scale
    assert (out.float() - ref32).abs().mean() <= (ref16.float() - ref32).abs().mean() * 1.05


def test_moe_experts_no_tokens():
    experts = make_experts(4, 16, 8, "tanh", torch.float32)
    out = tk.moe_experts(experts, torch.zeros(0, 16), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 16)


# ---------------------------------------------------------------------------------- bad calls
x3 = torch.zeros(2, 2, 16)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: tk.norm_rope(torch.zeros(2, 16), None, None, None, EPS), r"\[T, heads, D\]"),
        (lambda: tk.norm_rope(torch.zeros(2, 2, 12), None, None, None, EPS), "power of two"),
        (lambda: tk.norm_rope(x3, torch.ones(8), None, None, EPS), "weight must be"),
        (lambda: tk.norm_rope(x3, None, torch.ones(2, 16), None, EPS), "both cos and sin"),
        (lambda: tk.norm_rope(x3, None, torch.ones(3, 16), torch.ones(3, 16), EPS), "cos / sin must be"),
        (
            lambda: tk.norm_rope(
                x3, None, None, None, EPS, pool=torch.zeros(8, 3, 16), slots=torch.zeros(2, dtype=torch.long)
            ),
            "pool must be",
        ),
        (
            lambda: tk.norm_rope(
                x3, None, None, None, EPS, pool=torch.zeros(8, 2, 16), slots=torch.zeros(3, dtype=torch.long)
            ),
            "slots must be",
        ),
        (lambda: tk.gelu_mul(torch.zeros(3, 7)), "even last dim"),
        (lambda: tk.gelu_mul(torch.zeros(3, 8), "erf"), "approximate must be"),
        (lambda: tk.combine_topk(torch.zeros(6, 4), torch.zeros(4, dtype=torch.long), torch.zeros(4), 2), "6 pairs"),
        (
            lambda: tk.combine_topk(torch.zeros(5, 4), torch.zeros(5, dtype=torch.long), torch.zeros(5), 2),
            "multiple of top_k",
        ),
    ],
    ids=[
        "x-dims",
        "head-dim",
        "weight",
        "cos-only",
        "table-shape",
        "pool-heads",
        "slots",
        "odd",
        "approx",
        "pairs",
        "top_k",
    ],
)
def test_bad_shapes_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()

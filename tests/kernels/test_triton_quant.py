"""The GPU GEMM for every weight format (dgemma/kernels/triton_quant.py), run on CPU by Triton's
interpreter, against the torch code it replaces: x @ dequantize(W).T (quant/formats.py), and the
quantised modules' CPU paths (quant/modules.py) for their GPU ones.

TRITON_INTERPRET must be set before triton is first imported, so conftest.py sets it for the
whole pytest process (and this file again, run on its own). Tiny shapes keep the interpreter fast."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / triton_quant are imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

from dgemma.kernels import triton_quant as tq  # noqa: E402
from dgemma.quant.formats import QTensor, dequantize, quantize  # noqa: E402
from dgemma.quant.modules import quantize_stacked  # noqa: E402

if not tq.INTERPRETED:
    pytest.skip(
        "triton_quant was imported before TRITON_INTERPRET was set: its kernels need a GPU", allow_module_level=True
    )

# scheme, group size, inputs K (not a multiple of the K-tile: a masked tail)
CASES = [
    ("int4", 8, 40),
    ("int4", 32, 96),
    ("int4", 64, 320),
    ("int4", 128, 384),
    ("int8", None, 50),
    ("fp8", None, 50),
    ("nvfp4", None, 48),
]
IDS = [f"{s}{g or ''}" for s, g, _ in CASES]


def weight(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.logspace(-1, 0.5, shape[-2])[:, None]  # channels of many sizes


def acts(*shape: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def close(y: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    """Within rtol of the reference's largest magnitude (float32 sums in another order)."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    err = (y.float() - ref.float()).abs().max().item() if y.numel() else 0.0
    assert err <= rtol * max(ref.float().abs().max().item() if ref.numel() else 0.0, 1e-6), err


def test_available_under_the_interpreter():
    assert tq.HAVE_TRITON and tq.INTERPRETED
    assert tq.available("cpu") and tq.available(torch.device("cpu"))


@pytest.mark.parametrize("scheme,group,k", CASES, ids=IDS)
@pytest.mark.parametrize("m,n", [(1, 20), (37, 33)])  # ragged M and N against the tiles
def test_linear_matches_dequantized_float32(scheme, group, k, m, n):
    q = quantize(weight(n, k), scheme, group)
    x = acts(m, k)
    close(tq.quant_linear(x, q), F.linear(x, dequantize(q, torch.float32)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "scheme,group,k", [("int4", 8, 40), ("int8", None, 50), ("fp8", None, 50), ("nvfp4", None, 48), ("plain", None, 40)]
)
def test_half_precision_activations(dtype, scheme, group, k):
    x = acts(2, 3, k, dtype=dtype)
    if scheme == "plain":
        w = weight(24, k).to(dtype)
        y, ref = tq.quant_linear(x, tq.gemm_weight(w)), F.linear(x.float(), w.float()).to(dtype)
    else:
        q = quantize(weight(24, k), scheme, group, dtype)
        y, ref = tq.quant_linear(x, q), F.linear(x.float(), dequantize(q, torch.float32)).to(dtype)
    assert y.dtype == dtype and y.shape == (2, 3, 24)
    close(y, ref, rtol=1e-2)  # the weight rounded to x's dtype, one rounding of the output


def test_fp8_subnormals_and_signs_decode_exactly():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # all but the two NaNs
    w = codes.view(torch.float8_e4m3fn).reshape(2, -1)  # [2, 127]
    q = QTensor("fp8", tuple(w.shape), {"weight": w, "weight_scale": torch.ones(2, 1)})
    eye = torch.eye(w.shape[1])
    assert torch.equal(tq.quant_linear(eye, q).T, w.float())


def test_nvfp4_codes_decode_exactly():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # every e2m1 code, in both nibbles
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 16)
    scale = torch.tensor([[1.0, 0.5]]).to(torch.float8_e4m3fn)
    q = QTensor(
        "nvfp4", (1, 32), {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": torch.tensor([2.0])}
    )
    assert torch.equal(tq.quant_linear(torch.eye(32), q).T, dequantize(q, torch.float32))


def test_int4_scales_are_padded_to_whole_tiles_with_zeros():
    """gemm_weight's one repack: each row's group scales padded to the scales of whole 256-input
    K-tiles (rows then start on 8- / 16-byte boundaries, read as vectors), the padding zero."""
    q = quantize(weight(8, 704), "int4", 64)  # 11 groups a row -> 12
    w = tq.gemm_weight(q)
    assert (
        w.scales.shape == (8, 12)
        and torch.equal(w.scales[:, :11], q.parts["weight_scale"])
        and not w.scales[:, 11:].any()
    )
    assert (
        w.data.dtype == torch.uint8 and w.data.data_ptr() == q.parts["weight_packed"].data_ptr()
    )  # the codes as stored
    with pytest.raises(ValueError, match="group size"):
        tq.gemm_weight(quantize(weight(8, 96), "int4", 96))


def test_concatenated_weights_are_one_gemm_of_the_parts():
    parts = [tq.gemm_weight(quantize(weight(n, 64, seed=n), "nvfp4", None, torch.bfloat16)) for n in (32, 16, 16)]
    x = acts(9, 64, dtype=torch.bfloat16)
    whole = tq.gemm(x, tq.concat_weights(parts))
    assert torch.equal(whole, torch.cat([tq.gemm(x, p) for p in parts], dim=1))
    with pytest.raises(ValueError, match="one scheme"):
        tq.concat_weights([parts[0], tq.gemm_weight(quantize(weight(16, 64), "fp8"))])


def test_the_dispatcher_refuses_a_device_without_kernels(monkeypatch):
    monkeypatch.setattr(tq, "INTERPRETED", False)
    assert not tq.available("cpu")
    with pytest.raises(RuntimeError, match="no GPU kernel.*dgemma.quant.modules"):
        tq.quant_linear(acts(2, 32), quantize(weight(16, 32), "int8"))


def test_bad_inputs_are_refused():
    q = quantize(weight(16, 32), "int8")
    with pytest.raises(ValueError, match=r"x \[M, 32\]"):
        tq.quant_linear(acts(2, 48), q)
    with pytest.raises(ValueError, match="bfloat16 / float16 / float32"):
        tq.quant_linear(acts(2, 32).double(), q)
    with pytest.raises(ValueError, match="2D"):
        tq.quant_linear(acts(2, 32), quantize_stacked(lambda i: weight(16, 32), 2, "int8", None))
    with pytest.raises(ValueError, match="ends"):
        tq.gemm(acts(2, 32), tq.gemm_weight(quantize_stacked(lambda i: weight(16, 32), 2, "int8", None)))


@pytest.mark.parametrize("scheme", ["int4", "nvfp4", "int8", "fp8"])
@torch.no_grad()
def test_quantised_modules_gpu_paths_equal_their_cpu_paths(scheme, monkeypatch):
    """QuantExperts' GPU path (the MoE kernels) and QuantLinear's (the GEMM) give what their CPU
    tile-by-tile paths give, on routed tokens with an idle expert."""
    from dgemma.quant import modules

    e, hidden, inter = 4, 32, 16
    gate_up = quantize_stacked(lambda i: weight(2 * inter, hidden, seed=i), e, scheme, 16)
    down = quantize_stacked(lambda i: weight(hidden, inter, seed=10 + i), e, scheme, 16)
    experts = modules.QuantExperts(gate_up, down, "tanh")
    x = acts(9, hidden)
    index = torch.tensor([[0, 1], [1, 3], [3, 0]] * 3)  # expert 2 gets no token
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(4))
    want = experts(x, index, weights)  # CPU: tile by tile
    close(experts._grouped(x, index, weights, gate_up, down), want)
    linear = modules.QuantLinear(quantize(weight(20, hidden), scheme, 16))
    want = linear(x)
    monkeypatch.setattr(modules, "_on_gpu", lambda x: True)  # as on CUDA with triton
    close(linear(x), want)

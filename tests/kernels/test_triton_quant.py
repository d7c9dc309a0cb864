"""The Triton kernels for quantised weights (dgemma/kernels/triton_quant.py), run on CPU by
Triton's interpreter, against F.linear on the dequantised weight in float32; and the FP8
tensor-core paths where this CPU build of torch can run them (_scaled_mm) or check their
arguments (_scaled_grouped_mm, on the meta device).

TRITON_INTERPRET must be set before triton is first imported (compressed-tensors imports it too),
so conftest.py sets it for the whole pytest process (and this file again, run on its own). Small
blocks (16) and tiny shapes keep the interpreter fast."""

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
    pytest.skip("triton_quant was imported before TRITON_INTERPRET was set: its kernels need a GPU", allow_module_level=True)

SMALL = (16, 16, 16)
# scheme, group size, inputs K (not a multiple of the K block where the format allows it)
CASES = [("int4", 8, 40), ("int4", 32, 96), ("int8", None, 50), ("fp8", None, 50), ("nvfp4", None, 48)]
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
@pytest.mark.parametrize("m,n", [(1, 20), (5, 33), (37, 16)])  # ragged M and N against 16
def test_linear_matches_dequantized_float32(scheme, group, k, m, n):
    q = quantize(weight(n, k), scheme, group)
    x = acts(m, k)
    close(tq.triton_quant_linear(x, q, blocks=SMALL), F.linear(x, dequantize(q, torch.float32)))


@pytest.mark.parametrize("scheme,group,k", [("int4", 32, 96), ("nvfp4", None, 48)])
def test_linear_with_k_block_deeper_than_a_group(scheme, group, k):
    q = quantize(weight(24, k), scheme, group)
    x = acts(3, k)
    close(tq.triton_quant_linear(x, q, blocks=(16, 32, 64)), F.linear(x, dequantize(q, torch.float32)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme,group,k", [("int4", 8, 40), ("int8", None, 50), ("fp8", None, 50), ("nvfp4", None, 48)])
def test_half_precision_activations(dtype, scheme, group, k):
    q = quantize(weight(20, k), scheme, group, scale_dtype=dtype)  # int4 scales in the model dtype
    x = acts(2, 3, k, dtype=dtype)  # leading dims kept
    y = tq.triton_quant_linear(x, q, blocks=SMALL)
    ref = F.linear(x.float(), dequantize(q, torch.float32)).to(dtype)
    close(y, ref, rtol=1e-2)  # the weight rounded to x's dtype, one rounding of the output


def test_fp8_subnormals_and_signs_decode_exactly():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # all but the two NaNs
    w = codes.view(torch.float8_e4m3fn).reshape(2, -1)  # [2, 127]
    q = QTensor("fp8", tuple(w.shape), {"weight": w, "weight_scale": torch.ones(2, 1)})
    eye = torch.eye(w.shape[1])
    assert torch.equal(tq.triton_quant_linear(eye, q, blocks=SMALL).T, w.float())


def test_nvfp4_codes_decode_exactly():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # every e2m1 code, in both nibbles
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 16)
    scale = torch.tensor([[1.0, 0.5]]).to(torch.float8_e4m3fn)
    q = QTensor("nvfp4", (1, 32), {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": torch.tensor([2.0])})
    y = tq.triton_quant_linear(torch.eye(32), q, blocks=SMALL).T
    assert torch.equal(y, dequantize(q, torch.float32))


def grouped_reference(x: torch.Tensor, q: QTensor, counts: list[int]) -> torch.Tensor:
    out, start = [], 0
    for e, c in enumerate(counts):
        out.append(F.linear(x[start : start + c], dequantize(q.select(e), torch.float32)))
        start += c
    return torch.cat(out)


@pytest.mark.slow
@pytest.mark.parametrize("scheme,group,k", CASES, ids=IDS)
@pytest.mark.parametrize("counts", [[3, 0, 17, 1], [0, 0, 5, 0]])  # experts without rows, one past a tile
def test_grouped_matches_each_expert(scheme, group, k, counts):
    e, n = len(counts), 33
    q = quantize_stacked(lambda i: weight(n, k, seed=i), e, scheme, group)
    x = acts(sum(counts), k)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    close(tq.triton_quant_grouped_linear(x, q, offsets, blocks=SMALL), grouped_reference(x, q, counts))


def test_grouped_half_precision_and_no_rows():
    counts = [2, 0, 6]
    q = quantize_stacked(lambda i: weight(20, 64, seed=i), 3, "int4", 32, torch.bfloat16)
    x = acts(8, 64, dtype=torch.bfloat16)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    ref = grouped_reference(x.float(), q, counts).to(torch.bfloat16)
    close(tq.triton_quant_grouped_linear(x, q, offsets, blocks=SMALL), ref, rtol=1e-2)
    empty = tq.triton_quant_grouped_linear(x[:0], q, torch.zeros(3, dtype=torch.int32))
    assert empty.shape == (0, 20) and empty.dtype == torch.bfloat16


@pytest.mark.parametrize("counts", [[3, 0, 17, 1], [0, 0, 0, 40], [1, 1, 1, 1]])
def test_tile_map_covers_each_row_once(counts):
    block = 16
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    expert, first, slots = tq._tile_map(ends, sum(counts), block)
    assert slots == expert.numel() == first.numel()
    covered = []
    for e, r in zip(expert.tolist(), first.tolist()):
        if e >= 0:
            covered += [(e, row) for row in range(r, min(r + block, ends[e].item()))]
    want = [(e, row) for e in range(len(counts)) for row in range(ends[e].item() - counts[e], ends[e].item())]
    assert sorted(covered) == want


def test_dispatchers_use_the_kernels_here():
    q = quantize(weight(20, 64), "fp8")  # fp8 on a CPU: no _scaled_mm, the Triton kernel
    x = acts(5, 64)
    close(tq.quant_linear(x, q), F.linear(x, dequantize(q, torch.float32)))
    counts = [4, 0, 1]
    qs = quantize_stacked(lambda i: weight(20, 64, seed=i), 3, "int4", 32)
    x = acts(5, 64)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    close(tq.quant_grouped_linear(x, qs, offsets), grouped_reference(x, qs, counts))


def test_dispatchers_refuse_a_device_without_kernels(monkeypatch):
    monkeypatch.setattr(tq, "INTERPRETED", False)
    assert not tq.available("cpu")
    q = quantize(weight(16, 32), "int8")
    with pytest.raises(RuntimeError, match="no GPU kernel.*dgemma.quant.modules"):
        tq.quant_linear(acts(2, 32), q)
    with pytest.raises(RuntimeError, match="not CUDA"):
        tq.quant_grouped_linear(acts(2, 32), quantize_stacked(lambda i: weight(16, 32), 2, "int8", None), torch.tensor([1, 2]))


def test_bad_inputs_are_refused():
    q = quantize(weight(16, 32), "int8")
    with pytest.raises(ValueError, match="inputs"):
        tq.quant_linear(acts(2, 48), q)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        tq.quant_linear(acts(2, 32).double(), q)
    with pytest.raises(ValueError, match="2D"):
        tq.quant_linear(acts(2, 32), quantize_stacked(lambda i: weight(16, 32), 2, "int8", None))


# ------------------------------------------------------------------------------ FP8 tensor cores
def test_activation_quantization_per_token():
    x = acts(4, 64) * torch.tensor([[1e-3], [1.0], [30.0], [0.0]])  # rows of many sizes, and zeros
    x_fp8, scale = tq.quantize_activations_fp8(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and scale.shape == (4, 1) and scale.dtype == torch.float32
    back = x_fp8.float() * scale
    assert torch.isfinite(back).all() and torch.equal(back[3], torch.zeros(64))
    assert torch.equal(x_fp8.float().abs().amax(dim=-1)[:3], torch.full((3,), 448.0))  # absmax -> 448
    assert ((back - x).abs() <= x.abs() * 2**-4 + scale * 2**-9).all()  # half a step of e4m3


def test_fp8_scaled_mm_linear_on_cpu():
    """torch 2.13's CPU build runs torch._scaled_mm with row-wise scales: the function's maths is
    checked here against the dequantised weight times the dequantised activations."""
    q = quantize(weight(32, 64), "fp8")
    x = acts(2, 5, 64)
    x_fp8, scale = tq.quantize_activations_fp8(x.reshape(-1, 64))
    ref = F.linear((x_fp8.float() * scale).reshape(2, 5, 64), dequantize(q, torch.float32))
    close(tq.fp8_scaled_mm_linear(x, q, out_dtype=torch.float32), ref, rtol=1e-5)
    close(tq.fp8_scaled_mm_linear(x, q), ref, rtol=1e-2)  # bf16 out (the CUDA row-wise kernel's), cast back
    close(tq.fp8_scaled_mm_linear(x, q), F.linear(x, dequantize(q, torch.float32)), rtol=0.1)  # activations' fp8 error


def test_fp8_scaled_grouped_mm_arguments_on_meta():
    """torch._scaled_grouped_mm has no CPU kernel; its meta kernel checks the layouts, dtypes
    and shapes the CUDA one requires."""
    qs = quantize_stacked(lambda i: weight(32, 64, seed=i), 3, "fp8", None)
    meta = QTensor("fp8", qs.shape, {k: v.to("meta") for k, v in qs.parts.items()})
    x = torch.empty(9, 64, dtype=torch.float32, device="meta")
    y = tq.fp8_scaled_grouped_mm(x, meta, torch.empty(3, dtype=torch.int32, device="meta"))
    assert y.shape == (9, 32) and y.dtype == torch.float32 and y.device.type == "meta"


@pytest.mark.parametrize("scheme", ["int4", "nvfp4", "int8"])
@torch.no_grad()
def test_quantised_experts_gpu_path_equals_their_cpu_path(scheme, monkeypatch):
    """QuantExperts' grouped-kernel path (what a GPU runs) and QuantLinear's dispatch to the
    kernels give what their CPU tile-by-tile path gives, on routed tokens with an idle expert."""
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

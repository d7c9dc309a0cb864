"""The GPU GEMM for every weight format (dgemma/kernels/triton_quant.py, its decoders in
kernels/triton_decode.py), run on CPU by Triton's interpreter, against the torch code it replaces: x @ dequantize(W).T (quant/formats.py), and the
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

from dgemma.kernels import triton_decode as td  # noqa: E402
from dgemma.kernels import triton_quant as tq  # noqa: E402
from dgemma.quant.formats import (  # noqa: E402
    QTensor,
    dequantize,
    e2m1_values,
    pack_e2m1,
    pack_int4,
    quantize,
    unpack_e2m1,
    unpack_int4,
)
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


# ------------------------------------------------------------------- the decoders, tile by tile
# `weight_tile` (kernels/triton_decode.py: a K-tile of a weight dequantised in registers, before any per-channel scale) run
# by the interpreter through a kernel of this file, against torch's decoding of the same parts: bit
# for bit. The hardware fp8 conversion and the 16-bit 4-bit decode are the paths an sm89+ GPU
# takes (their sm90 and sm80 compiles: test_triton_compile.py); the interpreter runs them where it
# can (it misreads bf16 bitcasts: there the same bit operations are checked in torch).
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

OUT_TYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _tile_kernel(
    w_ptr, s_ptr, y_ptr, N, K, KB, stride_wn, stride_sn,
    SCHEME: tl.constexpr, GROUP: tl.constexpr, SCALE_BYTES: tl.constexpr, SCALE_FP16: tl.constexpr,
    BLOCK_K: tl.constexpr, OUT: tl.constexpr, FP8_CVT: tl.constexpr, FAST4: tl.constexpr, W_ALIGN: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    ns = tl.arange(0, BLOCK_N)
    n_ok = ns < N
    for k0 in range(0, K, BLOCK_K):
        w = td.weight_tile(
            w_ptr, s_ptr, ns, n_ok, k0, K, KB, stride_wn, stride_sn, SCHEME, GROUP, SCALE_BYTES, SCALE_FP16, BLOCK_K,
            OUT, FP8_CVT, FAST4, W_ALIGN,
        )  # fmt: skip
        ks = k0 + tl.arange(0, BLOCK_K)
        tl.store(y_ptr + ns[:, None] * K + ks[None, :], w, mask=n_ok[:, None] & (ks < K)[None, :])


def decoded_tile(w: tq.GemmWeight, dtype: torch.dtype, fp8_cvt: bool = False, fast4: bool = False) -> torch.Tensor:
    """The weight [N, K] as `weight_tile` decodes it (no per-channel or global scale) in `dtype`."""
    n, k = w.shape
    code = tq._code(w)
    four_bit = code in (0, 3)
    data = w.data.view(torch.int32) if four_bit else w.data
    scales = w.scales.view(torch.int64) if w.scales is not None else data
    block_k = tq.four_bit_k(w.group, w.scales.element_size()) if four_bit else 64
    y = torch.empty(n, k, dtype=dtype)
    _tile_kernel[(1,)](
        data, scales, y, n, k, k // 8, data.stride(0), scales.stride(0) if w.scales is not None else 0,
        SCHEME=code, GROUP=w.group, SCALE_BYTES=w.scales.element_size() if w.scales is not None else 1,
        SCALE_FP16=w.scales is not None and w.scales.dtype == torch.float16, BLOCK_K=block_k, OUT=OUT_TYPES[dtype],
        FP8_CVT=fp8_cvt, FAST4=fast4, W_ALIGN=4 if four_bit and k // 8 % 4 == 0 else 1,
        BLOCK_N=triton.next_power_of_2(n),
    )  # fmt: skip
    return y


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit (-0.0 is not +0.0), NaN where the other is NaN (of any sign and payload)."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = a.isnan()
    return a.dtype == b.dtype and torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(ints), b[~nan].view(ints))


def truncated(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> bf16 by dropping the low 16 bits: the interpreter's cast (a GPU's rounds)."""
    return (
        x.to(dtype) if dtype != torch.bfloat16 else (x.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    )


FP8_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64)  # every byte, NaNs included


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_cvt", [False, True], ids=["bits", "hardware"])
def test_fp8_tile_decodes_every_byte_bit_exactly(dtype, fp8_cvt):
    """fp8 weights: the bit decode (sm80, the interpreter) and the hardware conversion (a bitcast to
    float8e4nv, sm89+) both give torch's float8_e4m3fn values, subnormals, signs and NaN. The
    interpreter's own conversion turns 0x7F / 0xFF into +-480 (a GPU gives NaN): those two bytes
    are left out of the hardware path's check here."""
    q = QTensor("fp8", (4, 64), {"weight": FP8_CODES.view(torch.float8_e4m3fn), "weight_scale": torch.ones(4, 1)})
    got = decoded_tile(tq.gemm_weight(q), dtype, fp8_cvt=fp8_cvt)
    want = FP8_CODES.view(torch.float8_e4m3fn).to(dtype)
    keep = (FP8_CODES & 0x7F) != 0x7F if fp8_cvt else torch.ones_like(FP8_CODES, dtype=torch.bool)
    assert same_bits(got[keep], want[keep])
    if not fp8_cvt:
        assert got[~((FP8_CODES & 0x7F) != 0x7F)].isnan().all()


def four_bit_weight(scheme: str, dtype: torch.dtype, n: int = 16, k: int = 512) -> QTensor:
    """Every code in every position and scales of many sizes (nvfp4's e4m3 scales: subnormals too)."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (n, k), generator=g)
    codes[0, :16] = torch.arange(16)
    if scheme == "int4":
        scale = (torch.randn(n, k // 64, generator=g) * 10.0 ** torch.randint(-3, 3, (n, k // 64), generator=g)).to(
            dtype
        )
        return QTensor(
            "int4", (n, k), {"weight_packed": pack_int4((codes - 8).to(torch.int8)), "weight_scale": scale}, 64
        )
    scale = torch.randint(1, 0x7F, (n, k // 16), generator=g, dtype=torch.int32).to(torch.uint8)  # no NaN scale
    scale[0, :4] = torch.tensor([1, 2, 7, 8], dtype=torch.uint8)  # subnormal e4m3 scales
    parts = {
        "weight_packed": pack_e2m1(codes.to(torch.uint8)),
        "weight_scale": scale.view(torch.float8_e4m3fn),
        "weight_global_scale": torch.tensor([1.0]),
    }
    return QTensor("nvfp4", (n, k), parts)


def four_bit_reference(q: QTensor, dtype: torch.dtype, cast=None) -> torch.Tensor:
    """value x scale in float32 (exact), rounded once to dtype (or `cast`): the float32 decode's."""
    if q.scheme == "int4":
        values, scale = unpack_int4(q.parts["weight_packed"]).float(), q.parts["weight_scale"].float()
    else:
        values, scale = e2m1_values(unpack_e2m1(q.parts["weight_packed"])), q.parts["weight_scale"].float()
    product = (values.unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]).flatten(-2)
    return cast(product, dtype) if cast else product.to(dtype)


@pytest.mark.parametrize("scheme", ["int4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_four_bit_tiles_decode_bit_exactly(scheme, dtype):
    """int4 and nvfp4 K-tiles (read as int32 words): the float32 decode, and the 16-bit one where the
    interpreter runs it (float16; bf16's bitcasts it misreads), give value x scale rounded once
    (the float32 decode's product cast to bf16 as the interpreter casts: truncated)."""
    q = four_bit_weight(scheme, dtype)
    w = tq.gemm_weight(q)
    want = four_bit_reference(q, dtype)
    assert same_bits(decoded_tile(w, dtype, fp8_cvt=False, fast4=False), four_bit_reference(q, dtype, truncated))
    if dtype == torch.float16:
        assert same_bits(decoded_tile(w, dtype, fast4=True), want)
        assert same_bits(decoded_tile(w, dtype, fp8_cvt=True, fast4=True), want)
    assert tq._fast4(w, dtype) == (dtype == torch.float16)  # what `gemm` picks under the interpreter


def four_bit_fast_in_torch(words: torch.Tensor, scheme: str, dtype: torch.dtype) -> torch.Tensor:
    """triton_decode's `_four_bit_fast`'s operations, one for one, on int32 words [R, C] -> [R, 8C] in dtype."""
    bf16 = dtype == torch.bfloat16
    pairs = [
        (words & 0xF) | ((words << 12) & 0xF0000),
        ((words >> 8) & 0xF) | ((words << 4) & 0xF0000),
        ((words >> 16) & 0xF) | ((words >> 4) & 0xF0000),
        ((words >> 24) & 0xF) | ((words >> 12) & 0xF0000),
    ]
    halves = []
    for p in pairs:
        if scheme == "int4":
            v = p | (0x43004300 if bf16 else 0x64006400)
        elif bf16:
            v = ((p << 6) & 0x01C001C0) | ((p << 12) & -0x7FFF8000)
        else:
            v = ((p << 9) & 0x0E000E00) | ((p << 12) & -0x7FFF8000)
        halves.append((v.to(torch.int16).view(dtype), (v >> 16).to(torch.int16).view(dtype)))
    q = torch.stack([x for lo_hi in halves for x in lo_hi], dim=-1)  # byte j's low, high code: values 2j, 2j + 1
    q = q.flatten(-2)
    if scheme == "int4":
        return q - (136.0 if bf16 else 1032.0)
    return q * (2.0**126 if bf16 else 2.0**14)


@pytest.mark.parametrize("scheme", ["int4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_16_bit_four_bit_decode_in_torch(scheme, dtype):
    """The bf16 magic-number (int4: code | 0x4300 is 128 + code) and bit-placement (nvfp4: the code's
    magnitude as the lowest exponent bits, 0.5 a subnormal) decodes, done in torch with the kernel's
    constants: every code exact, and times every scale the product rounded once. The same for
    float16, which the interpreter runs too: its tile is the torch one (so the torch copy is the
    kernel's bit layout)."""
    q = four_bit_weight(scheme, dtype)
    words = q.parts["weight_packed"].view(torch.int32)
    values = four_bit_fast_in_torch(words, scheme, dtype)
    if scheme == "int4":
        exact = unpack_int4(q.parts["weight_packed"]).to(dtype)
        scale = q.parts["weight_scale"]
    else:
        exact = e2m1_values(unpack_e2m1(q.parts["weight_packed"])).to(dtype)
        scale = q.parts["weight_scale"].to(dtype)  # e4m3 -> bf16 / fp16: exact
    assert same_bits(values, exact)
    tile = (values.unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]).flatten(-2)  # one 16-bit multiply
    assert same_bits(tile, four_bit_reference(q, dtype))
    if dtype == torch.float16:
        assert same_bits(decoded_tile(tq.gemm_weight(q), dtype, fast4=True), tile)

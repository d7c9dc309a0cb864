"""Native dequantisation (kernels/csrc/dequant.cpp, AVX2; into bf16 also dequant_avx512.cpp): every
scheme into float32 and bfloat16 equals `formats.dequantize` exactly, on odd sizes, row tiles and
experts of a stacked weight, on each kernel set this CPU runs; misuse is a RuntimeError that says
what is wrong; without the kernel the wrappers give the same values."""

import dataclasses
import logging

import pytest
import torch

from dgemma.kernels import avx2
from dgemma.kernels import native as avx512
from dgemma.quant import formats
from dgemma.quant.modules import quantize_stacked

needs_kernel = pytest.mark.skipif(
    avx2.extension() is None,
    reason="native dequantisation unavailable (CPU lacks AVX2/FMA/F16C, no C++ compiler, the build failed, or DGEMMA_NATIVE=0)",
)
pytestmark = [
    pytest.mark.native,
    pytest.mark.usefixtures("two_threads"),
]  # two threads: the kernels split their work across threads
OUT_DTYPES = [torch.float32, torch.bfloat16]
AVX512_REASON = (
    "the AVX-512 bf16 kernels need AVX-512 BF16 (native.py's extension), which this CPU lacks or did not build"
)


@pytest.fixture(params=["avx2", "avx512"])
def kernels(request, monkeypatch):
    """Each kernel set a bf16 output can take: dequant.cpp's AVX2 kernels (also on an AVX-512 CPU,
    where they are the float32 path), and dequant_avx512.cpp's where this CPU has them."""
    if request.param == "avx2":
        monkeypatch.setattr(avx2, "bf16_extension", avx2.extension)
    elif avx512.extension() is None:
        pytest.skip(AVX512_REASON)
    return request.param


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different sizes, negative values, and zeros (a zero row, zero runs)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]
    w[:, :5] = 0.0
    if n > 2:
        w[1] = 0.0
    return w


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN where NaN (any payload), the sign of zero included."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    ints = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a.masked_fill(nan, 0).view(ints), b.masked_fill(nan, 0).view(ints))


def native(q: formats.QTensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full(q.shape, float("nan"), dtype=dtype)  # every element must be written
    assert avx2.dequantize_into(q, out) is out
    return out


# scheme, group, K, int4 scale dtype: K not a multiple of 16 / 32 where the format allows
CASES = [
    ("fp8", None, 75, None),
    ("fp8", None, 1024, None),
    ("int8", None, 75, None),
    ("int8", None, 1024, None),
    *[("int4", 8, 72, s) for s in (torch.bfloat16, torch.float16, torch.float32)],
    *[("int4", 32, 96, s) for s in (torch.bfloat16, torch.float16, torch.float32)],
    *[("int4", 64, 192, s) for s in (torch.bfloat16, torch.float16, torch.float32)],
    ("int4", 16, 48, torch.bfloat16),  # groups of 16 and of 40 (32 + 8): every step of a group's loop
    ("int4", 40, 120, torch.bfloat16),
    ("nvfp4", None, 80, None),  # 5 groups of 16: an odd last group
    ("nvfp4", None, 256, None),
]


def case_id(case):
    scheme, group, k, sd = case
    return f"{scheme}-g{group}-K{k}" + (f"-{str(sd).removeprefix('torch.')}" if sd else "")


@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("n", [1, 37])
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_native_equals_reference(case, n, dtype, kernels):
    scheme, group, k, scale_dtype = case
    q = formats.quantize(weight(n, k), scheme, group, scale_dtype or torch.float32)
    assert torch.equal(native(q, dtype), formats.dequantize(q, dtype))


@needs_kernel
@pytest.mark.parametrize("scheme", ["fp8", "int8"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_per_channel_scales_in_the_model_dtype(scheme, scale_dtype, dtype, kernels):
    q = formats.quantize(weight(37, 75), scheme)
    q.parts["weight_scale"] = q.parts["weight_scale"].to(scale_dtype)
    assert torch.equal(native(q, dtype), formats.dequantize(q, dtype))


@needs_kernel
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_fp8_every_code(dtype, kernels):
    """All 256 e4m3fn codes (subnormals, +-0, the two NaNs) at every position of a vector and the
    scalar tail, under scales that are negative, tiny (subnormal products) and huge."""
    codes = (torch.arange(6 * 263) % 256).to(torch.uint8).reshape(6, 263)
    scale = torch.tensor([[1.0], [-0.37], [3e-38], [1e30], [2.0**-20], [0.5]])
    q = formats.QTensor("fp8", (6, 263), {"weight": codes.view(torch.float8_e4m3fn), "weight_scale": scale})
    ref = formats.dequantize(q, dtype)
    assert torch.isnan(ref).any() and (ref == 0).any()
    assert same_bits(native(q, dtype), ref)


@needs_kernel
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_every_code_of_the_packed_formats(dtype, kernels):
    """int4 nibbles 0..15 and nvfp4 codes 0..15 (-0 included) in every position of their words."""
    g = torch.Generator().manual_seed(3)
    nibbles = torch.randint(0, 16, (9, 128), generator=g)
    nibbles[0] = torch.arange(128) % 16
    q4 = formats.QTensor(
        "int4",
        (9, 128),
        {
            "weight_packed": formats.pack_int4((nibbles - 8).to(torch.int8)),
            "weight_scale": torch.rand(9, 4, generator=g).to(torch.bfloat16) + 0.01,
            "weight_shape": torch.tensor([9, 128], dtype=torch.int32),
        },
        32,
    )
    assert same_bits(native(q4, dtype), formats.dequantize(q4, dtype))
    scale = (torch.rand(9, 8, generator=g) * 400).to(torch.float8_e4m3fn)
    scale[0, 0] = 0.0  # a zero scale
    scale[1, 1] = torch.tensor(2.0**-9).to(torch.float8_e4m3fn)  # the smallest subnormal
    qf = formats.QTensor(
        "nvfp4",
        (9, 128),
        {
            "weight_packed": formats.pack_e2m1(nibbles.to(torch.uint8)),
            "weight_scale": scale,
            "weight_global_scale": torch.tensor([37.3]),
        },
        16,
    )
    assert same_bits(native(qf, dtype), formats.dequantize(qf, dtype))


@needs_kernel
@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("group", [8, 32])  # the arithmetic path and (into bf16) the table one
def test_non_finite_and_negative_scales(dtype, group, kernels):
    """inf, NaN, negative, subnormal and huge scales give what the reference gives (zero signs and
    NaN places included), on every path the kernels take."""
    special = [float("inf"), float("nan"), -0.75, 1e-45, 3e38, -float("inf"), 0.0, -0.0]
    q = formats.quantize(weight(8, 128), "int4", group, torch.float32)
    q.parts["weight_scale"].view(-1)[: len(special)] = torch.tensor(special)
    q.parts["weight_scale"][3] = torch.tensor(special).repeat(2)[: q.parts["weight_scale"].shape[1]]
    assert same_bits(native(q, dtype), formats.dequantize(q, dtype))
    for scheme in ("int8", "fp8"):
        q = formats.quantize(weight(8, 75), scheme)
        q.parts["weight_scale"] = torch.tensor(special)[:, None]
        assert same_bits(native(q, dtype), formats.dequantize(q, dtype))
    q = formats.quantize(weight(8, 64), "nvfp4")
    for global_scale in (0.0, float("inf"), -3.0, 3e37):  # steps inf / NaN, 0, negative, subnormal products
        q.parts["weight_global_scale"] = torch.tensor([global_scale])
        assert same_bits(native(q, dtype), formats.dequantize(q, dtype))


@needs_kernel
@pytest.mark.parametrize("scheme", formats.SCHEMES)
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_row_tiles_and_experts_of_a_stacked_weight(scheme, dtype, kernels):
    experts = [weight(40, 128, seed=i) for i in range(3)]
    q = quantize_stacked(lambda i: experts[i], 3, scheme, 32, torch.bfloat16)
    for e in range(3):
        qe = q.select(e)
        assert torch.equal(native(qe, dtype), formats.dequantize(qe, dtype))
        for a, b in [(0, 16), (7, 40), (39, 40), (5, 5)]:
            tile = qe.rows(a, b)
            assert torch.equal(native(tile, dtype), formats.dequantize(tile, dtype))
    assert torch.equal(native(q, dtype), formats.dequantize(q, dtype))  # [E, N, K]: expert by expert


@needs_kernel
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_into_a_strided_output(dtype, kernels):
    q = formats.quantize(weight(24, 64), "int4", 32)
    big = torch.zeros(24, 96, dtype=dtype)
    avx2.dequantize_into(q, big[:, 16:80])
    assert torch.equal(big[:, 16:80], formats.dequantize(q, dtype))
    assert not big[:, :16].any() and not big[:, 80:].any()


@needs_kernel
@pytest.mark.parametrize("k", [1, 15, 16, 1000])
def test_widen_bf16_is_exact(k):
    w = weight(37, k).bfloat16()
    w[0, 0] = float("inf")
    out = torch.empty(37, k)
    assert avx2.widen_into(w, out) is out
    assert torch.equal(out, w.float())
    same = torch.empty(37, k, dtype=torch.bfloat16)
    assert torch.equal(avx2.widen_into(w, same), w)
    tile = torch.empty(3, 5, k)  # any leading shape
    assert torch.equal(avx2.widen_into(w[:15].reshape(3, 5, k), tile), w[:15].reshape(3, 5, k).float())


@needs_kernel
def test_large_tile_runs_in_parallel_chunks(kernels):
    """Enough rows for the parallel split (chunks of >= 32K outputs), with a tail row."""
    q = formats.quantize(weight(301, 512), "nvfp4")
    assert torch.equal(native(q, torch.float32), formats.dequantize(q, torch.float32))
    q = formats.quantize(weight(301, 512), "int4", 64, torch.bfloat16)
    assert torch.equal(native(q, torch.bfloat16), formats.dequantize(q, torch.bfloat16))


def test_bf16_outputs_take_the_avx512_kernels_where_the_cpu_has_them():
    expected = avx512.extension() if avx512.extension() is not None else avx2.extension()
    assert avx2.bf16_extension() is expected


@pytest.mark.skipif(avx512.extension() is None, reason=AVX512_REASON)
def test_avx512_kernels_refuse_what_the_avx2_ones_do_and_a_float32_out():
    ext, out = avx512.extension(), torch.empty(4, 64, dtype=torch.bfloat16)
    s = torch.ones(4, 1)
    with pytest.raises(RuntimeError, match="out must be bfloat16"):
        ext.dequant_int8(torch.zeros(4, 64, dtype=torch.int8), s, torch.empty(4, 64))
    with pytest.raises(RuntimeError, match="weight must be int8"):
        ext.dequant_int8(torch.zeros(4, 64), s, out)
    with pytest.raises(RuntimeError, match="one per row"):
        ext.dequant_fp8(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(3, 1), out)
    with pytest.raises(RuntimeError, match="not a multiple of group_size"):
        ext.dequant_int4(torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, 2), 48, out)
    with pytest.raises(RuntimeError, match=r"scale must be \[4, 4\]"):
        ext.dequant_nvfp4(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), 1.0, out)


@needs_kernel
def test_bad_arguments_raise_with_a_message():
    ext = avx2.extension()
    out = torch.empty(4, 64)
    w8 = torch.zeros(4, 64, dtype=torch.int8)
    s = torch.ones(4, 1)
    with pytest.raises(RuntimeError, match="weight must be int8"):
        ext.dequant_int8(w8.float(), s, out)
    with pytest.raises(RuntimeError, match="differ in shape"):
        ext.dequant_int8(torch.zeros(4, 32, dtype=torch.int8), s, out)
    with pytest.raises(RuntimeError, match="one per row"):
        ext.dequant_int8(w8, torch.ones(3, 1), out)
    with pytest.raises(RuntimeError, match="scale must be float32, bfloat16 or float16"):
        ext.dequant_fp8(w8.view(torch.uint8), s.double(), out)
    with pytest.raises(RuntimeError, match="out must be float32 or bfloat16"):
        ext.dequant_int8(w8, s, out.half())
    with pytest.raises(RuntimeError, match="out must be contiguous"):
        ext.dequant_int8(w8, s, torch.empty(64, 4).t())
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        ext.dequant_int8(torch.zeros(64, 4, dtype=torch.int8).t(), s, out)
    packed = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="packed must be int32"):
        ext.dequant_int4(packed.to(torch.int64), torch.ones(4, 2), 32, out)
    with pytest.raises(RuntimeError, match=r"packed must be \[4, 8\]"):
        ext.dequant_int4(torch.zeros(4, 7, dtype=torch.int32), torch.ones(4, 2), 32, out)
    with pytest.raises(RuntimeError, match=r"scale must be \[4, 2\]"):
        ext.dequant_int4(packed, torch.ones(4, 4), 32, out)
    with pytest.raises(RuntimeError, match="positive multiple of 8"):
        ext.dequant_int4(packed, torch.ones(4, 2), 12, out)
    with pytest.raises(RuntimeError, match="not a multiple of group_size"):
        ext.dequant_int4(packed, torch.ones(4, 2), 48, out)
    with pytest.raises(RuntimeError, match="packed must be uint8"):
        ext.dequant_nvfp4(torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 4, dtype=torch.uint8), 1.0, out)
    with pytest.raises(RuntimeError, match=r"scale must be \[4, 4\]"):
        ext.dequant_nvfp4(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), 1.0, out)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.dequant_nvfp4(
            torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(4, 0, dtype=torch.uint8), 1.0, torch.empty(4, 8)
        )
    with pytest.raises(RuntimeError, match="src must be bfloat16"):
        ext.widen_bf16(out.clone(), out)
    with pytest.raises(RuntimeError, match="differ in shape"):
        ext.widen_bf16(torch.zeros(4, 63, dtype=torch.bfloat16), out)
    with pytest.raises(RuntimeError, match="out must be 2D"):
        ext.widen_bf16(torch.zeros(256, dtype=torch.bfloat16), torch.empty(256))
    with pytest.raises(RuntimeError, match="out has shape"):  # the wrapper checks the shape on either path
        avx2.dequantize_into(formats.quantize(weight(4, 64), "int8"), torch.empty(4, 32))


@pytest.mark.parametrize("scheme", formats.SCHEMES)
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_fallback_without_the_kernel(monkeypatch, scheme, dtype):
    monkeypatch.setattr(avx2, "extension", lambda wait=None: None)
    q = formats.quantize(weight(37, 64), scheme, 32)
    out = torch.empty(37, 64, dtype=dtype)
    assert avx2.dequantize_into(q.rows(3, 34), out[3:34]) is not None
    assert torch.equal(out[3:34], formats.dequantize(q, dtype)[3:34])
    w = weight(5, 33).bfloat16()
    assert torch.equal(avx2.widen_into(w, torch.empty(5, 33)), w.float())


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_what_the_kernel_does_not_take_goes_to_torch(dtype):
    """A float16 output or float64 scales: the wrapper takes torch's path (kernel or not)."""
    q = formats.quantize(weight(37, 64), "int8")
    half = torch.empty(37, 64, dtype=torch.float16)
    assert torch.equal(avx2.dequantize_into(q, half), formats.dequantize(q, torch.float16))
    q.parts["weight_scale"] = q.parts["weight_scale"].double()
    assert torch.equal(avx2.dequantize_into(q, torch.empty(37, 64, dtype=dtype)), formats.dequantize(q, dtype))


def test_extension_is_off_without_avx2_or_when_switched_off(monkeypatch, caplog):
    monkeypatch.setattr(avx512, "cpu_flags", lambda: {"avx", "sse4_2", "f16c"})  # native.py: where avx2.py asks
    with caplog.at_level("DEBUG", logger="dgemma"):
        assert dataclasses.replace(avx2.KERNELS).module(wait=True) is None
    assert "lacks avx2, fma" in caplog.text  # at debug level only: what runs is what is said (cpu.describe)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    monkeypatch.setenv("DGEMMA_NATIVE", "0")
    assert dataclasses.replace(avx2.KERNELS).module(wait=True) is None

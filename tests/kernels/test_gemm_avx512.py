"""Native AVX-512 BF16 GEMMs on quantised weights (kernels/csrc/dequant_avx512.cpp): out = x @ W.T,
x and out bf16, W int8, int4, fp8 or nvfp4 as stored, against a float64 product with
`formats.dequantize(W)` on ragged shapes (M, N, K tails of the 6 x 4 microkernel and its 32-wide
K step), row slices of a bigger weight and every scale dtype; misuse is a RuntimeError that says
what is wrong; `cpu_quant_linear` takes them for bf16 activations, and the whole-weight oneDNN
path where they are off."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from dgemma.kernels import avx2, native
from dgemma.quant import formats, modules

ext = native.extension()
pytestmark = [
    pytest.mark.skipif(
        ext is None,
        reason="the AVX-512 BF16 kernels need a CPU with AVX-512 BF16 (native.py's extension), which this one lacks or did not build",
    ),
    pytest.mark.native,
    pytest.mark.usefixtures("two_threads"),  # two threads: the kernels split their work across threads
]
# linear and cpu_quant_linear take these GEMMs where the CPU has no AMX (avx2.fused_bf16_extension)
needs_dispatch = pytest.mark.skipif(
    avx2.fused_bf16_extension() is None,
    reason="an AMX CPU: its bf16 activations multiply the weight dequantised whole on oneDNN's AMX GEMM",
)


@pytest.fixture(autouse=True)
def through_linear(monkeypatch):
    """avx2.linear calls the kernels on any CPU that has them (an AMX one too), so that each
    test below checks the kernel through the wrapper's argument handling."""
    monkeypatch.setattr(avx2, "fused_bf16_extension", lambda: ext)


MS, NS, KS = (1, 5, 6, 7, 13, 67), (1, 3, 4, 37, 130), (8, 72, 1000, 1024)


def data(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]  # rows of different sizes
    if n > 2:
        w[1] = 0.0
    return x, w


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within one bf16 rounding of the float64 product plus float32 accumulation (1e-5 of
    sum |x_k w_k|, each output's own scale)."""
    exact = x.double() @ w.double().T
    size = x.double().abs() @ w.double().abs().T
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    assert torch.isfinite(out).all()
    err = (out.double() - exact).abs()
    bound = exact.abs() * 2.0**-8 + 1e-5 * size + 1e-30
    assert (err <= bound).all(), f"max error / bound {(err / bound).max().item():.2f}"


def quantized(w: torch.Tensor, scheme: str, group: int | None = None, scale_dtype=torch.float32) -> formats.QTensor:
    return formats.quantize(w, scheme, group, scale_dtype)


def run(x: torch.Tensor, q: formats.QTensor) -> torch.Tensor:
    out = torch.full((x.shape[0], q.shape[0]), float("nan"), dtype=torch.bfloat16)
    got = avx2.linear(x, q)
    assert got is not None
    out.copy_(got)
    return out


@pytest.mark.parametrize("m,n,k", list(itertools.product(MS, NS, KS)))
def test_int8_and_fp8(m, n, k):
    x, w = data(m, n, k, seed=1)
    for scheme in ("int8", "fp8"):
        q = quantized(w, scheme)
        for scale in (q.parts["weight_scale"], q.parts["weight_scale"].bfloat16()):
            qs = formats.QTensor(scheme, q.shape, {"weight": q.parts["weight"], "weight_scale": scale})
            flat = formats.QTensor(scheme, q.shape, {"weight": q.parts["weight"], "weight_scale": scale.reshape(-1)})
            for weight in (qs, flat):  # [N, 1] or [N] scales
                check(run(x, weight), x, formats.dequantize(qs, torch.bfloat16))


INT4_CASES = [(k, g) for k in KS for g in (8, 32, 64) if k % g == 0]


@pytest.mark.parametrize("m,n", list(itertools.product(MS, NS)))
@pytest.mark.parametrize("k,group", INT4_CASES, ids=[f"K{k}-g{g}" for k, g in INT4_CASES])
def test_int4(m, n, k, group):
    x, w = data(m, n, k, seed=2)
    for scale_dtype in (torch.bfloat16, torch.float32, torch.float16):
        q = quantized(w, "int4", group, scale_dtype)
        check(run(x, q), x, formats.dequantize(q, torch.bfloat16))


@pytest.mark.parametrize("m,n,k", list(itertools.product(MS, NS, (16, 80, 1024))))
def test_nvfp4(m, n, k):
    x, w = data(m, n, k, seed=4)
    q = quantized(w, "nvfp4")
    check(run(x, q), x, formats.dequantize(q, torch.bfloat16))


def test_row_slices_of_a_bigger_weight_and_a_batch_of_rows():
    """Rows [a, b) of a weight (views into its storage, read in place); x with leading dims; more
    rows of x than one L2 chunk (chunks of ~384 KB of x: 66 rows at K = 2816)."""
    x, w = data(120, 150, 2816, seed=5)
    a, b = 37, 120
    for scheme, group in (("int8", None), ("int4", 64), ("fp8", None), ("nvfp4", None)):
        tile = quantized(w, scheme, group, torch.bfloat16).rows(a, b)
        got = avx2.linear(x.reshape(3, 40, 2816), tile)
        assert got.shape == (3, 40, b - a)
        check(got.reshape(120, b - a), x, formats.dequantize(tile, torch.bfloat16))
    # the kernel itself takes any number of rows; linear leaves more than FUSED_BF16_ROWS to oneDNN
    big, _ = data(avx2.FUSED_BF16_ROWS + 1, 1, 2816, seed=7)
    q = quantized(w, "int8")
    assert avx2.linear(big, q) is None and avx2.linear(big[:-1], q) is not None
    out = torch.empty(big.shape[0], 150, dtype=torch.bfloat16)
    check(
        ext.gemm_int8(big, q.parts["weight"], q.parts["weight_scale"], out), big, formats.dequantize(q, torch.bfloat16)
    )


@needs_dispatch
def test_cpu_quant_linear_takes_them_for_bf16_and_dequantises_whole_without_them(monkeypatch):
    monkeypatch.undo()  # the real dispatch
    x, w = data(9, 40, 512, seed=6)
    q = quantized(w, "int4", 32, torch.bfloat16)
    whole = []
    real = avx2.dequantize_into
    monkeypatch.setattr(avx2, "dequantize_into", lambda q_, out: whole.append(out.shape) or real(q_, out))
    check(modules.cpu_quant_linear(x, q), x, formats.dequantize(q, torch.bfloat16))
    assert whole == []  # decoded inside the GEMM: no dequantised weight
    monkeypatch.setattr(avx2, "fused_bf16_extension", lambda: None)
    got = modules.cpu_quant_linear(x, q)
    assert whole == [(40, 512)]
    assert torch.equal(got, F.linear(x, formats.dequantize(q, torch.bfloat16)))


def test_misuse_is_refused_with_a_message():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w8, s = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 1)
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be a 2D bfloat16"):
        ext.gemm_int8(x.float(), w8, s, out)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        ext.gemm_int8(x[:, :32].contiguous(), w8, s, out)
    with pytest.raises(RuntimeError, match=r"out must be bfloat16 \[4, 8\]"):
        ext.gemm_int8(x, w8, s, torch.empty(4, 8))
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        ext.gemm_int8(torch.zeros(64, 4, dtype=torch.bfloat16).t(), w8, s, out)
    with pytest.raises(RuntimeError, match="one per row"):
        ext.gemm_fp8(x, w8.view(torch.uint8), torch.ones(3, 1), out)
    with pytest.raises(RuntimeError, match="positive multiple of 8 dividing K"):
        ext.gemm_int4(x, torch.zeros(8, 8, dtype=torch.int32), torch.ones(8, 2), 48, out)
    with pytest.raises(RuntimeError, match=r"scale must be \[8, 2\]"):
        ext.gemm_int4(x, torch.zeros(8, 8, dtype=torch.int32), torch.ones(8, 4), 32, out)
    with pytest.raises(RuntimeError, match=r"scale must be \[8, 4\]"):
        ext.gemm_nvfp4(x, torch.zeros(8, 32, dtype=torch.uint8), torch.zeros(8, 2, dtype=torch.uint8), 1.0, out)
    # where they do not apply, linear says None (the caller falls back)
    q = quantized(torch.randn(8, 64), "int8")
    assert avx2.linear(x.half(), q) is None
    assert avx2.linear(x, torch.randn(8, 64).bfloat16()) is None  # a bf16 weight: oneDNN's job
    assert avx2.linear(x, formats.quantize(torch.randn(2, 8, 64), "int8")) is None  # [E, N, K]


def test_empty_sizes():
    q = quantized(torch.randn(5, 64), "int8")
    assert ext.gemm_int8(
        torch.empty(0, 64, dtype=torch.bfloat16),
        q.parts["weight"],
        q.parts["weight_scale"],
        torch.empty(0, 5, dtype=torch.bfloat16),
    ).shape == (0, 5)
    out = torch.full((3, 5), float("nan"), dtype=torch.bfloat16)  # K = 0: an empty sum
    empty = torch.zeros(5, 0, dtype=torch.int8)
    assert torch.equal(
        ext.gemm_int8(torch.empty(3, 0, dtype=torch.bfloat16), empty, torch.ones(5, 1), out),
        torch.zeros(3, 5, dtype=torch.bfloat16),
    )

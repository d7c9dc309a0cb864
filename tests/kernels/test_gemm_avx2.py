"""Native AVX2 GEMMs on stored weights (kernels/csrc/gemm_avx2.cpp): out = x @ W.T with W bf16,
int8, int4, fp8 or nvfp4 as stored, against a float64 product with `formats.dequantize(W)`, on
ragged shapes (M, N, K tails of every microkernel), row slices of a bigger weight and every
scale dtype; misuse is a RuntimeError that says what is wrong; `avx2.linear` returns None
where the kernels do not apply."""

import itertools

import pytest
import torch

from dgemma.kernels import avx2
from dgemma.quant import formats

ext = avx2.extension()
needs_kernel = pytest.mark.skipif(
    ext is None,
    reason="native GEMMs unavailable (CPU lacks AVX2/FMA/F16C, no C++ compiler, the build failed, or DGEMMA_NATIVE=0)",
)
pytestmark = [
    needs_kernel,
    pytest.mark.native,
    pytest.mark.usefixtures("two_threads"),
]  # two threads: the kernels split their work across threads

MS, NS, KS = (1, 3, 5, 32, 67), (1, 7, 37, 130), (8, 72, 1000, 1024)
SCALE_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def data(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]  # rows of different sizes
    if n > 2:
        w[1] = 0.0
    return x, w


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within 1e-5 of the float64 product, relative to sum |x_k w_k| (each output's own scale:
    float32 accumulation errs in proportion to it)."""
    exact = x.double() @ w.double().T
    size = x.double().abs() @ w.double().abs().T
    assert out.dtype == torch.float32 and out.shape == exact.shape
    assert torch.isfinite(out).all()
    err = (out.double() - exact).abs()
    assert (err <= 1e-5 * size + 1e-30).all(), f"max relative error {(err / size.clamp(min=1e-30)).max().item():.2e}"


@pytest.mark.parametrize("m,n,k", list(itertools.product(MS, NS, KS)))
def test_bf16(m, n, k):
    x, w = data(m, n, k)
    wb = w.bfloat16()
    out = torch.full((m, n), float("nan"))
    assert ext.gemm_bf16(x, wb, out) is out
    check(out, x, wb.float())


@pytest.mark.parametrize("m,n,k", list(itertools.product(MS, NS, KS)))
def test_int8(m, n, k):
    x, w = data(m, n, k, seed=1)
    q = formats.quantize(w, "int8")
    for scale in (q.parts["weight_scale"], q.parts["weight_scale"].bfloat16(), q.parts["weight_scale"].reshape(-1)):
        out = torch.full((m, n), float("nan"))
        assert ext.gemm_int8(x, q.parts["weight"], scale, out) is out
        check(out, x, q.parts["weight"].float() * scale.float().reshape(-1, 1))


INT4_CASES = [(k, g) for k in KS for g in (8, 32, 64) if k % g == 0]


@pytest.mark.parametrize("m,n", list(itertools.product(MS, NS)))
@pytest.mark.parametrize("k,group", INT4_CASES, ids=[f"K{k}-g{g}" for k, g in INT4_CASES])
def test_int4(m, n, k, group):
    x, w = data(m, n, k, seed=2)
    for scale_dtype in SCALE_DTYPES:
        q = formats.quantize(w, "int4", group, scale_dtype)
        out = torch.full((m, n), float("nan"))
        assert ext.gemm_int4(x, q.parts["weight_packed"], q.parts["weight_scale"], group, out) is out
        check(out, x, formats.dequantize(q))


@pytest.mark.parametrize("m,n,k", [(m, n, k) for m, n, k in itertools.product(MS, NS, KS) if n != 37 or m in (1, 67)])
def test_fp8(m, n, k):
    x, w = data(m, n, k, seed=3)
    q = formats.quantize(w, "fp8")
    for scale in (q.parts["weight_scale"], q.parts["weight_scale"].bfloat16()):
        qs = formats.QTensor("fp8", q.shape, {"weight": q.parts["weight"], "weight_scale": scale})
        for weight in (q.parts["weight"], q.parts["weight"].view(torch.uint8)):
            out = torch.full((m, n), float("nan"))
            assert ext.gemm_fp8(x, weight, scale, out) is out
            check(out, x, formats.dequantize(qs))


@pytest.mark.parametrize("m,n,k", [(m, n, k) for m, n, k in itertools.product(MS, NS, (16, 80, 1024))])
def test_nvfp4(m, n, k):
    x, w = data(m, n, k, seed=4)
    q = formats.quantize(w, "nvfp4")
    out = torch.full((m, n), float("nan"))
    p = q.parts
    assert (
        ext.gemm_nvfp4(x, p["weight_packed"], p["weight_scale"].view(torch.uint8), p["weight_global_scale"].item(), out)
        is out
    )
    check(out, x, formats.dequantize(q))


def test_row_slices_of_a_bigger_weight():
    """Rows [a, b) of a weight: contiguous views into its storage, read in place."""
    x, w = data(9, 150, 1024, seed=5)
    a, b = 37, 120
    wb = w.bfloat16()
    out = torch.empty(9, b - a)
    check(ext.gemm_bf16(x, wb[a:b], out), x, wb[a:b].float())
    for scheme, group in (("int8", None), ("int4", 64), ("fp8", None), ("nvfp4", None)):
        q = formats.quantize(w, scheme, group, torch.bfloat16) if scheme == "int4" else formats.quantize(w, scheme)
        tile = q.rows(a, b)
        got = avx2.linear(x, tile)
        assert got is not None, scheme
        check(got, x, formats.dequantize(tile))


def test_linear_dispatch_and_shapes():
    x, w = data(6, 37, 72, seed=6)
    x3 = x.reshape(2, 3, 72)
    wb = w.bfloat16()
    got = avx2.linear(x3, wb)
    assert got.shape == (2, 3, 37)
    check(got.reshape(6, 37), x, wb.float())
    # a non-contiguous x: linear makes it contiguous; the kernel itself refuses it
    xt = torch.randn(72, 6).t()
    check(avx2.linear(xt, wb), xt, wb.float())
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        ext.gemm_bf16(xt, wb, torch.empty(6, 37))
    # where the kernels do not apply: None (the caller falls back)
    assert avx2.linear(x.double(), wb) is None
    assert avx2.linear(x.bfloat16(), wb) is None
    assert avx2.linear(x, w) is None  # a float32 weight: oneDNN's job
    assert avx2.linear(x, wb[:, :64]) is None  # K differs
    stacked = formats.quantize(torch.randn(2, 8, 72), "int8")
    assert avx2.linear(x, stacked) is None  # [E, N, K]: one 2D weight at a time
    assert avx2.linear(x, stacked.select(0)) is not None


def test_empty_sizes():
    wb = torch.randn(5, 16).bfloat16()
    assert ext.gemm_bf16(torch.empty(0, 16), wb, torch.empty(0, 5)).shape == (0, 5)
    out = torch.full((3, 5), float("nan"))
    assert torch.equal(
        ext.gemm_bf16(torch.empty(3, 0), torch.empty(5, 0, dtype=torch.bfloat16), out), torch.zeros(3, 5)
    )


def test_threads_do_not_change_results():
    x, w = data(67, 130, 1000, seed=7)
    wb = w.bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.gemm_bf16(x, wb, torch.empty(67, 130))
        torch.set_num_threads(max(2, threads))
        many = ext.gemm_bf16(x, wb, torch.empty(67, 130))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_bad_arguments():
    x, w = data(4, 8, 64)
    wb, out = w.bfloat16(), torch.empty(4, 8)
    q8, q4 = formats.quantize(w, "int8"), formats.quantize(w, "int4", 32)
    packed, s4 = q4.parts["weight_packed"], q4.parts["weight_scale"]
    cases = [
        (lambda: ext.gemm_bf16(x, w, out), "w must be bfloat16"),
        (lambda: ext.gemm_bf16(x.double(), wb, out), "x must be float32"),
        (lambda: ext.gemm_bf16(x[:, :32].contiguous(), wb, out), r"x must be \[M, 64\]"),
        (lambda: ext.gemm_bf16(x, wb, torch.empty(4, 9)), r"out must be \[4, 8\]"),
        (lambda: ext.gemm_bf16(x, wb, torch.empty(4, 8, dtype=torch.bfloat16)), "out must be float32"),
        (lambda: ext.gemm_bf16(x, wb, torch.empty(8, 4).t()), "out must be contiguous"),
        (lambda: ext.gemm_bf16(x, wb.t().contiguous().t(), out), "w must be contiguous"),
        (lambda: ext.gemm_bf16(x, wb[None], out), "w must be 2D"),
        (lambda: ext.gemm_int8(x, q8.parts["weight"], torch.ones(7, 1), out), "one per output channel"),
        (
            lambda: ext.gemm_int8(x, q8.parts["weight"], torch.ones(8, 1, dtype=torch.float64), out),
            "scale must be float32",
        ),
        (lambda: ext.gemm_int8(x, wb, q8.parts["weight_scale"], out), "w must be int8"),
        (lambda: ext.gemm_int4(x, packed, s4, 12, out), "group must be a positive multiple of 8"),
        (lambda: ext.gemm_int4(x, packed, s4, 64, out), r"scale must be \[8, 1\]"),
        (lambda: ext.gemm_int4(x, packed.float(), s4, 32, out), "packed must be int32"),
        (lambda: ext.gemm_fp8(x, q8.parts["weight"], q8.parts["weight_scale"], out), "float8_e4m3fn"),
        (
            lambda: ext.gemm_nvfp4(
                x, torch.zeros(8, 32, dtype=torch.uint8), torch.zeros(8, 3, dtype=torch.uint8), 1.0, out
            ),
            r"scale must be \[8, 4\]",
        ),
    ]
    for fn, message in cases:
        with pytest.raises(RuntimeError, match=message):
            fn()


# ------------------------------------------------------------------ bf16, W as [K, N] (gemm_bf16_nn)


def check_nn(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """check() for out = x @ w with w [K, N]."""
    check(out, x, w.T)


@pytest.mark.parametrize("m,k,n", list(itertools.product((1, 5, 64, 256), (16, 100, 4096), (8, 37, 1024))))
def test_bf16_nn(m, k, n):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]  # rows / columns of different sizes
    w = (torch.randn(k, n, generator=g) * torch.logspace(-1, 1, n)).bfloat16()
    if k > 2:
        w[1] = 0.0
    out = torch.full((m, n), float("nan"))
    assert ext.gemm_bf16_nn(x, w, out) is out
    check_nn(out, x, w.float())


@pytest.mark.parametrize("kc,nc", [(16, 16), (48, 32), (1000, 48), (5000, 4096)])
def test_bf16_nn_blocking(kc, nc):
    """Explicit K chunks / N blocks (ragged against K and N): same products."""
    g = torch.Generator().manual_seed(10)
    x, w = torch.randn(13, 1100, generator=g), torch.randn(1100, 75, generator=g).bfloat16()
    check_nn(ext.gemm_bf16_nn(x, w, torch.empty(13, 75), kc, nc), x, w.float())


def test_bf16_nn_threads_and_sizes():
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(67, 1000, generator=g), torch.randn(1000, 130, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.gemm_bf16_nn(x, w, torch.empty(67, 130))
        torch.set_num_threads(max(2, threads))
        many = ext.gemm_bf16_nn(x, w, torch.empty(67, 130))
        many_m = ext.gemm_bf16_nn(x, w[:, :16].contiguous(), torch.empty(67, 16))  # N too small to split: M split
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    check_nn(many_m, x, w[:, :16].float())
    assert ext.gemm_bf16_nn(torch.empty(0, 16), w[:16], torch.empty(0, 130)).shape == (0, 130)
    out = torch.full((3, 5), float("nan"))
    assert torch.equal(
        ext.gemm_bf16_nn(torch.empty(3, 0), torch.empty(0, 5, dtype=torch.bfloat16), out), torch.zeros(3, 5)
    )


def test_matmul_nn_wrapper():
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(2, 3, 72, generator=g), torch.randn(72, 37, generator=g).bfloat16()
    got = avx2.matmul_nn(x, w)
    assert got.shape == (2, 3, 37)
    check_nn(got.reshape(6, 37), x.reshape(6, 72), w.float())
    xt = torch.randn(72, 6, generator=g).t()  # non-contiguous x: made contiguous
    check_nn(avx2.matmul_nn(xt, w), xt, w.float())
    wt = torch.randn(37, 72, generator=g).bfloat16().t()  # non-contiguous w: made contiguous
    check_nn(avx2.matmul_nn(x.reshape(6, 72), wt), x.reshape(6, 72), wt.float())
    assert avx2.matmul_nn(x.double(), w) is None
    assert avx2.matmul_nn(x.bfloat16(), w) is None
    assert avx2.matmul_nn(x, w.float()) is None  # a float32 w: oneDNN's job
    assert avx2.matmul_nn(x, w[:64]) is None  # K differs
    assert avx2.matmul_nn(x, w[None]) is None


def test_bf16_nn_bad_arguments():
    g = torch.Generator().manual_seed(13)
    x, w = torch.randn(4, 64, generator=g), torch.randn(64, 8, generator=g).bfloat16()
    out = torch.empty(4, 8)
    cases = [
        (lambda: ext.gemm_bf16_nn(x, w.float(), out), "w must be bfloat16"),
        (lambda: ext.gemm_bf16_nn(x.double(), w, out), "x must be float32"),
        (lambda: ext.gemm_bf16_nn(x[:, :32].contiguous(), w, out), r"x must be \[M, 64\]"),
        (lambda: ext.gemm_bf16_nn(x, w, torch.empty(4, 9)), r"out must be \[4, 8\]"),
        (lambda: ext.gemm_bf16_nn(x, w, torch.empty(4, 8, dtype=torch.bfloat16)), "out must be float32"),
        (lambda: ext.gemm_bf16_nn(x, w, torch.empty(8, 4).t()), "out must be contiguous"),
        (lambda: ext.gemm_bf16_nn(x, w.t().contiguous().t(), out), "w must be contiguous"),
        (lambda: ext.gemm_bf16_nn(torch.randn(64, 4).t(), w, out), "x must be contiguous"),
        (lambda: ext.gemm_bf16_nn(x, w[None], out), r"w must be 2D \[K, N\]"),
    ]
    for fn, message in cases:
        with pytest.raises(RuntimeError, match=message):
            fn()

"""Native CPU kernels (kernels/csrc): the AMX MoE block and the fused step statistics agree with the
torch code they replace, to float32 / bfloat16 rounding, on the cases that stress them."""

import dataclasses

import pytest
import torch

import dgemma
from dgemma.engine import sampler
from dgemma.engine.engine import Engine
from dgemma.kernels import native
from dgemma.kernels.cpu import LeanRMSNorm
from dgemma.model.diffusion_gemma import DenseMLP, Experts
from dgemma.model.layers import RMSNorm

needs_native = pytest.mark.skipif(
    native.extension() is None, reason="native kernels unavailable (no AVX-512 BF16 or no compiler)"
)
needs_amx = pytest.mark.skipif(native.amx() is None, reason="no AMX on this CPU")
pytestmark = [
    pytest.mark.native,
    pytest.mark.usefixtures("two_threads"),
]  # two threads: the kernels split their work across threads


class _MoEConfig:
    num_experts, hidden_size, moe_intermediate_size = 8, 64, 64

    def __init__(self, approximate: str):
        self.gelu_approximate = approximate


@needs_amx
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@torch.no_grad()
def test_amx_experts_match_the_reference_block(approximate):
    g = torch.Generator().manual_seed(0)
    experts = Experts(_MoEConfig(approximate))
    experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.1)
    experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.1)
    oracle = Experts(_MoEConfig(approximate)).double()
    oracle.load_state_dict({k: v.double() for k, v in experts.state_dict().items()})
    experts = experts.bfloat16()
    fast = native.AMXExperts(experts, native.amx())
    tokens, top_k = 75, 2
    x = torch.randn(tokens, 64, generator=g).bfloat16()
    # uneven routing: expert 0 gets 40 rows (two full tiles and a partial one), expert 7 none,
    # expert 1 a single row; the rest spread
    index = torch.randint(2, 7, (tokens, top_k), generator=g)
    index[:, 1] = (index[:, 0] + 1 - 2) % 5 + 2
    index[:40, 0], index[40, 0] = 0, 1
    weights = torch.rand(tokens, top_k, generator=g)
    expected = experts(x, index, weights)
    got = fast(x, index, weights)
    truth = oracle(x.double(), index, weights.double())
    scale = truth.abs().max().item()
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert (got.double() - truth).abs().max().item() <= (expected.double() - truth).abs().max().item() + 2**-8 * scale
    assert (got.float() - expected.float()).abs().max().item() <= 2**-7 * scale


@needs_amx
@pytest.mark.parametrize(
    "rows, k, n", [(37, 64, 96), (1, 96, 32), (20, 4160, 64)]
)  # ragged rows; AR's one row; K-blocked
def test_amx_linear_equals_a_bf16_matmul(rows, k, n):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    got = native.AMXLinear(w, native.amx())(x[None])[0]
    exact = x.double() @ w.double().T  # bf16 products are exact in float64; only the float32 sums round
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.allclose(got.double(), exact, rtol=2**-8, atol=1e-6 * k)


@needs_amx
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@torch.no_grad()
def test_amx_gated_mlp_matches_the_dense_mlp(approximate):
    g = torch.Generator().manual_seed(4)
    mlp = DenseMLP(64, 96, approximate)
    for p in mlp.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    oracle = DenseMLP(64, 96, approximate).double()
    oracle.load_state_dict({k: v.double() for k, v in mlp.state_dict().items()})
    mlp = mlp.bfloat16()
    x = torch.randn(2, 19, 64, generator=g).bfloat16()
    got, expected, truth = native.AMXGatedMLP(mlp, native.amx())(x), mlp(x), oracle(x.double())
    scale = truth.abs().max().item()
    assert got.shape == expected.shape
    assert (got.double() - truth).abs().max().item() <= (expected.double() - truth).abs().max().item() + 2**-8 * scale


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_step_statistics_equal_the_torch_ones(dtype):
    g = torch.Generator().manual_seed(1)
    raw = (torch.randn(9, 4096, generator=g) * 12).to(dtype)
    raw[2, 100] = raw[2, 3000] = 200.0  # a tie on the maximum: the first index wins, as in torch
    raw[3] = 0.0  # a flat row: maximal entropy, argmax 0
    raw[4], raw[4, 7] = -1e4, 1e4  # one certain token: entropy ~0, the other weights at the exp floor
    temps = torch.rand(9, generator=g) + 0.3
    weights, probs = torch.empty(9, 4096), torch.empty(9, 4096, dtype=torch.bfloat16)
    argmax, entropy, total = native.extension().step_statistics(raw, 30.0, temps, weights, probs)
    reference = sampler.step_statistics(raw.float().div(30.0).tanh().mul(30.0), temps[:, None])
    assert torch.equal(argmax, reference.argmax) and argmax[2].item() == 100 and argmax[3].item() == 0
    assert torch.allclose(entropy, reference.entropy, atol=2e-5) and entropy[4].item() < 1e-6
    assert torch.allclose(total, reference.total, rtol=1e-5)
    assert torch.allclose(weights, reference.weights, rtol=1e-4, atol=1e-30)
    assert torch.equal(probs, weights.bfloat16())


@needs_native
@torch.no_grad()
def test_engine_step_with_native_statistics_matches_the_torch_step(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    net = model.engine_net
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 128, (13,), generator=g).tolist()
    canvas = torch.randint(0, 128, (1, model.config.canvas_length), generator=g)
    soft = torch.randn(1, model.config.canvas_length, model.config.hidden_size, generator=g)
    temps = torch.full((model.config.canvas_length, 1), 0.7)
    outputs = []
    for use_native in (True, False):
        engine = Engine(net)
        runner = engine.runner
        assert runner.ops.native is not None
        runner.ops.native = runner.ops.native if use_native else None
        kv = engine.encode_prefix(prompt)
        plan = runner.cache.plan_decoder(model.config.canvas_length, [kv])
        outputs.append(runner.ops.decoder_step(canvas, soft, temps, plan))
    (argmax, entropy, weights, total, soft_next), (argmax_t, entropy_t, weights_t, total_t, soft_next_t) = outputs
    assert torch.allclose(total, total_t, rtol=1e-5)
    assert torch.equal(argmax, argmax_t)
    assert torch.allclose(entropy, entropy_t, atol=1e-5)
    assert torch.allclose(weights, weights_t, rtol=1e-4, atol=1e-30)
    assert torch.allclose(soft_next, soft_next_t, atol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape, scaled", [((2, 9, 1024), True), ((1, 4, 8, 40), True), ((5, 48), False)])
@torch.no_grad()
def test_native_rms_norm_equals_the_model_norm(dtype, shape, scaled):
    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(shape[-1], 1e-6, with_scale=scaled)
    if scaled:
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    norm = norm.to(dtype)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    lean = LeanRMSNorm(norm)
    assert lean.kernel is not None
    got, expected = lean(x), norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.bfloat16:  # the same float32 value before the cast, up to the sum's order
        assert (got != expected).float().mean().item() < 1e-3
        assert torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=0)
    else:
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)


@needs_amx
@torch.no_grad()
def test_bf16_engine_net_on_amx_is_as_close_to_float32_as_the_reference(tmp_path):
    """A bf16 model whose shapes the AMX kernels take: the engine's step logits (AMX experts, MLPs,
    linears, native norms) are as close to the float32 model's as the bf16 reference path's are."""
    from checkpoints import step_logits
    from oracle import build_reference

    dims = {
        "hidden_size": 64,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "head_dim": 16,
        "global_head_dim": 32,
    }
    build_reference(tmp_path, "gqa", text_overrides=dims)
    full, half = dgemma.load(tmp_path), dgemma.load(tmp_path, dtype="bfloat16")
    layer = half.engine_net.layers[0]
    assert isinstance(layer.experts, native.AMXExperts) and isinstance(layer.mlp, native.AMXGatedMLP)
    g = torch.Generator().manual_seed(6)
    prompt, canvas = torch.randint(0, 128, (1, 21), generator=g), torch.randint(0, 128, (1, 8), generator=g)
    soft = torch.randn(1, 8, 64, generator=g)
    truth = step_logits(full.net, prompt, canvas, soft)
    reference = step_logits(half.net, prompt, canvas, soft.bfloat16())
    engine = step_logits(half.engine_net, prompt, canvas, soft.bfloat16())
    for t, r, e in zip(truth, reference, engine):
        reference_error = (r.float() - t).abs().max().item()
        engine_error = (e.float() - t).abs().max().item()
        assert 0 < reference_error and engine_error <= 1.5 * reference_error


def test_a_failed_build_or_dgemma_native_0_falls_back_with_one_line(monkeypatch, caplog, tmp_path):
    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # not the session's build (imported as it is)
    monkeypatch.setattr(native, "cpu_flags", lambda: native.AVX512_FLAGS | native.AMX_FLAGS)

    def broken_build(*args, **kwargs):
        raise RuntimeError(
            "Error building extension 'dgemma_native'\nx.cpp:1:1: error: no compiler here\nninja: build stopped"
        )

    monkeypatch.setattr(cpp, "load", broken_build)
    with caplog.at_level("WARNING", logger="dgemma"):
        assert dataclasses.replace(native.KERNELS).module(wait=True) is None
    assert "the build failed (x.cpp:1:1: error: no compiler here)" in caplog.text
    monkeypatch.setenv("DGEMMA_NATIVE", "0")
    assert dataclasses.replace(native.KERNELS).module(wait=True) is None


def test_dgemma_cpu_isa_avx2_picks_kernels_as_an_avx2_only_cpu(monkeypatch):
    """The emulation scripts/cpu_speed.py runs: no AVX-512 or AMX kernels, no native bf16, the
    AVX2 kernels' flags kept."""
    from dgemma.kernels import avx2, choice

    real = native.cpu_flags()
    monkeypatch.setenv("DGEMMA_CPU_ISA", "avx2")
    flags = native.cpu_flags()
    assert not {f for f in flags if f.startswith(("avx512", "amx"))}
    assert (real & avx2.CPU_FLAGS) <= flags  # the AVX2 dequantisation / GEMM kernels still run
    assert dataclasses.replace(native.KERNELS).module(wait=True) is None and not choice.native_bf16()
    kernels = native.extension()  # (an AVX-512 CPU's kernels, built for the session)
    assert kernels is None or not native.amx_runs.__wrapped__(kernels)


def test_builds_live_by_source_content(monkeypatch, tmp_path):
    """Another checkout's sources (other content) build elsewhere, the same content in the same
    place, below TORCH_EXTENSIONS_DIR where it is set (as torch reads it). How builds, rebuilds
    and waits are said, and two checkouts building once: tests/kernels/test_native_build.py."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "get_default_build_root", lambda: str(tmp_path))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "chosen"))
    assert native.build_directory("dgemma_native", native.SOURCES, native.CFLAGS).parent == tmp_path / "chosen"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    here = native.build_directory("dgemma_native", native.SOURCES, native.CFLAGS)
    assert here.parent == tmp_path
    other = tmp_path / "elsewhere.cpp"
    other.write_text("// another checkout's source\n")
    assert native.build_directory("dgemma_native", native.SOURCES, native.CFLAGS) == here
    assert native.build_directory("dgemma_native", [*native.SOURCES[:-1], other], native.CFLAGS) != here
    assert native.build_directory("dgemma_native", native.SOURCES, native.CFLAGS[:-1]) != here
    copy = tmp_path / "src"  # a header the sources include, changed: another build
    copy.mkdir()
    sources = [copy / src.name for src in native.SOURCES]
    for src, dest in zip(native.SOURCES, sources):
        dest.write_bytes(src.read_bytes())
    (copy / "scales.h").write_text("// one version\n")
    first = native.build_directory("dgemma_native", sources, native.CFLAGS)
    (copy / "scales.h").write_text("// another version\n")
    assert native.build_directory("dgemma_native", sources, native.CFLAGS) != first

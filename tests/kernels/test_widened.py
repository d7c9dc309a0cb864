"""bf16 weights on a CPU without native bf16: kept in bf16, multiplied in float32 a tile at a time
(kernels/widened.py). Checked on any CPU by saying the CPU has no native bf16 (DGEMMA_CPU_BF16=0)."""

import pytest
import torch
import torch.nn.functional as F

import dgemma
from checkpoints import step_logits
from dgemma.kernels import avx2, choice, widened
from dgemma.model.diffusion_gemma import Experts

pytestmark = pytest.mark.native


@pytest.mark.parametrize(
    "tokens, k, n, tile", [(1, 24, 40, 64), (7, 48, 37, 100), (33, 64, 128, 1 << 18), (5, 16, 8, 8)]
)
def test_tiled_linear_equals_a_float32_matmul_on_the_widened_weight(tokens, k, n, tile):
    g = torch.Generator().manual_seed(tokens)
    x, w = torch.randn(2, tokens, k, generator=g), torch.randn(n, k, generator=g).bfloat16()
    got = widened.tiled_linear(x, n, widened.widened_rows(w), tile_elements=tile)
    assert got.shape == (2, tokens, n) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w.float()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native_gemm", [True, False], ids=["native-gemm", "tiles"])
def test_soft_embed_and_experts_equal_their_float32_computation(native_gemm, monkeypatch):
    if not native_gemm:
        monkeypatch.setattr(avx2, "linear", lambda x, w: None)
        monkeypatch.setattr(avx2, "matmul_nn", lambda x, w: None)
    g = torch.Generator().manual_seed(1)
    table = torch.randn(3000, 24, generator=g).bfloat16()  # more vocabulary rows than one tile
    probs = torch.softmax(torch.randn(2, 5, 3000, generator=g), -1)
    torch.testing.assert_close(widened.WidenedSoftEmbed(table)(probs), probs @ table.float(), rtol=1e-5, atol=1e-6)

    from dgemma.model.checkpoint import make_config
    from dgemma.model.presets import PRESETS

    experts = Experts(make_config(**PRESETS["test"]))
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g))
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g))
    half = experts.bfloat16()
    x = torch.randn(11, 64, generator=g)
    index = torch.tensor([[0, 1]] * 6 + [[1, 3]] * 5)  # expert 2 gets no token
    weights = torch.rand(11, 2, generator=g)
    want = Experts(make_config(**PRESETS["test"]))
    with torch.no_grad():
        want.gate_up_proj.copy_(half.gate_up_proj.float())
        want.down_proj.copy_(half.down_proj.float())
        expected = want(x, index, weights)  # (float32 sums in another order: within 1e-5 of the largest output)
        torch.testing.assert_close(
            widened.WidenedExperts(half)(x, index, weights), expected, rtol=0, atol=1e-5 * expected.abs().max().item()
        )


def test_native_bf16_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("DGEMMA_CPU_BF16", "0")
    assert choice.native_bf16() is False


@pytest.mark.slow
@pytest.mark.parametrize("native_gemm", [True, False], ids=["native-gemm", "tiles"])
@torch.no_grad()
def test_bf16_engine_without_native_bf16_computes_float32_on_bf16_weights(tmp_path, monkeypatch, native_gemm):
    """The engine's copy of a bf16 model on such a CPU runs in float32, shares the bf16 weights
    (no float32 copy) and gives the float32 model's logits on the same (bf16-rounded) weights:
    with the native AVX2 GEMM (where it is built) and with the tile-by-tile fallback."""
    from oracle import build_reference

    if native_gemm and avx2.extension() is None:
        pytest.skip("the native AVX2 kernels are not built here (no AVX2/FMA/F16C, no compiler, or DGEMMA_NATIVE=0)")
    if not native_gemm:
        monkeypatch.setattr(avx2, "linear", lambda x, w: None)
        monkeypatch.setattr(avx2, "matmul_nn", lambda x, w: None)
    monkeypatch.setenv("DGEMMA_CPU_BF16", "0")
    monkeypatch.setattr(widened, "TILE_ELEMENTS", 16 * 64)  # several tiles per weight, LM head included
    build_reference(tmp_path, "gqa")
    truth, half = dgemma.load(tmp_path), dgemma.load(tmp_path, dtype="bfloat16")
    for p in list(truth.net.parameters()) + list(truth.net.buffers()):
        p.copy_(p.bfloat16().float())
    net = half.engine_net
    assert net.dtype == torch.float32 and half.net.dtype == torch.bfloat16
    layer, original = net.layers[0], half.net.layers[0]
    assert isinstance(layer.experts, widened.WidenedExperts) and isinstance(
        layer.self_attn.q_proj, widened.WidenedLinear
    )
    assert layer.self_attn.q_proj.weight.data_ptr() == original.self_attn.q_proj.weight.data_ptr()  # shared, bf16
    assert layer.experts.gate_up.data_ptr() == original.experts.gate_up_proj.data_ptr()
    g = torch.Generator().manual_seed(3)
    prompt, canvas = torch.randint(0, 128, (1, 21), generator=g), torch.randint(0, 128, (1, 8), generator=g)
    soft = torch.randn(1, 8, truth.config.hidden_size, generator=g)
    want = step_logits(truth.engine_net, prompt, canvas, soft)
    got = step_logits(net, prompt, canvas, soft)
    bf16_compute = step_logits(half.net, prompt, canvas, soft.bfloat16())
    for w, e, b in zip(want, got, bf16_compute):
        assert (e - w).abs().max().item() < 1e-4
        assert (b.float() - w).abs().max().item() > 10 * (e - w).abs().max().item()  # bf16 compute is farther
    # (tokens are not compared with the float32 model's: the same float32 maths summed in another
    # order flips a near-tie of this random model within a few blocks, and then every token after)
    out = half.generate([[2, 5, 6, 7]], max_new_tokens=16, seed=0)
    assert (
        len(out.sequences[0]) == 16
        and out.sequences == half.generate([[2, 5, 6, 7]], max_new_tokens=16, seed=0).sequences
    )


@pytest.mark.slow
@torch.no_grad()
def test_quantised_bf16_model_without_native_bf16_generates_in_float32(tmp_path, monkeypatch):
    from oracle import build_reference

    monkeypatch.setenv("DGEMMA_CPU_BF16", "0")
    monkeypatch.setattr(widened, "TILE_ELEMENTS", 16 * 64)
    build_reference(tmp_path, "gqa")
    model = dgemma.load(tmp_path, dtype="bfloat16", quantization="int4", group_size=16)
    assert model.engine_net.dtype == torch.float32
    out = model.generate([[2, 5, 6, 7]], max_new_tokens=16, seed=0)
    assert len(out.sequences[0]) == 16

"""W8A8 FP8 on the fused path (issue 54, item 2), run on CPU by Triton's interpreter: activations
quantised per token where they are made (dgemma/kernels/triton_norms.py, kernels/triton_decode.py's
`fp8_rows`), the fp8 x fp8 GEMM (kernels/triton_quant.py, A8), the choice (kernels/choice.py), the
fused network taking it, each against the float32 emulation of the fp8 rounding in torch
(quant/modules.py's `fp8_per_token`, `w8a8_reference`: per-token e4m3 activations, e4m3 weights,
float32 accumulation).

What an interpreter can check: the quantised bytes and scales bit for bit (the bit encode; the
hardware's cvt.rn.satfinite path is the sm90 compile's: test_triton_compile.py), the GEMM's
emulation path (both operands decoded by bits, multiplied in float32) against torch's within float32
summation order, and a fused network's step against the torch network running the same emulation.
fp8 MMA instructions in the compiled GEMMs, their budgets and sm80's weight-only fp8 are
test_triton_compile.py's."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

from dgemma.kernels import choice, triton_moe, triton_norms, triton_quant  # noqa: E402
from dgemma.model.checkpoint import make_config  # noqa: E402
from dgemma.model.diffusion_gemma import DiffusionGemma  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402
from dgemma.quant.formats import quantize  # noqa: E402
from dgemma.quant.modules import fp8_per_token, quantize_stacked, w8a8_reference  # noqa: E402

if not triton_quant.INTERPRETED:
    pytest.skip("triton_quant was imported before TRITON_INTERPRET was set", allow_module_level=True)


def randn(*shape: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def same_rows(got: triton_quant.Fp8Rows, x: torch.Tensor) -> None:
    """The kernel's bytes and scales are `fp8_per_token`'s of x, bit for bit."""
    codes, scales = fp8_per_token(x)
    assert got.codes.dtype == torch.uint8 and got.scales.dtype == torch.float32 and got.dtype == x.dtype
    assert torch.equal(got.codes, codes.view(torch.uint8).reshape(got.codes.shape))
    assert torch.equal(got.scales, scales.reshape(-1))


def hard_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows of many magnitudes, a zero row, and values at e4m3's edges once scaled (448 exactly,
    subnormals, a tie, tiny amax, -0.0)."""
    x = randn(9, 300, seed=3) * torch.logspace(-30, 4, 9)[:, None]
    x[2] = 0.0
    x[4, :8] = torch.tensor([448.0, -1e-3, 2**-10, 3 * 2**-10, 0.99 * 2**-6, 1e-30, -0.0, -448.0])
    x[5, :3] = torch.tensor([448.0, 76.0, -1.5 * 2**-9])  # at scale 1: ties (72 | 80, 2^-9 | 2^-8: the even one)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_quantised_per_token_are_torchs_bytes(dtype):
    """`quantize_rows` (one launch): e4m3 bytes and float32 scales equal torch's cast of the same
    float32 products (round to nearest even, saturating at 448), a zero row all zeros."""
    x = hard_rows(dtype)
    rows = triton_norms.quantize_rows(x)
    same_rows(rows, x)
    assert not rows.codes[2].any()
    assert rows.codes[4, 0] == 0x7E  # 448: e4m3's largest
    back = rows.codes.view(torch.float8_e4m3fn).float() * rows.scales[:, None]
    err = (back - x.float()).abs() / x.float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert float(err.max()) <= 2**-4  # half an e4m3 step of the row's largest value, at most


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_producers_write_their_outputs_quantised_too(dtype):
    """embed_norm, post_attention (the dense and the experts' inputs) and combine with `quant`:
    their outputs as without it, and beside them those outputs quantised per token, bit for bit."""
    torch.manual_seed(0)
    net = DiffusionGemma(make_config(**PRESETS["test"])).to(dtype).eval()
    cfg, layer = net.config, net.layers[0]
    h = cfg.hidden_size
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    scale = float(torch.tensor(cfg.embed_scale).to(dtype))
    w = layer.input_layernorm.weight
    plain = triton_norms.embed_norm(net.embed_tokens.weight, scale, w, 1e-6, ids=ids)
    hx, x, xq = triton_norms.embed_norm(net.embed_tokens.weight, scale, w, 1e-6, ids=ids, quant=True)
    assert torch.equal(x, plain[1]) and torch.equal(hx, plain[0])
    same_rows(xq, x)

    hs, attn = randn(10, h, seed=2, dtype=dtype), randn(10, h, seed=3, dtype=dtype)
    args = (hs, attn, w, layer.pre_feedforward_layernorm.weight, w, layer.router.scale, 0.1, 1e-6)
    outs = triton_norms.post_attention(*args)
    *quantised, dense_q, moe_q = triton_norms.post_attention(*args, quant=True, quant_moe=True)
    assert all(torch.equal(a, b) for a, b in zip(outs, quantised))
    same_rows(dense_q, outs[1])
    same_rows(moe_q, outs[2])
    *_, only_dense, none = triton_norms.post_attention(*args, quant=True)
    same_rows(only_dense, outs[1])
    assert none is None

    y, top_w = randn(20, h, seed=4, dtype=dtype), torch.rand(10, 2, generator=torch.Generator().manual_seed(5))
    args = (hs, attn, y, top_w, w, w, w, torch.ones(1, dtype=dtype), w, 1e-6)
    h_out, x_out = triton_norms.combine(*args)
    h_q, x_q, xq = triton_norms.combine(*args, quant=True)
    assert torch.equal(h_q, h_out) and torch.equal(x_q, x_out)
    same_rows(xq, x_out)


def fp8_weight(n: int, k: int, seed: int = 7):
    return quantize(randn(n, k, seed=seed) * torch.logspace(-1, 0.5, n)[:, None], "fp8")


def rows_of(x: torch.Tensor) -> triton_quant.Fp8Rows:
    codes, scales = fp8_per_token(x)
    return triton_quant.Fp8Rows(codes.view(torch.uint8).contiguous(), scales.reshape(-1).contiguous(), x.dtype)


def close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max()
    assert float(err) <= rtol * float(want.float().abs().max()), float(err)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("m,n,k", [(1, 20, 50), (37, 33, 130), (70, 64, 256)])
def test_the_w8a8_gemm_is_the_float32_emulation(dtype, rtol, m, n, k):
    """fp8 weights times activations quantised per token: the kernel's emulation path (both operands
    decoded by bits, products and sums in float32, the token's and the channel's scale on the
    accumulator) is `w8a8_reference` but for float32 summation order (bf16: one rounding of each)."""
    q = fp8_weight(n, k)
    x = randn(m, k, seed=m, dtype=dtype)
    y = triton_quant.gemm(rows_of(x), triton_quant.gemm_weight(q))
    close(y, w8a8_reference(x, q), rtol)


def test_the_dual_w8a8_gemm_computes_gelu_times_up():
    """gate|up W8A8 with gelu * up in its epilogue: torch's gelu of the emulated gate times the up."""
    gu = fp8_weight(2 * 24, 96)
    x = randn(19, 96, seed=4)
    y = triton_quant.gemm(rows_of(x), triton_quant.gemm_weight(gu), dual="tanh")
    gate, up = w8a8_reference(x, gu).chunk(2, dim=-1)
    close(y, F.gelu(gate, approximate="tanh") * up, 1e-5)


@torch.no_grad()
def test_the_experts_gate_up_reads_quantised_rows_gathered_by_token():
    """The MoE block with its input quantised per token (kernels/triton_moe.py's `moe`: gate|up
    gathers each pair's token row and its scale): as the experts computed one by one with gate|up
    emulated and down weight-only."""
    e, hidden, inter, top_k = 4, 64, 32, 2
    gate_up = quantize_stacked(lambda i: randn(2 * inter, hidden, seed=i), e, "fp8", None)
    down = quantize_stacked(lambda i: randn(hidden, inter, seed=10 + i), e, "fp8", None)
    x = randn(9, hidden, seed=1)
    top_i = torch.tensor([[0, 1], [1, 3], [3, 0]] * 3, dtype=torch.int32)  # expert 2: no token
    gw, dw = triton_quant.gemm_weight(gate_up), triton_quant.gemm_weight(down)
    y = triton_moe.moe(rows_of(x), top_i, gw, dw, "tanh")
    want = torch.empty(9 * top_k, hidden)
    for t in range(9):
        for s in range(top_k):
            ex = int(top_i[t, s])
            g, u = w8a8_reference(x[t : t + 1], gate_up.select(ex)).chunk(2, dim=-1)
            act = F.gelu(g, approximate="tanh") * u
            want[t * top_k + s] = F.linear(act, down.select(ex).parts["weight"].float())[0] * down.select(ex).parts[
                "weight_scale"
            ].float().reshape(-1)
    close(y, want, 1e-5)


def test_the_gemm_refuses_quantised_rows_for_other_weights():
    x = randn(4, 64)
    with pytest.raises(ValueError, match="W8A8"):
        triton_quant.gemm(rows_of(x), triton_quant.gemm_weight(quantize(randn(16, 64), "int8")))


def test_w8a8_is_chosen_from_the_scheme_table_and_the_device(monkeypatch):
    """fp8 (its table entry: fp8 tensor cores from sm89) under the interpreter (its emulation) and
    on an sm89+ GPU; weight-only on sm80 and for every other scheme."""
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert choice.fp8_activations("fp8", cpu)
    assert not any(choice.fp8_activations(s, cpu) for s in ("int8", "int4", "nvfp4", None))
    monkeypatch.setattr(triton_quant, "INTERPRETED", False)
    monkeypatch.setattr(triton_quant, "available", lambda device: True)
    assert choice.fp8_activations("fp8", meta)  # the meta device models an H200 (ARCH_ON_META 90)
    monkeypatch.setattr(triton_quant, "ARCH_ON_META", 80)
    assert not choice.fp8_activations("fp8", meta)
    monkeypatch.setattr(triton_quant, "ARCH_ON_META", 89)
    assert choice.fp8_activations("fp8", meta)


PROMPTS = [[5, 9, 14, 3, 7, 1, 2, 8, 30, 31, 4], list(range(40, 60))]


@pytest.mark.slow
@torch.no_grad()
def test_a_fused_fp8_model_runs_w8a8_as_the_torch_emulation(tmp_path, monkeypatch):
    """An fp8 model on the fused path (kernels/fused.py) with every pass W8A8 (SMALL_M 0: the test
    size's canvas has 8 rows): its layers chose W8A8 at load (the dense linears and the experts'
    gate|up), and one-step first blocks equal the torch path's running the same emulation
    (`QuantLinear.fp8_activations`, `QuantExperts.fp8_activations`), argmax for argmax."""
    import dgemma
    from dgemma.kernels import fused
    from dgemma.model.checkpoint import byte_tokenizer, random_model, save_checkpoint
    from dgemma.quant.modules import QuantExperts, QuantLinear

    config = make_config(**PRESETS["test"])
    path = save_checkpoint(random_model(config, seed=3, std=0.5), tmp_path / "ckpt", tokenizer=byte_tokenizer())
    model = dgemma.load(path, quantization="fp8")
    monkeypatch.setattr(fused, "SMALL_M", 0)
    c = model.config.canvas_length

    def blocks() -> list:
        return [
            model.generate(PROMPTS, seed=s, eos_token_ids=[], max_new_tokens=c, max_denoising_steps=1).sequences
            for s in range(2)
        ]

    model.configure_engine(triton=True, block_size=8)
    got = blocks()
    layers = model.engine.runner.net.fused_layers
    assert all(layer.a8 and layer.experts_a8 for layer in layers)
    assert all(layer.quant_next for layer in layers[:-1]) and not layers[-1].quant_next
    monkeypatch.setattr(QuantLinear, "fp8_activations", True)
    monkeypatch.setattr(QuantExperts, "fp8_activations", True)
    model.configure_engine(triton=False, block_size=8)
    assert blocks() == got
    monkeypatch.setattr(QuantLinear, "fp8_activations", False)
    monkeypatch.setattr(QuantExperts, "fp8_activations", False)
    model.configure_engine(triton=False, block_size=8)
    assert blocks() != got  # the activations' rounding shows: the check above is not vacuous

"""Quantised weights: the formats' round trip, and a quantised model against the transformers
reference run on the dequantised weights (float32 compute)."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import dgemma
from dgemma.engine.engine import Engine
from dgemma.kernels import avx2, native
from dgemma.kernels.avx2 import dequantize_into
from dgemma.quant.formats import E2M1_VALUES, SCHEMES, QuantError, dequantize, pack_int4, quantize, unpack_int4
from dgemma.quant.modules import LINEAR_TARGETS, QuantExperts, QuantLinear, cpu_quant_linear, weight_bytes
from oracle import build_reference


def half_step(w: torch.Tensor, q) -> torch.Tensor:
    """Half the distance between the two codes around each value of w (times its scale)."""
    p = q.parts
    if q.scheme in ("int8", "int4"):
        scale = p["weight_scale"].float()
        if q.scheme == "int4":
            scale = scale.repeat_interleave(q.group_size, dim=-1)
        return scale / 2
    if q.scheme == "fp8":
        scale = p["weight_scale"].float()
        v = (w.abs() / scale).clamp(min=2**-6)  # e4m3: 3 mantissa bits; subnormal steps are 2^-9
        return 2.0 ** (torch.floor(torch.log2(v)) - 3) / 2 * scale
    step = (p["weight_scale"].float() / p["weight_global_scale"].float()[..., None]).repeat_interleave(16, dim=-1)
    grid = torch.tensor(E2M1_VALUES)
    v = (w.abs() / step).clamp(max=6.0)
    upper = torch.bucketize(v, grid).clamp(1, len(grid) - 1)
    return (grid[upper] - grid[upper - 1]) / 2 * step


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", [(48, 64), (3, 32, 128)])  # a linear, fused experts
def test_dequantize_of_quantize_is_within_half_a_step(scheme, shape):
    g = torch.Generator().manual_seed(len(shape))
    w = torch.randn(*shape, generator=g) * torch.logspace(-2, 1, shape[-2])[:, None]  # channels of many sizes
    w[..., 0, :5] = 0.0  # zeros stay zeros
    q = quantize(w, scheme, group_size=32)
    err = (dequantize(q) - w).abs()
    assert (err <= half_step(w, q) * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(dequantize(q)[..., 0, :5], torch.zeros_like(w[..., 0, :5]))
    assert q.nbytes < w.numel() * 2  # smaller than bf16


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bf16_activations_multiply_the_whole_dequantised_weight(scheme, monkeypatch):
    # bf16 activations (a CPU with native bf16) without the AVX-512 GEMM that decodes inside
    # (tests/kernels/test_gemm_avx512.py) take one GEMM on the weight dequantised whole, not the float32
    # fallback's 1 MB tiles (1.6-2x slower): F.linear on formats.dequantize's weight
    monkeypatch.setattr(native, "extension", lambda wait=None: None)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1040, 512, generator=g) / 512**0.5  # 532k elements: three float32 tiles
    q = quantize(w, scheme, group_size=32)
    x = torch.randn(2, 9, 512, generator=g).bfloat16()
    tiles = []
    monkeypatch.setattr(avx2, "dequantize_into", lambda q_, out: tiles.append(out.shape) or dequantize_into(q_, out))
    got = cpu_quant_linear(x, q)
    assert tiles == [(1040, 512)]
    assert got.dtype == torch.bfloat16 and got.shape == (2, 9, 1040)
    assert torch.equal(got, nn.functional.linear(x, dequantize(q, torch.bfloat16)))


def test_int4_packing_is_compressed_tensors_layout():
    values = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7]], dtype=torch.int8)
    word = pack_int4(values)
    # value k of a word in bits 4k..4k+3, offset by 8: 0x F E B A 9 8 1 0 from the last value down
    assert word.dtype == torch.int32 and word.item() == int.from_bytes(
        bytes([0x10, 0x98, 0xBA, 0xFE]), "little", signed=True
    )
    assert torch.equal(unpack_int4(word), values)


def test_bad_schemes_are_refused():
    with pytest.raises(QuantError, match="unknown quantization scheme 'int3'"):
        quantize(torch.ones(4, 32), "int3")
    with pytest.raises(QuantError, match="multiple of 8"):
        quantize(torch.ones(4, 32), "int4", group_size=12)
    with pytest.raises(QuantError, match="multiple of its group size 16"):
        quantize(torch.ones(4, 24), "nvfp4")


@pytest.fixture(scope="module")
def quant_ref(tmp_path_factory):
    path = tmp_path_factory.mktemp("quant")
    return path, build_reference(path, "gqa", generation={"eos_token_id": [1], "pad_token_id": 0})


def dequantised_reference(model, path):
    """A fresh transformers model of the same checkpoint with the quantised weights, dequantised."""
    from transformers import DiffusionGemmaForBlockDiffusion

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()
    with torch.no_grad():
        for ours, theirs in zip(model.net.layers, ref.model.decoder.layers):
            for target in LINEAR_TARGETS:
                if target == "self_attn.v_proj" and ours.self_attn.v_proj is None:
                    continue
                theirs.get_submodule(target).weight.copy_(dequantize(ours.get_submodule(target).qtensor))
            theirs.experts.gate_up_proj.copy_(dequantize(ours.experts.gate_up_proj.qtensor))
            theirs.experts.down_proj.copy_(dequantize(ours.experts.down_proj.qtensor))
    return ref


def reference_case(model, path, seed: int):
    """A prompt, a canvas, and transformers' logits for them on `model`'s dequantised weights."""
    ref = dequantised_reference(model, path)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (13,), generator=g)
    canvas = torch.randint(0, model.config.vocab_size, (1, model.config.canvas_length), generator=g)
    with torch.no_grad():
        return prompt, canvas, ref(input_ids=prompt[None], decoder_input_ids=canvas).logits


@pytest.mark.parametrize("scheme", SCHEMES)
def test_engine_logits_equal_reference_on_dequantised_weights(quant_ref, scheme):
    path, full = quant_ref
    model = dgemma.load(path, quantization=scheme, group_size=16)
    for layer in model.net.layers:  # every target holds only its quantised parts
        assert isinstance(layer.experts, QuantExperts)
        assert all(
            isinstance(layer.get_submodule(t), QuantLinear)
            for t in LINEAR_TARGETS
            if t != "self_attn.v_proj" or layer.self_attn.v_proj is not None
        )
    linears = [name for name, m in model.net.layers.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(name.endswith("router.proj") for name in linears)  # routers stay full precision
    prompt, canvas, want = reference_case(model, path, 0)
    with torch.no_grad():
        unquantised = full(input_ids=prompt[None], decoder_input_ids=canvas).logits
        net = model.engine_net  # the engine's network (packed where it packs; quantised parts as they are)
        engine = Engine(net)
        kv = engine.encode_prefix(prompt.tolist())
        got = net.logits(net.decode(canvas, engine.runner.cache.plan_decoder(model.config.canvas_length, [kv]), None))
    assert (got - want).abs().max().item() < 1e-4
    assert (got - unquantised).abs().max().item() > 1e-2  # the weights really are the quantised ones
    assert (model.canvas_logits([prompt.tolist()], canvas) - want).abs().max().item() < 1e-4


@pytest.mark.slow
def test_quantised_weights_take_fewer_bytes_and_generate(quant_ref):
    path, _ = quant_ref
    full = weight_bytes(dgemma.load(path).net)
    for scheme, ratio in [("int8", 0.3), ("int4", 0.2), ("nvfp4", 0.2)]:  # of float32's bytes (tiny rows: scales weigh)
        model = dgemma.load(path, quantization=scheme, group_size=16)
        part = weight_bytes(model.net)
        assert part["experts"] <= ratio * full["experts"], scheme
        assert part["embeddings"] == full["embeddings"]  # the tied embeddings stay in the model dtype
        out = model.generate([[2, 5, 6, 7]], max_new_tokens=16, seed=0)
        assert out.sequences == model.generate([[2, 5, 6, 7]], max_new_tokens=16, seed=0).sequences


@pytest.mark.slow
@pytest.mark.parity
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_written_checkpoint_loads_and_equals_the_reference_on_its_weights(quant_ref, scheme, tmp_path):
    """`dgemma quantize`'s files (experts unfused per expert) load fused and run: the logits equal
    transformers' on the file's dequantised weights; int4 / int8 / fp8 also equal quantising at load."""
    from dgemma.quant.write import write_quantized

    path, _ = quant_ref
    out = write_quantized(path, tmp_path / scheme, scheme, 16 if scheme == "int4" else None)
    model = dgemma.load(out)
    assert model.net.quantization[0] == scheme
    prompt, canvas, want = reference_case(model, path, 1)
    got = model.canvas_logits([prompt.tolist()], canvas)
    assert (got - want).abs().max().item() < 1e-4
    if (
        scheme != "nvfp4"
    ):  # (nvfp4 files share one global scale across q/k/v, as vLLM needs; load-time quantisation does not)
        at_load = dgemma.load(path, quantization=scheme, group_size=16)
        assert torch.equal(at_load.canvas_logits([prompt.tolist()], canvas), got)


@pytest.mark.slow
@pytest.mark.subprocess
def test_freed_heap_memory_goes_back_to_the_kernel_after_quantising():
    # with the CLI's malloc settings (keep_freed_memory) a quantised layer's temporaries stay
    # resident between the weights kept; release_freed_memory (called per quantised layer) returns them
    script = """
import torch
from dgemma.kernels.cpu import keep_freed_memory, release_freed_memory
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096
assert keep_freed_memory()
kept, temporaries = [], []
for _ in range(48):  # 8 MB temporaries, each followed by a small tensor that stays
    temporaries.append(torch.ones(2 << 20))
    kept.append(torch.ones(1024))
del temporaries
before = rss()
assert release_freed_memory()
print((before - rss()) >> 20)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 300  # of the 384 MB freed

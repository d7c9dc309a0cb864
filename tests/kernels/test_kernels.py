"""CPU packed-weight kernels: same maths as the model to float32 rounding, sharing its tensors."""

import pytest
import torch

import dgemma
from checkpoints import step_logits
from dgemma.kernels.cpu import PackedExperts, packed_copy, supported
from oracle import build_reference

pytestmark = pytest.mark.skipif(not supported(torch.float32), reason="no oneDNN packed linears in this torch")


@torch.no_grad()
def test_packed_copy_matches_and_shares_tensors(ref_wide):
    model = dgemma.load(ref_wide[0])
    fast = packed_copy(model.net)
    assert fast is not model.net and fast.embed_tokens.weight is model.net.embed_tokens.weight
    assert fast.layers[0].input_layernorm.weight is model.net.layers[0].input_layernorm.weight
    assert isinstance(fast.layers[0].experts, PackedExperts) and not isinstance(
        model.net.layers[0].experts, PackedExperts
    )
    assert model.net.lm_head_kernel is None  # the original stays on plain torch (reference-exact)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 160, (2, 21), generator=g)
    canvas = torch.randint(0, 160, (2, 16), generator=g)
    soft = torch.randn(2, 16, 48, generator=g)
    for a, b in zip(step_logits(model.net, prompt, canvas, soft), step_logits(fast, prompt, canvas, soft)):
        assert (a - b).abs().max().item() < 1e-4
    probs = torch.softmax(torch.randn(5, 160, generator=g), -1)
    assert torch.allclose(fast.soft_embed(probs), model.net.soft_embed(probs), atol=1e-5)


@torch.no_grad()
def test_packed_copy_follows_the_activation(tmp_path):
    build_reference(tmp_path, "wide", text_overrides={"hidden_activation": "gelu"})  # exact (erf) gelu
    model = dgemma.load(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompt, canvas = torch.randint(0, 160, (1, 9), generator=g), torch.randint(0, 160, (1, 16), generator=g)
    soft = torch.randn(1, 16, 48, generator=g)
    for a, b in zip(
        step_logits(model.net, prompt, canvas, soft), step_logits(packed_copy(model.net), prompt, canvas, soft)
    ):
        assert (a - b).abs().max().item() < 1e-4


@torch.no_grad()
def test_engine_net_keeps_lora_adapters(ref_gqa):
    from dgemma.train import lora

    model = dgemma.load(ref_gqa[0])
    g = torch.Generator().manual_seed(2)
    prompt, canvas = torch.randint(0, 128, (1, 7), generator=g), torch.randint(0, 128, (1, 8), generator=g)
    before = step_logits(model.engine_net, prompt, canvas)[1]
    lora.apply_lora(model.net, rank=2)
    for adapter in lora.adapters(model.net).values():
        adapter.B.normal_(std=0.5, generator=g)
    model.reset_engine_net()
    expected, got = step_logits(model.net, prompt, canvas)[1], step_logits(model.engine_net, prompt, canvas)[1]
    assert (expected - before).abs().max().item() > 1e-3  # the adapters change the logits
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.slow
def test_engine_uses_packed_copy_and_stays_batch_invariant(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    assert model.engine_net is model.engine_net and model.engine_net is not model.net
    prompts = [list(range(5, 27)), [20, 21, 22]]
    batch = model.generate(prompts, max_new_tokens=12, seed=[1, 2], entropy_bound=1.0)
    for r, p in enumerate(prompts):
        assert model.generate([p], max_new_tokens=12, seed=r + 1, entropy_bound=1.0).sequences[0] == batch.sequences[r]

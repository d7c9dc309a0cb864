"""The sampler's maths against transformers' own sampler classes, on hand-made and random logits."""

import math

import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)

import dgemma
from dgemma.engine import sampler


def test_temperature_schedule_matches_reference():
    proc = LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=48)
    logits = torch.randn(2, 3, 11)
    for step in (48, 30, 1):
        expected = proc(None, logits, cur_step=torch.tensor(step, dtype=torch.int32))
        assert torch.equal(logits / sampler.temperature(step, 48, 0.4, 0.8), expected)
    assert sampler.temperature(48, 48, 0.4, 0.8).item() == pytest.approx(0.8)
    assert sampler.temperature(1, 48, 0.4, 0.8).item() == pytest.approx(0.4 + 0.4 / 48)


def test_entropy_bound_rule_on_hand_made_entropies():
    entropy = torch.tensor([[0.0, 0.05, 0.04, 1.0, 2.0]])
    # sorted: 0, .04, .05, 1.0, 2.0 -> cumsum minus own entropy: 0, 0, .04, .09, 1.09
    assert sampler.entropy_bound_accept(entropy, 0.1).tolist() == [[True, True, True, True, False]]
    assert sampler.entropy_bound_accept(entropy, 0.02).tolist() == [[True, False, True, False, False]]
    # the lowest-entropy position is always accepted, however high
    assert sampler.entropy_bound_accept(torch.tensor([[5.0, 3.0, 4.0]]), 0.1).tolist() == [[False, True, False]]


@pytest.mark.parity
@pytest.mark.parametrize("seed", range(5))
def test_acceptance_equals_reference_sampler_including_ties(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 16, 50, generator=g) * 3
    logits[0, 4] = logits[0, 9]  # exact ties in entropy
    logits[1, :8] = logits[1, 0]
    ref = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=0.7), 16, 50, 48)
    current = torch.zeros(3, 16, dtype=torch.long)
    denoised = torch.ones(3, 16, dtype=torch.long)
    ref.accept_canvas(current, denoised, logits, 1)
    mine = sampler.entropy_bound_accept(sampler.reference_entropy(logits), 0.7)
    assert torch.equal(mine, ref.accepted_token_mask)
    # the fast path's entropy agrees to rounding and makes the same decisions here
    fast = sampler.step_statistics(logits.view(-1, 50), 1.0)
    assert torch.allclose(fast.entropy.view(3, 16), sampler.reference_entropy(logits), atol=1e-5)
    assert torch.equal(fast.argmax.view(3, 16), logits.argmax(-1))


def test_step_statistics_on_extreme_rows():
    logits = torch.tensor([[0.0] * 8, [30.0] + [-30.0] * 7, [1.0, 1.0, -30.0, -30.0, -30.0, -30.0, -30.0, -30.0]])
    stats = sampler.step_statistics(logits, 0.4)
    assert stats.entropy[0].item() == pytest.approx(math.log(8), abs=1e-6)
    assert 0.0 <= stats.entropy[1].item() < 1e-30 or stats.entropy[1].item() == 0.0
    assert stats.entropy[2].item() == pytest.approx(math.log(2), abs=1e-5)
    probs = stats.weights / stats.total[:, None]
    assert torch.allclose(probs, torch.softmax(logits / 0.4, -1), atol=1e-7)


@pytest.mark.parity
@pytest.mark.parametrize("stability", [0, 1, 2])
def test_stopping_equals_reference(stability):
    ref = StableAndConfidentStoppingCriteria(stability_threshold=stability, confidence_threshold=0.3)
    history = None
    g = torch.Generator().manual_seed(stability)
    canvases = [torch.randint(0, 3, (2, 4), generator=g) for _ in range(3)] + [
        torch.tensor([[1, 1, 1, 1], [2, 2, 2, 2]])
    ] * 4
    for i, canvas in enumerate(canvases):
        logits = torch.randn(2, 4, 5, generator=g) * (1 + 4 * i)
        expected = ref(canvas, logits)
        got, history = sampler.stable_and_confident(history, canvas, sampler.reference_entropy(logits), stability, 0.3)
        assert torch.equal(got, expected)


def test_inverse_cdf_sampling_follows_the_distribution():
    weights = torch.tensor([[0.0, 1.0, 3.0, 0.0, 4.0]]).repeat(20000, 1)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    picks = sampler.sample_from_weights(weights, u)
    counts = torch.bincount(picks, minlength=5).float() / 20000
    assert counts[0] == 0 and counts[3] == 0
    assert torch.allclose(counts, torch.tensor([0, 1 / 8, 3 / 8, 0, 4 / 8]), atol=0.015)
    edge = sampler.sample_from_weights(torch.tensor([[0.0, 2.0, 0.0]]), torch.tensor([0.9999999]))
    assert edge.item() == 1


@pytest.mark.parity
def test_fast_self_conditioning_step_matches_reference_logits(ref_gqa):
    """The engine's step input (soft embeddings from unnormalised weights) gives the reference's logits."""
    path, ref = ref_gqa
    model = dgemma.load(path)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (2, 11), generator=g)
    canvas = torch.randint(0, 128, (2, 8), generator=g)
    processed = torch.randn(2, 8, 128, generator=g) * 5
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=processed).logits
    from dgemma.dense.kv_cache import DenseKVCache

    net = model.net
    cache = DenseKVCache(model.config, 2, 19, "cpu", torch.float32)
    plan = cache.plan_encoder(11)
    net.encode(prompt, plan)
    cache.commit(plan)
    stats = sampler.step_statistics(processed.view(-1, 128), 1.0)
    soft = net.soft_embed(stats.weights.view(2, 8, 128), stats.total.view(2, 8))
    with torch.no_grad():
        got = net.logits(net.decode(canvas, cache.plan_decoder(8), soft))
    assert (got - expected).abs().max().item() < 1e-4


def test_step_statistics_in_place_equals_out_of_place_and_ignores_denormal_tail():
    """The engine's variant (logits overwritten, weights into a reused buffer) decides exactly as the plain one,
    and weights clamped at exp(-87) leave totals and entropies as float32 computes them without the clamp."""
    g = torch.Generator().manual_seed(7)
    logits = torch.tanh(torch.randn(6, 4000, generator=g) * 2) * 30.0  # (logits - max) / 0.4 reaches -150
    temp = torch.full((6, 1), 0.4)
    plain = sampler.step_statistics(logits, temp)
    buffer = torch.empty_like(logits)
    fast = sampler.step_statistics(logits.clone(), temp, overwrite_logits=True, out=buffer)
    assert fast.weights.data_ptr() == buffer.data_ptr()
    assert torch.equal(fast.argmax, plain.argmax) and torch.equal(fast.weights, plain.weights)
    assert torch.allclose(fast.entropy, plain.entropy, atol=1e-6)
    unclamped = torch.exp((logits - logits.max(-1, keepdim=True).values) / temp)
    assert (unclamped < 1e-38).any()  # the case the clamp is for
    assert torch.equal(plain.total, unclamped.sum(-1))
    exact = torch.distributions.Categorical(logits=logits.double() / 0.4).entropy().float()
    assert torch.allclose(plain.entropy, exact, atol=1e-5)

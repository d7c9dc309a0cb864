"""dgemma against the transformers 5.23 reference: decoder logits and reference-mode tokens."""

import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

import dgemma
from checkpoints import EOS, cut
from oracle import build_reference

pytestmark = pytest.mark.parity


def _reference_knobs(knobs):
    knobs = dict(knobs)
    if "entropy_bound" in knobs:  # the reference takes it inside a sampler config
        knobs["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=knobs.pop("entropy_bound"))
    return knobs


@pytest.mark.parametrize("shape", ["ref_gqa", "ref_wide"])
@pytest.mark.parametrize("prompt_len", [5, 23])  # 23 > sliding window
@pytest.mark.parametrize("with_sc", [False, True])
def test_canvas_logits_match_reference(request, shape, prompt_len, with_sc):
    path, ref = request.getfixturevalue(shape)
    model = dgemma.load(path)
    g = torch.Generator().manual_seed(prompt_len)
    vocab, canvas_len = model.config.vocab_size, model.config.canvas_length
    prompt = torch.randint(0, vocab, (2, prompt_len), generator=g)
    canvas = torch.randint(0, vocab, (2, canvas_len), generator=g)
    sc = torch.randn(2, canvas_len, vocab, generator=g) * 4 if with_sc else None
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=sc).logits
    got = model.canvas_logits(prompt.tolist(), canvas, sc)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


KNOBS = [
    {},  # checkpoint defaults: 48 steps, entropy bound 0.1
    {"entropy_bound": 2.0, "confidence_threshold": 1.0},  # several tokens per step, early stops
    {"entropy_bound": 1.0, "confidence_threshold": 0.5, "stability_threshold": 2, "max_denoising_steps": 10},
    {"t_min": 0.1, "t_max": 1.5, "stability_threshold": 0, "confidence_threshold": 2.0},
]


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["ref_gqa", "ref_wide"])
@pytest.mark.parametrize("knobs", range(len(KNOBS)))
def test_reference_sampling_is_token_exact(request, shape, knobs):
    path, ref = request.getfixturevalue(shape)
    model = dgemma.load(path)
    knobs = KNOBS[knobs]
    max_new = 3 * model.config.canvas_length - 5  # several canvases, the last one cut
    hit_eos = 0
    for seed in range(3):
        prompt = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        expected = ref.generate(prompt, max_new_tokens=max_new, **_reference_knobs(knobs))
        torch.manual_seed(seed)
        got = model.generate(prompt.tolist(), max_new_tokens=max_new, sampling="reference", **knobs)
        want = [cut(r[12:], max_new) for r in expected.sequences.tolist()]
        assert got.sequences == want
        assert got.tokens_per_forward == pytest.approx(expected.tokens_per_forward.tolist(), rel=1e-6)
        hit_eos += sum(1 for s in want if s and s[-1] in EOS and len(s) < max_new)
    assert hit_eos > 0, "the test should exercise EOS inside a canvas"


@pytest.mark.slow
def test_reference_sampling_ragged_batch_is_left_padded(ref_gqa):
    path, ref = ref_gqa
    model = dgemma.load(path)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22], [30, 31, 32, 33, 34, 35]]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, 12 - len(p) :] = torch.tensor(p)
        mask[r, 12 - len(p) :] = 1
    for seed in range(2):
        torch.manual_seed(seed)
        expected = ref.generate(ids, attention_mask=mask, max_new_tokens=20, **_reference_knobs({"entropy_bound": 1.0}))
        got = model.generate(prompts, max_new_tokens=20, sampling="reference", entropy_bound=1.0, seed=seed)
        assert got.sequences == [cut(r[12:], 20) for r in expected.sequences.tolist()]


@pytest.mark.slow
def test_reference_seed_argument_equals_manual_seed(ref_gqa):
    model = dgemma.load(ref_gqa[0])
    torch.manual_seed(7)
    a = model.generate([[1, 2, 3]], max_new_tokens=8, sampling="reference")
    b = model.generate([[1, 2, 3]], max_new_tokens=8, sampling="reference", seed=7)
    assert a.sequences == b.sequences


@pytest.mark.slow
def test_erf_gelu_checkpoint_matches_reference(tmp_path):
    """hidden_activation "gelu" is exact (erf) gelu in the reference, not the tanh approximation."""
    ref = build_reference(tmp_path, "gqa", text_overrides={"hidden_activation": "gelu"})
    model = dgemma.load(tmp_path)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (1, 11), generator=g)
    canvas = torch.randint(0, model.config.vocab_size, (1, model.config.canvas_length), generator=g)
    sc = torch.randn(1, model.config.canvas_length, model.config.vocab_size, generator=g) * 4
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=sc).logits
        tanh_instead = build_reference(tmp_path / "tanh", "gqa")(
            input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=sc
        ).logits
    assert (tanh_instead - expected).abs().max().item() > 1e-3  # the test can tell the two apart
    assert (model.canvas_logits(prompt.tolist(), canvas, sc) - expected).abs().max().item() < 1e-4

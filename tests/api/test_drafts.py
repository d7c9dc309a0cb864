"""Draft events, what a live view draws: the argmax canvas, which positions keep their tokens
(accepted) and each position's entropy, checked against one decoder pass done by hand."""

import pytest
import torch

import dgemma
from dgemma.engine import sampler
from dgemma.engine.constraints import CanvasConstraints, FirstCanvas
from dgemma.engine.events import Draft


@pytest.fixture(scope="module")
def tiny():
    # float32: the engine's pass and canvas_logits' dense pass agree to float32 rounding, not bf16's
    return dgemma.load(dtype="float32")


@pytest.mark.parametrize("sampling", ["default", "reference"])
def test_first_draft_is_the_first_pass_entropy_and_acceptance(tiny, sampling):
    """From a given first canvas, the first draft's entropies are those of the pass's logits at
    the first step's temperature, its accepted positions the entropy bound's choice over them,
    its canvas their argmax."""
    c, vocab = tiny.config.canvas_length, tiny.config.vocab_size
    gen = tiny.generation_config
    prompt = tiny.tokenizer.encode("def add(a, b):\n")
    start = torch.randint(0, vocab, (c,), generator=torch.Generator().manual_seed(1)).tolist()
    events = tiny.stream(prompt, drafts=True, seed=0, canvas=start, sampling=sampling, max_new_tokens=c)
    first = next(ev for ev in events if isinstance(ev, Draft))
    logits = tiny.canvas_logits([prompt], [start])[0]
    t = sampler.temperature(gen.max_denoising_steps, gen.max_denoising_steps, gen.t_min, gen.t_max)
    entropy = sampler.reference_entropy(logits / t)
    assert len(first.entropy) == len(first.accepted) == c
    assert torch.allclose(torch.tensor(first.entropy), entropy, atol=2e-3)
    assert first.accepted == sampler.entropy_bound_accept(entropy[None], gen.entropy_bound)[0].tolist()
    assert 1 <= sum(first.accepted) < c  # the bound keeps some, re-noises the rest
    assert first.canvas == logits.argmax(-1).tolist()


@pytest.mark.slow
def test_every_draft_accepts_within_the_entropy_bound(tiny):
    """Each step's accepted positions are the lowest-entropy ones, their sum minus the largest
    within the bound, and the next lowest would break it."""
    bound = tiny.generation_config.entropy_bound
    drafts = [ev for ev in tiny.stream("import os\n", drafts=True, seed=4, max_new_tokens=64) if isinstance(ev, Draft)]
    assert len(drafts) > 4
    for d in drafts:
        kept = sorted(e for e, a in zip(d.entropy, d.accepted) if a)
        rest = [e for e, a in zip(d.entropy, d.accepted) if not a]
        assert kept and sum(kept) - kept[-1] <= bound + 1e-3
        assert all(e >= kept[-1] - 1e-3 for e in rest)
        if rest:
            assert sum(kept) + min(rest) - max(kept[-1], min(rest)) > bound - 1e-3


@pytest.mark.slow
def test_fixed_positions_are_accepted_with_zero_entropy(tiny):
    c, vocab = tiny.config.canvas_length, tiny.config.vocab_size
    fixed = {0: 5, 9: 100, 31: 42}
    seeded = FirstCanvas(CanvasConstraints.build(c, vocab, fixed=fixed))
    events = tiny.stream("import os\n", drafts=True, seed=3, constraints=seeded, max_new_tokens=2 * c, eos_token_ids=[])
    drafts = [ev for ev in events if isinstance(ev, Draft)]
    firsts = [d for d in drafts if d.block == 0]
    assert firsts and all(d.accepted[p] and d.entropy[p] == 0.0 for d in firsts for p in fixed)
    assert any(
        not d.accepted[p] or d.entropy[p] > 0 for d in drafts if d.block == 1 for p in fixed
    )  # later canvases are free

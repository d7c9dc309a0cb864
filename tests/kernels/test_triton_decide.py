"""The sampler's decisions in Triton (kernels/triton_step.py `decide`, `sample_drawn`), run on CPU
by Triton's interpreter, against the torch code they replace in the runner: entropy-bound
acceptance, sampling from the request's Philox stream, re-noising, fixed positions, the stopping
rule and its history (engine/sampler.py, engine/host/step.py's `decide`)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

from dgemma.engine import sampler  # noqa: E402
from dgemma.kernels import triton_canvas  # noqa: E402
from dgemma.kernels import triton_step as ts  # noqa: E402

if not triton_canvas.INTERPRETED:
    pytest.skip("triton_step was imported before TRITON_INTERPRET was set", allow_module_level=True)

S = ts.MAX_STABILITY


def test_sample_drawn_is_philox_draws_then_sample_rows():
    g = torch.Generator().manual_seed(0)
    n, c, vocab = 3, 8, 50
    weights = torch.rand(n * c, vocab, generator=g) ** 4
    seeds = torch.tensor([ts.seed_bits(s) for s in (1, 2**64 - 1, 2**63)])
    passes = torch.tensor([0, 7, 123])
    uniforms, _ = ts.philox_draws(seeds, passes, c, vocab)
    want = ts.sample_rows(weights, None, uniforms.view(-1))
    assert torch.equal(ts.sample_drawn(weights, seeds, passes, c), want)


def torch_decisions(entropy, argmax, sampled, noise, fixed, bounds, conf, stability, histories):
    """engine/host/step.py's `decide` (torch) for each request (no grammar): what the kernel must give."""
    free = None if fixed is None else fixed < 0
    accepted = sampler.entropy_bound_accept(entropy if free is None else entropy * free, bounds[:, None])
    if free is not None:
        accepted &= free
    canvas = torch.where(accepted, sampled, noise)
    if fixed is not None:
        canvas = torch.where(free, canvas, fixed)
        argmax = torch.where(free, argmax, fixed)
    stops, hist = [], []
    for i in range(entropy.shape[0]):
        stop, history = sampler.stable_and_confident(
            histories[i],
            argmax[i : i + 1],
            entropy[i : i + 1],
            int(stability[i]),
            float(conf[i]),
            None if free is None else free[i : i + 1],
        )
        stops.append(bool(stop))
        hist.append(history)
    kept, shown = (accepted, entropy) if free is None else (accepted | ~free, entropy * free)
    return canvas, argmax, stops, hist, kept, shown


@pytest.mark.parametrize("with_fixed", [False, True])
def test_decide_is_the_runners_torch_decisions(with_fixed):
    g = torch.Generator().manual_seed(1)
    n, c, vocab = 4, 24, 97
    entropy = torch.rand(n, c, generator=g) * 0.3
    entropy[1, :5] = 0.0  # ties at zero: all taken
    entropy[3] = 1e-6  # confident
    argmax = torch.randint(0, vocab, (n, c), generator=g)
    sampled = torch.randint(0, vocab, (n, c), generator=g)
    seeds, passes = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 3, 9, 2])
    _, noise = ts.philox_draws(seeds, passes, c, vocab)
    fixed = None
    if with_fixed:
        fixed = torch.full((n, c), -1, dtype=torch.long)
        fixed[0, :3] = torch.tensor([4, 5, 6])
        fixed[2] = 9  # nothing free
    bounds = torch.tensor([0.1, 0.5, 0.0, 2.0])
    conf = torch.tensor([0.005, 0.5, 1.0, 0.01])
    stability = torch.tensor([1, 0, 2, 3], dtype=torch.int32)
    # histories: request 0 none yet (-1), 1 unused, 2 equal to this argmax (stable), 3 one row off
    final_argmax = argmax if fixed is None else torch.where(fixed < 0, argmax, fixed)
    hist = torch.full((n, S, c), -1, dtype=torch.long)
    hist[2, :2] = final_argmax[2]
    hist[3, :3] = final_argmax[3]
    hist[3, 0, 5] += 1
    torch_hist = [None, None, hist[2, :2, None].clone(), hist[3, :3, None].clone()]  # runner's [S, 1, C]
    want = torch_decisions(entropy, argmax, sampled, noise, fixed, bounds, conf, stability, torch_hist)
    got = ts.decide(entropy, argmax, sampled, seeds, passes, fixed, bounds, conf, stability, hist, vocab)
    canvas, arg, history, stop, kept, shown = got
    assert torch.equal(canvas, want[0]) and torch.equal(arg, want[1])
    assert stop.tolist() == want[2]
    assert stop.tolist()[2] and not stop.tolist()[3]  # the cases the histories were made for
    for i in range(n):
        s = int(stability[i])
        if s:
            assert torch.equal(history[i, :s], want[3][i][:, 0])
        assert torch.equal(history[i, s:], hist[i, s:])  # rows past the request's own untouched
    assert torch.equal(kept, want[4]) and torch.equal(shown, want[5])

"""The sampler's Triton kernels (dgemma/kernels/triton_step.py), run by Triton's interpreter on
CPU, against the torch code they replace: `sampler.step_statistics` on softcapped logits (with
and without allowed-token masks), `sampler.sample_from_weights`, and the Philox draws' contract.

Tolerances (float32 rounding of a different summation order and of tanh): argmax equal; entropy
and total within 1e-5 relative (plus 1e-6 absolute); weights within 1e-4 relative (exp((z - max) / T)
amplifies tanh's float32 rounding by up to 2 cap / T); samples equal
except where u x total lies within float32 rounding of a cumulative-weight boundary."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")

from dgemma.engine import sampler  # noqa: E402
from dgemma.kernels import triton_step as ts  # noqa: E402

if not ts.INTERPRETED:
    pytest.skip("triton_step was imported before TRITON_INTERPRET was set: its kernels need a GPU", allow_module_level=True)

CAP = 30.0


def raw_logits(rows: int, vocab: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g) * torch.linspace(0.5, 12, rows)[:, None]  # flat to peaked rows
    return z.to(dtype)


def torch_statistics(raw: torch.Tensor, temps: torch.Tensor, allowed=None):
    logits = torch.tanh(raw.float() / CAP) * CAP
    return sampler.step_statistics(logits, temps[:, None], allowed=allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [300, 512])  # one not a multiple of the vocab tile
def test_statistics_equal_the_torch_chain(dtype, vocab):
    raw = raw_logits(7, vocab, dtype=dtype)
    raw[2, 5] = raw[2].max() + 20  # a certain row: one token far above, at T 0.05
    temps = torch.tensor([0.8, 0.4, 0.05, 1.0, 0.3, 0.7, 0.5])
    argmax, entropy, total, probs = ts.step_statistics(raw, temps, CAP)
    ref = torch_statistics(raw, temps)
    assert argmax.tolist() == ref.argmax.tolist()
    assert torch.allclose(entropy, ref.entropy, rtol=1e-5, atol=1e-6)
    assert torch.allclose(total, ref.total, rtol=1e-5)
    assert torch.allclose(probs.log(), ref.weights.log(), atol=1e-4)  # both > 0 (floored exponent)
    assert entropy[2] < 1e-3 and argmax[2] == 5 and (entropy >= 0).all()


def test_statistics_write_bf16_probabilities_for_self_conditioning():
    raw = raw_logits(4, 256, seed=2)
    temps = torch.full((4,), 0.6)
    _, _, total, probs = ts.step_statistics(raw, temps, CAP, probs_dtype=torch.bfloat16)
    ref = torch_statistics(raw, temps)
    assert probs.dtype == torch.bfloat16
    assert torch.allclose(probs.float(), ref.weights, rtol=2**-7, atol=0)  # within one bf16 ulp of each weight
    assert torch.allclose(total, ref.total, rtol=1e-5)  # the sum is taken before rounding


def test_allowed_masks_ban_tokens_exactly():
    vocab = 300
    raw = raw_logits(5, vocab, seed=3)
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(5, vocab, generator=g) < 0.3
    keep[0] = True  # all allowed: as without a mask
    keep[1] = False
    keep[1, 299] = True  # one token, in the last word
    keep[2, raw[2].argmax()] = False  # the best token banned
    allowed = sampler.pack_token_mask(keep)
    temps = torch.full((5,), 0.5)
    argmax, entropy, total, probs = ts.step_statistics(raw, temps, CAP, allowed=allowed)
    ref = torch_statistics(raw, temps, allowed=allowed)
    assert argmax.tolist() == ref.argmax.tolist() and argmax[1] == 299
    assert (probs[~keep] == 0).all() and (probs[keep] > 0).all()
    assert torch.allclose(entropy, ref.entropy, rtol=1e-5, atol=1e-6) and entropy[1] == 0
    assert torch.allclose(total, ref.total, rtol=1e-5)
    plain = ts.step_statistics(raw, temps, CAP)
    assert torch.equal(plain[3][0], probs[0]) and plain[0][0] == argmax[0]


def test_sampling_equals_inverse_cdf():
    vocab = 700
    raw = raw_logits(64, vocab, seed=5)
    temps = torch.full((64,), 0.7)
    _, _, total, probs = ts.step_statistics(raw, temps, CAP)
    probs[::7, ::3] = 0.0  # zero-weight tokens scattered through
    total = probs.sum(-1)
    u = torch.rand(64, generator=torch.Generator().manual_seed(6))
    u[0], u[1] = 0.0, 1.0 - 1e-7  # the two ends
    got = ts.sample_rows(probs, total, u)
    expected = sampler.sample_from_weights(probs, u)
    cdf = probs.double().cumsum(-1)
    target = u.double() * cdf[:, -1]
    for row, (a, b) in enumerate(zip(got.tolist(), expected.tolist())):
        assert probs[row, a] > 0  # never a zero-weight token
        if a != b:  # only at a float32 rounding of the boundary
            lo = cdf[row, a - 1] if a > 0 else 0.0
            assert abs(target[row] - lo) < 1e-5 * cdf[row, -1] or abs(target[row] - cdf[row, a]) < 1e-5 * cdf[row, -1]
    assert (got == expected).float().mean() > 0.95


def test_sampling_bf16_weights_accumulates_in_float32():
    probs = torch.full((2, 1000), 1.0, dtype=torch.bfloat16)  # a bf16 cumsum would stall at 256
    u = torch.tensor([0.999, 0.5])
    assert ts.sample_rows(probs, probs.float().sum(-1), u).tolist() == [999, 500]


def test_philox_draws_are_per_request_streams():
    seeds = torch.tensor([7, 7, 8], dtype=torch.long)
    steps = torch.tensor([0, 0, 0], dtype=torch.long)
    u, noise = ts.philox_draws(seeds, steps, 48, 1000)
    assert u.shape == (3, 48) and noise.shape == (3, 48)
    assert torch.equal(u[0], u[1]) and torch.equal(noise[0], noise[1])  # same seed and step: same numbers
    assert not torch.equal(u[0], u[2])  # another request's stream
    assert ((u >= 0) & (u < 1)).all() and ((noise >= 0) & (noise < 1000)).all()
    later, later_noise = ts.philox_draws(seeds, torch.tensor([1, 0, 0]), 48, 1000)
    assert not torch.equal(later[0], u[0]) and torch.equal(later[1], u[1])  # the step moves the stream on
    many, tokens = ts.philox_draws(torch.tensor([3]), torch.tensor([5]), 4096, 50)
    assert abs(float(many.mean()) - 0.5) < 0.03 and len(set(tokens.view(-1).tolist())) == 50  # roughly uniform


def test_bad_arguments_name_the_problem():
    raw = raw_logits(3, 64)
    with pytest.raises(ValueError, match="temps must be"):
        ts.step_statistics(raw, torch.ones(2), CAP)
    with pytest.raises(ValueError, match="allowed must be int32"):
        ts.step_statistics(raw, torch.ones(3), CAP, allowed=torch.zeros(3, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="logits must be"):
        ts.step_statistics(raw.long(), torch.ones(3), CAP)
    with pytest.raises(ValueError, match="uniforms must be"):
        ts.sample_rows(raw.exp(), raw.exp().sum(-1), torch.rand(4))

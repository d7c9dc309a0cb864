"""The allowed-token mask (llguidance's packed int32 bitmask) in a step's statistics: packing, the
torch path against a hand computation with -inf logits, sampling never leaving the mask, and the
native kernel against the torch path."""

import math

import pytest
import torch

from dgemma.engine import sampler
from dgemma.kernels import native

needs_native = pytest.mark.skipif(
    native.extension() is None, reason="native kernels unavailable (no AVX-512 BF16 or no compiler)"
)


def _random_mask(rows: int, vocab: int, density: float, g: torch.Generator) -> torch.Tensor:
    keep = torch.rand(rows, vocab, generator=g) < density
    keep[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=g)] = True  # every row allows a token
    return keep


def _hand_statistics(logits: torch.Tensor, temps: torch.Tensor, keep: torch.Tensor):
    """What the mask means: disallowed logits -inf, then the plain definitions."""
    masked = logits.masked_fill(~keep, -math.inf)
    top = masked.max(-1, keepdim=True).values
    weights = torch.where(keep, torch.exp(((masked - top) / temps).clamp(min=sampler.EXP_FLOOR)), 0.0)
    entropy = torch.distributions.Categorical(logits=masked.double() / temps.double()).entropy().float()
    return masked.argmax(-1), entropy, weights, weights.sum(-1)


@pytest.mark.parametrize("vocab", [1, 5, 31, 32, 33, 100, 128, 1040])
def test_pack_unpack_round_trip(vocab):
    g = torch.Generator().manual_seed(vocab)
    keep = torch.rand(6, vocab, generator=g) < 0.5
    keep[0], keep[1] = True, False
    bits = sampler.pack_token_mask(keep)
    assert bits.dtype == torch.int32 and bits.shape == (6, math.ceil(vocab / 32))
    assert torch.equal(sampler.unpack_token_mask(bits, vocab), keep)
    # the format, bit by bit: token t is bit t % 32 of word t // 32, the bits past the vocab are 0
    for row in range(6):
        for w in range(bits.shape[1]):
            word = sum(1 << b for b in range(32) if 32 * w + b < vocab and keep[row, 32 * w + b])
            assert bits[row, w].item() == (word - 2**32 if word >= 2**31 else word)
    # bits past the vocab are ignored when unpacking
    assert sampler.unpack_token_mask(torch.full_like(bits, -1), vocab).all()
    # leading dims pass through
    assert torch.equal(
        sampler.unpack_token_mask(sampler.pack_token_mask(keep.view(2, 3, vocab)), vocab), keep.view(2, 3, vocab)
    )


def test_pack_known_words():
    keep = torch.zeros(1, 64, dtype=torch.bool)
    keep[0, [0, 31, 33]] = True
    assert sampler.pack_token_mask(keep).tolist() == [[1 - 2**31, 2]]
    with pytest.raises(ValueError):
        sampler.unpack_token_mask(torch.zeros(1, 1, dtype=torch.int32), 33)


@pytest.mark.parametrize("seed", range(3))
def test_torch_path_with_a_mask_equals_the_hand_computation(seed):
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 8, 100
    logits = torch.tanh(torch.randn(rows, vocab, generator=g) * 2) * 30.0
    temps = torch.rand(rows, 1, generator=g) + 0.3
    keep = _random_mask(rows, vocab, 0.3, g)
    keep[0] = False
    keep[0, 57] = True  # one allowed token: entropy 0, weight 1 there
    keep[1, logits[1].argmax()] = False  # the unmasked argmax disallowed
    keep[2, -1] = False  # the last token disallowed
    argmax, entropy, weights, total = _hand_statistics(logits, temps, keep)
    stats = sampler.step_statistics(logits, temps, allowed=sampler.pack_token_mask(keep))
    assert torch.equal(stats.argmax, argmax) and stats.argmax[0].item() == 57
    assert keep[torch.arange(rows), stats.argmax].all()
    assert torch.allclose(stats.entropy, entropy, atol=1e-5) and stats.entropy[0].item() == 0.0
    assert torch.allclose(stats.total, total, rtol=1e-6)
    assert torch.allclose(stats.weights, weights, rtol=1e-6, atol=0)
    assert (stats.weights[~keep] == 0).all() and (stats.weights[keep] > 0).all()
    # the engine's variant (logits overwritten, weights into a buffer) and a [B, C, V] layout agree
    buffer = torch.empty_like(logits)
    fast = sampler.step_statistics(
        logits.clone(), temps, overwrite_logits=True, out=buffer, allowed=sampler.pack_token_mask(keep)
    )
    assert fast.weights.data_ptr() == buffer.data_ptr()
    assert (
        torch.equal(fast.argmax, stats.argmax)
        and torch.equal(fast.weights, stats.weights)
        and torch.equal(fast.total, stats.total)
    )
    assert torch.allclose(fast.entropy, stats.entropy, atol=1e-6)
    shaped = sampler.step_statistics(
        logits.view(2, 4, vocab), temps.view(2, 4, 1), allowed=sampler.pack_token_mask(keep.view(2, 4, vocab))
    )
    assert torch.equal(shaped.argmax.view(-1), stats.argmax) and torch.equal(
        shaped.weights.view(rows, vocab), stats.weights
    )


def test_torch_path_with_an_all_ones_mask_is_bit_identical_to_no_mask():
    g = torch.Generator().manual_seed(11)
    logits = torch.tanh(torch.randn(6, 100, generator=g) * 2) * 30.0  # (logits - max) / 0.4 reaches the exp floor
    logits[0] = 0.0
    logits[1, 3] = logits[1, 60] = 30.0
    temps = torch.full((6, 1), 0.4)
    ones = torch.full((6, 4), -1, dtype=torch.int32)  # the 28 bits past vocab 100 set too: ignored
    for overwrite in (False, True):
        plain = sampler.step_statistics(logits.clone(), temps, overwrite_logits=overwrite)
        masked = sampler.step_statistics(logits.clone(), temps, overwrite_logits=overwrite, allowed=ones)
        for name in ("argmax", "entropy", "weights", "total"):
            assert torch.equal(getattr(masked, name), getattr(plain, name)), name


def test_a_row_allowing_nothing_gives_finite_numbers():
    logits = torch.randn(2, 40)
    keep = torch.ones(2, 40, dtype=torch.bool)
    keep[1] = False
    stats = sampler.step_statistics(logits, 0.7, allowed=sampler.pack_token_mask(keep))
    assert stats.entropy.isfinite().all() and stats.total.isfinite().all() and stats.weights.isfinite().all()
    sampler.sample_from_weights(stats.weights, torch.tensor([0.5, 0.5]))  # no crash


def test_sampling_masked_weights_never_picks_a_disallowed_token():
    g = torch.Generator().manual_seed(5)
    rows, vocab = 6, 70
    logits = torch.randn(rows, vocab, generator=g) * 8
    keep = _random_mask(rows, vocab, 0.2, g)
    keep[0] = False
    keep[0, 35] = True  # a single allowed token
    keep[1, :-1], keep[1, -1] = False, True  # only the last token
    keep[2], keep[2, 0] = False, True  # only the first
    keep[3, -5:] = False  # the tail disallowed: u ~ 1 must not fall into it
    keep[4, :5] = False  # the head disallowed: u ~ 0 must not either
    logits[5, ~keep[5]] = 50.0  # the disallowed tokens are the most likely ones
    stats = sampler.step_statistics(logits, 0.9, allowed=sampler.pack_token_mask(keep))
    one = torch.tensor(1.0)
    edges = torch.tensor(
        [0.0, 1e-45, 1e-30, 2**-24, 2**-10, 0.5, 1 - 2**-10, 1 - 2**-23, torch.nextafter(one, torch.tensor(0.0)).item()]
    )
    uniforms = torch.cat([edges, torch.rand(5000, generator=g)])
    for row in range(rows):
        picks = sampler.sample_from_weights(stats.weights[row].expand(len(uniforms), -1), uniforms)
        assert keep[row, picks].all(), row
    weights = stats.weights.repeat(len(uniforms), 1)
    picks = sampler.sample_from_weights(weights, uniforms.repeat_interleave(rows))
    assert keep.repeat(len(uniforms), 1)[torch.arange(len(picks)), picks].all()


def _native_and_torch(
    raw: torch.Tensor, temps: torch.Tensor, keep: torch.Tensor | None, bits: torch.Tensor | None = None
):
    rows, vocab = raw.shape
    if bits is None:
        bits = sampler.pack_token_mask(keep) if keep is not None else torch.empty(0, dtype=torch.int32)
    weights, probs = torch.empty(rows, vocab), torch.empty(rows, vocab, dtype=torch.bfloat16)
    argmax, entropy, total = native.extension().step_statistics(raw, 30.0, temps, weights, probs, bits)
    reference = sampler.step_statistics(
        raw.float().div(30.0).tanh().mul(30.0), temps[:, None], allowed=bits if bits.numel() else None
    )
    return (argmax, entropy, total, weights, probs), reference


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_step_statistics_with_a_mask_equal_the_torch_ones(dtype):
    g = torch.Generator().manual_seed(1)
    rows, vocab = 9, 1040  # 32.5 words a row: the last word's high half-word lies past the vocab
    raw = (torch.randn(rows, vocab, generator=g) * 12).to(dtype)
    raw[2, 100] = raw[2, 1000] = 200.0  # a tie on the maximum, both allowed: the first index wins
    raw[3] = 0.0  # a flat row: entropy log(allowed count)
    raw[4], raw[4, 7] = -1e4, 1e4  # one certain token, disallowed: the mask decides among the rest
    raw[5, 500] = 300.0  # the maximum disallowed
    temps = torch.rand(rows, generator=g) + 0.3
    keep = _random_mask(rows, vocab, 0.4, g)
    keep[2, [100, 1000]] = True
    keep[4, 7] = False
    keep[5, 500] = False
    keep[6] = True  # all ones
    keep[7], keep[7, 1039] = False, True  # a single allowed token, the last one
    bits = sampler.pack_token_mask(keep)
    bits[:, -1] |= -65536  # bits past the vocab set (the high half-word): ignored
    (argmax, entropy, total, weights, probs), reference = _native_and_torch(raw, temps, None, bits)
    assert torch.equal(argmax, reference.argmax) and argmax[2].item() == 100 and argmax[7].item() == 1039
    assert keep[torch.arange(rows), argmax].all()
    assert torch.allclose(entropy, reference.entropy, atol=2e-5) and entropy[7].item() == 0.0
    assert entropy[3].item() == pytest.approx(math.log(keep[3].sum().item()), abs=2e-5)
    assert torch.allclose(total, reference.total, rtol=1e-5)
    assert torch.allclose(weights, reference.weights, rtol=1e-4, atol=1e-30)
    assert torch.equal(probs, weights.bfloat16())
    assert (weights[~keep] == 0).all() and (weights[keep] > 0).all()
    assert (probs[~keep] == 0).all()


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_all_ones_mask_is_bit_identical_to_no_mask(dtype):
    g = torch.Generator().manual_seed(2)
    rows, vocab = 5, 1024
    raw = (torch.randn(rows, vocab, generator=g) * 12).to(dtype)
    raw[1], raw[1, 9] = -1e4, 1e4  # weights at the exp floor
    temps = torch.rand(rows, generator=g) + 0.3
    (no_mask, _), (ones, _) = (
        _native_and_torch(raw, temps, keep) for keep in (None, torch.ones(rows, vocab, dtype=torch.bool))
    )
    for a, b in zip(no_mask, ones):
        assert torch.equal(a, b)
    weights, probs = torch.empty(rows, vocab), torch.empty(rows, vocab, dtype=torch.bfloat16)
    default = native.extension().step_statistics(raw, 30.0, temps, weights, probs)  # allowed defaults to none
    assert all(torch.equal(a, b) for a, b in zip(default, no_mask[:3])) and torch.equal(weights, no_mask[3])


@needs_native
def test_native_mask_edge_cases():
    kernel = native.extension()
    raw, temps = torch.randn(3, 48) * 5, torch.ones(3)
    weights, no_probs = torch.empty(3, 48), torch.empty(0, dtype=torch.bfloat16)
    keep = torch.ones(3, 48, dtype=torch.bool)
    keep[1] = False  # allows nothing: finite garbage, no crash
    keep[2, :47] = False
    argmax, entropy, total = kernel.step_statistics(raw, 30.0, temps, weights, no_probs, sampler.pack_token_mask(keep))
    assert entropy.isfinite().all() and total.isfinite().all() and weights.isfinite().all()
    assert argmax[2].item() == 47 and entropy[2].item() == 0.0 and weights[2, 47].item() == 1.0
    for bad in (
        torch.zeros(3, 1, dtype=torch.int32),
        torch.zeros(2, 2, dtype=torch.int32),
        torch.zeros(3, 2, dtype=torch.int64),
    ):
        with pytest.raises(RuntimeError, match="allowed"):
            kernel.step_statistics(raw, 30.0, temps, weights, no_probs, bad)

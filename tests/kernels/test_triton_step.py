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
pytestmark = pytest.mark.triton

from dgemma.engine import sampler  # noqa: E402
from dgemma.kernels import triton_canvas  # noqa: E402
from dgemma.kernels import triton_step as ts  # noqa: E402

if not triton_canvas.INTERPRETED:
    pytest.skip(
        "triton_step was imported before TRITON_INTERPRET was set: its kernels need a GPU", allow_module_level=True
    )

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


@pytest.mark.slow
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


def peaked_bf16_rows(vocab: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """Peaked rows as `step_statistics` writes them for bf16 self-conditioning: the float32
    weights (every token at least exp(EXP_FLOOR), so all non-zero unless banned) and their bf16
    rounding. 0.3017 rounds down to 0.30078125 in bf16, so the float32 total exceeds the sum of
    the stored (searched) weights by ~7e-4 relative."""
    floor = torch.tensor(sampler.EXP_FLOOR).exp()
    w = torch.full((5, vocab), float(floor))
    w[0, 300], w[0, 700] = 1.0, 0.3017  # the second big weight comes last: where a high draw lands
    w[1, 10], w[1, vocab - 1] = 0.3017, 1.0  # the last id has real mass
    w[2, 5] = 1.0  # one token only
    w[3, 200], w[3, vocab - 2], w[3, vocab - 1] = 0.6017, 0.5, 0.0  # a banned last token
    w[4, 130], w[4, 640] = 0.3017, 1.0  # the peak in a later tile than the second weight
    return w, w.to(torch.bfloat16)


def inverse_cdf64(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Float64 inverse CDF over the weights as stored: the first index whose cumulative weight
    exceeds u x (their sum)."""
    cdf = weights.double().cumsum(-1)
    target = u.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)


@pytest.mark.parametrize("draw", [0.99999, float(torch.tensor(1.0).nextafter(torch.tensor(0.0)))])  # 1 - 2^-24
def test_high_draws_on_bf16_rows_follow_the_stored_weights(draw):
    w32, probs = peaked_bf16_rows()
    vocab = probs.shape[1]
    u = torch.full((probs.shape[0],), draw)
    assert float(u[0]) < 1.0
    got = ts.sample_rows(probs, w32.sum(-1), u)  # the total step_statistics gives: of the unrounded weights
    expected = inverse_cdf64(probs, u)
    argmax = probs.float().argmax(-1)
    assert expected.tolist() == [700, vocab - 1, 5, vocab - 2, 640]
    for row, token in enumerate(got.tolist()):
        assert probs[row, token] > 1e-3  # real mass: never a floor-weight token, never the last id by default
        if draw == 0.99999:
            assert token == expected[row]
        else:  # u x sum may round up to the sum in float32: then the row's argmax
            assert token in (expected[row], argmax[row])
    assert got[1] == vocab - 1  # where the last id does carry the mass, it is sampled


@pytest.mark.slow
def test_draw_past_the_searched_sum_falls_back_to_the_argmax():
    _, probs = peaked_bf16_rows()
    argmax = probs.float().argmax(-1)
    for u in (1.0, 1.5):  # outside [0, 1): u x sum >= every cumulative weight
        got = ts.sample_rows(probs, probs.float().sum(-1), torch.full((probs.shape[0],), u))
        assert got.tolist() == argmax.tolist()
    total = probs.float().sum(-1)
    hint = ts.sample_rows(probs, total * 3, torch.full((5,), 0.5))  # `total` is only a hint now: ignored
    assert torch.equal(hint, ts.sample_rows(probs, None, torch.full((5,), 0.5)))
    assert torch.equal(hint, inverse_cdf64(probs, torch.full((5,), 0.5)))


# philox_draws(seeds=[0, 1, 7, 2^63 - 1, 123456789], steps=[0, 3, 1, 2, 9], C=4, vocab=1000), as the
# kernel drew them before seeds were read as unsigned 64-bit keys: seeds below 2^63 keep their streams.
PINNED_SEEDS = [0, 1, 7, 2**63 - 1, 123456789]
PINNED_STEPS = [0, 3, 1, 2, 9]
PINNED_U = [
    ["0x1.989fa2p-1", "0x1.c6ccd4p-5", "0x1.3ea8c8p-5", "0x1.b37884p-2"],
    ["0x1.a9f9d6p-1", "0x1.973386p-1", "0x1.e776f0p-2", "0x1.b6841ap-1"],
    ["0x1.28e30ap-1", "0x1.5abd58p-1", "0x1.940f32p-2", "0x1.152472p-1"],
    ["0x1.b207b4p-4", "0x1.554e0ep-2", "0x1.fd577cp-5", "0x1.07fb02p-1"],
    ["0x1.e94a14p-5", "0x1.4e5b10p-1", "0x1.05f8bcp-1", "0x1.1bc078p-3"],
]
PINNED_NOISE = [
    [453, 499, 126, 206],
    [866, 547, 485, 567],
    [438, 393, 666, 51],
    [57, 336, 86, 641],
    [231, 797, 82, 531],
]


def philox_reference(seed: int, step: int, canvas_length: int, vocab: int) -> tuple[list[float], list[int]]:
    """Philox4x32-10 in Python, keyed by the seed's unsigned 64 bits (low word k0, high word k1)
    at counter (step x C + position mod 2^32, 0, 0, 0), converted as tl.rand does."""
    m = 0xFFFFFFFF
    us, noise = [], []
    for pos in range(canvas_length):
        c0, c1, c2, c3 = (step * canvas_length + pos) & m, 0, 0, 0
        k0, k1 = seed & m, (seed >> 32) & m
        for _ in range(10):
            hi_b, lo_b = divmod(0xCD9E8D57 * c2, 1 << 32)
            hi_a, lo_a = divmod(0xD2511F53 * c0, 1 << 32)
            c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
            k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
        x = c0 - (1 << 32) if c0 >= 1 << 31 else c0  # as int32
        x = ~x if x < 0 else x
        us.append(float(torch.tensor(float(x)) * torch.tensor(4.6566127342e-10)))  # float32, as the kernel
        noise.append(c1 % vocab)
    return us, noise


def test_seed_bits_maps_the_full_unsigned_range_to_int64():
    assert ts.seed_bits(0) == 0 and ts.seed_bits(2**63 - 1) == 2**63 - 1
    assert ts.seed_bits(2**63) == -(2**63) and ts.seed_bits(2**64 - 1) == -1
    assert torch.tensor([ts.seed_bits(2**64 - 1)], dtype=torch.long).item() == -1  # fits an int64 tensor
    for bad in (-1, 2**64, 2**70):
        with pytest.raises(ValueError, match="seed"):
            ts.seed_bits(bad)


def test_philox_streams_of_small_seeds_are_unchanged():
    seeds = torch.tensor([ts.seed_bits(s) for s in PINNED_SEEDS], dtype=torch.long)
    u, noise = ts.philox_draws(seeds, torch.tensor(PINNED_STEPS), 4, 1000)
    assert u.tolist() == [[float.fromhex(x) for x in row] for row in PINNED_U]
    assert noise.tolist() == PINNED_NOISE


def test_philox_seeds_up_to_2_pow_64_give_distinct_valid_streams():
    big = [0, 2**63 - 1, 2**63, 2**64 - 1]
    seeds = torch.tensor([ts.seed_bits(s) for s in big], dtype=torch.long)
    u, noise = ts.philox_draws(seeds, torch.tensor([2, 2, 2, 2]), 48, 1000)
    assert ((u >= 0) & (u < 1)).all() and ((noise >= 0) & (noise < 1000)).all()
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(u[a], u[b]) and not torch.equal(noise[a], noise[b])
    for row, seed in enumerate(big):  # each the Philox stream keyed by the seed's unsigned 64 bits
        ref_u, ref_noise = philox_reference(seed, 2, 48, 1000)
        assert u[row].tolist() == ref_u and noise[row].tolist() == ref_noise


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
    with pytest.raises(ValueError, match="seeds must be int64"):
        ts.philox_draws(torch.tensor([1], dtype=torch.int32), torch.tensor([0]), 8, 100)

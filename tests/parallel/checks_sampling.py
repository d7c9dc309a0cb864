"""The sampler over a vocabulary split across ranks (dgemma/engine/sharded/sampling.py) against the
single-process sampler on the full rows: every rank builds the same full logits (same seed) and
keeps its shard's columns. Run by worker.py on 2 gloo ranks; each check raises on failure."""

import math

import torch

from dgemma.engine import sampler
from dgemma.engine.constraints.grammar import best_allowed, best_allowed_candidate, top_candidates
from dgemma.engine.sharded import sampling
from dgemma.parallel.plan import vocab_shard

CAP = 30.0  # the final logit softcap
VOCABS = (1000, 1003)  # not multiples of 64: the last shard is shorter


def _logits(seed: int, rows: int, vocab: int) -> torch.Tensor:
    """Softcapped random logits, rows from flat to peaked (some weights reach EXP_FLOOR)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1.5, rows)[:, None]
    return CAP * torch.tanh(torch.randn(rows, vocab, generator=g) * scale / CAP)


def _plant(logits: torch.Tensor, start: int, vocab: int) -> dict[str, int]:
    """Rows whose argmax is a tie or sits on the last shard; {what: row}."""
    top = float(logits.max()) + 1.0
    rows = {}
    rows["tie across shards"] = 0  # equal maxima on both shards: the lower id wins
    logits[0, start + 7] = logits[0, 9] = top
    rows["tie at the boundary"] = 1
    logits[1, start - 1] = logits[1, start] = top
    rows["tie inside the last shard"] = 2
    logits[2, start + 40] = logits[2, start + 3] = logits[2, vocab - 1] = top
    rows["tie inside the first shard"] = 3
    logits[3, 100] = logits[3, 31] = top
    rows["max at the last token"] = 4
    logits[4, vocab - 1] = top
    return rows


def _masks(rows: int, vocab: int, start: int, seed: int) -> torch.Tensor:
    """Packed allowed-token masks: random rows, one token on the other shard, one on the first,
    everything, nothing."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=g) < 0.3
    allowed[5] = False
    allowed[5, vocab - 2] = True  # a single token on the last shard
    allowed[6] = False
    allowed[6, 5] = True  # a single token on the first shard
    allowed[7] = True
    allowed[8] = False  # nothing (the caller's error): argmax 0, weights 0, entropy 0
    allowed[9] = False
    allowed[9, start - 3 : start + 3] = True  # straddling the boundary
    return sampler.pack_token_mask(allowed)


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    if not torch.allclose(a, b, rtol=tol, atol=tol):
        worst = (a - b).abs().max()
        raise AssertionError(f"{what}: max difference {float(worst):.3g}")


def _stats_case(group, vocab: int, seed: int, temp, masked: bool, overwrite: bool) -> None:
    start, end = vocab_shard(vocab, group.size, group.rank)
    first_end = vocab_shard(vocab, group.size, 0)[1]
    rows = 24
    full = _logits(seed, rows, vocab)
    planted = _plant(full, first_end, vocab)
    allowed = _masks(rows, vocab, first_end, seed + 1) if masked else None
    want = sampler.step_statistics(full.clone(), temp, allowed=allowed)
    local = full[:, start:end].clone()
    out = torch.empty_like(local) if overwrite else None
    got = sampling.sharded_step_statistics(
        local, temp, group, start, allowed=allowed, overwrite_logits=overwrite, out=out
    )
    label = f"vocab {vocab}, seed {seed}, masked {masked}, overwrite {overwrite}"
    if not torch.equal(got.argmax, want.argmax):
        bad = (got.argmax != want.argmax).nonzero().flatten().tolist()
        names = [n for n, r in planted.items() if r in bad]
        raise AssertionError(f"{label}: argmax differs at rows {bad} {names}: {got.argmax[bad]} vs {want.argmax[bad]}")
    if not masked:
        for name, r in planted.items():  # the planted rows: the full row's first maximum
            first = int((full[r] == full[r].max()).nonzero()[0])
            if int(got.argmax[r]) != first:
                raise AssertionError(f"{label}: {name}: argmax {int(got.argmax[r])}, want {first}")
    if not torch.equal(got.weights, want.weights[:, start:end]):
        raise AssertionError(f"{label}: weights are not the full weights' columns [{start}, {end})")
    if overwrite and got.weights.data_ptr() != out.data_ptr():
        raise AssertionError(f"{label}: weights not written to `out`")
    _close(got.total, want.total, f"{label}: total")
    _close(got.entropy, want.entropy, f"{label}: entropy")
    if masked:
        if not (got.entropy[8] == 0 and got.total[8] == 0 and got.argmax[8] == 0):
            raise AssertionError(f"{label}: a row allowing nothing: {got.entropy[8]}, {got.total[8]}, {got.argmax[8]}")
        if int(got.argmax[5]) != vocab - 2 or int(got.argmax[6]) != 5:
            raise AssertionError(f"{label}: single-token rows: argmax {got.argmax[5:7].tolist()}")


def check_statistics(group):
    """Argmax exactly (planted ties across and inside shards, the max on the shorter last shard),
    weights bit-equal per shard, total and entropy within 1e-5: with scalar and per-row
    temperatures, masks, and the in-place buffers."""
    per_row = torch.linspace(0.2, 2.0, 24)[:, None]
    for vocab in VOCABS:
        for seed, temp in ((1, 1.0), (2, per_row), (3, 0.05)):
            for masked in (False, True):
                _stats_case(group, vocab, seed + vocab, temp, masked, overwrite=False)
        _stats_case(group, vocab, 7, per_row, True, overwrite=True)
        _stats_case(group, vocab, 8, 1.0, False, overwrite=True)


def check_shard_mask(group):
    """A packed mask sliced at a shard's words unpacks to the shard's columns of the full mask."""
    g = torch.Generator().manual_seed(5)
    for vocab in VOCABS:
        allowed = torch.rand(3, vocab, generator=g) < 0.5
        packed = sampler.pack_token_mask(allowed)
        for rank in range(group.size):
            start, end = vocab_shard(vocab, group.size, rank)
            got = sampler.unpack_token_mask(sampling.shard_mask(packed, start, end), end - start)
            assert torch.equal(got, allowed[:, start:end]), f"vocab {vocab}, rank {rank}: mask slice differs"
    try:
        sampling.shard_mask(packed, 16, 48)
    except ValueError:
        pass
    else:
        raise AssertionError("a shard starting inside a mask word was accepted")


def _weights(vocab: int, seed: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Full weights of softcapped logits at T = 1 with masks (rows allowing one token, a boundary)."""
    first_end = vocab_shard(vocab, 2, 0)[1]
    logits = _logits(seed, rows, vocab)
    allowed = _masks(rows, vocab, first_end, seed)
    allowed[8] = -1  # every row allows a token here
    return sampler.step_statistics(logits, 1.0, allowed=allowed).weights, allowed


def check_sample(group):
    """Sampled tokens equal sample_from_weights on the full rows for 256 draws per row, except
    draws whose target lies within 1e-5 (relative) of a CDF boundary (skipped; at least 90% are
    compared); never a zero-weight token; u = 0 and u just below 1 included."""
    draws = 256
    for vocab in VOCABS:
        start, end = vocab_shard(vocab, group.size, group.rank)
        full, _ = _weights(vocab, 11 + vocab)
        rows = full.shape[0]
        g = torch.Generator().manual_seed(vocab)
        u = torch.rand(rows, draws, generator=g)
        u[:, 0], u[:, 1] = 0.0, 1.0 - 2**-24
        weights = full.repeat_interleave(draws, dim=0)
        got = sampling.sharded_sample(weights[:, start:end].contiguous(), u.flatten(), group, start)
        want = sampler.sample_from_weights(weights, u.flatten())
        cdf = torch.cumsum(weights, dim=-1)
        target = u.flatten()[:, None] * cdf[:, -1:]
        margin = ((cdf - target).abs() / cdf[:, -1:]).amin(dim=-1)
        compared = margin > 1e-5
        if compared.float().mean() < 0.9:
            raise AssertionError(f"vocab {vocab}: only {compared.float().mean():.1%} of draws clear of a CDF boundary")
        bad = (got != want) & compared
        if bad.any():
            i = int(bad.nonzero()[0])
            raise AssertionError(
                f"vocab {vocab}: draw {i}: token {int(got[i])} vs {int(want[i])} (margin {float(margin[i]):.3g})"
            )
        if (weights.gather(1, got[:, None]) == 0).any():
            raise AssertionError(f"vocab {vocab}: a zero-weight token was sampled")
        if not torch.equal(got[5 * draws : 6 * draws], torch.full((draws,), vocab - 2)):
            raise AssertionError(f"vocab {vocab}: a row allowing one token on the last shard sampled another")


def _same_top(got, want, weights: torch.Tensor, what: str) -> None:
    """Top lists equal up to the order of equal weights (ties are interchangeable)."""
    if len(got) != len(want):
        raise AssertionError(f"{what}: {len(got)} alternatives vs {len(want)}")
    if len({t for t, _ in got}) != len(got):
        raise AssertionError(f"{what}: a token listed twice")
    for (ta, la), (tb, lb) in zip(got, want):
        if abs(la - lb) > 1e-6 or weights[ta] != weights[tb]:
            raise AssertionError(f"{what}: ({ta}, {la}) vs ({tb}, {lb})")


def check_logprobs(group):
    """row_logprobs on the full rows: picked and top log probabilities within 1e-6, the same
    tokens (up to equal weights), k of 3, wider than the last shard, and wider than the vocabulary;
    a banned picked token gives -inf."""
    for vocab in VOCABS:
        start, end = vocab_shard(vocab, group.size, group.rank)
        full, _ = _weights(vocab, 21 + vocab)
        g = torch.Generator().manual_seed(vocab)
        tokens = torch.randint(0, vocab, (full.shape[0],), generator=g)
        tokens[0], tokens[1], tokens[2] = full[0].argmax(), vocab - 1, start
        tokens[5] = 3  # banned there: probability 0
        local = full[:, start:end]
        for k in (3, 600, 1200):
            got = sampling.sharded_row_logprobs(local, tokens, k, group, start)
            want = sampler.row_logprobs(full, tokens, k)
            for r, (a, b) in enumerate(zip(got, want)):
                what = f"vocab {vocab}, k {k}, row {r}"
                same = a.logprob == b.logprob or abs(a.logprob - b.logprob) <= 1e-6
                if a.token != b.token or not same:
                    raise AssertionError(f"{what}: picked ({a.token}, {a.logprob}) vs ({b.token}, {b.logprob})")
                _same_top(a.top, b.top, full[r], what)
            if not math.isinf(got[5].logprob):
                raise AssertionError(f"vocab {vocab}: a banned token's logprob {got[5].logprob}")


def check_refine_candidates(group):
    """A grammar's refine inputs: the top candidates equal top_candidates on the full rows (values
    exactly, tokens up to equal weights), the candidates settle the same tokens, and the
    whole-row fallback rounds (driven by rank 0) give best_allowed's token on every rank,
    including ties across the shards (the lower id) and masks with no weighted token."""
    vocab = 1003
    start, end = vocab_shard(vocab, group.size, group.rank)
    first_end = vocab_shard(vocab, group.size, 0)[1]
    full, _ = _weights(vocab, 31)
    full[2, 700], full[2, 40] = 2.0, 2.0  # a tie across the shards, above every other weight
    full[3, first_end + 5], full[3, first_end + 2] = 2.0, 2.0  # a tie inside the last shard
    local = full[:, start:end].contiguous()
    got = sampling.sharded_top_candidates(local, group, start)
    want = top_candidates(full)
    for r, ((gv, gi), (wv, wi)) in enumerate(zip(got, want)):
        if gv != wv or any(full[r, a] != full[r, b] for a, b in zip(gi, wi)):
            raise AssertionError(f"row {r}: candidates differ")
    if got[2][1][0] != 40 or got[3][1][0] != first_end + 2:
        raise AssertionError(f"ties: candidates start {got[2][1][:2]}, {got[3][1][:2]}")
    g = torch.Generator().manual_seed(3)
    requests = []
    for r in range(full.shape[0]):
        allowed = torch.rand(vocab, generator=g) < 0.01
        if r == 2:
            allowed[:] = False
            allowed[[40, 700]] = True
        if r == 4:
            allowed[:] = False
            allowed[vocab - 3] = True  # a single token on the last shard
        if r == 3:
            allowed[:] = False
            allowed[[first_end + 2, first_end + 5, 7]] = True  # a tie inside the last shard
        if r == 5:
            allowed[:] = False
            allowed[3] = True  # a zero weight there: None
        mask = sampler.pack_token_mask(allowed)
        requests.append((r, mask))
        settled = best_allowed_candidate(mask, *got[r])
        if settled != best_allowed_candidate(mask, *want[r]):
            raise AssertionError(f"row {r}: the candidates settle differently")
    answers = [(True, sampling.sharded_best_allowed_at(local, group, start, r, mask)) for r, mask in requests]
    for (r, mask), (_, token) in zip(requests, answers):
        expect = best_allowed(mask, full[r])
        if token != expect:
            raise AssertionError(f"row {r}: best allowed {token}, want {expect}")
    planted = [answers[r][1] for r in (2, 3, 4, 5)]
    if planted != [40, first_end + 2, vocab - 3, None]:
        raise AssertionError(f"planted rows: {planted}")


def check_tiny_vocabulary(group):
    """A vocabulary narrower than one 32-token word per rank leaves the last shard empty: every
    function still equals the full-row one (the empty shard adds nothing and is never chosen)."""
    vocab = 20
    start, end = vocab_shard(vocab, group.size, group.rank)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, vocab, generator=g) * 3
    allowed = sampler.pack_token_mask(torch.rand(6, vocab, generator=g) < 0.5)
    allowed[0] = -1
    want = sampler.step_statistics(logits.clone(), 0.8, allowed=allowed)
    got = sampling.sharded_step_statistics(logits[:, start:end].clone(), 0.8, group, start, allowed=allowed)
    assert torch.equal(got.argmax, want.argmax) and torch.equal(got.weights, want.weights[:, start:end]), "statistics"
    _close(got.entropy, want.entropy, "entropy")
    u = torch.rand(6, generator=g)
    assert torch.equal(
        sampling.sharded_sample(got.weights, u, group, start), sampler.sample_from_weights(want.weights, u)
    ), "sample"
    a = sampling.sharded_row_logprobs(got.weights, want.argmax, 30, group, start)
    b = sampler.row_logprobs(want.weights, want.argmax, 30)
    for r, (x, y) in enumerate(zip(a, b)):
        assert x.token == y.token and abs(x.logprob - y.logprob) <= 1e-6, f"row {r}: picked"
        _same_top(x.top, y.top, want.weights[r], f"row {r}")
    answer = sampling.sharded_best_allowed_at(got.weights, group, start, 1, allowed[1])
    assert answer == best_allowed(allowed[1], want.weights[1]), f"best allowed {answer}"

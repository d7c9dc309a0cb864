"""The fused network's encoder pass planned in place (`PagedKVCache.plan_encoder(in_place=True)`:
the q|k|v kernel writes K/V into the pool, `triton_attention.paged_prefix_attention` reads them
there with the prefix) against the path it replaced (the same fused layers, K/V copied into the pool
by `index_copy_`, the prefix gathered, SDPA with a mask), run on CPU by Triton's interpreter on the
"test" preset (3 layers: sliding, sliding, global; window 16, block 8).

Both encode the same prompts in the same passes (ragged rows padded to one pass; chunks starting
mid-block and on a block; a prefix longer than the window, whose sliding blocks behind it are
released and poisoned with NaN; images whose tokens see each other), each into its own pool (NaN
before any write): the hidden states of every new token and the K/V of every position in view are
compared after every pass. And `prefill` itself with images (bidirectional vision): the fused
network's in-place encode against the plain model's torch layers; the engine's plan (in place, two
non-blocking copies a pass, no host sync on the meta device).

Tolerances (the two attentions add the same products in another order; the kernel divides by the
softmax's sum once at the end): float32 within 1e-5 of the largest value (measured: 3.9e-7 for the
hidden states, 4.3e-7 for K/V). bf16 within 2e-2 of the largest value (measured 1.4e-2 / 1.0e-2,
a few bf16 ulps): the kernel rounds the probabilities to bf16 for P @ V (as FlashAttention does)
and SDPA's CPU path rounds its softmax, and every later op rounds what it is given; the in-place
bf16 pools are no further from a float32 encode than the gathered ones. The first layer's K/V are
bit for bit the same in both dtypes (the q|k|v kernel writes what `index_copy_` wrote)."""

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

from dgemma.config import GLOBAL, SLIDING  # noqa: E402
from dgemma.engine.kv.paged_cache import PagedKVCache, SequenceBlocks  # noqa: E402
from dgemma.kernels import triton_attention  # noqa: E402
from dgemma.kernels.fused import fused_network  # noqa: E402
from dgemma.model.checkpoint import make_config, random_model  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402

if not triton_attention.INTERPRETED:
    pytest.skip("triton was imported before TRITON_INTERPRET was set: the kernels need a GPU", allow_module_level=True)

BS, BLOCKS = 8, 48


@pytest.fixture(scope="module")
def config():
    return make_config(**PRESETS["test"])


def fused(config, dtype):
    return fused_network(random_model(config, seed=5, std=0.5, dtype=dtype))


def poisoned_cache(config, dtype) -> PagedKVCache:
    cache = PagedKVCache(config, {SLIDING: BLOCKS, GLOBAL: BLOCKS}, BS, dtype=dtype)
    for pool in cache.keys + cache.values:
        pool.fill_(float("nan"))  # a slot read before it was written shows
    return cache


def encode_both(net, config, dtype, lengths, passes, images=None, seed=0):
    """Rows of `lengths` tokens encoded in `passes` (a pass: {row: tokens}) by both paths; after
    each pass, each row's new tokens' hidden states are compared, then the sliding blocks behind
    the window released (-1 in the table, NaN in both pools). `images`: {pass index: {row: [(first
    token in the pass, length)]}}, embeddings random there. Returns (in place, gathered) caches, the rows."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(3, config.vocab_size, (n,), generator=g) for n in lengths]
    need = -(-max(lengths) // BS)  # blocks a row: each row's from a random permutation of the pool's
    perms = {kind: torch.randperm(BLOCKS, generator=g).tolist() for kind in (SLIDING, GLOBAL)}
    rows = [
        SequenceBlocks({k: ids[i * need : (i + 1) * need] for k, ids in perms.items()}) for i in range(len(lengths))
    ]
    in_place, gathered = poisoned_cache(config, dtype), poisoned_cache(config, dtype)
    worst = 0.0
    for index, spec in enumerate(passes):
        now, counts = [rows[i] for i in spec], list(spec.values())
        width = max(counts)
        ids = torch.zeros(len(spec), width, dtype=torch.long)
        for j, (i, c) in enumerate(spec.items()):
            ids[j, :c] = tokens[i][rows[i].length : rows[i].length + c]
        a = in_place.plan_encoder(width, now, counts, in_place=True)
        b = gathered.plan_encoder(width, now, counts)
        embeds = None
        placed = (images or {}).get(index)
        if placed:
            embeds = net.embed(ids)
            groups = torch.full(ids.shape, -1, dtype=torch.long)
            for j, i in enumerate(spec):
                for k, (s, n) in enumerate(placed.get(i, [])):
                    embeds[j, s : s + n] = torch.randn(n, config.hidden_size, generator=g).to(dtype)
                    groups[j, s : s + n] = k
            a.see_within_images(groups)
            b.see_within_images(groups)
        ha, hb = net.encode(ids, a, embeds), net.encode(ids, b, embeds)
        in_place.commit(a)  # the rows are shared: one commit advances both
        for j, c in enumerate(counts):
            worst = max(worst, compare(ha[j, :c], hb[j, :c], dtype))
        for r in now:
            table = r.tables[SLIDING]
            for blk in range(max(0, r.length - (config.sliding_window - 1)) // BS):
                if table[blk] >= 0:
                    for cache in (in_place, gathered):
                        for layer, spec_ in enumerate(config.layers):
                            if spec_.kind == SLIDING:
                                cache.keys[layer][table[blk]] = float("nan")
                                cache.values[layer][table[blk]] = float("nan")
                    table[blk] = -1
    return in_place, gathered, rows, worst


def compare(x: torch.Tensor, y: torch.Tensor, dtype) -> float:
    """The largest difference relative to the largest value; asserts it within the dtype's tolerance."""
    assert torch.isfinite(x).all() and torch.isfinite(y).all()
    err = ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
    assert err <= (1e-5 if dtype == torch.float32 else 2e-2), err
    return err


def in_view(config, cache, rows, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) float32 of the positions each row's layer `layer` still sees, a row at a time."""
    spec, out = config.layers[layer], []
    for r in rows:
        lo = max(0, r.length - (config.sliding_window - 1)) if spec.kind == SLIDING else 0
        pos = torch.arange(lo, r.length)
        blocks = torch.tensor(r.tables[spec.kind])[pos // BS]
        assert (blocks >= 0).all()
        out.append((cache.keys[layer][blocks, pos % BS].float(), cache.values[layer][blocks, pos % BS].float()))
    return out


def compare_pools(config, in_place, gathered, rows, dtype, exact_first: bool = True) -> float:
    """K and V of every position each row's layers still see, equal in both pools; the first
    layer's bit for bit where both are the fused network's (its keys come from the same embeddings:
    the q|k|v kernel's pool writes are the values `index_copy_` wrote)."""
    worst = 0.0
    for layer in range(len(config.layers)):
        for kv_a, kv_b in zip(in_view(config, in_place, rows, layer), in_view(config, gathered, rows, layer)):
            for a, b in zip(kv_a, kv_b):
                worst = max(worst, compare(a, b, dtype))
                assert layer > 0 or not exact_first or torch.equal(a, b)
    return worst


# passes: three ragged rows in one padded pass (a row under a block, one ending mid-block), then
# chunks of two rows starting mid-block and on a block boundary, then a long one that takes a row
# past the window (sliding blocks released behind it), then a one-token pass
LENGTHS = [45, 9, 31]
PASSES = [{0: 13, 1: 5, 2: 11}, {0: 11, 2: 5}, {0: 21, 1: 4, 2: 14}, {2: 1}]


def test_in_place_encode_equals_the_gathered_one_float32(config):
    in_place, gathered, rows, worst = encode_both(fused(config, torch.float32), config, torch.float32, LENGTHS, PASSES)
    assert [r.length for r in rows] == LENGTHS
    assert any(-1 in r.tables[SLIDING] for r in rows)  # a window's worth behind: blocks released
    pools = compare_pools(config, in_place, gathered, rows, torch.float32)
    print(f"\nfloat32: hidden states within {worst:.1e}, K/V within {pools:.1e} of the largest value")


@pytest.mark.slow
def test_in_place_encode_in_bf16_is_as_close_to_float32_as_the_gathered_one(config):
    """bf16: the two paths within the tolerance above, and the in-place pools no further from
    the float32 encode's than the gathered ones (at most 1.5x their largest difference, layer by
    layer: the rounding of another order of sums, not an error that grows)."""
    in_place, gathered, rows, worst = encode_both(
        fused(config, torch.bfloat16), config, torch.bfloat16, LENGTHS, PASSES
    )
    pools = compare_pools(config, in_place, gathered, rows, torch.bfloat16)
    reference, _, rows32, _ = encode_both(fused(config, torch.float32), config, torch.float32, LENGTHS, PASSES)
    for layer in range(len(config.layers)):
        exact = in_view(config, reference, rows32, layer)
        off = [
            max(
                (x - e).abs().max().item()
                for got, ref in zip(in_view(config, cache, rows, layer), exact)
                for x, e in zip(got, ref)
            )
            for cache in (in_place, gathered)
        ]
        assert off[0] <= 1.5 * off[1] + 1e-6, (layer, off)
    print(f"\nbf16: hidden states within {worst:.1e}, K/V within {pools:.1e} of the largest value")


def test_images_in_an_in_place_pass_see_each_other(config):
    """Bidirectional vision: an image's tokens see each other in the in-place pass as in the
    gathered pass's mask (`attention.within_images`), one image longer than the window."""
    net = fused(config, torch.float32)
    images = {0: {0: [(2, 20)], 1: [(0, 3)]}, 1: {0: [(1, 4)]}}
    in_place, gathered, rows, _ = encode_both(net, config, torch.float32, [40, 6], [{0: 24, 1: 6}, {0: 16}], images)
    compare_pools(config, in_place, gathered, rows, torch.float32)


def test_the_engines_encode_is_planned_in_place(config, monkeypatch):
    """prefill plans the fused network's passes in place on the paged cache (the engine's GPU
    path), and a pass planned so refuses the gathering path."""
    from dgemma.engine.prefill import prefill

    net = fused(config, torch.float32)
    cache = poisoned_cache(config, torch.float32)
    row = SequenceBlocks({SLIDING: [3, 4], GLOBAL: [7, 1]})
    plans = []
    real = PagedKVCache.plan_encoder

    def spy(self, *args, **kwargs):
        plans.append(real(self, *args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(PagedKVCache, "plan_encoder", spy)
    prefill(net, cache, [row], [list(range(3, 15))])
    assert [p.slots is not None for p in plans] == [True] and row.length == 12
    with pytest.raises(RuntimeError, match="planned in place"):
        cache.attend(plans[0], 0, SLIDING, None, None)


def test_an_in_place_encode_sends_its_plan_in_one_copy_and_never_waits(config):
    """On the meta device as on a GPU (tests/host_sync.py): a prompt's passes through the engine's
    fused network make no host sync, and each sends two non-blocking copies up, its token ids and
    its plan (block tables, starts, counts, slots and positions in one buffer)."""
    from dgemma.engine.engine import Engine, EngineOptions
    from host_sync import no_host_sync, stub_triton_launches, to_device

    net = to_device(random_model(config).to(torch.bfloat16))
    options = EngineOptions(
        triton=True, cuda_graphs=False, block_size=8, batch_invariant=False, prefix_cache=False, kv_cache_memory=2**24
    )
    engine = Engine(net, dataclasses.replace(options, prefill_chunk=16))
    with stub_triton_launches(), torch.no_grad():
        engine.encode_prefix([3, 4])  # the first pass also sends what a network makes once (its RoPE frequencies)
        with no_host_sync("non_blocking") as guard:
            kv = engine.encode_prefix(list(range(3, 43)))  # 40 tokens: passes of 16, 16 and 8
    assert kv.length == 40 and guard.h2d_copies == 3 * 2


def test_prefill_with_images_equals_the_torch_models(config):
    """`prefill` with images, bidirectional vision on, in passes of 8 (an image whole in each): the
    fused network's in-place encode against the plain model's (torch's layers, gathered SDPA with
    `within_images`' mask) on the same blocks, float32: the last hidden states and every K/V."""
    import types

    from dgemma.engine.prefill import prefill

    plain = random_model(config, seed=5, std=0.5)
    net = fused_network(plain)
    seen = dataclasses.replace(config, vision=types.SimpleNamespace(bidirectional=True))  # what a tower's config says
    plain.config = net.config = seen
    g = torch.Generator().manual_seed(1)
    prompts = [list(range(3, 33)), list(range(40, 52))]
    images = [
        [(3, torch.randn(5, config.hidden_size, generator=g)), (17, torch.randn(6, config.hidden_size, generator=g))]
    ]
    images.append([(8, torch.randn(4, config.hidden_size, generator=g))])
    out = []
    for model in (net, plain):
        cache = poisoned_cache(config, torch.float32)
        rows = [
            SequenceBlocks({SLIDING: [5, 9, 2, 7], GLOBAL: [1, 4, 8, 0]}),
            SequenceBlocks({SLIDING: [3, 6], GLOBAL: [2, 3]}),
        ]
        out.append((prefill(model, cache, rows, prompts, pass_tokens=8, images=images), cache, rows))
    (fused_last, in_place, rows), (torch_last, gathered, _) = out
    assert [r.length for r in rows] == [len(p) for p in prompts]
    compare(fused_last, torch_last, torch.float32)
    compare_pools(config, in_place, gathered, rows, torch.float32, exact_first=False)  # torch's norms round apart
    net.config = config  # without bidirectional vision the images' tokens are causal: another answer
    rows = [
        SequenceBlocks({SLIDING: [5, 9, 2, 7], GLOBAL: [1, 4, 8, 0]}),
        SequenceBlocks({SLIDING: [3, 6], GLOBAL: [2, 3]}),
    ]
    causal = prefill(net, poisoned_cache(config, torch.float32), rows, prompts, pass_tokens=8, images=images)
    assert (causal - fused_last).abs().max() > 1e-3

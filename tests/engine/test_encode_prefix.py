"""`Engine.encode_prefix` encodes a prompt of any length in the scheduler's chunks, releasing the
sliding blocks behind the window as it goes (a whole-prompt allocation exceeded the sliding
reservation past ~3,300 tokens at the released sizes)."""

import pytest
import torch

from dgemma.config import GLOBAL, SLIDING
from dgemma.dense.kv_cache import DenseKVCache
from dgemma.engine.engine import Engine, EngineOptions, prompt_chunks
from dgemma.engine.kv.paged_cache import sliding_blocks_held
from dgemma.engine.prefill import prefill
from dgemma.model.checkpoint import make_config, random_model
from dgemma.model.diffusion_gemma import DiffusionGemma
from dgemma.model.presets import PRESETS
from host_sync import DEVICE, stub_triton_launches


@pytest.fixture(scope="module")
def real_meta_engine() -> Engine:
    """The released size (block 256 = the canvas, window 1024, 2,048-token chunks) on the meta
    device with the GPU path's kernels (launches stubbed: meta tensors hold no data)."""
    with torch.device(DEVICE):
        net = DiffusionGemma(make_config(**PRESETS["real"])).to(torch.bfloat16).eval()
    options = EngineOptions(
        triton=True, cuda_graphs=False, batch_invariant=False, prefix_cache=False, kv_cache_memory=2**34
    )
    return Engine(net, options)


@pytest.mark.slow
@pytest.mark.parametrize("length", [4096, 16384])
def test_long_prefix_at_the_released_sizes_holds_only_the_window(real_meta_engine, length):
    engine = real_meta_engine
    cfg, o = engine.runner.config, engine.options
    assert (o.block_size, cfg.sliding_window, o.prefill_chunk) == (256, 1024, 2048)
    passes = []
    encode = engine.runner.net.encode
    engine.runner.net.encode = lambda ids, *a, **k: passes.append(ids.shape[1]) or encode(ids, *a, **k)
    try:
        with stub_triton_launches(), torch.no_grad():
            kv = engine.encode_prefix(list(range(3, 3 + length)))
    finally:
        del engine.runner.net.encode
    assert passes == [2048] * (length // 2048)  # the scheduler's chunks, one pass each
    assert kv.length == length and len(kv.tables[GLOBAL]) == length // 256 and min(kv.tables[GLOBAL]) >= 0
    held = [j for j, blk in enumerate(kv.tables[SLIDING]) if blk >= 0]
    # what the window sees behind the next position: the blocks of positions >= length - 1023
    assert held == list(range((length - 1023) // 256, length // 256))
    assert len(held) <= sliding_blocks_held(1024, o.max_span(cfg), 256)
    used = engine.kv_usage()
    assert used[SLIDING]["used"] == len(held) and used[GLOBAL]["used"] == length // 256
    engine.release_prefix(kv)
    assert engine.kv_usage()[SLIDING]["used"] == engine.kv_usage()[GLOBAL]["used"] == 0


def test_a_prefix_past_the_models_positions_is_refused_in_one_line(real_meta_engine):
    with pytest.raises(ValueError, match="a prefix takes 1 to 131072 tokens"):
        real_meta_engine.encode_prefix([5] * 131073)
    with pytest.raises(ValueError, match="got 0"):
        real_meta_engine.encode_prefix([])


@pytest.mark.parametrize("invariant", [False, True])
def test_chunked_prefix_decodes_as_the_whole_prompt_does(invariant):
    """A 100-token prefix of the "test" model (window 16, blocks of 8) in 24-token chunks, then a
    decoder pass after it, against the dense cache's one-pass prefill: the released blocks were
    the ones no later position reads."""
    net = random_model(make_config(**PRESETS["test"]), seed=3, std=0.05)
    cfg, c = net.config, net.config.canvas_length
    engine = Engine(
        net,
        EngineOptions(
            block_size=8, prefill_chunk=24, batch_invariant=invariant, prefix_cache=False, kv_cache_memory=2**22
        ),
    )
    prompt = torch.randint(10, cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    canvas = torch.randint(0, cfg.vocab_size, (1, c), generator=torch.Generator().manual_seed(1))
    kv = engine.encode_prefix(prompt)
    assert kv.tables[SLIDING][:10] == [-1] * 10  # positions < 100 - 15 = 85: blocks 0..9 released
    with torch.no_grad():
        paged = net.decode(canvas, engine.runner.cache.plan_decoder(c, [kv]), None)
        dense = DenseKVCache(cfg, 1, len(prompt) + c, net.device, net.dtype)
        prefill(net, dense, [0], [prompt])
        want = net.decode(canvas, dense.plan_decoder(c), None)
    assert float((paged - want).norm() / want.norm()) < 1e-5


def test_prompt_chunks_cut_as_the_scheduler_does():
    assert prompt_chunks(5000, 2048, 256, invariant=False) == [(0, 2048), (2048, 4096), (4096, 5000)]
    assert prompt_chunks(100, 24, 8, invariant=True) == [(0, 24), (24, 48), (48, 72), (72, 96), (96, 100)]
    with pytest.raises(ValueError, match="not whole blocks"):
        prompt_chunks(100, 20, 8, invariant=True)

"""LoRA adapters in the engine: requests on different adapters (and none) share steps, each getting
its solo run's tokens; the prefix cache never hands one adapter's blocks to another; unloading
drops them; the modes that cannot run an adapter say so in one line."""

from __future__ import annotations

import pytest

import dgemma
from adapter_files import ATTENTION, write_adapter
from dgemma.adapters import AdapterError
from dgemma.engine.request import Request
from dgemma.model.checkpoint import make_tiny_random

FAST = {"max_new_tokens": 32, "max_denoising_steps": 8}
NAMES = (None, "a", "b")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """dgemma-tiny with two adapters: every linear at rank 8, and attention plus down_proj at rank 4."""
    model = dgemma.load()
    model.adapter_root = root = tmp_path_factory.mktemp("adapters")
    model.enable_adapters(max_loras=4, max_rank=16)
    model.add_adapter("a", write_adapter(root / "a", model.config, rank=8, alpha=16, seed=1))
    down = ATTENTION + ("mlp.down_proj",)
    model.add_adapter("b", write_adapter(root / "b", model.config, rank=4, alpha=8, seed=2, sites=down))
    return model


def run_together(model, prompt_ids: list[list[int]], names, seed: int, **knobs) -> list[Request]:
    """The requests added at once to the model's engine and stepped to the end (one batch)."""
    config = model.generation_config.with_overrides(**(FAST | knobs))
    requests = [Request(list(p), config, seed, adapter=model.adapter_ref(n)) for p, n in zip(prompt_ids, names)]
    engine = model.engine
    for r in requests:
        engine.add(r)
    while engine.has_work:
        engine.step()
    return requests


def test_a_batch_mixing_two_adapters_and_the_base_gives_each_its_solo_tokens(tiny):
    prompt = tiny.tokenizer.encode("Once upon a time, in a land far away,")
    solo = {n: tiny.generate([prompt], adapter=n, seed=5, **FAST).sequences[0] for n in NAMES}
    assert solo[None] != solo["a"] and solo[None] != solo["b"] and solo["a"] != solo["b"]
    together = run_together(tiny, [prompt] * 3, NAMES, seed=5)
    assert [r.tokens for r in together] == [solo[n] for n in NAMES]


def test_turbo_logprobs_and_grammars_run_with_adapters(tiny):
    prompt = tiny.tokenizer.encode("The weather today is")
    turbo = {n: tiny.generate([prompt], adapter=n, seed=7, turbo=True, **FAST).sequences[0] for n in ("a", None)}
    assert turbo["a"] != turbo[None]
    assert [r.tokens for r in run_together(tiny, [prompt] * 2, ("a", None), seed=7, turbo=True)] == [
        turbo["a"],
        turbo[None],
    ]
    grammar = tiny.compile_grammar("regex", "[a-z ]{1,20}")
    out = tiny.generate([prompt], adapter="b", seed=7, grammar=grammar, **FAST).sequences[0]
    assert all(ch == " " or "a" <= ch <= "z" for ch in tiny.tokenizer.decode(out))
    blocks = [ev for ev in tiny.stream(prompt, adapter="a", seed=7, **FAST) if hasattr(ev, "tokens")]
    assert sum((b.tokens for b in blocks), []) == tiny.generate([prompt], adapter="a", seed=7, **FAST).sequences[0]
    infill = tiny.infill("The cat ", " on the mat.", span_length=4, adapter="a", seed=1, max_denoising_steps=4)
    assert len(infill.tokens) == 4


def test_prefix_blocks_are_never_shared_across_adapters(tiny):
    prompt = tiny.tokenizer.encode("A long shared system prompt, " * 12)
    assert len(prompt) >= 3 * tiny.config.canvas_length
    cached = {}
    for n in (None, "a", "b", "a", None, "b"):
        (r,) = run_together(tiny, [prompt], [n], seed=1)
        cached.setdefault(n, []).append(r.cached_tokens)
    assert cached == {n: [0, cached[n][1]] for n in NAMES}  # a first run finds nothing of another's
    assert all(v[1] > 0 for v in cached.values())  # ... a second run its own blocks
    engine = tiny.engine
    key = tiny.adapters.get("b").key
    cached_keys = set(engine.scheduler.blocks.rooted[key])
    assert cached_keys and cached_keys <= {k for p in engine.scheduler.blocks.pools.values() for k in p.by_key}
    tiny.remove_adapter("b")
    held = {k for p in engine.scheduler.blocks.pools.values() for k in p.by_key}
    assert key not in engine.scheduler.blocks.rooted and not any(k in held for k in cached_keys)
    tiny.add_adapter("b", tiny.adapter_root / "b")  # the same weights again
    (r,) = run_together(tiny, [prompt], ["b"], seed=1)
    assert r.cached_tokens == 0  # its blocks went with the unload


def test_modes_outside_the_engine_refuse_an_adapter(tiny):
    with pytest.raises(ValueError, match="mode='ar' runs the base network alone: it takes no adapter"):
        tiny.generate(["hi"], adapter="a", mode="ar", max_new_tokens=4)
    with pytest.raises(ValueError, match="sampling='reference' runs the base network alone"):
        tiny.generate(["hi"], adapter="a", sampling="reference", seed=1, **FAST)
    with pytest.raises(AdapterError, match=r"no adapter named 'nope' is loaded \(loaded: 'a', 'b'\)"):
        tiny.generate(["hi"], adapter="nope", **FAST)


def test_a_random_model_with_gqa_sliding_and_global_layers(tmp_path):
    model = dgemma.load(make_tiny_random(tmp_path / "ckpt", seed=3))
    model.enable_adapters(max_loras=2, max_rank=8)
    model.add_adapter("a", write_adapter(tmp_path / "a", model.config, rank=8, alpha=16, seed=1, std=0.3))
    model.add_adapter("b", write_adapter(tmp_path / "b", model.config, rank=2, alpha=2, seed=2, std=0.3))
    prompt = list(range(3, 80))
    solo = {n: model.generate([prompt], adapter=n, seed=9, **FAST).sequences[0] for n in NAMES}
    assert len({tuple(v) for v in solo.values()}) == 3
    together = run_together(model, [prompt] * 3, NAMES, seed=9)
    assert [r.tokens for r in together] == [solo[n] for n in NAMES]

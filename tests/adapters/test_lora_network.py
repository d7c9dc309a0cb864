"""Adapters inside the engine's network (kernels/lora.py): merged and unmerged logits agree, every
CPU network kind (packed oneDNN, AMX, widened, plain, each quantised scheme) adds the same deltas, and
a pass whose rows run different adapters (and none) gives each row what it gets alone."""

from __future__ import annotations

import copy

import pytest
import torch

import dgemma
from adapter_files import ATTENTION, merged, write_adapter
from dgemma.adapters import AdapterBank, adapter_dtype
from dgemma.dense.kv_cache import DenseKVCache
from dgemma.engine.prefill import prefill
from dgemma.kernels import cpu, native
from dgemma.kernels.choice import engine_net
from dgemma.kernels.lora import AdaptedGatedMLP, RowGroups, adapted_network, selected
from dgemma.model.checkpoint import make_config, random_model
from dgemma.model.presets import PRESETS
from dgemma.quant import schemes
from dgemma.quant.modules import quantize_model
from dgemma.train import lora

PROMPTS = [list(range(3, 40)), list(range(5, 30)), list(range(7, 50)), list(range(9, 20))]


@pytest.fixture(scope="module")
def gqa_config():
    """A random model's config with GQA (4 heads, 2 KV heads), sliding and global layers (K = V)."""
    return make_config(**PRESETS["test"])


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, gqa_config):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": write_adapter(root / "a", gqa_config, rank=8, alpha=16, seed=1),
        "b": write_adapter(root / "b", gqa_config, rank=4, alpha=4, seed=2, sites=ATTENTION + ("mlp.down_proj",)),
    }


def bank_for(net, dtype, paths: dict) -> AdapterBank:
    bank = AdapterBank(net.config, net.device, dtype, max_loras=4, max_rank=16)
    for name, path in paths.items():
        bank.load(name, path)
    return bank


@torch.no_grad()
def logits(net, prompts, canvas, slots=None, dtype=torch.float32):
    """One decoder pass's logits after the prompts, row i on adapter slot slots[i] (-1: none)."""
    c = canvas.shape[1]
    cache = DenseKVCache(net.kv_config, len(prompts), max(map(len, prompts)) + c, net.device, dtype)
    prefill(net, cache, list(range(len(prompts))), prompts, adapters=slots)
    with selected(net, slots):
        hidden = net.decode(canvas, cache.plan_decoder(c), None)
    return net.logits(hidden)


def canvas_of(config, rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, config.vocab_size, (rows, config.canvas_length), generator=torch.Generator().manual_seed(seed)
    )


def test_merged_and_unmerged_logits_agree_on_a_random_gqa_model(gqa_config, adapters):
    net = random_model(gqa_config, seed=0)
    fast = engine_net(net)
    adapted = adapted_network(fast, bank_for(net, torch.float32, adapters).slots)
    canvas = canvas_of(gqa_config, 1)
    base = logits(fast, PROMPTS[:1], canvas)
    for slot, name in enumerate(adapters):
        unmerged = logits(adapted, PROMPTS[:1], canvas, [slot])
        folded = logits(engine_net(merged(net, adapters[name])), PROMPTS[:1], canvas)
        assert (unmerged - folded).abs().max() < 1e-4, name
        assert (unmerged - base).abs().max() > 1e-2, name  # the adapter changes what the model computes


def test_merged_and_unmerged_logits_agree_on_dgemma_tiny(tmp_path):
    model = dgemma.load(dtype="float32")
    net, config = model.net, model.config
    path = write_adapter(tmp_path / "a", config, rank=8, alpha=16, seed=1)
    fast = engine_net(net)
    adapted = adapted_network(fast, bank_for(net, torch.float32, {"a": path}).slots)
    ids = [model.tokenizer.encode("The quick brown fox jumps over the lazy dog. Once upon a time")]
    canvas = canvas_of(config, 1)
    unmerged = logits(adapted, ids, canvas, [0])
    folded = logits(engine_net(merged(net, path)), ids, canvas)
    assert (unmerged - folded).abs().max() < 1e-4
    assert (unmerged - logits(fast, ids, canvas)).abs().max() > 1e-2


def test_rows_of_one_pass_run_their_own_adapters(gqa_config, adapters):
    """A batched pass over rows on adapters a, none, b, a: each row as it is alone (float32)."""
    net = random_model(gqa_config, seed=0)
    adapted = adapted_network(engine_net(net), bank_for(net, torch.float32, adapters).slots)
    slots = [0, -1, 1, 0]
    canvas = canvas_of(gqa_config, len(slots))
    mixed = logits(adapted, PROMPTS, canvas, slots)
    for i, slot in enumerate(slots):
        alone = logits(adapted, PROMPTS[i : i + 1], canvas[i : i + 1], [slot])
        assert (mixed[i] - alone[0]).abs().max() < 1e-4, i
    assert (mixed[0] - mixed[1]).abs().max() > 1e-2


def _hooked(net, path):
    """`net` (a deep copy) with the adapter at `path` added by test-local forward hooks in float32:
    the reference every fast module kind is held to."""
    found = lora.read_adapters(path)
    out = copy.deepcopy(net)
    modules = dict(out.named_modules())
    for name in found.names:
        a, b = found.tensors[f"{name}.lora_A.weight"].float(), found.tensors[f"{name}.lora_B.weight"].float()

        def hook(module, inputs, output, a=a, b=b):
            return output + ((inputs[0].float() @ a.t()) @ b.t() * found.scale).to(output.dtype)

        modules[name].register_forward_hook(hook)
    return out


@pytest.mark.parametrize("scheme", schemes.names())
def test_adapters_beside_each_quantised_scheme(gqa_config, adapters, scheme):
    rule = schemes.get(scheme).group
    net = quantize_model(random_model(gqa_config, seed=0), scheme, 16 if rule.choosable else rule.default)
    fast = engine_net(net)
    adapted = adapted_network(fast, bank_for(net, adapter_dtype(net.device, fast.dtype), adapters).slots)
    canvas = canvas_of(gqa_config, 1)
    unmerged = logits(adapted, PROMPTS[:1], canvas, [0], fast.dtype).float()
    reference = logits(_hooked(net, adapters["a"]), PROMPTS[:1], canvas, None, fast.dtype).float()
    base = logits(fast, PROMPTS[:1], canvas, None, fast.dtype).float()
    assert (unmerged - reference).abs().max() < 1e-3, scheme
    assert (unmerged - base).abs().max() > 1e-2, scheme


@pytest.mark.parametrize("kind", ["packed", "amx", "widened", "plain"])
def test_adapters_beside_each_cpu_network_kind(gqa_config, adapters, kind, monkeypatch):
    """bf16 weights on oneDNN (packed), AMX, the widened float32 path, and torch's own modules: the
    adapter (kept in the activations' dtype) adds what float32 hooks add, to bf16 rounding."""
    if kind == "amx" and native.amx() is None:
        pytest.skip("no AMX kernels on this CPU")
    dtype = torch.float32 if kind == "plain" else torch.bfloat16
    config = make_config(**dict(PRESETS["test"], hidden_size=64, intermediate_size=128))
    net = random_model(config, seed=0, dtype=dtype)
    if kind == "widened":
        fast = cpu.widened_copy(net)
    elif kind == "packed":
        monkeypatch.setattr(native, "amx", lambda wait=None: None)  # oneDNN's packed modules, not AMX
        fast = cpu.packed_copy(net)
    elif kind == "amx":
        fast = cpu.packed_copy(net)
        assert isinstance(fast.layers[0].mlp, native.AMXGatedMLP)
    else:
        fast = net
    adapted = adapted_network(fast, bank_for(net, adapter_dtype(net.device, fast.dtype), adapters).slots)
    if kind in ("packed", "amx"):
        assert isinstance(adapted.layers[0].mlp, AdaptedGatedMLP)
    canvas = canvas_of(config, 1)
    unmerged = logits(adapted, PROMPTS[:1], canvas, [0], fast.dtype).float()
    # the reference: float32 hooks on the model as loaded (the widened path computes in float32)
    plain = copy.deepcopy(net).float() if kind == "widened" else net
    reference = logits(_hooked(plain, adapters["a"]), PROMPTS[:1], canvas, None, fast.dtype).float()
    base = logits(fast, PROMPTS[:1], canvas, None, fast.dtype).float()
    plain_base = logits(plain, PROMPTS[:1], canvas, None, fast.dtype).float()
    effect = (reference - plain_base).abs().max()
    error = (unmerged - reference).abs().max()
    if dtype == torch.float32:
        assert error < 1e-4, kind
    else:  # bf16 activations (and the adapter's low-rank product) round at every layer: far below its effect
        assert error < 0.2 * effect, kind
    assert (unmerged - base).abs().max() > 0.5 * effect, kind
    untouched = logits(adapted, PROMPTS[:1], canvas, [-1], fast.dtype).float()
    assert torch.equal(untouched, base)  # a base row runs the fast modules as they are


def test_rows_group_into_runs_of_one_adapter():
    assert RowGroups.of([-1, -1]) is None
    assert RowGroups.of([2, 2, 2]) == RowGroups(3, ((2, None),))
    assert RowGroups.of([0, 0, -1, 1, 0, 1, 1]) == RowGroups(7, ((0, ((0, 2), (4, 5))), (1, ((3, 4), (5, 7)))))

"""Served LoRA adapters on the fused GPU layer (kernels/fused.py + kernels/triton_lora.py): the same
logits as kernels/lora.py's torch modules (Triton's interpreter), and, at the released size on the
meta device, a step with adapters captured in one graph per bucket, 8 launches a layer more than
without (none more without adapters), and the step's one read of the device."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is an optional (Linux) test dependency: the GPU kernels need it")
pytestmark = pytest.mark.triton

import torch  # noqa: E402

from adapter_files import ATTENTION, write_adapter  # noqa: E402
from dgemma.adapters import AdapterBank  # noqa: E402
from dgemma.config import GenerationConfig  # noqa: E402
from dgemma.dense.kv_cache import DenseKVCache  # noqa: E402
from dgemma.engine.engine import Engine, EngineOptions, Request  # noqa: E402
from dgemma.engine.fused.inputs import StepLayout, StepTensors, fill, host_buffer  # noqa: E402
from dgemma.engine.fused.step import DeviceStep, run_step, stack_state  # noqa: E402
from dgemma.engine.prefill import prefill  # noqa: E402
from dgemma.engine.request import AdapterRef  # noqa: E402
from dgemma.kernels.fused import fused_network  # noqa: E402
from dgemma.kernels.lora import LoraSlots, adapted_network, selected, site_shapes  # noqa: E402
from dgemma.model.checkpoint import make_config, random_model  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402
from host_sync import count_host_reads, no_host_sync, stub_triton_launches  # noqa: E402
from launch_count import PINNED, count_launches, counting_capture, h200, released_net  # noqa: E402

ADAPTED_LAUNCHES = 8  # a shrink and an expand after each of the layer's four GEMMs


def test_the_fused_layer_adds_what_the_torch_modules_add(tmp_path):
    config = make_config(**dict(PRESETS["test"], num_layers=2, layer_types=["sliding_attention", "full_attention"]))
    net = random_model(config, seed=0)
    bank = AdapterBank(config, net.device, torch.float32, 4, 16)
    bank.load("a", write_adapter(tmp_path / "a", config, rank=8, alpha=16, seed=1))
    bank.load("b", write_adapter(tmp_path / "b", config, rank=4, seed=2, sites=ATTENTION + ("mlp.down_proj",)))
    reference, fused = adapted_network(net, bank.slots), fused_network(net, bank.slots)
    prompts, slots = [list(range(3, 12)), list(range(5, 19)), list(range(7, 10))], [0, -1, 1]
    canvas = torch.randint(0, config.vocab_size, (3, config.canvas_length), generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def logits(n, rows):
        cache = DenseKVCache(n.kv_config, 3, 19 + config.canvas_length, n.device, torch.float32)
        prefill(n, cache, [0, 1, 2], prompts, adapters=rows)
        with selected(n, rows):
            return n.logits(n.decode(canvas, cache.plan_decoder(config.canvas_length), None))

    expected, got, base = logits(reference, slots), logits(fused, slots), logits(fused, None)
    assert (got - expected).abs().max() < 1e-4
    assert (got[0] - base[0]).abs().max() > 1e-2 and (got[2] - base[2]).abs().max() > 1e-2
    assert (got[1] - base[1]).abs().max() < 1e-4  # the base's row


def meta_slots(config) -> LoraSlots:
    """Four slots of rank 16 on the meta device, slots 0 and 1 holding adapters on every linear."""
    slots = LoraSlots(site_shapes(config), 4, 16, torch.device("meta"), torch.bfloat16)
    for s in (0, 1):
        slots.ranks[s], slots.targets[s] = 16, frozenset(slots.shapes)
    return slots


def adapted_step_launches(net, slots: LoraSlots | None, adapters: list[int | None], prompt: int = 512):
    """The launches of one steady step (as launch_count.step_launches) of requests on `adapters`
    (a slot, or None: the base) over an engine serving `slots`."""
    with h200():
        options = EngineOptions(triton=True, cuda_graphs=True, batch_invariant=False, prefix_cache=False)
        engine = Engine(net, EngineOptions(**vars(options) | {"kv_cache_memory": 2**33}), slots)
        engine.runner.graphs.capture = counting_capture
        c = net.config.canvas_length
        gen = GenerationConfig(max_new_tokens=4 * c, max_denoising_steps=16, confidence_threshold=1e-30)
        for i, slot in enumerate(adapters):
            ref = None if slot is None else AdapterRef(f"a{slot}", slot, bytes([slot]) * 16)
            engine.add(Request(list(range(10, 10 + prompt)), gen, i, adapter=ref))
        with torch.no_grad(), count_host_reads():
            with count_launches():
                while engine.scheduler.waiting or any(r.pending_tokens for r in engine.scheduler.running):
                    engine.step()
                engine.step()
            with count_launches(engine.runner.net) as launches:
                engine.step()
    return launches


@pytest.fixture(scope="module")
def released():
    return released_net(None, layers=2)


@pytest.mark.parametrize("batch", [1, 8])
def test_an_adapted_step_launches_eight_more_a_layer_in_one_graph(released, batch):
    per, outside, _ = PINNED[("bf16", batch)]
    slots = meta_slots(released.config)
    plain = adapted_step_launches(released, None, [None] * batch)
    mixed = adapted_step_launches(released, slots, [0, None, 1, 0, None, 1, 0, 1][:batch])
    print(f"\nwithout: {plain.summary()}\nwith: {mixed.summary()}\n  layer 0: {mixed.detail('layer 0')}")
    assert max(plain.layers) <= per  # no adapters: the layer as ever
    assert max(mixed.layers) <= max(plain.layers) + ADAPTED_LAUNCHES
    layer = mixed.kernels("layer 0")
    assert layer["triton:_shrink_kernel"] == layer["triton:_expand_kernel"] == ADAPTED_LAUNCHES // 2
    assert mixed.outside <= plain.outside + 2  # the rows' slots: an expand to the canvas's rows
    assert mixed.eager <= plain.eager  # the adapters ride in the step's inputs: the rest replays
    assert mixed.kernels("outside")["d2h:tolist"] == 1  # the step's one read, the stop flags


def test_requests_with_adapters_take_the_fused_step_and_read_the_device_once(released):
    slots = meta_slots(released.config)
    with h200():
        engine = Engine(
            released,
            EngineOptions(triton=True, cuda_graphs=False, batch_invariant=False, kv_cache_memory=2**33),
            slots,
        )
        gen = GenerationConfig(max_new_tokens=4 * released.config.canvas_length, max_denoising_steps=8)
        requests = [
            Request(list(range(3, 14)), gen, 1, adapter=AdapterRef("a0", 0, b"\0" * 16)),
            Request(list(range(20, 37)), gen, 2),
            Request(list(range(40, 45)), gen, 3, adapter=AdapterRef("a1", 1, b"\1" * 16)),
        ]
        for r in requests:
            engine.add(r)
        assert {path.name for path in engine.runner.choose(requests).values()} == {"fused"}
        with stub_triton_launches(), torch.no_grad():
            with count_host_reads():
                engine.step()
            for _ in range(2):
                with count_host_reads() as reads:
                    engine.step()
                assert reads.count == 1, reads.where
            ops, c = engine.runner.ops, released.config.canvas_length
            with no_host_sync("non_blocking"):  # the step's inputs go up (the adapters' slots among them)
                layout = StepLayout(3, c, max(len(t) for r in requests for t in r.kv.tables.values()))
                host = host_buffer(layout, ops.net.device)
                fill(layout, host, ops.cache, requests)
                inputs = StepTensors.of(layout, ops.to_device(host), ops.cache, requests)
                canvas, soft, history = stack_state(ops, requests, 3)
            with no_host_sync("none"):  # what a graph captures: no copy, no read
                run_step(ops, DeviceStep(inputs, canvas, soft, history, None))

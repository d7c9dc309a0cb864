"""Counting the GPU kernel launches of one engine step on a CPU: the released model's shapes on
torch's "meta" device (no data, no GPU), every operation that would launch a kernel counted where
it runs (per layer, or outside the layers).

Why count: on a GPU a step's time is bounded below by its launches (eager: ~5-15 us each; under a
CUDA graph still ~1-3 us each plus the gaps between dependent kernels), so the number of launches
is the first thing a fused path must lower, and it can be proved without a GPU.

What counts as a launch:
- an ATen operation that is not a view or an allocation (`NO_KERNEL`), at its CUDA kernel count:
  one for most; `MULTI_KERNEL` for those torch's CUDA build implements in several (sort, topk,
  nonzero, ...), with the count written beside each and why;
- a copy between the host and the device (cudaMemcpyAsync: not a kernel, but a launch's cost);
- every Triton kernel launch (stubbed: meta tensors hold no data; `host_sync.stub_triton_launches`
  checks their arguments);
- a path the meta device cannot see (torch.compile, a library kernel without a meta
  implementation) raises `Uncounted` rather than counting nothing.

Regions: `layer` (inside `net.layers[i]`, by a forward pre/post hook on each layer of the network
the runner runs) and `outside` (everything else of the step: preparation, embeddings,
self-conditioning, LM head, statistics, sampler, the host reads). `captured` is what a CUDA graph
holds (the decoder step the graphs capture), `eager` the rest of the step.

The GPU paths are taken on meta tensors as on an H100 / H200: Triton kernels (the interpreter's
`available` answers yes for meta), quantised weights on the GPU kernels, and `SM90` makes the fp8
dispatchers see compute capability 9.0 (torch._scaled_mm / _scaled_grouped_mm, whose meta
kernels check their arguments).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# ATen operations that launch nothing on a GPU: allocations and metadata.
NO_KERNEL = {
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "detach",
    "alias",
    "lift_fresh",
    "_unsafe_view",
    "set_",
    "resize_",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "_local_scalar_dense",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
    "record_stream",
    "_nested_tensor_from_mask",
}

# CUDA kernels per call of operations torch implements in several, as torch 2.11's CUDA build
# launches them for the sizes a step uses (counted from torch's sources; kept on the high side):
MULTI_KERNEL = {
    "sort": 3,  # <= 4096 keys a row: copy values, fill indices, one bitonic sort; more keys: cub radix (below)
    "topk": 2,  # the radix-select top-k kernel, then the sort of the k results (sorted=True)
    "nonzero": 3,  # count, cub select, copy (and a host sync to size the output)
    "histc": 2,  # zero the bins, then the atomic histogram
    "bincount": 3,  # max/min reductions, zero, histogram (and a host sync)
    "unique": 4,
    "_unique2": 4,
    "index_put_": 2,  # with accumulate: a sort of the indices first
    "index_put": 2,
    "_index_put_impl_": 2,
    "repeat_interleave": 2,  # cumsum of the repeats, then the expansion
    "masked_select": 3,
}
RADIX_SORT_PASSES = 12  # cub's onesweep radix sort of int64 keys: histogram, scan, 8 passes, 2 copies


class Uncounted(AssertionError):
    """A launch the meta device cannot see, so it would be left out of the count."""


@dataclass
class Launches:
    """Counts by region ("layer 0".., "outside") and, within each, by kernel name."""

    by_region: dict[str, Counter] = field(default_factory=dict)
    captured: int = 0
    eager: int = 0

    def add(self, region: str, name: str, count: int, captured: bool) -> None:
        self.by_region.setdefault(region, Counter())[name] += count
        if captured:
            self.captured += count
        else:
            self.eager += count

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.by_region.values())

    def layer(self, index: int) -> int:
        return sum(self.by_region.get(f"layer {index}", Counter()).values())

    @property
    def layers(self) -> list[int]:
        found = sorted(int(r.split()[1]) for r in self.by_region if r.startswith("layer "))
        return [self.layer(i) for i in range(found[-1] + 1)] if found else []

    @property
    def outside(self) -> int:
        return sum(self.by_region.get("outside", Counter()).values())

    def kernels(self, region: str) -> Counter:
        return self.by_region.get(region, Counter())

    def summary(self) -> str:
        layers = self.layers
        per = f"{min(layers)}-{max(layers)} per layer ({sum(layers)} in {len(layers)})" if layers else "no layers"
        return f"{self.total} launches: {per}, {self.outside} outside; captured {self.captured}, eager {self.eager}"

    def detail(self, region: str) -> str:
        return ", ".join(f"{name} x{n}" for name, n in sorted(self.kernels(region).items(), key=lambda kv: -kv[1]))


def _kernels(func, args, kwargs) -> int:
    name = func._schema.name.split("::")[-1]
    if name == "sort" or name == "sort.stable":
        t = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else -1)
        keys = t.shape[dim] if t.dim() else 1
        return MULTI_KERNEL["sort"] if keys <= 4096 else RADIX_SORT_PASSES
    return MULTI_KERNEL.get(name, 1)


class _Counter(TorchDispatchMode):
    def __init__(self, launches: Launches):
        super().__init__()
        self.launches = launches
        self.region = "outside"
        self.captured = False
        self.paused = 0

    def note(self, name: str, count: int = 1) -> None:
        if not self.paused:
            self.launches.add(self.region, name, count, self.captured)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if func.is_view or name in NO_KERNEL or func._schema.name.startswith("prim::"):
            return func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        try:
            out = func(*args, **kwargs)
        except NotImplementedError as e:  # no meta kernel: the count cannot see this path
            raise Uncounted(f"aten.{name} has no meta implementation, so its launches cannot be counted: {e}") from e
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        devices |= {t.device.type for t in results}
        if "meta" in devices:  # work on the device (host-only ops, e.g. building a plan, launch nothing)
            self.note(name, _kernels(func, args, kwargs))
        return out


class _Reads(TorchFunctionMode):
    """A read of a device value by the host (`tolist`, `item`, ...) is a device-to-host copy: a
    launch (and a sync). Counted here, answered by whatever runs inside (host_sync.count_host_reads
    gives zeros for meta tensors)."""

    READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, counter: _Counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            self.counter.note(f"d2h:{name}")
            self.counter.paused += 1  # the read's own ops (a copy) are this one launch
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.counter.paused -= 1
        return func(*args, **(kwargs or {}))


_ACTIVE: list[_Counter] = []


@contextlib.contextmanager
def count_launches(net=None):
    """Inside, every launch of device work counts (see the module); `net`'s layers get regions of
    their own. Triton launches are stubbed and counted by kernel name."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from host_sync import stub_triton_launches

    launches = Launches()
    counter = _Counter(launches)
    hooks = []
    if net is not None:  # the fused network's layers (kernels/fused.py) or the torch ones
        for i, layer in enumerate(getattr(net, "fused_layers", None) or net.layers):
            hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(counter, "region", f"layer {i}")))
            hooks.append(layer.register_forward_hook(lambda m, a, o: setattr(counter, "region", "outside")))
    with stub_triton_launches():
        stubbed = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

        def counted(run):
            def launch(self, *args, **kwargs):
                counter.note(f"triton:{getattr(self, '__name__', None) or self.fn.__name__}")
                return run(self, *args, **kwargs)

            return launch

        for cls, run in stubbed.items():
            cls.run = counted(run)
        _ACTIVE.append(counter)
        try:
            with counter, _Reads(counter):
                yield launches
        finally:
            _ACTIVE.pop()
            for cls, run in stubbed.items():
                cls.run = run
            for h in hooks:
                h.remove()


@contextlib.contextmanager
def captured_region():
    """Launches inside count as a CUDA graph's (the decoder step a graph replays)."""
    if not _ACTIVE:
        yield
        return
    counter = _ACTIVE[-1]
    saved, counter.captured = counter.captured, True
    try:
        yield
    finally:
        counter.captured = saved


@contextlib.contextmanager
def not_counted():
    """Work the count leaves out on purpose (e.g. a graph's capture, done once, not per step)."""
    if not _ACTIVE:
        yield
        return
    counter = _ACTIVE[-1]
    counter.paused += 1
    try:
        yield
    finally:
        counter.paused -= 1


def counting_capture(step, graphs=None):
    """A `DecoderGraphs` capture for counting: the capture runs `step()` uncounted (it happens
    once); each replay runs it again as the captured region (a graph replays exactly the captured
    kernels), its outputs copied into the first run's tensors uncounted (a replay writes them in
    place)."""
    with not_counted():
        outputs = step()

    def replay():
        with captured_region():
            fresh = step()
        with not_counted():
            for dest, src in zip(outputs, fresh):
                dest.copy_(src)

    return replay, outputs


H200_SMS = 132


@contextlib.contextmanager
def h200():
    """Meta tensors take the choices an H200 gets: the kernels' block sizes, grids and split counts
    as compiled for a GPU (not the interpreter's), 132 SMs for the attention's split count."""
    from dgemma.kernels import (
        triton_attention,
        triton_canvas,
        triton_layer,
        triton_moe,
        triton_norms,
        triton_quant,
        triton_step,
    )

    saved = triton_attention._sm_count, triton_attention.pick_splits
    pick_splits = saved[1]
    # the modules whose INTERPRETED picks block sizes (triton_canvas: the step kernels'), those with `available`
    sizing = (triton_attention, triton_layer, triton_moe, triton_norms, triton_quant, triton_canvas)
    gated = (triton_attention, triton_layer, triton_moe, triton_norms, triton_quant, triton_step)
    interpreted = [m.INTERPRETED for m in sizing]
    available = [m.available for m in gated]
    triton_attention._sm_count = lambda index: H200_SMS
    triton_attention.pick_splits = lambda device, *a: pick_splits(torch.device("cuda", 0), *a)
    for m in sizing:  # block sizes, split counts and grids as compiled for a GPU (the launches are stubbed)
        m.INTERPRETED = False
    for m in gated:
        m.available = lambda device: True
    try:
        yield
    finally:
        triton_attention._sm_count, triton_attention.pick_splits = saved
        for m, was in zip(sizing, interpreted):
            m.INTERPRETED = was
        for m, was in zip(gated, available):
            m.available = was


# ------------------------------------------------------------------------- the released model
def released_net(scheme: str | None = None, layers: int | None = None):
    """The released model's text stack (presets "real") on the meta device in bf16, its linears
    and experts quantised with `scheme` (int4: groups of 64) where given; `layers`: fewer layers
    (the per-layer counts do not depend on how many)."""
    from dgemma.model.checkpoint import make_config
    from dgemma.model.diffusion_gemma import DiffusionGemma
    from dgemma.model.presets import PRESETS

    preset = dict(PRESETS["real"])
    if layers is not None:
        preset.update(num_layers=layers, layer_types=None)
    config = make_config(**preset)
    if scheme is None:
        with torch.device("meta"):
            return DiffusionGemma(config).to(torch.bfloat16).eval()
    from dgemma.quant.modules import random_quantized_model

    return random_quantized_model(config, scheme, 64 if scheme == "int4" else None, torch.bfloat16, device="meta")


def meta_engine(net, **options):
    """An engine on `net` (meta) with the GPU path's kernels as on an H200 (call inside `h200()`),
    its CUDA graphs captured by `counting_capture`."""
    from dgemma.engine.engine import Engine, EngineOptions

    settings = dict(triton=True, cuda_graphs=True, batch_invariant=False, prefix_cache=False, kv_cache_memory=2**33)
    engine = Engine(net, EngineOptions(**(settings | options)))
    if engine.runner.graphs is not None:
        engine.runner.graphs.capture = counting_capture
    return engine


def step_launches(net, batch: int, prompt: int = 512, on_counted=None, **knobs) -> Launches:
    """The launches of one steady engine step of `batch` requests denoising canvases after
    `prompt`-token prompts (prompts encoded and graphs captured by the steps before, uncounted):
    the whole step, captured region and the host's work around it. `on_counted()` is called just
    before the counted step; `knobs`: GenerationConfig fields (e.g. turbo)."""
    from dgemma.config import GenerationConfig
    from dgemma.engine.engine import Request
    from host_sync import count_host_reads

    with h200():
        engine = meta_engine(net)
        c = net.config.canvas_length
        gen = GenerationConfig(max_new_tokens=4 * c, max_denoising_steps=16, confidence_threshold=1e-30, **knobs)
        for i in range(batch):
            engine.add(Request(list(range(10, 10 + prompt)), gen, i))
        with torch.no_grad(), count_host_reads():
            with count_launches():  # stubs the Triton launches; prompts, first passes, captures
                while engine.scheduler.waiting or any(r.pending_tokens for r in engine.scheduler.running):
                    engine.step()
                engine.step()
            if on_counted is not None:
                on_counted()
            with count_launches(engine.runner.net) as launches:
                engine.step()
    return launches


def encode_launches(net, prompt: int = 512) -> Launches:
    """The launches of one encoder pass: a committed block of one canvas (256 tokens at the
    released size) after a `prompt`-token prompt, as the engine's step encodes it (prefill)."""
    from dgemma.config import GenerationConfig
    from dgemma.engine.engine import Request
    from host_sync import count_host_reads

    with h200():
        engine = meta_engine(net)
        gen = GenerationConfig(max_new_tokens=4 * net.config.canvas_length, max_denoising_steps=1)  # a block a pass
        engine.add(Request(list(range(10, 10 + prompt)), gen, 0))
        with torch.no_grad(), count_host_reads():
            with count_launches():
                while not engine.scheduler.running or engine.scheduler.running[0].block == 0:
                    engine.step()
            plan = engine.scheduler.schedule()
            assert [w.end - w.start for w in plan.encode] == [net.config.canvas_length], plan.encode
            with count_launches(engine.runner.net) as launches:
                engine.runner._encode(plan.encode)
    return launches


def ar_token_launches(net, prompt: int = 512, rows: int = 1) -> Launches:
    """The launches of one AR token on the device path (engine/fused/ar.py): the captured step
    (one replay) and the host's work of a read-back batch of one token (block tables up, the read)."""
    from dgemma.engine.fused.ar import device_ar_events
    from host_sync import count_host_reads

    with h200():
        engine = meta_engine(net)
        events = device_ar_events(
            engine,
            [list(range(10, 10 + prompt))] * rows,
            4,
            0.0,
            list(range(rows)),
            (),
            read_every=1,
            capture=counting_capture,
        )
        with torch.no_grad(), count_host_reads():
            with count_launches():
                for _ in range(rows):  # the prompts and their first tokens
                    next(events)
            with count_launches(engine.runner.net) as launches:
                for _ in range(rows):  # the second token of each row: one step
                    next(events)
            events.close()
    return launches


# A step's launches at the released size on an H200's choices, pinned (per layer, outside, total):
# tests/engine/test_launch_count.py holds a step to them, test_device_ar.py an AR token.
PINNED = {
    ("bf16", 1): (14, 19, 439),  # 14 a layer: the attention splits its prefix at batch 1 (+1: the splits' combine)
    ("bf16", 8): (13, 19, 409),
    # fp8: W8A8 dense linears (issue 54, item 2): +1 a layer, the per-token quantisation of o_proj's
    # input (the attention's output: made by no kernel of ours that could write it quantised); down's
    # quantisation takes gelu_mul's launch (gelu * up moves into gate|up's epilogue); q|k|v's, gate|up's
    # and the experts' inputs are written quantised by the row kernels that make them (no launch)
    ("fp8", 1): (15, 19, 469),
    ("int4", 1): (14, 19, 439),
    ("nvfp4", 1): (14, 19, 439),
}
# a turbo pass on the device path (engine/fused/turbo.py), its row bucket C/8 (what the meta
# device's zero reads give): at batch 8 the attention splits the prefix of the fewer query rows
# (+1 a layer, the splits' combine); at batch 1 the router splits K over its 32 rows (+1 a layer,
# the chunks' sum: issue 54's split-K, 418 before)
TURBO_PINNED = {1: (14, 28, 448), 8: (14, 28, 448)}
# an encoder pass (`encode_launches`: a 256-token block after a 512-token prompt): 13 a layer, its
# K/V written into the pool by the q|k|v kernel and its causal attention one kernel reading the pool
# in place (triton_attention.paged_prefix_attention); outside, the embedding, the RoPE tables, the
# token ids' and the plan's copies and the last tokens' stack. Before: 35 / 18 / 1,068 (gathered
# SDPA on the meta device's math path, the masks built each pass, two `index_copy_` a layer).
ENCODE_PINNED = (13, 7, 397)

"""CUDA graphs of the device step (engine/fused/step.py: the pass, statistics, sampling and the
sampler's decisions): one per batch-size bucket (and per mask: with or without allowed-token
masks), captured once and replayed for any group of up to its size at any prefix lengths (the
paged attention reads the block tables on the device)."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch

from .inputs import StepLayout, StepTensors, fill, host_buffer
from .step import DeviceStep, run_step, stack_state

if TYPE_CHECKING:
    from ..request import Request
    from ..step_ops import StepOps

log = logging.getLogger("dgemma")


class DecoderGraphs:
    """CUDA graphs of `fused.step.run_step`, one per batch-size bucket (1, 2, 4, 8) and mask kind,
    each captured once, the first time a group needs it.

    A captured step reads static inputs: the packed step inputs (engine/fused/inputs.py: block
    tables, key ranges, positions, temperatures, seeds, pass counts, the sampler's knobs, fixed
    tokens) as one device buffer, the canvases, self-conditioning inputs and stop histories, and,
    in the masked variant, the packed allowed-token masks. Before each replay they are
    overwritten with the group's values (one host-to-device copy, one stack each); rows past the
    group get an empty prefix, token 0, temperature 1, no history and a mask allowing everything,
    and their outputs are dropped. So one graph serves every group of up to its size at any
    prefix lengths.

    `steps` holds the captured steps by (bucket, masked); `captured` the unmasked ones by bucket.
    A capture that fails is recorded in `failures` (same keys: "ExceptionType: message"), logged
    once, and that bucket and mask kind run eagerly for good (`run` returns None); the others keep
    replaying. Groups larger than `largest` get None too: the caller splits them (or runs them
    eagerly). The graphs share one memory pool (a failed capture's pool is left to the graphs
    already in it; later captures take a fresh one): only one replays at a time, and its outputs
    are read (or copied out) before the next replay. `capture` is how a step is captured (default:
    a CUDA graph; `eager_capture` replays it eagerly, which the tests use to check the static
    inputs on a CPU).
    """

    BUCKETS = (1, 2, 4, 8)

    def __init__(self, buckets: tuple[int, ...] = BUCKETS, capture=None):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"DecoderGraphs needs positive bucket sizes, got {buckets}")
        self.buckets = tuple(sorted(set(buckets)))
        self.steps: dict[tuple[int, bool], _CapturedStep] = {}
        self.turbo_steps: dict[tuple[int, int], object] = {}  # (bucket, rows a canvas): fused/turbo.py's
        self.failures: dict[tuple[int, bool], str] = {}
        self.capture = capture or cuda_capture
        self.pool = None  # the graphs' shared memory pool (CUDA)

    @property
    def largest(self) -> int:
        """The largest bucket: `run` replays groups of up to this many requests."""
        return self.buckets[-1]

    @property
    def captured(self) -> dict[int, _CapturedStep]:
        """The captured steps without masks, by bucket."""
        return {size: step for (size, masked), step in self.steps.items() if not masked}

    @property
    def failed(self) -> bool:
        """Whether any capture failed (see `failures` for which, and why)."""
        return bool(self.failures)

    def bucket(self, rows: int) -> int | None:
        """The bucket a group of `rows` requests replays in (None: larger than `largest`)."""
        return next((b for b in self.buckets if b >= rows), None)

    def run(self, ops: StepOps, group: list[Request], allowed: torch.Tensor | None = None):
        """`fused.step.run_step` of the group by a graph replay: its outputs (views of the graph's
        output tensors, valid until the next replay), or None where the group must run eagerly
        (larger than `largest`, or the capture failed)."""
        size = self.bucket(len(group))
        if size is None:
            return None
        key = (size, allowed is not None)
        what = f"decoder step for {size} rows{' with allowed-token masks' if key[1] else ''}"
        entry = self._entry(self.steps, key, key, lambda: _CapturedStep(ops, size, self, masked=key[1]), what)
        return None if entry is None else entry.replay(ops, group, allowed)

    def captured_turbo(self, key: tuple[int, int], capture, ops: StepOps, group: list[Request]):
        """A turbo step (engine/fused/turbo.py) of the group by a graph replay: the step under
        `key` ((batch bucket, rows a canvas)), captured with `capture()` the first time; None where
        that capture failed (then and for good: those run eagerly)."""
        what = f"turbo step for {key[0]} rows of {key[1]} positions"
        entry = self._entry(self.turbo_steps, key, ("turbo", *key), capture, what)
        return None if entry is None else entry.replay(ops, group)

    def _entry(self, store: dict, key: tuple, failure: tuple, capture, what: str):
        if failure in self.failures:
            return None
        entry = store.get(key)
        if entry is None:
            try:
                entry = capture()
            except Exception as e:  # noqa: BLE001 - any capture failure means: this bucket runs eagerly
                reason = self.failures[failure] = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture of the %s failed; those run eagerly: %s", what, reason)
                return None
            store[key] = entry
        return entry


class _CapturedStep:
    """One bucket's captured device step: its static inputs and outputs."""

    def __init__(self, ops: StepOps, size: int, graphs: DecoderGraphs, masked: bool = False):
        cfg, device = ops.config, ops.net.device
        c = cfg.canvas_length
        self.size, self.masked = size, masked
        width = -(-cfg.max_position_embeddings // ops.cache.block_size)  # any sequence's table fits
        self.layout = StepLayout(size, c, width)
        self.host = host_buffer(self.layout, device)
        fill(self.layout, self.host, ops.cache, [])  # every row padding
        self.buffer = self.host.to(device)
        blank = ops.blank_state()
        words = -(-cfg.vocab_size // 32)
        self.static = DeviceStep(
            StepTensors.of(self.layout, self.buffer, ops.cache, []),
            canvas=blank["canvas"].repeat(size, 1),
            soft=blank["soft"].repeat(size, 1, 1),
            history=blank["history"].repeat(size, 1, 1),
            allowed=torch.full((size * c, words), -1, dtype=torch.int32, device=device) if masked else None,
        )
        self._replay, self.outputs = graphs.capture(lambda: run_step(ops, self.static), graphs)

    @property
    def allowed(self) -> torch.Tensor | None:
        return self.static.allowed

    def replay(self, ops: StepOps, group: list[Request], allowed: torch.Tensor | None = None):
        if (allowed is not None) != self.masked:
            raise ValueError(
                f"a {'masked' if self.masked else 'mask-free'} graph needs {'' if self.masked else 'no '}allowed masks"
            )
        n, c = len(group), ops.config.canvas_length
        fill(self.layout, self.host, ops.cache, group)
        self.buffer.copy_(self.host, non_blocking=True)
        self.static.inputs.plan.rows = [r.kv for r in group]
        stack_state(ops, group, self.size, out=self.static)
        if allowed is not None:
            self.static.allowed[: n * c].copy_(allowed)
            if n < self.size:
                self.static.allowed[n * c :].fill_(-1)  # padded rows allow every token
        self._replay()
        return self.outputs


def cuda_capture(step, graphs: DecoderGraphs):
    """Capture `step()` as a CUDA graph (after a warm-up run on a side stream, which settles the
    allocator and kernel choices): (replay, the graph's output tensors).

    Unlike `torch.cuda.graph`'s context manager, whose `__exit__` leaves the capture stream current
    when `capture_end` raises (an illegal operation during the capture), the previous stream is
    restored on every path; a failed capture also stops the allocator recording into the graphs'
    pool (`capture_end` raises before it does so, and a later capture into the pool would fail
    with "already recording to mempool_id") and leaves that pool to the graphs already captured."""
    if graphs.pool is None:
        graphs.pool = torch.cuda.graph_pool_handle()
    pool = graphs.pool
    previous = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(previous)
    torch.cuda.set_stream(side)
    try:
        step()  # the warm-up
    finally:
        torch.cuda.set_stream(previous)
    previous.wait_stream(side)
    torch.cuda.synchronize()  # as torch.cuda.graph: nothing pending, freed memory back to the driver
    torch.cuda.empty_cache()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_stream(side)
    try:
        graph.capture_begin(pool=pool, capture_error_mode="global")
        try:
            outputs = step()
        except BaseException:
            _end_quietly(graph)  # leave capture mode; the step's error is the one to report
            raise
        graph.capture_end()
    except BaseException:
        _stop_recording(pool)
        graphs.pool = None
        raise
    finally:
        torch.cuda.set_stream(previous)
    return graph.replay, outputs


def _end_quietly(graph) -> None:
    with contextlib.suppress(Exception):  # an invalidated capture: the step's own error says why
        graph.capture_end()


def _stop_recording(pool) -> None:
    """End the caching allocator's recording into `pool` where a failed capture left it on
    (best effort: a capture that got past that point, or a torch without the binding, is fine)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    with contextlib.suppress(Exception):  # "not currently recording": nothing to undo
        end(torch.cuda.current_device(), pool)


def eager_capture(step, graphs: DecoderGraphs | None = None):
    """What a graph replay does, run eagerly: every replay recomputes `step()` from the static
    inputs into the first run's output tensors. Lets a CPU test check the bucket logic."""
    outputs = step()

    def replay():
        for dest, src in zip(outputs, step()):
            dest.copy_(src)

    return replay, outputs

"""CUDA graphs of the runner's decoder step: one per batch-size bucket (and per mask: with or
without allowed-token masks), captured once and replayed for any group of up to its size at any
prefix lengths (the paged attention reads the block tables on the device)."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..model.diffusion_gemma import DiffusionGemma
    from .kv.paged_cache import PagedKVCache, PagedPass
    from .request import Request


class StepRunner(Protocol):
    """What the graphs use of the runner (engine/runner.py): the network, its config, the KV pool
    and the decoder step they capture."""

    net: DiffusionGemma
    config: ModelConfig
    cache: PagedKVCache

    def decoder_step(self, canvas, soft, temps, plan: PagedPass, allowed=None) -> tuple[torch.Tensor, ...]: ...

log = logging.getLogger("dgemma")


class DecoderGraphs:
    """CUDA graphs of `Runner.decoder_step`, one per batch-size bucket (1, 2, 4, 8) and mask kind,
    each captured once, the first time a group needs it.

    A captured step reads static inputs: canvases, self-conditioning inputs, temperatures, a
    `plan_canvas` pass whose block tables, key ranges and positions are device tensors (the Triton
    attention reads the pool through them) and, in the masked variant, the packed allowed-token
    masks. Before each replay they are overwritten with the group's values; rows past the group
    get an empty prefix, token 0, temperature 1 and a mask allowing everything, and their outputs
    are dropped. So one graph serves every group of up to its size at any prefix lengths.

    `steps` holds the captured steps by (bucket, masked); `captured` the unmasked ones by bucket.
    A capture that fails is recorded in `failures` (same keys: "ExceptionType: message"), logged
    once, and that bucket and mask kind run eagerly for good (`run` returns None); the others keep
    replaying. Groups larger than `largest` get None too: the caller splits them (or runs them
    eagerly). The graphs share one memory pool (a failed capture's pool is left to the graphs
    already in it; later captures take a fresh one): only one replays at a time, and its outputs
    are read before the next replay. `capture` is how a step is captured (default: a CUDA graph;
    `eager_capture` replays it eagerly, which the tests use to check the static inputs on a CPU).
    """

    BUCKETS = (1, 2, 4, 8)

    def __init__(self, buckets: tuple[int, ...] = BUCKETS, capture=None):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"DecoderGraphs needs positive bucket sizes, got {buckets}")
        self.buckets = tuple(sorted(set(buckets)))
        self.steps: dict[tuple[int, bool], _CapturedStep] = {}
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

    def run(self, runner: StepRunner, group: list[Request], canvas, soft, temps, allowed=None):
        """`runner.decoder_step(canvas, soft, temps, <the group's plan_canvas>, allowed)` by a graph
        replay: its outputs (views of the graph's output tensors, valid until the next replay), or
        None where the group must run eagerly (larger than `largest`, or the capture failed)."""
        size = self.bucket(len(group))
        if size is None:
            return None
        key = (size, allowed is not None)
        if key in self.failures:
            return None
        entry = self.steps.get(key)
        if entry is None:
            try:
                entry = _CapturedStep(runner, size, self, masked=key[1])
            except Exception as e:  # noqa: BLE001 - any capture failure means: this bucket runs eagerly
                reason = self.failures[key] = f"{type(e).__name__}: {e}"
                log.warning(
                    "CUDA graph capture of the decoder step for %d rows%s failed; those run eagerly: %s",
                    size, " with allowed-token masks" if key[1] else "", reason,
                )  # fmt: skip
                return None
            self.steps[key] = entry
        return entry.replay(runner, group, canvas, soft, temps, allowed)


class _CapturedStep:
    """One bucket's captured decoder step: its static inputs and outputs."""

    def __init__(self, runner: StepRunner, size: int, graphs: DecoderGraphs, masked: bool = False):
        cfg, device = runner.config, runner.net.device
        c = cfg.canvas_length
        self.size, self.masked = size, masked
        self.canvas = torch.zeros(size, c, dtype=torch.long, device=device)
        self.soft = torch.zeros(size, c, cfg.hidden_size, dtype=runner.net.dtype, device=device)
        self.temps = torch.ones(size * c, 1, dtype=torch.float32, device=device)
        words = -(-cfg.vocab_size // 32)
        self.allowed = torch.full((size * c, words), -1, dtype=torch.int32, device=device) if masked else None
        width = -(-cfg.max_position_embeddings // runner.cache.block_size)  # any sequence's table fits
        self.plan = runner.cache.canvas_buffers(size, c, width)
        self._replay, self.outputs = graphs.capture(
            lambda: runner.decoder_step(self.canvas, self.soft, self.temps, self.plan, self.allowed), graphs
        )

    def replay(self, runner: StepRunner, group: list[Request], canvas, soft, temps, allowed=None):
        if (allowed is not None) != self.masked:
            raise ValueError(f"a {'masked' if self.masked else 'mask-free'} graph needs {'' if self.masked else 'no '}allowed masks")
        n, c = canvas.shape
        self.canvas[:n].copy_(canvas)
        self.canvas[n:].zero_()
        if soft is None:
            self.soft.zero_()  # exactly "no self-conditioning"
        else:
            self.soft[:n].copy_(soft)
            self.soft[n:].zero_()
        self.temps[: n * c].copy_(temps)
        self.temps[n * c :].fill_(1.0)
        if allowed is not None:
            self.allowed[: n * c].copy_(allowed)
            self.allowed[n * c :].fill_(-1)  # padded rows allow every token
        runner.cache.plan_canvas(c, [r.kv for r in group], out=self.plan)
        self._replay()
        argmax, entropy, weights, total, soft_next = self.outputs
        return argmax[:n], entropy[:n], weights[: n * c], total[: n * c], soft_next[:n]


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

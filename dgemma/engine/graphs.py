"""CUDA graphs of the runner's decoder step: one per batch-size bucket, captured once and replayed
for any group of up to its size at any prefix lengths (the paged attention reads the block tables
on the device)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .request import Request
    from .runner import Runner

log = logging.getLogger("dgemma")


class DecoderGraphs:
    """CUDA graphs of `Runner.decoder_step`, one per batch-size bucket (1, 2, 4, 8), captured once.

    A captured step reads static inputs: canvases, self-conditioning inputs, temperatures, and a
    `plan_canvas` pass whose block tables, key ranges and positions are device tensors (the Triton
    attention reads the pool through them). Before each replay they are overwritten with the
    group's values; rows past the group get an empty prefix, token 0 and temperature 1, and their
    outputs are dropped. So one graph serves every group of up to its size at any prefix lengths.
    Groups larger than the largest bucket, and passes with allowed-token masks, run eagerly; if a
    capture fails, the runner runs eagerly for good (with a warning). The buckets' graphs share one
    memory pool: only one replays at a time, and its outputs are read before the next replay.
    `capture` is how a step is captured (default: a CUDA graph; `eager_capture` replays it eagerly,
    which the tests use to check the static inputs on a CPU).
    """

    BUCKETS = (1, 2, 4, 8)

    def __init__(self, buckets: tuple[int, ...] = BUCKETS, capture=None):
        self.buckets = tuple(sorted(buckets))
        self.captured: dict[int, _CapturedStep] = {}
        self.failed = False
        self.capture = capture or cuda_capture
        self.pool = None  # the graphs' shared memory pool (CUDA)

    def run(self, runner: Runner, group: list[Request], canvas, soft, temps):
        size = next((b for b in self.buckets if b >= len(group)), None)
        if self.failed or size is None:
            return None
        entry = self.captured.get(size)
        if entry is None:
            try:
                entry = self.captured[size] = _CapturedStep(runner, size, self)
            except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly
                log.warning("CUDA graph capture failed, running eagerly: %s", e)
                self.failed, self.captured = True, {}
                return None
        return entry.replay(runner, group, canvas, soft, temps)


class _CapturedStep:
    """One bucket's captured decoder step: its static inputs and outputs."""

    def __init__(self, runner: Runner, size: int, graphs: DecoderGraphs):
        cfg, device = runner.config, runner.net.device
        c = cfg.canvas_length
        self.size = size
        self.canvas = torch.zeros(size, c, dtype=torch.long, device=device)
        self.soft = torch.zeros(size, c, cfg.hidden_size, dtype=runner.net.dtype, device=device)
        self.temps = torch.ones(size * c, 1, dtype=torch.float32, device=device)
        width = -(-cfg.max_position_embeddings // runner.cache.block_size)  # any sequence's table fits
        self.plan = runner.cache.canvas_buffers(size, c, width)
        self._replay, self.outputs = graphs.capture(
            lambda: runner.decoder_step(self.canvas, self.soft, self.temps, self.plan), graphs
        )

    def replay(self, runner: Runner, group: list[Request], canvas, soft, temps):
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
        runner.cache.plan_canvas(c, [r.kv for r in group], out=self.plan)
        self._replay()
        argmax, entropy, weights, total, soft_next = self.outputs
        return argmax[:n], entropy[:n], weights[: n * c], total[: n * c], soft_next[:n]


def cuda_capture(step, graphs: DecoderGraphs):
    """Capture `step()` as a CUDA graph (after a warm-up run on a side stream, which settles the
    allocator and kernel choices): (replay, the graph's output tensors)."""
    if graphs.pool is None:
        graphs.pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=graphs.pool):
        outputs = step()
    return graph.replay, outputs


def eager_capture(step, graphs: DecoderGraphs | None = None):
    """What a graph replay does, run eagerly: every replay recomputes `step()` from the static
    inputs into the first run's output tensors. Lets a CPU test check the bucket logic."""
    outputs = step()

    def replay():
        for dest, src in zip(outputs, step()):
            dest.copy_(src)

    return replay, outputs

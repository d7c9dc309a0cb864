"""The Triton path's decoder step, whole on the device: the pass, the statistics, the next
self-conditioning input, sampling and the sampler's decisions, in a fixed set of launches with no
host sync, so one CUDA graph replays all of it (engine/fused/graphs.py).

    inputs        one host-to-device copy of the group's step inputs (engine/fused/inputs.py), the
                  canvases, self-conditioning inputs and stop histories stacked once each
    the pass      net.decode (kernels/fused.py's fused network: 14 launches a layer)
    statistics    the LM head, then triton_step.step_statistics: argmax, entropy, softmax's
                  probabilities in the model's dtype (2 launches)
    soft_next     probs @ E x sqrt(hidden), one GEMM (the scale in its epilogue)
    sampling      triton_step.sample_drawn: every position, from its request's Philox stream
    decisions     triton_step.decide: acceptance, re-noising, fixed tokens, the stop rule

The host then reads the stop flags (the step's one read) and, for requests that ask when their
block ends, the log probabilities. `FusedPath` takes a request unless its decisions need the host
(a grammar's refinement walks the argmax canvas; a stop-rule history longer than
triton_step.MAX_STABILITY) or it denoises with turbo: those take the host paths (engine/host/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...kernels import triton_step
from ..step_plan import DecodeResult
from .inputs import StepLayout, StepTensors, fill, host_buffer

if TYPE_CHECKING:
    from ..request import Request
    from ..step_ops import StepOps
    from .graphs import DecoderGraphs


@dataclass
class DeviceStep:
    """A device step's inputs: `inputs` (the packed step inputs and the canvas pass they plan),
    canvases [n, C], self-conditioning inputs [n, C, H] (None: none for any row), stop
    histories [n, MAX_STABILITY, C] (-1: none yet), packed allowed-token masks [n C, words] or None."""

    inputs: StepTensors
    canvas: torch.Tensor
    soft: torch.Tensor | None
    history: torch.Tensor
    allowed: torch.Tensor | None


def run_step(ops: StepOps, step: DeviceStep) -> tuple[torch.Tensor, ...]:
    """One decoder step of the step's rows, no host sync (what a graph captures): (canvas,
    argmax [n, C], history [n, S, C], stop [n], kept [n, C], shown [n, C], soft_next [n, C, H],
    probs [n C, V])."""
    n, c = step.canvas.shape
    v = step.inputs
    hidden = ops.net.decode(step.canvas, v.plan, step.soft)
    argmax, entropy, probs, _, soft_next = ops.statistics(hidden, v["temps"], step.allowed)
    sampled = triton_step.sample_drawn(probs, v["seeds"], v["passes"], c)
    decided = triton_step.decide(
        entropy,
        argmax,
        sampled.view(n, c),
        v["seeds"],
        v["passes"],
        v["fixed"],
        v["bounds"],
        v["confidence"],
        v["stability"],
        step.history,
        ops.config.vocab_size,
    )
    return (*decided, soft_next, probs)


def stack_state(ops: StepOps, group: list[Request], rows: int, out: DeviceStep | None = None):
    """The group's canvases, self-conditioning inputs and histories stacked into [rows, ...]
    (rows past the group: token 0, no self-conditioning, no history), one launch each; into
    `out`'s tensors when given (a graph's static inputs). Returns (canvas, soft, history)."""
    pad = rows - len(group)
    blank = ops.blank_state()
    canvas = [r.canvas for r in group] + [blank["canvas"]] * pad
    history = [r.history if r.history is not None else blank["history"] for r in group] + [blank["history"]] * pad
    softs = [r.soft for r in group]
    if out is None:
        soft = (
            None
            if all(s is None for s in softs)
            else torch.stack([s if s is not None else blank["soft"] for s in softs] + [blank["soft"]] * pad)
        )
        return torch.stack(canvas), soft, torch.stack(history)
    torch.stack(canvas, out=out.canvas)
    torch.stack(history, out=out.history)
    torch.stack([s if s is not None else blank["soft"] for s in softs] + [blank["soft"]] * pad, out=out.soft)
    return out.canvas, out.soft, out.history


def eager_step(ops: StepOps, group: list[Request], allowed: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """`run_step` for a group outside any graph: its inputs copied up and stacked, then the step."""
    c = ops.config.canvas_length
    width = max([1] + [len(r.kv.tables[kind]) for r in group for kind in r.kv.tables])
    layout = StepLayout(len(group), c, width)
    host = host_buffer(layout, ops.net.device)
    fill(layout, host, ops.cache, group)
    inputs = StepTensors.of(layout, ops.to_device(host), ops.cache, group)
    canvas, soft, history = stack_state(ops, group, len(group))
    return run_step(ops, DeviceStep(inputs, canvas, soft, history, allowed))


class FusedPath:
    """The default step whole on the device (see the module): one graph replay a group where a
    graph of its bucket is captured (`graphs`, None: eager)."""

    name = "fused"

    def __init__(self, ops: StepOps, graphs: DecoderGraphs | None):
        self.ops, self.graphs = ops, graphs

    def accepts(self, r: Request) -> bool:
        """Whether `r`'s decoder steps run whole on the device (see the module)."""
        return (
            self.ops.triton
            and r.turbo is None
            and not r.refines
            and r.config.stability_threshold <= triton_step.MAX_STABILITY
        )

    def graph_key(self, group: list[Request]) -> tuple | None:
        """Which captured graph the group replays (None: it runs eagerly)."""
        if self.graphs is None:
            return None
        masked = any(r.active_constraints is not None and r.active_constraints.allowed is not None for r in group)
        return self.graphs.bucket(len(group)), masked

    def run(self, group: list[Request], copy_out: bool = False) -> list[DecodeResult]:
        """One decoder step of `group` on the device (a graph replay where one is captured), then
        the step's one read (the stop flags) and the log probabilities asked for. `copy_out`: the
        outputs are copied out of the graph's tensors (another group replays the same graph this
        step)."""
        ops = self.ops
        allowed = ops.allowed_masks(group)
        out = self.graphs.run(ops, group, allowed) if self.graphs is not None else None
        if out is None:
            out = eager_step(ops, group, allowed)
        elif copy_out:
            out = tuple(t.clone() for t in out)
        canvas, argmax, history, stop, kept, shown, soft_next, probs = out
        n, c = len(group), ops.config.canvas_length
        stops = stop[:n].tolist()
        logprobs = ops.logprobs(group, argmax, probs[: n * c], stops)
        return [
            DecodeResult(
                r, canvas[i], argmax[i], soft_next[i], history[i], stops[i], logprobs[i], kept[i], shown[i], positions=c
            )
            for i, r in enumerate(group)
        ]

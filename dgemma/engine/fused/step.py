"""The Triton path's decoder step, whole on the device: the pass, the statistics, the next
self-conditioning input, sampling and the sampler's decisions, in a fixed set of launches with no
host sync, so one CUDA graph replays all of it (engine/fused/graphs.py).

    inputs        one host-to-device copy of the group's step inputs (engine/fused/inputs.py), the
                  canvases, self-conditioning inputs and stop histories stacked once each
    the pass      net.decode (kernels/fused.py's fused network: 14 launches a layer; 8 more with LoRA
                  adapters, every row's adapter slot one of the inputs)
    statistics    the LM head, then triton_step.step_statistics: argmax, entropy, softmax's
                  probabilities in the model's dtype (2 launches)
    soft_next     probs @ E x sqrt(hidden), one GEMM (the scale in its epilogue)
    sampling      triton_step.sample_drawn: every position, from its request's Philox stream
    decisions     triton_step.decide: acceptance, re-noising, fixed tokens, the stop rule

The host then reads the stop flags (the step's one read) and, for requests that ask when their
block ends, the log probabilities. `FusedPath` (engine/fused/paths.py) takes a request unless its decisions need the host
(a grammar's refinement walks the argmax canvas; a stop-rule history longer than
triton_step.MAX_STABILITY) or it denoises with turbo: those take the host paths (engine/host/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...kernels import lora, triton_step
from .inputs import StepLayout, StepTensors, fill, host_buffer

if TYPE_CHECKING:
    from ..request import Request
    from ..step_ops import StepOps


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
    with lora.device_rows(ops.net, v["adapter"]):  # each row's adapter slot, read on the device
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

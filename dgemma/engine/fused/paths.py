"""The fused decode paths (engine/paths.py): a group's step whole on the device, by a CUDA graph
replay where one of its bucket is captured (fused/graphs.py), else eagerly. `FusedPath` runs the
default step (fused/step.py), `FusedTurboPath` turbo passes (fused/turbo.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...kernels import lora, triton_step
from ..step_plan import DecodeResult
from ..turbo import TurboState
from .graphs import DecoderGraphs
from .inputs import MAX_EOS
from .step import eager_step
from .turbo import CapturedTurbo, TurboCanvasPool, active_bucket, computed_positions, eager_turbo_step

if TYPE_CHECKING:
    from ..request import Request
    from ..step_ops import StepOps


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
            and (r.adapter is None or lora.on_device(self.ops.net))  # (else the host path's eager pass)
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


def fits_the_device(r: Request) -> bool:
    """Whether `r`'s turbo passes can run whole on the device (see the module), given a slot."""
    return (
        r.turbo is not None
        and r.adapter is None
        and not r.refines
        and r.top_logprobs is None
        and r.active_constraints is None
        and r.config.stability_threshold <= triton_step.MAX_STABILITY
        and len(r.config.eos_token_ids) <= MAX_EOS
    )


class FusedTurboPath:
    """Turbo passes whole on the device (see the module): a graph of (batch bucket, rows a
    canvas) replayed a group where one is captured (`graphs`, None: eager). The canvas K/V pool is
    made on the first turbo request that fits the device."""

    name = "fused turbo"

    def __init__(self, ops: StepOps, graphs: DecoderGraphs | None):
        self.ops, self.graphs = ops, graphs
        self.pool: TurboCanvasPool | None = None

    def assign_slots(self, requests: list[Request]) -> None:
        """Canvas K/V slots for the step's turbo requests that fit the device (the pool made on
        first use: as many slots as the default graph buckets' largest, 8, ~55 MB each at the
        released size; more turbo requests at once take the host's turbo step). A request that
        held a slot and no longer fits gives it up (and starts a pass over every position)."""
        if not self.ops.triton:
            return
        fitting = [r for r in requests if fits_the_device(r)]
        for r in requests:
            if r.turbo is not None and r.turbo.slot is not None and not fits_the_device(r):
                r.turbo.slot, r.turbo.passes, r.turbo.active = None, 0, None
                r.turbo.keys, r.turbo.values = [], []
                r.history = None
        if not fitting:
            return
        if self.pool is None:
            slots = DecoderGraphs.BUCKETS[-1]
            self.pool = TurboCanvasPool(self.ops.kv_config, slots, self.ops.net.dtype, self.ops.net.device)
        self.pool.assign(fitting)

    def accepts(self, r: Request) -> bool:
        """Whether `r`'s turbo pass runs on the device this step (it holds a canvas K/V slot)."""
        return r.turbo is not None and r.turbo.slot is not None

    def graph_key(self, group: list[Request]) -> tuple | None:
        """Every turbo group may replay a graph another replays this step (their rows a canvas are
        known only as they run): one key for them all."""
        return ("turbo",) if self.graphs is not None else None

    def run(self, group: list[Request], copy_out: bool = False) -> list[DecodeResult]:
        """One turbo pass of `group` on the device (a graph replay where one is captured), then the
        step's one read (stop flags and the next pass's counts). `copy_out`: the outputs are copied
        out of the graph's tensors (another turbo group replays this step)."""
        ops, pool, graphs = self.ops, self.pool, self.graphs
        c = ops.config.canvas_length
        counts = [computed_positions(r) for r in group]
        active = active_bucket(max(counts), c)
        out = None
        if graphs is not None:
            size = graphs.bucket(len(group))
            if size is not None:
                out = graphs.captured_turbo(
                    (size, active), lambda: CapturedTurbo(ops, pool, size, active, graphs), ops, group
                )
        if out is None:
            out = eager_turbo_step(ops, pool, group, active)
        elif copy_out:
            out = tuple(t.clone() for t in out)
        canvas, argmax, history, kept, entropy, frozen, streak, flags, resting, soft = out
        read = flags[: len(group)].tolist()  # the step's one read: stop flags, the next pass's counts
        results = []
        for i, (r, (stop, rest, no_rest)) in enumerate(zip(group, read)):
            s = r.turbo
            state = TurboState(
                frozen[i],
                streak[i],
                argmax[i],
                entropy[i],
                [],
                [],
                s.passes + 1,
                {},
                resting[i],
                s.slot,
                (rest, no_rest),
            )
            result = DecodeResult(r, canvas[i], argmax[i], soft[i], history[i], bool(stop), None, kept[i], entropy[i])
            result.positions, result.turbo = counts[i], state
            results.append(result)
        return results

"""Turbo denoising on the device: a turbo pass (engine/turbo.py's rules) captured like the
default step, with no host sync inside and one host read a step.

The pass computes A rows a canvas, A a bucket of the canvas (C/8, C/4, C/2, C) at least its
computed positions: the host learns the next pass's count with the stop flags (one read of both),
so it picks the bucket, and the graph of (batch bucket, A), without looking at the device again.
Inside the graph, `triton_turbo.turbo_plan` compacts the computed positions into those A rows
(padded with the last one), the fused network runs over them, writing their keys and values into
the request's slot of `TurboCanvasPool` (the q|k|v kernel's pool write) and attending over the
paged prefix and the slot's C canvas keys (no per-layer copies), then the statistics, sampling at
each row's canvas position (an exact pass's uniforms), and `triton_turbo.turbo_decide`.

`FusedTurboPath` (engine/fused/paths.py) takes the turbo requests that hold a slot (`assign_slots`, before the step's
paths are chosen). Requests with a grammar, log probabilities, canvas constraints, more than
MAX_EOS end tokens or a longer stop history than MAX_STABILITY, and those left without a slot,
take the host's turbo step (engine/host/turbo.py); a request that changes path starts a pass
over every position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...config import ModelConfig
from ...kernels import triton_step, triton_turbo
from ..turbo import may_rest
from .inputs import StepLayout, StepTensors, fill, host_buffer
from .step import stack_state

if TYPE_CHECKING:
    from ..kv.paged_cache import PagedPass
    from ..request import Request
    from ..step_ops import StepOps
    from .graphs import DecoderGraphs


def active_bucket(count: int, canvas_length: int) -> int:
    """The rows a turbo pass computes a canvas for `count` computed positions: C/8, C/4, C/2 or C."""
    for rows in (canvas_length // 8, canvas_length // 4, canvas_length // 2):
        if rows >= max(count, 1):
            return rows
    return canvas_length


class TurboCanvasPool:
    """The canvas K/V of the requests turbo runs on the device: per layer keys and values
    [slots + 1, C, Hkv, D] (the last slot, `scratch`, takes padding rows' writes), allocated once
    (a captured graph reads them in place); a slot a request, kept while it runs."""

    def __init__(self, config: ModelConfig, slots: int, dtype: torch.dtype, device: torch.device):
        c = config.canvas_length
        self.canvas_length, self.slots, self.scratch = c, slots, slots
        self.keys = [
            torch.zeros(slots + 1, c, s.num_kv_heads, s.head_dim, dtype=dtype, device=device) for s in config.layers
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.owners: dict[int, int] = {}  # slot -> request id

    def assign(self, requests: list[Request]) -> None:
        """A slot for each request (its last step's where it had one, else the lowest free one;
        none when all are taken: it runs the eager turbo step). A request whose slot changes (its
        first, or none now) starts a pass over every position with a fresh stop history: its
        canvas K/V is not where the pass will read it."""
        ids = {r.request_id for r in requests}
        self.owners = {slot: rid for slot, rid in self.owners.items() if rid in ids}
        held = {rid: slot for slot, rid in self.owners.items()}
        free = [s for s in range(self.slots) if s not in self.owners]
        for r in requests:
            slot = held.get(r.request_id)
            if slot is None and free:
                slot = free.pop(0)
                self.owners[slot] = r.request_id
            if slot != r.turbo.slot:
                r.turbo.slot, r.turbo.passes, r.turbo.active = slot, 0, None
                r.turbo.keys, r.turbo.values = [], []
                r.history = None


class TurboCanvasPass:
    """The cache pass of a turbo pass over A rows of n canvases: the rows' RoPE positions, their
    keys and values written into the requests' canvas K/V slots (by the fused q|k|v kernel through
    `pool_writes`, or here for an unfused layer), and their attention over the paged prefix and
    their slot's C canvas keys."""

    def __init__(self, inner: PagedPass, positions: torch.Tensor, writes: torch.Tensor, slots: torch.Tensor, pool):
        self.inner, self.positions, self.writes, self.slots, self.pool = inner, positions, writes, slots, pool
        self.written: set[int] = set()

    def pool_writes(self, layer: int, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.written.add(layer)
        return self.pool.keys[layer], self.pool.values[layer], self.writes

    def attention(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q / k / v [n, H(kv), A, D] of the computed rows -> [n, A, H, D]."""
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        if layer not in self.written:  # an unfused layer (LoRA adapters): its rows' keys and values here
            for pool, new in ((keys, k), (values, v)):
                flat = pool.view(-1, *pool.shape[-2:])
                flat.index_copy_(0, self.writes, new.transpose(1, 2).reshape(-1, *pool.shape[-2:]).to(pool.dtype))
        return self.inner.attention(layer, sliding, q, keys.transpose(1, 2), values.transpose(1, 2), self.slots)


@dataclass
class TurboStep:
    """A turbo step's inputs: the packed step inputs (StepLayout.turbo) and the canvases' state
    [n, C] (canvas, soft [n, C, H] or None, history [n, MAX_STABILITY, C], and TurboState's
    frozen, streak, tokens, entropy, rested)."""

    inputs: StepTensors
    canvas: torch.Tensor
    soft: torch.Tensor | None
    history: torch.Tensor
    frozen: torch.Tensor
    streak: torch.Tensor
    tokens: torch.Tensor
    entropy: torch.Tensor
    rested: torch.Tensor


def run_turbo_step(ops: StepOps, pool: TurboCanvasPool, step: TurboStep, active: int) -> tuple[torch.Tensor, ...]:
    """One turbo pass of the step's rows at `active` rows a canvas, no host sync (what a graph
    captures): (canvas, argmax [n, C], history, kept [n, C], entropy [n, C], frozen [n, C],
    streak [n, C], flags [n, 3] (stop, the next pass's counts), resting [n, C], soft [n, C, H])."""
    n, c = step.canvas.shape
    v = step.inputs
    plan = triton_turbo.turbo_plan(
        (step.frozen, step.streak, step.entropy, step.rested),
        v["full"],
        v["rest_threshold"],
        (v["slot"], v["positions"], v["temps"], step.canvas),
        pool.canvas_length,
        active,
    )
    rows, _, live, resting, writes, positions, temps, canvas = plan
    h = ops.config.hidden_size
    soft_in = None if step.soft is None else step.soft.gather(1, rows[..., None].expand(n, active, h))
    hidden = ops.net.decode(canvas, TurboCanvasPass(v.plan, positions, writes, v["slot"], pool), soft_in)
    argmax, entropy, probs, _, soft_next = ops.statistics(hidden, temps, None)
    sampled = triton_step.sample_drawn(probs, v["seeds"], v["passes"], c, positions=rows)
    state = (step.tokens, step.entropy, step.frozen, step.streak)
    decided = triton_turbo.turbo_decide(
        plan,
        argmax.view(n, active),
        entropy.view(n, active),
        sampled.view(n, active),
        state,
        v.views,
        step.history,
        ops.config.vocab_size,
    )
    base = step.soft if step.soft is not None else soft_next.new_zeros(n, c, h)
    soft = torch.where(
        live[..., None], base.scatter(1, rows[..., None].expand(n, active, h), soft_next.to(base.dtype)), base
    )
    return (*decided, resting, soft)


def stack_turbo_state(ops: StepOps, group: list[Request], rows: int, out: TurboStep | None = None) -> tuple:
    """`stack_state` and the group's TurboState tensors stacked into [rows, C] (padding rows:
    nothing frozen, no streak, no tokens), into `out`'s tensors when given. Returns (canvas, soft,
    history, frozen, streak, tokens, entropy, rested)."""
    pad = rows - len(group)
    blank = ops.blank_state()
    parts = {
        "frozen": [r.turbo.frozen for r in group],
        "streak": [r.turbo.streak for r in group],
        "tokens": [r.turbo.tokens for r in group],
        "entropy": [r.turbo.entropy for r in group],
        "rested": [r.turbo.rested if r.turbo.rested is not None else blank["rested"] for r in group],
    }
    common = stack_state(ops, group, rows, out=out)
    if out is None:
        return (*common, *(torch.stack(p + [blank[k]] * pad) for k, p in parts.items()))
    for k, p in parts.items():
        torch.stack(p + [blank[k]] * pad, out=getattr(out, k))
    return (*common, *(getattr(out, k) for k in parts))


def eager_turbo_step(
    ops: StepOps, pool: TurboCanvasPool, group: list[Request], active: int
) -> tuple[torch.Tensor, ...]:
    """`run_turbo_step` for a group outside any graph: its inputs copied up and stacked, then the pass."""
    c = ops.config.canvas_length
    width = max([1] + [len(r.kv.tables[kind]) for r in group for kind in r.kv.tables])
    layout = StepLayout(len(group), c, width, turbo=True)
    host = host_buffer(layout, ops.net.device)
    fill(layout, host, ops.cache, group, pool.scratch)
    inputs = StepTensors.of(layout, ops.to_device(host), ops.cache, group)
    return run_turbo_step(ops, pool, TurboStep(inputs, *stack_turbo_state(ops, group, len(group))), active)


class CapturedTurbo:
    """One (batch bucket, rows a canvas) turbo step captured: its static inputs and outputs."""

    def __init__(self, ops: StepOps, pool: TurboCanvasPool, size: int, active: int, graphs: DecoderGraphs):
        cfg, device = ops.config, ops.net.device
        width = -(-cfg.max_position_embeddings // ops.cache.block_size)  # any sequence's table fits
        self.size, self.active, self.pool = size, active, pool
        self.layout = StepLayout(size, cfg.canvas_length, width, turbo=True)
        self.host = host_buffer(self.layout, device)
        fill(self.layout, self.host, ops.cache, [], pool.scratch)  # every row padding
        self.buffer = self.host.to(device)
        inputs = StepTensors.of(self.layout, self.buffer, ops.cache, [])
        canvas, _, history, *state = stack_turbo_state(ops, [], size)
        soft = ops.blank_state()["soft"].repeat(size, 1, 1)
        self.static = TurboStep(inputs, canvas, soft, history, *state)
        self._replay, self.outputs = graphs.capture(lambda: run_turbo_step(ops, pool, self.static, active), graphs)

    def replay(self, ops: StepOps, group: list[Request]) -> tuple[torch.Tensor, ...]:
        fill(self.layout, self.host, ops.cache, group, self.pool.scratch)
        self.buffer.copy_(self.host, non_blocking=True)
        self.static.inputs.plan.rows = [r.kv for r in group]
        stack_turbo_state(ops, group, self.size, out=self.static)
        self._replay()
        return self.outputs


def computed_positions(r: Request) -> int:
    """The canvas positions `r`'s next turbo pass computes (known on the host: its last step's
    read, or every position on a full pass)."""
    state, settings = r.turbo, r.config.turbo_settings
    c = state.frozen.numel()
    if state.full_pass(settings) or state.active is None:
        return c
    return state.active[0] if may_rest(r) else state.active[1]

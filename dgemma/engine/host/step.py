"""The default decoder step on the host path, and the host's one decision rule.

`HostPath` runs a group's decoder pass (one batched pass, or a request at a time when batch
invariant), then `decide`: entropy-bound acceptance, sampling of the accepted positions,
re-noising of the others, fixed tokens, a grammar's refinement and the stopping rule. The turbo
step (host/turbo.py) decides with the same `decide`, giving it the rows its pass computed, the
positions resting and the frozen ones; with nothing frozen and nothing resting the rule is this
step's, token for token (tests/engine/test_turbo.py).

Randomness comes from each request's own stream, a fixed amount per pass (`StepOps.draws`): its
torch generator, or with the Triton kernels its Philox stream on the device. On a CPU only the
accepted positions are sampled; on a GPU every position is (no host sync), and the unaccepted
samples are discarded. Fixed positions of the canvas constraints are excluded from acceptance
(entropy 0 counts nothing against the bound) and from the stopping statistics, and keep their
tokens. Nothing here makes the host wait for the pass (tests/engine/test_host_sync.py proves it on
the meta device), except a grammar request's refinement, whose walk runs on the host, the CPU's
sampling of the accepted positions only, and the one read of the stop flags (`results`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import sampler
from ..constraints.grammar import PassRows, held_rows
from ..request import Request
from ..step_ops import StepOps
from ..step_plan import DecodeResult


@dataclass
class Decisions:
    """`decide`'s answer for n canvases: the next input canvases, the argmax canvases (refined,
    fixed and frozen tokens in place), the positions accepted, those a draft shows as decided
    (`kept`: accepted, or fixed), the entropies weighed for acceptance (0 at fixed positions)
    [n, C] each, the stop flags [n] (on the device) and the stop histories."""

    canvas: torch.Tensor
    argmax: torch.Tensor
    accepted: torch.Tensor
    kept: torch.Tensor
    weighed: torch.Tensor
    stops: torch.Tensor
    histories: list[torch.Tensor | None]


def decide(
    ops: StepOps,
    group: list[Request],
    argmax: torch.Tensor,
    entropy: torch.Tensor,
    weights: torch.Tensor,
    total: torch.Tensor,
    live: torch.Tensor | None = None,
    resting: torch.Tensor | None = None,
    held: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Decisions:
    """The sampler's decisions after a pass (argmax, entropy [n, C]; weights [R, V], totals [R]).

    Default step: every position computed, `weights` row i * C + p for position p of request i.
    Turbo (one request): `live` [R] the positions whose rows `weights` holds (computed, not
    frozen, not resting), `resting` [1, C] positions not computed this pass (ranked last, never
    accepted), `held` (frozen [C], tokens [C]): positions that keep their token."""
    fixed = ops.fixed_tokens(group)
    free = None if fixed is None else fixed < 0  # False where the constraints fix the token
    weighed = entropy if free is None else entropy * free
    bounds = ops.to_device(torch.tensor([[r.config.entropy_bound] for r in group], dtype=torch.float32))
    ranked = weighed if resting is None else torch.where(resting, torch.inf, weighed)  # a resting one: no sample
    accepted = sampler.entropy_bound_accept(ranked, bounds)
    if resting is not None:
        accepted &= ~resting
    if free is not None:
        accepted &= free
    canvas = _sample(ops, group, accepted, weights, total, live)
    if held is not None:
        canvas = torch.where(held[0], held[1], canvas)
    if fixed is not None:
        canvas = torch.where(free, canvas, fixed)
        argmax = torch.where(free, argmax, fixed)
    argmax = _refine(ops, group, argmax, weights, live, held)  # reads the canvas on the host: grammar requests only
    if held is not None:
        argmax = torch.where(held[0], held[1], argmax)  # a frozen position never changes
    stops, histories = [], []
    for i, r in enumerate(group):
        stop, history = sampler.stable_and_confident(
            r.history,
            argmax[i : i + 1],
            entropy[i : i + 1],
            r.config.stability_threshold,
            r.config.confidence_threshold,
            None if free is None else free[i : i + 1],
        )
        stops.append(stop)
        histories.append(history)
    kept = accepted if free is None else accepted | ~free  # what a draft shows: fixed positions keep their tokens
    return Decisions(canvas, argmax, accepted, kept, weighed, torch.cat(stops), histories)


def _sample(
    ops: StepOps,
    group: list[Request],
    accepted: torch.Tensor,
    weights: torch.Tensor,
    total: torch.Tensor,
    live: torch.Tensor | None,
) -> torch.Tensor:
    """The next input canvases [n, C]: each accepted position's token sampled from the pass's
    weights, every other position its noise token (re-noised)."""
    uniforms, noise = ops.draws(group)
    n, c = accepted.shape
    if live is not None:  # turbo: the rows of one request's live positions
        picked = accepted[0, live]
        rows = live[picked]
        canvas = noise.clone()
        if rows.numel():
            canvas[0, rows] = ops.sample_rows(weights[picked], total[picked], uniforms[0, rows])
        return canvas
    if ops.triton:  # every position (no host sync)
        sampled = ops.sample_rows(weights, total, uniforms.view(-1)).view(n, c)
        return torch.where(accepted, sampled, noise)
    if not ops.sample_all_positions:
        picked = accepted.view(-1).nonzero().squeeze(-1)
        noise.view(-1)[picked] = ops.sample_rows(weights[picked], total[picked], uniforms.view(-1)[picked])
        return noise
    sampled = ops.sample_rows(weights, total, uniforms.view(-1)).view(n, c)
    return torch.where(accepted, sampled, noise)


def _refine(
    ops: StepOps,
    group: list[Request],
    argmax: torch.Tensor,
    weights: torch.Tensor,
    live: torch.Tensor | None,
    held: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """The argmax canvases after constraint sources that correct them once the pass is known
    (`refine(argmax [C], weights [C, V]) -> [C]`: a grammar's left-to-right walk, which
    replaces each rejected token by the most likely allowed one; its weights are `full_rows`
    of the request's C rows, or a turbo pass's `turbo_rows`)."""
    if not any(r.refines for r in group):
        return argmax
    c = ops.config.canvas_length

    def rows(i: int) -> torch.Tensor | PassRows:
        if live is None:
            return ops.full_rows(weights[i * c : (i + 1) * c])
        return turbo_rows(ops.full_rows(weights), live, held, c)

    refined = [
        ops.to_device(r.constraints.refine(argmax[i].cpu(), rows(i))) if r.refines else argmax[i]
        for i, r in enumerate(group)
    ]
    return torch.stack(refined)


def turbo_rows(
    weights: torch.Tensor | PassRows, live: torch.Tensor, held: tuple[torch.Tensor, torch.Tensor], c: int
) -> torch.Tensor | PassRows:
    """[C, V] weights for a grammar's walk over a turbo pass: the pass's rows where computed
    (`live`), and a frozen position's own token with all the weight (it is what that position
    holds). From the walk's reads of the live rows (`PassRows`: a model cut by vocabulary), the
    same walk's reads of those [C, V] weights, which are never built."""
    frozen, tokens = held
    if isinstance(weights, PassRows):
        positions = frozen.nonzero().squeeze(-1).tolist()
        return held_rows(weights, live.tolist(), dict(zip(positions, tokens[positions].tolist())), c)
    full = weights.new_zeros(c, weights.shape[-1])
    full[live] = weights
    positions = frozen.nonzero().squeeze(-1)
    full[positions, tokens[positions]] = 1.0
    return full


@dataclass
class StepDecisions:
    """A group's decisions after its pass, on the device: `decide`'s, the self-conditioning
    inputs of the next pass [n, C, H] and the pass's weights [n * C, V] (for log probabilities)."""

    decisions: Decisions
    soft_next: torch.Tensor
    weights: torch.Tensor

    @property
    def canvas(self) -> torch.Tensor:
        return self.decisions.canvas

    @property
    def histories(self) -> list[torch.Tensor | None]:
        return self.decisions.histories


class HostPath:
    """The default step, eager, its decisions on the host path (see the module)."""

    name = "host"

    def __init__(self, ops: StepOps):
        self.ops = ops

    def accepts(self, r: Request) -> bool:
        """Every request that does not denoise with turbo (the fused path takes those it can first)."""
        return r.turbo is None

    def graph_key(self, group: list[Request]) -> None:
        return None  # eager: no graph

    def run(self, group: list[Request], copy_out: bool = False) -> list[DecodeResult]:
        return self.results(group, self.decide(group, *self.denoise(group)))

    def denoise(self, group: list[Request]) -> tuple[torch.Tensor, ...]:
        """The group's decoder pass and its statistics (`StepOps.decoder_step`)."""
        ops = self.ops
        canvas = torch.stack([r.canvas for r in group])
        rows, c = [r.kv for r in group], ops.config.canvas_length
        plan = ops.cache.plan_canvas(c, rows) if ops.triton else ops.cache.plan_decoder(c, rows)
        with ops.adapters(group):
            return ops.decoder_step(
                canvas, ops.soft_inputs(group), ops.temperatures(group), plan, ops.allowed_masks(group)
            )

    def decide(self, group: list[Request], argmax, entropy, weights, total, soft_next) -> StepDecisions:
        """`decide` over the group's pass (its outputs copied: a buffer or a graph reuses them)."""
        d = decide(self.ops, group, argmax.clone(), entropy.clone(), weights, total)
        return StepDecisions(d, soft_next.clone(), weights)

    def results(self, group: list[Request], step: StepDecisions) -> list[DecodeResult]:
        """What the scheduler needs on the host: the step's one read from the device (the stop
        flags), then, only for requests that ask when their block ends, the log probabilities of
        the canvas they commit."""
        d = step.decisions
        stops = d.stops.tolist()
        logprobs = self.ops.logprobs(group, d.argmax, step.weights, stops)
        return [
            DecodeResult(
                r,
                d.canvas[i],
                d.argmax[i],
                step.soft_next[i],
                d.histories[i],
                stop,
                logprobs[i],
                d.kept[i],
                d.weighed[i],
                positions=self.ops.config.canvas_length,
            )
            for i, (r, stop) in enumerate(zip(group, stops))
        ]

"""Decision margins of a whole-model run: how far each decision the sampler made was from going
the other way, so that a comparison of tokens with the sharded model (whose logits and
reductions differ from the whole model's by rounding, within 1e-4) is only made on runs whose
decisions a 1e-4 perturbation cannot flip.

`measured()` hooks the sampler for the duration of a `with` (monkeypatching; dgemma is not
changed) and collects, per kind of decision, the smallest margin over the run:

- "argmax": top-1 minus top-2 processed logit (after temperature) at every row of every decoder
  pass (each pass's argmax canvas enters the stopping rule's stability check, and the last one
  commits; turbo's passes decide their live rows, whose argmax extends a freeze streak). From
  the pass's weights, exp(processed - max): the gap is log(w1 / w2). "argmax_logit" is the same
  gap before temperature (processed gap x T): the margin against a perturbation of the logits
  themselves, T (0.05 to 0.3 on dgemma-tiny) times smaller.
- "sample": at every position the engine samples (the accepted ones on a CPU), the distance of
  u x total from the nearest CDF boundary, relative to the total (inverse-CDF sampling flips there).
- "accept": the entropy-bound cut, per canvas: bound minus (cumulative entropy minus the
  position's own) at the last accepted position, and that sum minus the bound at the first
  rejected one. "accept_order": the entropy gap between those two positions (a perturbation that
  swapped their order would swap which is accepted).
- "confidence": |mean entropy - confidence_threshold| at every stopping-rule test.
- "freeze" (turbo): |entropy - freeze_entropy| at the positions whose streak reached
  freeze_passes this pass (the positions whose freezing the entropy test decides).
- "dormant" (turbo): |entropy - dormant_entropy| at the positions whose resting the entropy test
  decides (neither frozen nor accepted last pass, nor resting last pass).

Reference mode (dense/reference.py) draws its tokens with torch.multinomial on the
probabilities: where in the CDF its u fell cannot be read from torch's kernel, so "sample" is
not measured there; its argmax gaps come from the processed logits it takes the entropy of.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from dgemma.engine import sampler, turbo
from dgemma.engine.host import turbo as host_turbo
from dgemma.engine.step_ops import StepOps

FLOOR = 1e-4


@dataclass
class Margin:
    """The smallest margin of one kind of decision, where it was, and how many were measured."""

    value: float = math.inf
    where: str = ""
    count: int = 0

    def add(self, values: torch.Tensor, where: str) -> None:
        values = values.detach().double().flatten()
        if not values.numel():
            return
        self.count += values.numel()
        low = float(values.min())
        if low < self.value:
            self.value, self.where = low, where


@dataclass
class Margins:
    kinds: dict[str, Margin] = field(default_factory=dict)
    passes: int = 0

    def add(self, kind: str, values: torch.Tensor, detail: str = "") -> None:
        self.kinds.setdefault(kind, Margin()).add(values, f"pass {self.passes}{detail}")

    def smallest(self, kinds: tuple[str, ...] | None = None) -> tuple[str, Margin]:
        chosen = {k: m for k, m in self.kinds.items() if kinds is None or k in kinds}
        kind = min(chosen, key=lambda k: chosen[k].value)
        return kind, chosen[kind]

    def summary(self) -> str:
        return ", ".join(f"{k} {m.value:.3g} (of {m.count}, {m.where})" for k, m in sorted(self.kinds.items()))

    def assert_above(self, floor: float = FLOOR, kinds: tuple[str, ...] | None = None, what: str = "") -> None:
        """Every measured decision of `kinds` (default: all) clears `floor`; each kind measured."""
        missing = [k for k in kinds or () if k not in self.kinds or not self.kinds[k].count]
        if missing:
            raise AssertionError(f"{what}: no {', '.join(missing)} decisions measured")
        kind, m = self.smallest(kinds)
        if not m.value > floor:
            raise AssertionError(
                f"{what}: a {kind} decision's margin {m.value:.3g} <= {floor} ({m.where}); {self.summary()}"
            )


def argmax_gaps(weights: torch.Tensor) -> torch.Tensor:
    """log(w1 / w2) per row of unnormalised probabilities [R, V]: the processed-logit gap between
    the two most likely tokens (inf where only one token weighs)."""
    top = weights.float().topk(2, dim=-1).values.double()
    return top[:, 0].log() - top[:, 1].log()


def cdf_margins(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row [R, V], the distance of u x total from the nearest CDF boundary (0 included),
    relative to the total."""
    cdf = torch.cumsum(weights.double(), dim=-1)
    total = cdf[:, -1:]
    target = uniforms.double()[:, None] * total
    nearest = (cdf - target).abs().amin(dim=-1).minimum(target[:, 0])
    return nearest / total[:, 0]


def accept_margins(entropy: torch.Tensor, bound) -> tuple[torch.Tensor, torch.Tensor]:
    """`entropy_bound_accept`'s cut per canvas [B, C]: (distance of the sum before each position
    from the bound, at the last accepted and the first rejected position), and the entropy gap
    between those two positions (inf when every position is accepted)."""
    sorted_entropy, _ = torch.sort(entropy.double(), dim=-1)
    before = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy
    bound = torch.as_tensor(bound, dtype=torch.float64).reshape(-1, 1).expand(before.shape[0], 1)
    accepted = before <= bound
    last = accepted.sum(dim=-1) - 1  # the lowest-entropy position is always accepted
    rows = torch.arange(before.shape[0])
    cut = bound[:, 0] - before[rows, last]
    order = torch.full_like(cut, math.inf)
    more = last + 1 < before.shape[-1]
    if more.any():
        nxt = (last + 1).clamp(max=before.shape[-1] - 1)
        cut = torch.where(more, cut.minimum(before[rows, nxt] - bound[:, 0]), cut)
        order = torch.where(more, sorted_entropy[rows, nxt] - sorted_entropy[rows, last], order)
    return cut, order


@contextlib.contextmanager
def measured() -> Iterator[Margins]:
    """The sampler's decisions in the runs made inside the `with`, as `Margins` (hooks removed
    on exit). Runs made inside it must be the whole model's, in one process."""
    m = Margins()
    saved = [
        (StepOps, "statistics"),
        (StepOps, "sample_rows"),
        (sampler, "entropy_bound_accept"),
        (sampler, "stable_and_confident"),
        (sampler, "temperature"),
        (sampler, "reference_entropy"),
        (host_turbo, "freeze"),
        (turbo, "dormant"),
    ]
    originals = {(owner, name): getattr(owner, name) for owner, name in saved}
    temperature_now = [None]

    def statistics(self, hidden, temps, allowed=None):
        out = originals[(StepOps, "statistics")](self, hidden, temps, allowed)
        weights = out[2]
        gaps = argmax_gaps(weights)
        m.add("argmax", gaps)
        m.add("argmax_logit", gaps * temps.reshape(-1).double().expand_as(gaps))
        m.passes += 1
        return out

    def sample_rows(self, weights, total, uniforms):
        m.add("sample", cdf_margins(weights, uniforms))
        return originals[(StepOps, "sample_rows")](self, weights, total, uniforms)

    def entropy_bound_accept(entropy, bound):
        cut, order = accept_margins(entropy, bound)
        m.add("accept", cut)
        m.add("accept_order", order)
        return originals[(sampler, "entropy_bound_accept")](entropy, bound)

    def stable_and_confident(history, argmax_canvas, entropy, stability_threshold, confidence_threshold, free=None):
        if free is None:
            mean = entropy.double().mean(dim=-1)
        else:
            mean = (entropy.double() * free).sum(dim=-1) / free.sum(dim=-1).clamp_min(1)
        m.add("confidence", (mean - confidence_threshold).abs())
        return originals[(sampler, "stable_and_confident")](
            history, argmax_canvas, entropy, stability_threshold, confidence_threshold, free
        )

    def temperature(*args):
        t = originals[(sampler, "temperature")](*args)
        temperature_now[0] = t
        return t

    def reference_entropy(processed):
        gaps = processed.topk(2, dim=-1).values.double()  # float32 values, their difference exact in float64
        gaps = (gaps[..., 0] - gaps[..., 1]).flatten()
        m.add("argmax", gaps)
        m.add("argmax_logit", gaps * float(temperature_now[0]))
        m.passes += 1
        return originals[(sampler, "reference_entropy")](processed)

    def freeze(frozen, streak, previous, argmax, accepted, entropy, settings, **kw):
        out = originals[(host_turbo, "freeze")](frozen, streak, previous, argmax, accepted, entropy, settings, **kw)
        deciding = ~frozen & (out[1] >= settings.freeze_passes)
        m.add("freeze", (entropy[deciding].double() - settings.freeze_entropy).abs())
        return out

    def dormant(frozen, streak, entropy, rested, threshold):
        if threshold > 0:
            deciding = ~frozen & (streak == 0) & (torch.ones_like(frozen) if rested is None else ~rested)
            m.add("dormant", (entropy[deciding].double() - threshold).abs())
        return originals[(turbo, "dormant")](frozen, streak, entropy, rested, threshold)

    hooks = dict(
        statistics=statistics,
        sample_rows=sample_rows,
        entropy_bound_accept=entropy_bound_accept,
        stable_and_confident=stable_and_confident,
        temperature=temperature,
        reference_entropy=reference_entropy,
        freeze=freeze,
        dormant=dormant,
    )
    for owner, name in saved:
        setattr(owner, name, hooks[name])
    try:
        yield m
    finally:
        for (owner, name), f in originals.items():
            setattr(owner, name, f)

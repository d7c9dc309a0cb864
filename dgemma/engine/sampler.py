"""The denoising sampler, as pure functions over one step's logits.

Per step (paper / reference): temperature from a linear schedule -> a token sampled per canvas
position -> entropy-bound acceptance (the k lowest-entropy positions whose summed entropy minus
their largest entropy stays within the bound) -> every other position re-noised with a uniform
random token. A canvas stops when its argmax is stable and its mean entropy is below a threshold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def temperature(steps_remaining: int, max_steps: int, t_min: float, t_max: float) -> torch.Tensor:
    """Linear schedule: t_max at the first step (steps_remaining == max_steps), falling towards t_min.

    Computed as the reference does (an int32 step tensor divided in float32), so processed logits
    agree to the bit.
    """
    step = torch.tensor(steps_remaining, dtype=torch.int32)
    return t_min + ((t_max - t_min) * (step / max_steps))


def reference_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy exactly as torch.distributions.Categorical computes it."""
    return torch.distributions.Categorical(logits=logits).entropy()


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Accepted positions [B, C]: lowest entropies first, while cumsum(entropy) - max(entropy) <= bound.

    The lowest-entropy position is always accepted (its own sum minus max is 0).
    """
    sorted_entropy, order = torch.sort(entropy, dim=-1, descending=False)
    cumulative = torch.cumsum(sorted_entropy, dim=-1)
    selected = cumulative - sorted_entropy <= bound
    return torch.scatter(torch.zeros_like(selected), dim=-1, index=order, src=selected)


def stable_and_confident(
    history: torch.Tensor | None,
    argmax_canvas: torch.Tensor,
    entropy: torch.Tensor,
    stability_threshold: int,
    confidence_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Adaptive stopping: (stop [B], new history).

    Stable: the argmax canvas equals each of the last `stability_threshold` argmax canvases
    (history starts at -1, so a canvas is never stable on its first step). Confident: the mean
    per-position entropy is below `confidence_threshold`.
    """
    if stability_threshold == 0:
        stable = torch.ones(argmax_canvas.shape[0], dtype=torch.bool, device=argmax_canvas.device)
    else:
        if history is None:
            history = torch.full(
                (stability_threshold, *argmax_canvas.shape), -1, dtype=argmax_canvas.dtype, device=argmax_canvas.device
            )
        stable = (history == argmax_canvas[None]).all(dim=-1).all(dim=0)
        history = torch.roll(history, shifts=-1, dims=0)
        history[-1] = argmax_canvas
    confident = entropy.mean(dim=-1) < confidence_threshold
    return stable & confident, history


@dataclass
class StepStatistics:
    """What one denoising step needs from the [N, vocab] logits, computed in few passes."""

    argmax: torch.Tensor  # [N] most likely token
    entropy: torch.Tensor  # [N] entropy of softmax(logits / T)
    weights: torch.Tensor  # [N, vocab] exp((logits - max) / T): unnormalised probabilities
    total: torch.Tensor  # [N] sum of weights


# exp(x) for x below ln(FLT_MIN) ~ -87.3 is a float32 denormal, which x86 computes up to 80x more
# slowly (measured: 157 ms vs 2 ms for 8M values). Clamping d there raises such weights to
# exp(-87) ~ 1.6e-38 relative to the top token's 1: no float32 sum, entropy or sample changes.
EXP_FLOOR = -87.0


def step_statistics(
    logits: torch.Tensor, temp: float | torch.Tensor, overwrite_logits: bool = False, out: torch.Tensor | None = None
) -> StepStatistics:
    """Argmax, entropy and unnormalised probabilities of logits / temp.

    Entropy is log(sum e) - sum(e * d) / sum(e) with d = (logits - max) / T <= 0 and e = exp(d),
    which avoids the cancellation of logsumexp - E[z] for peaked rows. With `overwrite_logits`
    the logits buffer is reused for d (the engine's full-vocab tensors are 32 MB each at vocab
    32768: each one saved is a pass over memory and, on CPU, a fresh mmap of page faults);
    `out` receives the weights.
    """
    top, argmax = logits.max(dim=-1)
    d = logits.sub_(top[..., None]) if overwrite_logits else logits - top[..., None]
    d.div_(temp).clamp_(min=EXP_FLOOR)
    e = torch.exp(d, out=out) if out is not None else torch.exp(d)
    total = e.sum(dim=-1)
    expected_d = (d.mul_(e) if overwrite_logits else d * e).sum(dim=-1)
    entropy = (torch.log(total) - expected_d / total).clamp_min_(0.0)
    return StepStatistics(argmax=argmax, entropy=entropy, weights=e, total=total)


def sample_from_weights(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of unnormalised `weights` [N, V] given u ~ U(0,1) [N].

    The first index whose cumulative weight exceeds u x (total weight): never a zero-weight token.
    """
    cdf = torch.cumsum(weights, dim=-1)
    target = uniform.to(cdf.dtype)[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return index.clamp_(max=weights.shape[-1] - 1)

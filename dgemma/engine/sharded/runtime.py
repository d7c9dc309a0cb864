"""What the engine asks of a model cut across ranks (parallel/shard.py), in one place.

- `agreed_blocks`: the KV pool's block counts, the same on every rank (each rank's scheduler
  replica must make the same decisions): the smallest any rank can hold.
- `ShardedSampler`: the runner's sampler calls over this rank's vocabulary shard (statistics,
  sampling, log probabilities, a grammar walk's reads), through sampling.py.
"""

from __future__ import annotations

import torch

from .. import sampler
from ..constraints.grammar import PassRows
from ..events import TokenLogprob
from . import sampling
from .sampling import Collectives


def sharded(net) -> bool:
    """Whether `net` is cut across more than one rank."""
    return getattr(net, "shards", None) is not None and net.shards.size > 1


def agreed_blocks(net, num_blocks: dict[str, int]) -> dict[str, int]:
    """Block counts per pool every rank uses: the smallest over the ranks (one all-gather)."""
    if not sharded(net):
        return num_blocks
    kinds = sorted(num_blocks)
    every = net.shards.all_gather(torch.tensor([num_blocks[k] for k in kinds], dtype=torch.long))
    return {k: int(v) for k, v in zip(kinds, every.min(dim=0).values.tolist())}


class ShardedSampler:
    """The sampler's reductions over this rank's vocabulary shard [start, end)."""

    def __init__(self, group: Collectives, vocab_size: int, start: int, end: int):
        self.group, self.vocab_size, self.start, self.end = group, vocab_size, start, end

    @classmethod
    def of(cls, net) -> ShardedSampler:
        start, end = net.shard_plan.ranks[net.shards.rank].vocab
        return cls(net.shards, net.config.vocab_size, start, end)

    def statistics(
        self, logits: torch.Tensor, temps: torch.Tensor, allowed: torch.Tensor | None
    ) -> sampler.StepStatistics:
        """`sampler.step_statistics` of this rank's logits' columns [R, Vs]: global argmax, entropy
        and total; local weights."""
        return sampling.sharded_step_statistics(logits, temps, self.group, self.start, allowed, overwrite_logits=True)

    def sample(self, weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        return sampling.sharded_sample(weights, uniforms, self.group, self.start)

    def row_logprobs(self, weights: torch.Tensor, tokens: torch.Tensor, top_logprobs: int) -> list[TokenLogprob]:
        return sampling.sharded_row_logprobs(weights, tokens, top_logprobs, self.group, self.start)

    def pass_rows(self, weights: torch.Tensor) -> PassRows:
        """What a grammar's walk reads of one canvas's full rows, from this rank's [C, Vs]: each
        shard's top-k gathered once per pass, and one gather per position the candidates do not
        settle (every rank walks the same canvas, so the collectives pair up); no [C, V] gather."""
        return sampling.sharded_pass_rows(weights, self.group, self.start)

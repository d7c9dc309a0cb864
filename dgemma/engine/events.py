"""What generation emits: per-step drafts, committed blocks, finished requests."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Draft:
    """One request's canvas after a denoising step: what a live view draws.

    `canvas` is the argmax canvas (what would commit if the block ended now); `accepted[i]` says
    whether position i keeps a token into the next step (sampled under the entropy bound, or fixed
    by the canvas constraints) rather than being re-noised; `entropy[i]` is the position's entropy
    in nats at the step's temperature (0 where a constraint fixes it).
    """

    row: int  # prompt index (generate) or request id (engine)
    block: int
    step: int  # 1-based step within the block
    canvas: list[int]
    accepted: list[bool] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    frozen: list[bool] = field(default_factory=list)  # turbo: positions no longer computed (else empty)


def shown_entropy(entropy: list[float]) -> list[float]:
    """A draft's entropies as it carries them: 4 decimals, all a view shows (and a frame's bytes)."""
    return [round(e, 4) for e in entropy]


@dataclass
class TokenLogprob:
    """A committed token's log probability under the decoder pass that fixed it (its block's
    last pass, at that pass's temperature, after the canvas constraints' masks), and the most
    likely tokens there, most likely first (tokens of probability 0, e.g. banned by a mask,
    never among them)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, log probability)


@dataclass
class Block:
    """Tokens a request committed (cut at EOS and at max_new_tokens); `done` on its last block."""

    row: int
    block: int
    tokens: list[int]
    done: bool
    decoder_passes: int  # passes spent on this block
    logprobs: list[TokenLogprob] | None = None  # one per token, for requests that ask (Request.top_logprobs)


@dataclass
class Finished:
    """A request ended: `reason` is "eos", "length" or "cancelled"."""

    row: int
    reason: str
    tokens: list[int]
    decoder_passes: int
    tokens_per_forward: float
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache
    decoder_positions: int = 0  # canvas positions the decoder computed (C per pass; fewer with turbo)


@dataclass
class GenerationOutput:
    sequences: list[list[int]]
    tokens_per_forward: list[float]
    decoder_passes: list[int]
    decoder_positions: list[int] = field(default_factory=list)  # canvas positions computed, per prompt


def cut_block(block: list[int], eos: tuple[int, ...], room: int) -> tuple[list[int], bool, int]:
    """Tokens to emit from a committed block: up to and including the first EOS, at most `room`.

    Returns (tokens, hit_eos, length up to and including the EOS, or the whole block); hit_eos
    only when the EOS itself is emitted, so an EOS past `room` is a length stop.
    """
    eos_set = set(eos)
    end = next((i + 1 for i, t in enumerate(block) if t in eos_set), None)
    kept = block[: end if end is not None else len(block)]
    return kept[:room], end is not None and end <= room, len(kept)


def collect(events: Iterator) -> GenerationOutput:
    """Run an event stream to the end and return its output (the generator's return value)."""
    while True:
        try:
            next(events)
        except StopIteration as stop:
            return stop.value

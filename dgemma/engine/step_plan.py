"""What one engine step hands between the scheduler and the runner: the scheduler's `StepPlan`
(the encoder work, then the canvases that take a decoder pass), the runner's `DecodeResult` for
each canvas, and the `EngineStats` both count into. scheduler.py, runner.py and the decode paths
import these; none of them imports another for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .events import TokenLogprob
from .request import Request
from .turbo import TurboState


@dataclass
class EncodeWork:
    """Encode request.sequence[start:end]; the cache length is set back to `start` first."""

    request: Request
    start: int
    end: int


@dataclass
class StepPlan:
    encode: list[EncodeWork] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    events: list = field(default_factory=list)  # produced while scheduling (cancellations)


@dataclass
class DecodeResult:
    """A canvas after one decoder pass and the sampler's decisions."""

    request: Request
    canvas: torch.Tensor  # [C] the next step's input
    argmax: torch.Tensor  # [C]
    soft: torch.Tensor  # [C, H] the next step's self-conditioning input
    history: torch.Tensor | None
    stop: bool  # stable and confident
    logprobs: list[TokenLogprob] | None = None  # [C], when the request asks and the pass ends its block
    accepted: torch.Tensor | None = None  # [C] bool: keeps its token into the next step (sampled or fixed)
    entropy: torch.Tensor | None = None  # [C] at the step's temperature (0 at fixed positions)
    positions: int = 0  # canvas positions the pass computed
    turbo: TurboState | None = None  # turbo: the canvas's state after the pass


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # of admitted requests
    cached_tokens: int = 0  # of those, found in the prefix cache
    encoded_tokens: int = 0  # every token run through the encoder (prefill, commits, re-encodes)
    decoder_passes: int = 0  # one per canvas per step
    decoder_positions: int = 0  # canvas positions computed (C per pass; fewer with turbo)
    image_tokens: int = 0  # image soft tokens in admitted prompts
    vision_encodes: int = 0  # images run through the vision tower
    vision_cache_hits: int = 0  # images whose soft tokens came from the vision cache

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

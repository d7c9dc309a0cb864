"""One generation request: what was asked, and every piece of state it carries through the engine.

A request's tokens live in `sequence` (the prompt, then each committed block that is encoded
into the cache); `kv` says where their keys/values are (block tables, how many are computed).
While a canvas denoises, the request holds it with its self-conditioning input, stopping
history and step count; its own `generator` draws all of its randomness, so what it produces
does not depend on what else runs.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig
from ..inputs.model_inputs import ImagePatches, image_token_runs
from .constraints import CanvasConstraints
from .events import TokenLogprob
from .kv.paged_cache import SequenceBlocks
from .turbo import TurboState

ConstraintSource = CanvasConstraints | Callable[["Request"], "CanvasConstraints | None"] | None
# A constraint source may also judge what a block commits: `commit(block) -> n` keeps the first n
# tokens of the converged canvas (a grammar's valid prefix: engine/constraints/grammar.py), and the next canvas
# starts after them.


@dataclass(frozen=True)
class AdapterRef:
    """The LoRA adapter a request runs (an adapter bank resolves its name): the slot its weights
    sit in (kernels/lora.py's `LoraSlots`) and their content hash, where the request's prefix-cache
    hash chain starts, so that no block is shared across adapters (or with the base)."""

    name: str
    slot: int
    key: bytes


class RequestStatus(enum.Enum):
    """Where a request is: the scheduler moves it WAITING -> RUNNING -> FINISHED, and only it."""

    WAITING = "waiting"  # queued: no KV blocks yet
    RUNNING = "running"  # admitted: holds its KV blocks; encoding its prompt or denoising a canvas
    FINISHED = "finished"  # ended (`finish_reason`: eos, length or cancelled); its blocks are free


@dataclass(eq=False)  # requests are identities (their tensors do not compare)
class Request:
    prompt: list[int]
    config: GenerationConfig
    seed: int
    drafts: bool = False
    # Canvas constraints: fixed tokens and allowed-token masks (see constraints/__init__.py), or a function
    # of the request called before every decoder pass (grammars update them as positions settle).
    constraints: ConstraintSource = None
    # Images of the prompt, in order: images[i] stands behind the i-th run of image tokens.
    images: list[ImagePatches] = field(default_factory=list)
    # Log probabilities of the committed tokens (events.TokenLogprob on each Block) with this
    # many most likely alternatives per position; None: none computed.
    top_logprobs: int | None = None
    # The LoRA adapter its passes run (None: the base alone); every pass of it, encoder and decoder.
    adapter: AdapterRef | None = None
    request_id: int = -1

    # --- sequence and cache
    sequence: list[int] = field(default_factory=list)  # prompt + encoded committed blocks
    kv: SequenceBlocks = field(default_factory=SequenceBlocks)
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of sequence's full blocks
    registered_blocks: int = 0  # leading full blocks already in the prefix cache
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    encoded_tokens: int = 0  # tokens this request ran through the encoder (re-encodes included)
    image_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each image's tokens
    image_features: list[torch.Tensor | None] = field(default_factory=list)  # soft tokens, once computed

    # --- output
    tokens: list[int] = field(default_factory=list)  # emitted tokens (cut at EOS and max_new_tokens)
    counted: int = 0  # generated non-pad tokens up to EOS: the numerator of tokens per forward
    passes: int = 0  # decoder passes of committed (and, on cancel, current) blocks
    decoder_positions: int = 0  # canvas positions computed by every decoder pass so far

    # --- the canvas being denoised
    block: int = 0
    step: int = 0
    block_passes: int = 0
    canvas: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    soft: torch.Tensor | None = None
    history: torch.Tensor | None = None
    active_constraints: CanvasConstraints | None = None
    generator: torch.Generator | None = None
    canvas_logprobs: list[TokenLogprob] | None = None  # of the last pass's argmax canvas, when it ended its block
    turbo: TurboState | None = None  # with config.turbo: frozen positions and the canvas K/V buffer

    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # with FINISHED: "eos", "length" or "cancelled"
    cancelled: bool = False  # a cancel was asked (any thread); the scheduler ends it at the next step

    def __post_init__(self) -> None:
        if not self.sequence:
            self.sequence = list(self.prompt)

    @property
    def adapter_slot(self) -> int:
        """Its adapter's slot, -1 for the base: the per-row index a pass's rows are grouped by."""
        return -1 if self.adapter is None else self.adapter.slot

    def tokens_per_forward(self) -> float:
        """Generated non-pad tokens (up to EOS) per decoder pass: the one definition the API,
        the server's usage and /metrics report."""
        return self.counted / self.passes if self.passes else 0.0

    def block_ends(self, stop: bool) -> bool:
        """Whether the pass at `step` (not yet counted) is its block's last: the canvas stopped
        (stable and confident, `stop`) or the block's denoising steps are spent."""
        return stop or self.step + 1 >= self.config.max_denoising_steps

    @property
    def pending_tokens(self) -> int:
        """Tokens of `sequence` whose keys/values are not computed yet."""
        return len(self.sequence) - self.kv.length

    def max_sequence_length(self, canvas_length: int) -> int:
        return max_sequence_length(len(self.prompt), self.config.max_new_tokens, canvas_length, self.partial_commits)

    @property
    def refines(self) -> bool:
        """Its constraints correct each pass's argmax canvas (a grammar's left-to-right walk)."""
        return hasattr(self.constraints, "refine")

    @property
    def partial_commits(self) -> bool:
        """Blocks may commit fewer than canvas_length tokens (the constraints judge them)."""
        return hasattr(self.constraints, "commit")

    def commit_length(self, block: list[int]) -> int:
        """How many leading tokens of the converged canvas `block` commit."""
        return self.constraints.commit(block) if self.partial_commits else len(block)

    def resolve_constraints(self) -> CanvasConstraints | None:
        source = self.constraints
        return source(self) if callable(source) else source

    def start_canvas(self, canvas_length: int, vocab_size: int, device: torch.device) -> None:
        """A fresh canvas of uniform random tokens (fixed positions of the constraints written in).

        The random canvas is drawn even where every position is given, so the request's random
        stream is the same whatever its constraints (as the reference draws one for
        `decoder_input_ids`)."""
        canvas = torch.randint(0, vocab_size, (canvas_length,), generator=self.generator)
        self.argmax = canvas  # what a constraint function sees before the first pass
        self.active_constraints = self.resolve_constraints()
        if self.active_constraints is not None:
            canvas = self.active_constraints.seed_canvas(canvas)
        self.canvas = canvas.to(device, non_blocking=True)  # no wait for the passes queued before it
        self.argmax = self.canvas.clone()
        self.soft = None
        self.history = None
        self.canvas_logprobs = None
        self.step = 0
        self.block_passes = 0
        if self.config.turbo:
            self.turbo = TurboState.fresh(canvas_length, device, self.turbo)


def max_sequence_length(prompt_len: int, max_new_tokens: int, canvas_length: int, partial: bool = False) -> int:
    """Positions a request may ever encode: its prompt and every block but the last (the last
    committed block ends the request and is never encoded). With `partial` commits, every
    token but the last of max_new_tokens may be encoded."""
    if partial:
        return prompt_len + max(max_new_tokens - 1, 0)
    return prompt_len + (math.ceil(max_new_tokens / canvas_length) - 1) * canvas_length


def image_spans(prompt: list[int], images: list[ImagePatches], image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each image's placeholder run in `prompt`, checked against the images."""
    spans = image_token_runs(prompt, image_token_id)
    if len(spans) != len(images):
        raise ValueError(f"the prompt holds {len(spans)} runs of image tokens for {len(images)} images")
    for k, ((a, b), image) in enumerate(zip(spans, images)):
        if b - a != image.num_soft_tokens:
            raise ValueError(
                f"image {k} has {image.num_soft_tokens} soft tokens, but its placeholder run holds {b - a}"
            )
    return spans


def validate_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids")
        for t in p:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"prompt {i} holds {t!r}, not a token id in [0, {vocab_size})")


SEED_MAX = (
    2**64 - 1
)  # a request's seed: any unsigned 64-bit integer (the generator and the Triton sampler take all of them)


def check_seed(seed: object, what: str = "seed") -> int:
    """The one seed rule for the API, the CLI and the server: an int in [0, 2**64)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"{what} must be an integer in [0, 2**64), got {seed!r}")
    return seed


def random_seed() -> int:
    """A seed for a request that named none (drawn from the OS, so concurrent requests differ)."""
    return random.SystemRandom().randrange(2**63)

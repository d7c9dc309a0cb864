"""A call to `Model` (api.py) as the engine's requests, and their events back: what the call hands
in, checked before anything runs (prompts as strings, token ids, tensors or the processor's
`ModelInputs`, made token ids and images; the generation settings and seeds, a `SamplingRequest`;
warm-start canvases), one `Request` per prompt, and the engine's events read back by prompt
(`row` = the prompt's index) with the `GenerationOutput` at the end."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .config import GenerationConfig
from .engine.client import EngineClient
from .engine.constraints import CanvasConstraints, FirstCanvas, canvas_row
from .engine.events import Block, Draft, Finished, GenerationOutput
from .engine.request import AdapterRef, Request, check_seed, random_seed
from .inputs.model_inputs import ImagePatches, MediaError, ModelInputs
from .inputs.tokenizer import Tokenizer

SAMPLING_MODES = ("default", "reference")


@dataclass
class SamplingRequest:
    """Validated per-call generation settings."""

    config: GenerationConfig
    sampling: str
    seeds: list[int]


def split_prompts(
    prompts: Sequence, tokenizer: Tokenizer | None, vision: bool
) -> tuple[list[list[int]], list[list[ImagePatches]]]:
    """Token ids and images of each prompt (a string, token ids, or processor `ModelInputs`);
    `vision`: the checkpoint has a vision tower (else images are refused)."""
    if isinstance(prompts, ModelInputs):
        raise TypeError("prompts must be a list of prompts, e.g. [inputs]")
    images = None
    if isinstance(prompts, (list, tuple)) and any(isinstance(p, ModelInputs) for p in prompts):
        images = [list(p.images) if isinstance(p, ModelInputs) else [] for p in prompts]
        prompts = [p.input_ids if isinstance(p, ModelInputs) else p for p in prompts]
    ids = prompt_ids(prompts, tokenizer)
    if images and any(images) and not vision:
        raise MediaError("this checkpoint has no vision tower: it cannot take images")
    return ids, images or [[] for _ in ids]


def prompt_ids(prompts: Sequence, tokenizer: Tokenizer | None) -> list[list[int]]:
    """Each prompt as a list of token ids (strings encoded by `tokenizer`)."""
    if isinstance(prompts, (str, bytes)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    ):
        raise TypeError("prompts must be a list of prompts (token-id lists or strings), e.g. [ids]")
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("string prompts need a tokenizer; this checkpoint has no tokenizer.json")
            p = tokenizer.encode(p)
        elif isinstance(p, torch.Tensor):
            p = p.tolist()
        out.append(list(p))
    return out


def sampling_request(
    defaults: GenerationConfig,
    num_prompts: int,
    seed: int | Sequence[int] | None,
    sampling: str,
    overrides: dict,
    shards=None,
) -> SamplingRequest:
    """`defaults` with a call's `overrides`, and a seed for each prompt: `seed`'s, or drawn.
    `shards`: the model's cut across ranks where each rank's engine replica must draw the same
    seeds (broadcast from rank 0); None where seeds travel with the requests or nothing is cut."""
    if sampling not in SAMPLING_MODES:
        raise ValueError(f"sampling must be one of {SAMPLING_MODES}, got {sampling!r}")
    config = defaults.with_overrides(**overrides)
    if seed is None:
        seeds = [random_seed() for _ in range(num_prompts)]
        if shards is not None:  # every rank's engine replica must draw the same numbers
            seeds = shards.broadcast_object(seeds)
    elif isinstance(seed, int) and not isinstance(seed, bool):
        seeds = [seed] * num_prompts
    elif isinstance(seed, (list, tuple)) and all(isinstance(s, int) and not isinstance(s, bool) for s in seed):
        if len(seed) != num_prompts:
            raise ValueError(f"got {len(seed)} seeds for {num_prompts} prompts")
        if sampling == "reference":
            raise ValueError("sampling='reference' draws from torch's global RNG: pass one int seed, not a list")
        seeds = list(seed)
    else:
        raise ValueError(f"seed must be an int or a list of ints, got {seed!r}")
    for s in seeds:
        check_seed(s)
    return SamplingRequest(config, sampling, seeds)


def initial_canvas(canvas, count: int, canvas_length: int, vocab_size: int) -> torch.Tensor | None:
    """`canvas` (one list of canvas_length token ids per prompt) checked, as [count, C]."""
    if canvas is None:
        return None
    if len(canvas) != count:
        raise ValueError(f"got {len(canvas)} canvases for {count} prompts")
    rows = [canvas_row(row, canvas_length, vocab_size, what=f"canvas {i}") for i, row in enumerate(canvas)]
    return torch.tensor(rows, dtype=torch.long)


def engine_requests(
    prompt_ids: list[list[int]],
    request: SamplingRequest,
    drafts: bool,
    images: list[list[ImagePatches]],
    constraints: Sequence | None,
    initial: torch.Tensor | None,
    ref: AdapterRef | None,
) -> list[Request]:
    """One `Request` per prompt, with its seed, images, constraints (or its warm-start canvas,
    `initial`'s row, as the first canvas's constraint) and adapter."""
    if initial is not None:
        if constraints is not None:
            raise ValueError("pass canvas or constraints, not both (CanvasConstraints.initial warm-starts a canvas)")
        constraints = [FirstCanvas(CanvasConstraints(initial=row)) for row in initial]
    if constraints is not None and len(constraints) != len(prompt_ids):
        raise ValueError(f"got {len(constraints)} constraints for {len(prompt_ids)} prompts")
    return [
        Request(
            list(p),
            request.config,
            seed,
            drafts=drafts,
            images=im,
            constraints=None if constraints is None else constraints[i],
            adapter=ref,
        )
        for i, (p, seed, im) in enumerate(zip(prompt_ids, request.seeds, images))
    ]


def seeded_requests(plans: list, request: SamplingRequest, vocab_size: int, ref: AdapterRef | None) -> list[Request]:
    """One `Request` per infill or edit plan (engine/constraints/infill.py): its first canvas seeded
    by the plan's constraints, with the committed block's log probabilities."""
    return [
        Request(
            plan.prompt,
            request.config,
            s,
            constraints=FirstCanvas(plan.constraints(vocab_size)),
            top_logprobs=0,
            adapter=ref,
        )
        for plan, s in zip(plans, request.seeds)
    ]


def prompt_events(client: EngineClient, requests: list[Request]) -> Iterator[Draft | Block]:
    """Engine events with `row` = the prompt's index; returns the GenerationOutput."""
    finished: list[Finished | None] = [None] * len(requests)
    row_of = None
    for ev in client.run(requests):
        if row_of is None:  # ids are set once the requests are submitted
            row_of = {r.request_id: i for i, r in enumerate(requests)}
        ev.row = row_of[ev.row]
        if isinstance(ev, Finished):
            finished[ev.row] = ev
        else:
            yield ev
    return GenerationOutput(
        sequences=[f.tokens for f in finished],
        tokens_per_forward=[f.tokens_per_forward for f in finished],
        decoder_passes=[f.decoder_passes for f in finished],
        decoder_positions=[f.decoder_positions for f in finished],
    )

"""OpenAI's insert mode on /v1/completions (`suffix`), and fixed canvas tokens (`canvas`): the
server side of dgemma/engine/constraints/infill.py.

With `suffix`, the completion is the text between the prompt and the suffix: one engine request
per candidate span length (`span_length`, or infill.DEFAULT_LENGTHS within max_tokens), each a
single canvas whose span denoises beside the fixed suffix; the most likely canvas wins, as in
`Model.infill`. With `canvas` (canvas_length entries, a token id to fix or null), the request's
first canvas keeps those tokens fixed and generation goes on as usual.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ...engine.constraints import CanvasConstraints, CanvasError, FirstCanvas, canvas_row
from ...engine.constraints.infill import DEFAULT_LENGTHS, candidate_lengths, infill_plan, most_likely_span
from ...engine.events import Block, Finished


class InsertError(ValueError):
    """A suffix / span_length / canvas field the server refuses: a 400 naming `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class Insertion:
    tokens: list[int]  # the span
    span_length: int
    decoder_passes: int
    scores: dict[int, float]
    timed_out: bool = False  # some candidate passed the request's deadline: the best of the others (or nothing)
    decoder_positions: int = 0  # canvas positions the candidates' passes computed (fewer with turbo)


def span_lengths(span_length: Any, max_tokens: int | None, canvas_length: int, max_candidates: int) -> list[int]:
    """The candidate span lengths of an insert request (infill.candidate_lengths, as `Model.infill`
    checks them); `max_candidates` because each counts against the server's --max-active."""
    try:
        return candidate_lengths(canvas_length, span_length, DEFAULT_LENGTHS, max_tokens, max_candidates)
    except ValueError as e:
        raise InsertError("span_length", str(e)) from None


def fixed_canvas(canvas: Any, canvas_length: int, vocab_size: int) -> FirstCanvas:
    """The `canvas` field (canvas_length entries: a token id to fix, or null) as constraints."""
    try:
        row = canvas_row(canvas, canvas_length, vocab_size, nulls=True)
    except CanvasError as e:
        raise InsertError(e.param, str(e)) from None
    fixed = {i: t for i, t in enumerate(row) if t is not None}
    if not fixed:
        raise InsertError("canvas", "canvas fixes no position (every entry is null)")
    return FirstCanvas(CanvasConstraints.build(canvas_length, vocab_size, fixed=fixed))


async def insert(
    engine_thread,
    prompt: list[int],
    suffix: list[int],
    lengths: list[int],
    config,
    seed: int,
    canvas_length: int,
    vocab_size: int,
    end_tokens: tuple[int, int],
    deadline: float | None = None,
    adapter: str | None = None,
) -> Insertion:
    """Denoise one infill canvas per candidate length (side by side in the engine) and keep the
    most likely; `config` is the request's GenerationConfig for one canvas without EOS. The
    candidates that pass `deadline` drop out (Insertion.timed_out); cancelling this coroutine
    (the client went away) cancels them all."""
    jobs = []
    try:
        for n in lengths:
            plan = infill_plan(prompt, suffix, n, canvas_length, *end_tokens)
            constraints = FirstCanvas(plan.constraints(vocab_size))
            jobs.append(
                engine_thread.submit(
                    plan.prompt,
                    config,
                    seed,
                    constraints=constraints,
                    top_logprobs=0,
                    deadline=deadline,
                    adapter=adapter,
                )
            )
        results = await asyncio.gather(*(_block_of(job) for job in jobs))
    except BaseException:
        for job in jobs:
            engine_thread.cancel(job)
        raise
    passes, positions = sum(f.decoder_passes for _, f in results), sum(f.decoder_positions for _, f in results)
    done = [(n, block) for n, (block, _) in zip(lengths, results) if block is not None]
    timed_out = len(done) < len(lengths)
    if not done:
        return Insertion([], 0, passes, {}, timed_out=True, decoder_positions=positions)
    best, scores = most_likely_span([n for n, _ in done], [b for _, b in done])
    block = dict(done)[best]
    return Insertion(block.tokens[:best], best, passes, scores, timed_out, positions)


async def _block_of(job) -> tuple[Block | None, Finished]:
    """The job's one committed block (None when it passed its deadline first) and the engine's
    account of it (its events, to the end: decoder passes and positions)."""
    block = None
    while True:
        ev = await job.events.get()
        if isinstance(ev, Exception):
            raise ev
        if isinstance(ev, Block):
            block = ev
        elif isinstance(ev, Finished):
            if block is None and ev.reason == "timeout":
                return None, ev
            if block is None:
                raise RuntimeError(f"the infill request ended ({ev.reason}) without a block")
            return block, ev

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

from ..engine.constraints import CanvasConstraints, FirstCanvas
from ..engine.events import Block, Finished
from ..engine.constraints.infill import DEFAULT_LENGTHS, infill_plan, most_likely_span


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


def span_lengths(span_length: Any, max_tokens: int | None, canvas_length: int, max_candidates: int) -> list[int]:
    """The candidate span lengths of an insert request, checked: `span_length`, or
    infill.DEFAULT_LENGTHS within max_tokens, thinned evenly to at most `max_candidates` (each is
    an engine request of its own, so they count against the server's --max-active)."""
    if span_length is not None:
        if isinstance(span_length, bool) or not isinstance(span_length, int) or not 1 <= span_length < canvas_length:
            raise InsertError("span_length", f"span_length must be an integer from 1 to {canvas_length - 1} (the canvas "
                                             f"holds {canvas_length} tokens, one at least for the suffix); got {span_length!r}")  # fmt: skip
        if max_tokens is not None and span_length > max_tokens:
            raise InsertError("span_length", f"span_length={span_length} is more than max_tokens={max_tokens}")
        return [span_length]
    limit = canvas_length - 1 if max_tokens is None else min(canvas_length - 1, max_tokens)
    lengths = [n for n in DEFAULT_LENGTHS if n <= limit] or [limit]
    if len(lengths) <= max_candidates:
        return lengths
    if max_candidates == 1:
        return [lengths[len(lengths) // 2]]
    step = (len(lengths) - 1) / (max_candidates - 1)  # the shortest, the longest, and evenly between
    return sorted({lengths[round(k * step)] for k in range(max_candidates)})


def fixed_canvas(canvas: Any, canvas_length: int, vocab_size: int) -> FirstCanvas:
    """The `canvas` field (canvas_length entries: a token id to fix, or null) as constraints."""
    if not isinstance(canvas, list) or len(canvas) != canvas_length:
        raise InsertError("canvas", f"canvas must be a list of {canvas_length} entries (a token id to fix, or null); "
                                    f"got {type(canvas).__name__} of length {len(canvas) if isinstance(canvas, list) else '-'}")  # fmt: skip
    fixed = {}
    for i, t in enumerate(canvas):
        if t is None:
            continue
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InsertError(f"canvas[{i}]", f"canvas[{i}] must be a token id in [0, {vocab_size}) or null (got {t!r})")
        fixed[i] = t
    if not fixed:
        raise InsertError("canvas", "canvas fixes no position (every entry is null)")
    return FirstCanvas(CanvasConstraints.build(canvas_length, vocab_size, fixed=fixed))


async def insert(engine_thread, prompt: list[int], suffix: list[int], lengths: list[int], config, seed: int,
                 canvas_length: int, vocab_size: int, end_tokens: tuple[int, int], deadline: float | None = None) -> Insertion:  # fmt: skip
    """Denoise one infill canvas per candidate length (side by side in the engine) and keep the
    most likely; `config` is the request's GenerationConfig for one canvas without EOS. The
    candidates that pass `deadline` drop out (Insertion.timed_out); cancelling this coroutine
    (the client went away) cancels them all."""
    jobs = []
    try:
        for n in lengths:
            plan = infill_plan(prompt, suffix, n, canvas_length, *end_tokens)
            constraints = FirstCanvas(plan.constraints(vocab_size))
            jobs.append(engine_thread.submit(plan.prompt, config, seed, constraints=constraints, top_logprobs=0,
                                             deadline=deadline))  # fmt: skip
        results = await asyncio.gather(*(_block_of(job) for job in jobs))
    except BaseException:
        for job in jobs:
            engine_thread.cancel(job)
        raise
    passes = sum(p for _, p in results)
    done = [(n, block) for n, (block, _) in zip(lengths, results) if block is not None]
    timed_out = len(done) < len(lengths)
    if not done:
        return Insertion([], 0, passes, {}, timed_out=True)
    best, scores = most_likely_span([n for n, _ in done], [b for _, b in done])
    block = dict(done)[best]
    return Insertion(block.tokens[:best], best, passes, scores, timed_out)


async def _block_of(job) -> tuple[Block | None, int]:
    """The job's one committed block (None when it passed its deadline first) and its decoder
    passes (its events, to the end)."""
    block = None
    while True:
        ev = await job.events.get()
        if isinstance(ev, Exception):
            raise ev
        if isinstance(ev, Block):
            block = ev
        elif isinstance(ev, Finished):
            if block is None and ev.reason == "timeout":
                return None, ev.decoder_passes
            if block is None:
                raise RuntimeError(f"the infill request ended ({ev.reason}) without a block")
            return block, ev.decoder_passes

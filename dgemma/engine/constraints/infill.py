"""Infill and in-place editing: one canvas seeded with fixed tokens (constraints/__init__.py).

The decoder is bidirectional, so a canvas whose positions are partly *fixed* (never re-noised,
no part of acceptance or stopping, committed as given) denoises its free positions seeing the
fixed ones on both sides. Two uses:

- **infill(prefix, suffix)**: the prefix is the prompt (through the encoder, into the cache); the
  canvas holds the span (free) and then the start of the suffix (fixed). Where the suffix ends
  inside the canvas, the text ends there: EOS, then pad, fixed. The span's length is given, or
  chosen: each candidate length is denoised (one request each, batched) and the one whose
  committed canvas the model finds most likely wins (the mean log probability of all its
  tokens, span and fixed suffix, under the pass that committed it: a span that does not lead
  into the suffix makes the suffix unlikely).
- **edit(text, spans)**: character ranges of `text` are rewritten, everything else kept. Each
  range snaps outward to token boundaries (the smallest run of whole tokens covering it);
  ranges that touch or overlap after snapping merge. The text before the first span is the
  prompt; the canvas starts at the first span and holds the spans (free, as many tokens as
  they had) and the text between and after them (fixed) up to the canvas's end; text past the
  canvas is kept but unseen. Everything outside the snapped spans is returned byte for byte.

Limits: one canvas per call. A span takes at most canvas_length - 1 positions (at least one
suffix token is seen); spans of an edit must fit in one canvas from the first span's start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from . import CanvasConstraints

DEFAULT_LENGTHS = (1, 2, 3, 4, 6, 8, 11, 16, 23)  # candidate span lengths when none is given


@dataclass(frozen=True)
class CanvasPlan:
    """One seeded canvas: the prompt before it and its initial / fixed tokens."""

    prompt: list[int]
    canvas: list[int]  # canvas_length tokens: the fixed ones, and -1 where the canvas denoises
    free: list[tuple[int, int]]  # [start, end) canvas positions that denoise

    def constraints(self, vocab_size: int) -> CanvasConstraints:
        fixed = {i: t for i, t in enumerate(self.canvas) if t >= 0}
        return CanvasConstraints.build(len(self.canvas), vocab_size, fixed=fixed)


@dataclass
class InfillResult:
    text: str  # the span
    tokens: list[int]
    span_length: int
    scores: dict[int, float] = field(default_factory=dict)  # candidate length -> mean log probability


@dataclass
class EditResult:
    text: str  # the whole text, spans rewritten
    spans: list[tuple[int, int]]  # the snapped character ranges of `text` that were rewritten
    replacements: list[str]  # what each snapped span became


def candidate_lengths(
    canvas_length: int,
    span_length: int | None = None,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    max_tokens: int | None = None,
    max_candidates: int | None = None,
) -> list[int]:
    """The span lengths an infill tries, for the API, the CLI and the server alike: `span_length`
    (checked), or those of `lengths` that fit (1 to canvas_length - 1, at most `max_tokens`),
    thinned evenly to at most `max_candidates` (each is an engine request of its own)."""
    limit = canvas_length - 1 if max_tokens is None else min(canvas_length - 1, max_tokens)
    if span_length is not None:
        if (
            isinstance(span_length, bool)
            or not isinstance(span_length, int)
            or not 1 <= span_length <= canvas_length - 1
        ):
            raise ValueError(
                f"span_length must be 1 to {canvas_length - 1} (the canvas holds {canvas_length} tokens and "
                f"the span must leave one for the suffix); got {span_length!r}"
            )
        if span_length > limit:
            raise ValueError(f"span_length={span_length} is more than max_tokens={max_tokens}")
        return [span_length]
    fits = sorted({n for n in lengths if 1 <= n <= limit})
    if not fits:
        raise ValueError(f"no candidate span length in 1..{limit}")
    if max_candidates is None or len(fits) <= max_candidates:
        return fits
    if max_candidates == 1:
        return [fits[len(fits) // 2]]
    step = (len(fits) - 1) / (max_candidates - 1)  # the shortest, the longest, and evenly between
    return sorted({fits[round(k * step)] for k in range(max_candidates)})


def most_likely_span(lengths: list[int], blocks: list) -> tuple[int, dict[int, float]]:
    """The span length whose committed canvas (`blocks[i]`, an engine Block with logprobs) has the
    highest mean log probability, and every candidate's score."""
    scores = {n: sum(t.logprob for t in b.logprobs) / len(b.logprobs) for n, b in zip(lengths, blocks)}
    return max(lengths, key=lambda n: scores[n]), scores


def infill_plan(
    prefix: list[int], suffix: list[int], span_length: int, canvas_length: int, eos: int, pad: int
) -> CanvasPlan:
    """The canvas of an infill: `span_length` free positions, then the suffix (fixed), then EOS
    and pad where the suffix ends inside the canvas."""
    candidate_lengths(canvas_length, span_length)  # checked as every caller's
    room = canvas_length - span_length
    tail = suffix[:room]
    if len(tail) < room:
        tail = tail + [eos] + [pad] * (room - len(tail) - 1)
    return CanvasPlan(list(prefix), [-1] * span_length + tail, [(0, span_length)])


def snap_spans(spans: list[tuple[int, int]], offsets: list[tuple[int, int]], text_length: int) -> list[tuple[int, int]]:
    """Character ranges -> token ranges [first, last + 1): each range grows to the whole tokens it
    touches; ranges that then touch or overlap merge. Ranges are checked (inside the text,
    non-empty, not overlapping as given)."""
    checked = []
    for k, span in enumerate(spans):
        if not (
            isinstance(span, (tuple, list))
            and len(span) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in span)
        ):
            raise ValueError(f"span {k} must be a pair of character offsets (start, end), got {span!r}")
        a, b = span
        if not 0 <= a < b <= text_length:
            raise ValueError(
                f"span {k} = ({a}, {b}) must satisfy 0 <= start < end <= {text_length} (the text's length)"
            )
        checked.append((a, b))
    ordered = sorted(checked)
    for (a1, b1), (a2, b2) in zip(ordered, ordered[1:]):
        if a2 < b1:
            raise ValueError(f"spans ({a1}, {b1}) and ({a2}, {b2}) overlap")
    tokens = []
    for a, b in ordered:
        first = next(i for i, (s, e) in enumerate(offsets) if e > a)
        last = max(i for i, (s, e) in enumerate(offsets) if s < b)
        if tokens and first <= tokens[-1][1]:
            tokens[-1] = (tokens[-1][0], max(tokens[-1][1], last + 1))
        else:
            tokens.append((first, last + 1))
    return tokens


def edit_plan(
    bos: list[int], ids: list[int], token_spans: list[tuple[int, int]], canvas_length: int, eos: int, pad: int
) -> CanvasPlan:
    """The canvas of an edit: from the first span's first token, spans free and the rest fixed;
    EOS and pad past the text's end."""
    start = token_spans[0][0]
    if token_spans[-1][1] - start > canvas_length:
        raise ValueError(
            f"the spans cover tokens {start} to {token_spans[-1][1]}: more than one canvas of "
            f"{canvas_length} tokens; edit them in separate calls"
        )
    window = ids[start : start + canvas_length]
    if len(window) < canvas_length:
        window = window + [eos] + [pad] * (canvas_length - len(window) - 1)
    canvas = list(window)
    free = [(a - start, b - start) for a, b in token_spans]
    for a, b in free:
        canvas[a:b] = [-1] * (b - a)
    if start == 0 and not bos:
        raise ValueError("a span at the start of the text needs a prompt before it (the tokenizer has no <bos>)")
    return CanvasPlan(bos + ids[:start], canvas, free)

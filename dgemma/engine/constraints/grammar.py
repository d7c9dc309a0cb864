"""Grammars on a canvas: structured output enforced while a block denoises.

llguidance compiles JSON schemas, regexes and Lark grammars against the checkpoint's tokenizer and
answers two questions about a grammar state: which tokens may come next (a packed mask, the
layout the engine's statistics read), and how many of a list of tokens it accepts. An
autoregressive engine asks once per token. A canvas is C positions decided together, so a
`CanvasGrammar` asks before every decoder pass (it is the request's constraint source, see
constraints/__init__.py):

- the committed prefix fixes the grammar state: the matcher is advanced only by `commit`;
- the previous pass's argmax canvas is walked left to right from that state. Each position whose
  left neighbours the grammar all accepts gets the mask of the tokens allowed there; where one
  token only is allowed (JSON's punctuation and keys) it is fixed: filled directly, never
  re-noised, no part of acceptance or stopping. The first position whose argmax the grammar
  rejects is masked too, and the walk stops there: the positions after it are left free until
  their left context is known (a later pass). Positions after an accepted EOS may only hold
  EOS or pad.
- After the pass, `refine` walks its argmax canvas the same way, and each token the grammar
  rejects (given the refined tokens before it) becomes the most likely allowed token under that
  pass's probabilities: the argmax canvas (drafts, stopping, the commit) is valid left to right
  after every pass, and its walk is the next pass's masks.
- A block commits only its valid prefix (`commit`: at least its first token, which is always
  masked from the committed state), and the next canvas continues from there.

A walk reads a pass's weights only through `PassRows`: each position's top candidates (once per
pass, at the first rejection) and, where they cannot settle a position, its whole row's best
allowed token. On a model cut by vocabulary every rank walks the same canvas from the same state,
and both reads are collectives over the shards (engine/sharded/sampling.py), never a gathered [C, V].

Every pass thus masks a valid prefix of the canvas that grows as the draft settles, instead of
fixing one position per pass; scripts/grammar_speed.py measures tokens per forward with and
without a grammar (docs/server.md, "Structured output").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..sampler import pack_token_mask, unpack_token_mask
from . import CanvasConstraints

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")
# what llguidance raises for input it cannot take (a lone surrogate: UnicodeEncodeError, a ValueError;
# a schema nested past what the conversion to Rust takes: RecursionError), besides its error states
LLGUIDANCE_ERRORS = (ValueError, TypeError, RuntimeError, OverflowError, RecursionError)
# JSON output as OpenAI writes it: compact, no free whitespace (a random model fills free
# whitespace forever), every schema keyword llguidance does not implement is an error.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """A grammar that cannot be compiled: a schema that is not one, an unsupported feature, a
    regex or Lark grammar that does not parse. The message is llguidance's, naming the problem."""


@dataclass(frozen=True)
class Grammar:
    """A compiled, validated grammar (llguidance's serialised form) and what it came from.

    `matcher` is the compiled grammar in its start state, never advanced: each request's state
    is a copy of it (`LLMatcher.deep_copy` shares the compiled grammar and its lexer caches, and
    takes microseconds), so a grammar is compiled once, where `compile` ran (the server's
    big-stack compile thread: llguidance compiles recursively)."""

    kind: str
    source: str  # llguidance's grammar text
    matcher: Any = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        return self.kind.replace("_", " ")


def grammar_text(kind: str, spec: Any, lenient: bool = False) -> str:
    """llguidance's grammar for a JSON schema (dict or JSON text), any JSON object, a regex, or a
    Lark grammar. `lenient`: schema keywords llguidance does not implement are ignored, not
    refused. Raises GrammarError for specs of the wrong type."""
    import llguidance

    if kind == "json_object":
        spec = {"type": "object"}
        kind = "json_schema"
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            except RecursionError:
                raise GrammarError("the JSON schema is nested too deeply to read") from None
        if not isinstance(spec, dict):
            raise GrammarError(f"a JSON schema must be an object (got {type(spec).__name__})")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults={**JSON_OPTIONS, "lenient": lenient})
        except LLGUIDANCE_ERRORS as e:
            raise GrammarError(f"invalid JSON schema: {_why(e)}") from None
    if not isinstance(spec, str) or not spec:
        raise GrammarError(f"a {kind} must be a non-empty string (got {type(spec).__name__})")
    convert = {"regex": llguidance.LLMatcher.grammar_from_regex, "lark": llguidance.LLMatcher.grammar_from_lark}.get(
        kind
    )
    if convert is not None:
        try:
            return convert(spec)
        except LLGUIDANCE_ERRORS as e:
            raise GrammarError(f"invalid {kind}: {_why(e)}") from None
    raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(GRAMMAR_KINDS)}")


class GrammarCompiler:
    """One checkpoint's tokenizer as llguidance sees it, and grammars compiled against it.

    Built once per model (reading tokenizer.json takes up to a second for a 262k vocabulary).
    `vocab_size` is the model's (its logits' width): masks have ceil(vocab_size / 32) words, and
    ids the tokenizer lacks are never allowed."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], pad_token_id: int | None):
        import llguidance

        if not eos_token_ids:
            raise GrammarError("structured output needs an EOS token (the checkpoint's generation config has none)")
        self.vocab_size = vocab_size
        self.eos = tuple(eos_token_ids)
        self.pad = pad_token_id
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(self.eos))
        self.words = -(-vocab_size // 32)
        end = torch.zeros(vocab_size, dtype=torch.bool)
        end[list(self.eos) + ([pad_token_id] if pad_token_id is not None else [])] = True
        self.end_mask = pack_token_mask(end)  # after EOS: EOS or pad only

    def compile(self, kind: str, spec: Any, lenient: bool = False) -> Grammar:
        """A validated grammar, compiled once (its start state answers a first mask here too, so
        its lexer caches are warm for every copy); GrammarError naming the problem otherwise.

        llguidance compiles recursively: a deep enough grammar overflows the native stack of the
        calling thread. The server calls this on a big-stack thread, after its limits
        (serve/structured/limits.py)."""
        import llguidance

        text = grammar_text(kind, spec, lenient)
        what = Grammar(kind, text).describe()
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
            if not matcher.is_error():
                matcher.compute_bitmask()
        except LLGUIDANCE_ERRORS as e:
            raise GrammarError(f"invalid {what}: {_why(e)}") from None
        if matcher.is_error():
            raise GrammarError(f"invalid {what}: {_first_line(matcher.get_error())}")
        return Grammar(kind, text, matcher)

    def canvas(self, grammar: Grammar, canvas_length: int) -> CanvasGrammar:
        """A fresh grammar state for one request."""
        return CanvasGrammar(self, grammar, canvas_length)


class CanvasGrammar:
    """One request's grammar state: the constraint source of its canvases (`__call__`, before
    every decoder pass) and the judge of what each block commits (`commit`). See the module
    docstring for the walk."""

    def __init__(self, compiler: GrammarCompiler, grammar: Grammar, canvas_length: int):
        import llguidance

        self.compiler, self.grammar, self.canvas_length = compiler, grammar, canvas_length
        if grammar.matcher is not None:  # a copy of the compiled start state: no second compile
            self.matcher = grammar.matcher.deep_copy()
        else:  # a Grammar made by hand
            self.matcher = llguidance.LLMatcher(compiler.tokenizer, grammar.source, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"invalid {grammar.describe()}: {_first_line(self.matcher.get_error())}")
        self._row = torch.empty(1, compiler.words, dtype=torch.int32)
        self.masked_positions = 0  # positions given a mask, over all passes (tests, diagnostics)
        self._walked: tuple[list[int], CanvasConstraints] | None = None  # refine's draft and its walk

    def __call__(self, request) -> CanvasConstraints:
        """The constraints of the next pass: the walk of its draft (the last argmax canvas). After
        a pass, `refine` has walked that draft already (the runner refines every pass of a grammar
        request, and the refined canvas is the request's argmax; a commit clears the walk), so the
        draft is read from the device only for a block's first pass."""
        if self._walked is not None:
            return self._walked[1]
        return self._walk(request.argmax.tolist())[1]

    def refine(self, argmax: torch.Tensor, weights: torch.Tensor | PassRows) -> torch.Tensor:
        """The pass's argmax canvas made valid left to right: each token the grammar rejects
        (given the refined tokens before it) becomes the most likely allowed token under this
        pass's `weights` [C, V] (or what a walk reads of them: `PassRows`, for weights cut across
        ranks); past an EOS, that EOS repeated (the block is cut there); where no allowed token
        has weight (the pass masked that position differently), the walk stops and the rest is
        kept. The walk is kept for the next pass, whose draft this is."""
        tokens, constraints = self._walk(argmax.tolist(), weights)
        self._walked = (tokens, constraints)
        return torch.tensor(tokens, dtype=argmax.dtype)

    def _walk(
        self, tokens: list[int], weights: torch.Tensor | PassRows | None = None
    ) -> tuple[list[int], CanvasConstraints]:
        """Walk `tokens` from the committed state: the mask at each position whose left
        neighbours are accepted, forced tokens fixed (and written into `tokens`). At the first
        rejected token: without `weights` the walk stops (that position masked, the rest free);
        with them the token is replaced by the most likely allowed one."""
        from llguidance.torch import fill_next_token_bitmask

        c, compiler, matcher, row = self.canvas_length, self.compiler, self.matcher, self._row[0]
        rows = None if weights is None else pass_rows(weights)
        candidates = None  # each position's most likely tokens, read from the device at the first rejection
        tokens = list(tokens)
        masks = torch.full((c, compiler.words), -1, dtype=torch.int32)
        fixed = torch.full((c,), -1, dtype=torch.long)
        consumed = 0
        for i in range(c):
            fill_next_token_bitmask(matcher, self._row)
            masks[i] = row
            self.masked_positions += 1
            only = single_token(row)
            if only is not None:
                fixed[i] = tokens[i] = only
            elif not token_allowed(row, tokens[i]):
                best = None
                if rows is not None:
                    if candidates is None:
                        candidates = rows.candidates()
                    best = best_allowed_candidate(row, *candidates[i])
                    if best is False:  # not settled by the candidates: the whole row
                        best = rows.best_allowed(i, row)
                if best is None:
                    break
                tokens[i] = best
            if tokens[i] in compiler.eos:  # the answer ends here: the rest of the canvas is padding
                masks[i + 1 :] = compiler.end_mask
                tokens[i + 1 :] = [tokens[i]] * (c - i - 1)
                break
            if not matcher.consume_token(tokens[i]):
                break
            consumed += 1
        if consumed and not matcher.rollback(consumed):
            raise RuntimeError(f"grammar rollback failed: {matcher.get_error()}")
        return tokens, CanvasConstraints(fixed if bool((fixed >= 0).any()) else None, masks)

    def commit(self, block: list[int]) -> int:
        """How many leading tokens of `block` the grammar accepts from the committed state;
        those are consumed (the new committed state). Never 0 for a block whose first token
        was masked from this state."""
        self._walked = None  # the committed state moves: walks from the old one are stale
        n = self.matcher.validate_tokens(block)
        if n:
            self.matcher.consume_tokens(block[:n])
        if n < len(block) and block[n] in self.compiler.eos and self.matcher.is_accepting():
            n += 1  # the answer ends here (a stopped matcher validates no token, not even EOS)
        return n

    @property
    def complete(self) -> bool:
        """The committed output is a whole sentence of the grammar."""
        return self.matcher.is_accepting()


def single_token(mask: torch.Tensor) -> int | None:
    """The one allowed token of a packed mask row, or None when it allows more (or none)."""
    words = mask.nonzero()
    if words.numel() != 1:
        return None
    w = int(words[0, 0])
    bits = int(mask[w]) & 0xFFFFFFFF
    return w * 32 + bits.bit_length() - 1 if bits & (bits - 1) == 0 else None


CANDIDATES = 64


@dataclass(frozen=True)
class PassRows:
    """What a grammar's walk reads of a pass's weights [C, V], as two functions, so that rows cut
    across ranks (engine/sharded/sampling.py) can answer without gathering them: `candidates()`, each
    position's heaviest tokens (`top_candidates`' format; called at most once per walk, at its
    first rejection), and `best_allowed(i, mask)`, position i's allowed token of highest weight
    (`best_allowed` of its whole row; only where the candidates cannot settle it)."""

    candidates: Callable[[], list[tuple[list[float], list[int]]]]
    best_allowed: Callable[[int, torch.Tensor], int | None]


def pass_rows(weights: torch.Tensor | PassRows) -> PassRows:
    """A walk's reads of whole rows [C, V] (`top_candidates`, `best_allowed`), or `weights` itself
    when it already is one."""
    if isinstance(weights, PassRows):
        return weights
    return PassRows(lambda: top_candidates(weights), lambda i, mask: best_allowed(mask, weights[i]))


def held_rows(rows: PassRows, computed: list[int], held: dict[int, int], c: int) -> PassRows:
    """`rows` (R rows, of canvas positions `computed`) read as C positions, where each position of
    `held` (position: token) has all its weight on its token (turbo's frozen positions) and any
    other position none: the walk on it equals the walk on the [C, V] weights so built
    (`host.step.turbo_rows`), with no [C, V] tensor."""
    row_of = {p: k for k, p in enumerate(computed)}

    def weightless(p: int) -> tuple[list[float], list[int]]:
        # one token of weight 1 and the others 0 (or all 0): settled by these (best_allowed_candidate)
        return ([1.0, 0.0], [held[p], held[p]]) if p in held else ([0.0], [0])

    def candidates() -> list[tuple[list[float], list[int]]]:
        found = rows.candidates()
        return [found[row_of[p]] if p in row_of else weightless(p) for p in range(c)]

    def best(i: int, mask: torch.Tensor) -> int | None:
        if i in row_of:
            return rows.best_allowed(row_of[i], mask)
        return held[i] if i in held and token_allowed(mask, held[i]) else None

    return PassRows(candidates, best)


def top_candidates(weights: torch.Tensor, k: int = CANDIDATES) -> list[tuple[list[float], list[int]]]:
    """Each position's `k` heaviest tokens, in one read from the device (on a GPU, one copy and one
    wait per refined pass, instead of a row copy and two waits per rejected token)."""
    values, ids = weights.float().topk(min(k, weights.shape[-1]), dim=-1)
    k = values.shape[-1]
    both = torch.cat([values, ids.float()], dim=-1).cpu()  # one copy: ids < 2^24 are exact in float32
    return [(row[:k], [int(t) for t in row[k:]]) for row in both.tolist()]


def best_allowed_candidate(mask: torch.Tensor, values: list[float], ids: list[int]) -> int | None | bool:
    """`best_allowed` from a position's heaviest tokens (descending): the allowed one of highest
    weight (the lowest id among equals, as argmax picks), None when a zero weight is reached first
    (every allowed token weighs 0), False when the candidates cannot settle it (none allowed, or
    the best ties with the lightest candidate, so an unseen token could tie with a lower id)."""
    best = None
    for v, t in zip(values, ids):
        if best is not None and v < best[0]:
            break
        if v <= 0:
            return None if best is None else best[1]
        if token_allowed(mask, t) and (best is None or t < best[1]):
            best = (v, t)
    if best is None or (len(values) and best[0] == values[-1]):
        return False
    return best[1]


def best_allowed(mask: torch.Tensor, weights: torch.Tensor) -> int | None:
    """The allowed token of highest weight, or None when every allowed token has weight 0."""
    allowed = unpack_token_mask(mask, weights.shape[-1])
    scores = torch.where(allowed.to(weights.device), weights.float(), -1.0)
    best = int(scores.argmax())
    return best if float(scores[best]) > 0 else None


def token_allowed(mask: torch.Tensor, token: int) -> bool:
    return token // 32 < mask.shape[0] and (int(mask[token // 32]) >> (token % 32)) & 1 == 1


def _why(e: Exception) -> str:
    """An exception from llguidance's Python side as a message (a lone surrogate said so)."""
    if isinstance(e, UnicodeEncodeError):
        return f"it holds a lone surrogate (U+{ord(e.object[e.start]):04X}); text must be valid Unicode"
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return _first_line(str(e))


def _first_line(message: str) -> str:
    """llguidance's message on one line: a regex's parse error as what is wrong and where (the
    regex crate draws it on lines of its own), else its first three lines, whitespace collapsed."""
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    if len(lines) > 3 and lines[0].endswith("regex parse error:") and lines[3].startswith("error: "):
        pattern, caret = lines[1][4:], lines[2].find("^") - 3  # (the crate indents both by 4)
        return f"regex parse error: {lines[3][len('error: ') :]} at character {caret} of {json.dumps(pattern)}"
    return " ".join(" ".join(lines[:3]).split()) if lines else "rejected by llguidance"

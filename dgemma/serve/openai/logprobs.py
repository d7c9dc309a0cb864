"""Log probabilities of committed tokens in OpenAI's shapes (chat and completions), whole or per chunk.

The engine computes them (runner `_logprobs`: a committed token's log probability under the
decoder pass that fixed it, see docs/server.md, "Log probabilities"); here they get their token
texts and bytes and the layout each endpoint uses.
"""

from __future__ import annotations

from collections.abc import Callable

from ...engine.events import TokenLogprob

MAX_TOP_LOGPROBS = 20
# A token of probability 0 under its pass (a mask banned it, and a grammar's refine put it there
# after its left context changed) gets OpenAI's floor: JSON has no -inf.
FLOOR = -9999.0


class TokenTexts:
    """Token id -> (text, bytes) as logprobs show a token: its exact bytes (`token_bytes`: a
    byte-fallback token is its one byte, a special token its name), its text those bytes as
    UTF-8 with invalid bytes written as \\xNN escapes (a token holding part of a character)."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._bytes = token_bytes
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            raw = self._bytes(token)
            hit = self._cache[token] = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
        return hit


class TextOffsets:
    """Characters of text before each token (completions' `text_offset`), from a token stream.

    Decodes only the tokens since the last point where the text was whole characters (a trailing
    U+FFFD is a character split across tokens, not yet decided), so a long answer costs no
    quadratic decoding. The offset of a token of a stop string may pass the returned text's end
    (that text is cut before the stop string)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        self.base, self.base_chars = 0, 0  # tokens[:base] decode to base_chars whole characters

    def add(self, tokens: list[int]) -> list[int]:
        out = []
        for t in tokens:
            tail = self.decode(self.tokens[self.base :])
            settled = tail.rstrip("\ufffd")
            out.append(self.base_chars + len(settled))
            if len(settled) == len(tail):
                self.base, self.base_chars = len(self.tokens), self.base_chars + len(tail)
            self.tokens.append(t)
        return out


def _logprob(value: float) -> float:
    return max(value, FLOOR)


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""

    def one(token: int, logprob: float) -> dict:
        text, raw = texts(token)
        return {"token": text, "logprob": _logprob(logprob), "bytes": raw}

    content = [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, offsets: TextOffsets) -> dict:
    """A completion choice's `logprobs`: tokens, token_logprobs, top_logprobs (one dict per token:
    the alternatives and, as OpenAI always adds it, the token itself) and text_offset."""
    tokens = [texts(e.token)[0] for e in entries]
    tops = []
    for e, text in zip(entries, tokens):
        top: dict[str, float] = {}
        for t, lp in e.top:
            top.setdefault(texts(t)[0], _logprob(lp))  # most likely first: two tokens of one text keep the likelier
        top.setdefault(text, _logprob(e.logprob))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(e.logprob) for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets.add([e.token for e in entries]),
    }

"""The model's tool calls read out of its answer: a hand-written recursive-descent reader of
Gemma 4's call syntax (syntax.py), fed committed text as it streams, giving content pieces
and OpenAI tool calls in order; and the decoder that keeps the call tokens in the text.

Content is passed on as soon as it cannot be the start of a call; text that looks like a call but
does not parse, or calls a function the request did not declare, stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from .syntax import KEPT_TOKENS, QUOTE, TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE

MAX_DEPTH = 64  # nesting of objects and lists the reader follows; deeper is not a call


def keeping_decoder(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode` (special tokens skipped), except that the tool-call tokens stay in the
    text: Gemma 4's tokenizer marks <|tool_call>, <tool_call|> and <|"|> special."""
    keep = {i: t for t in KEPT_TOKENS if (i := tokenizer.token_to_id(t)) is not None}
    if not keep:
        return tokenizer.decode

    def decode(ids: list[int]) -> str:
        out, run = [], []
        for t in ids:
            if t in keep:
                out.append(tokenizer.decode(run) if run else "")
                out.append(keep[t])
                run = []
            else:
                run.append(t)
        out.append(tokenizer.decode(run) if run else "")
        return "".join(out)

    return decode


class _Incomplete(Exception):
    """The text ends inside what may still become a call."""


class _NotACall(Exception):
    """The text breaks the call syntax (or names an unknown function)."""


_SPACE = " \t\r\n"
_BARE_KEY = re.compile(r"[^:{}\[\],\"<>\n]+")
_BARE_VALUE = re.compile(r"[^,}\]\s]+")
_FUNCTION = re.compile(r"[A-Za-z0-9_-]*")


class _Reader:
    """A recursive-descent reader of one Gemma 4 call at s[i:]."""

    def __init__(self, s: str, i: int):
        self.s, self.i = s, i

    def space(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in _SPACE:
            self.i += 1

    def at_end(self) -> None:
        if self.i >= len(self.s):
            raise _Incomplete

    def starts(self, token: str) -> bool:
        """Whether `token` is next; text that ends in the middle of it is incomplete."""
        rest = self.s[self.i : self.i + len(token)]
        if rest == token:
            return True
        if len(rest) < len(token) and self.i + len(rest) == len(self.s) and token.startswith(rest):
            raise _Incomplete
        return False

    def expect(self, token: str) -> None:
        if not self.starts(token):
            raise _NotACall
        self.i += len(token)

    def string(self) -> str:
        if self.starts(QUOTE):
            start = self.i + len(QUOTE)
            end = self.s.find(QUOTE, start)
            if end < 0:
                raise _Incomplete
            self.i = end + len(QUOTE)
            return self.s[start:end]
        try:  # a JSON string, which some outputs use instead
            text, self.i = json.decoder.scanstring(self.s, self.i + 1, False)
        except json.JSONDecodeError as e:
            raise (_Incomplete if e.msg.startswith("Unterminated") else _NotACall) from None
        return text

    def key(self) -> str:
        self.space()
        self.at_end()
        if self.s[self.i] == '"' or self.starts(QUOTE):
            return self.string()
        m = _BARE_KEY.match(self.s, self.i)
        if not m:
            raise _NotACall
        if m.end() == len(self.s):
            raise _Incomplete
        self.i = m.end()
        if not m.group().strip():
            raise _NotACall
        return m.group().strip()

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _NotACall
        self.space()
        self.at_end()
        c = self.s[self.i]
        if c == '"' or self.starts(QUOTE):
            return self.string()
        if c == "{":
            self.i += 1
            return self.members(depth + 1)
        if c == "[":
            self.i += 1
            return self.items(depth + 1)
        m = _BARE_VALUE.match(self.s, self.i)
        if not m or m.group().startswith("<"):
            raise _NotACall
        if m.end() == len(self.s):
            raise _Incomplete  # more digits may follow
        try:
            value = json.loads(m.group())  # a number, true, false or null
        except ValueError:
            raise _NotACall from None
        if isinstance(value, (dict, list, str)):
            raise _NotACall
        self.i = m.end()
        return value

    def _next(self, close: str) -> bool:
        """After an item: True for ',' (another follows), False for `close` (the end)."""
        self.space()
        self.at_end()
        c = self.s[self.i]
        self.i += 1
        if c == ",":
            return True
        if c == close:
            return False
        raise _NotACall

    def members(self, depth: int) -> dict:
        out: dict = {}
        self.space()
        self.at_end()
        if self.s[self.i] == "}":
            self.i += 1
            return out
        while True:
            key = self.key()
            self.space()
            self.expect(":")
            out[key] = self.value(depth)
            if not self._next("}"):
                return out

    def items(self, depth: int) -> list:
        out: list = []
        self.space()
        self.at_end()
        if self.s[self.i] == "]":
            self.i += 1
            return out
        while True:
            out.append(self.value(depth))
            if not self._next("]"):
                return out

    def call(self, names: set[str]) -> tuple[str, dict]:
        self.expect(TOOL_CALL)
        self.expect("call:")
        m = _FUNCTION.match(self.s, self.i)
        self.i = m.end()
        self.at_end()
        if self.s[self.i] != "{" or not m.group() or m.group() not in names:
            raise _NotACall
        self.i += 1
        arguments = self.members(1)
        self.space()
        self.expect(TOOL_CALL_END)
        return m.group(), arguments


def partial_tail(s: str, start: int, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of s[start:] that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(s) - start), best, -1):
            if s.endswith(marker[:k]):
                best = k
                break
    return best


def split_calls(s: str, names: set[str], final: bool) -> tuple[list, int, bool]:
    """Scan s for calls: returns (items, used, ended). Items are content strings and
    (name, arguments) calls, in order, for s[:used]; the rest may still become a call (all of s is
    decided when `final`: an unfinished call is content). `ended`: a <|tool_response> came, with
    which the model hands over to the tool runner; nothing after it is the answer."""
    items: list = []
    i = 0
    while True:
        found = [(j, m) for m in (TOOL_CALL, TOOL_RESPONSE) if (j := s.find(m, i)) >= 0]
        if not found:
            end = len(s) if final else len(s) - partial_tail(s, i, (TOOL_CALL, TOOL_RESPONSE))
            items.append(s[i:end])
            return items, end, False
        j, marker = min(found)
        items.append(s[i:j])
        if marker == TOOL_RESPONSE:
            return items, len(s), True
        reader = _Reader(s, j)
        try:
            items.append(reader.call(names))
            i = reader.i
        except _Incomplete:
            if final:
                items.append(s[j:])
                return items, len(s), False
            return items, j, False
        except _NotACall:  # stays content; scanning goes on after its marker
            items.append(TOOL_CALL)
            i = j + len(TOOL_CALL)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """One request's committed text in, content pieces and OpenAI tool calls out, in order.

    Content is passed on as soon as it cannot be the start of a call; a call comes out once its
    closing <tool_call|> has arrived and it parses. Text that looks like a call but does not parse,
    or calls a function not in `names`, stays content. Whitespace next to calls is dropped, so an
    answer of calls only has no content. With `parallel` false the answer ends after the first
    call; it also ends at a <|tool_response> (`done`: the caller may stop generating)."""

    def __init__(self, names: set[str], parallel: bool = True, prefix: str = ""):
        self.names, self.parallel = set(names), parallel
        self.buffer = prefix  # undecided text
        self.calls: list[dict] = []
        self.done = False
        self._space = ""  # trailing whitespace held back: dropped if a call follows
        self._after_call = False

    def feed(self, text: str, final: bool = False) -> list[str | dict]:
        """New text (with `final`, the end of the answer): content strings and calls to send."""
        out: list[str | dict] = []
        if self.done:
            return out
        self.buffer += text
        items, used, ended = split_calls(self.buffer, self.names, final)
        self.buffer = self.buffer[used:]
        for item in items:
            if self.done:
                break
            if isinstance(item, str):
                self._content(item, out)
                continue
            name, arguments = item
            self._space = ""
            call = {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
            self.calls.append(call)
            out.append(call)
            self._after_call = True
            self.done = not self.parallel
        if ended:
            self.done = True
        if (final or self.done) and self._space and not self.calls:
            out.append(self._space)
        if final or self.done:
            self._space, self.buffer = "", ""
        return out

    def _content(self, text: str, out: list) -> None:
        if self._after_call:
            text = text.lstrip(_SPACE)
            if not text:
                return
            self._after_call = False
        body = text.rstrip(_SPACE)
        if body:
            out.append(self._space + body)
            self._space = ""
        self._space += text[len(body) :]


def parse_tool_calls(
    text: str, names: set[str], parallel: bool = True, prefix: str = ""
) -> tuple[str | None, list[dict]]:
    """A whole answer as (content, tool_calls): content None when the answer is calls only."""
    parser = ToolCallParser(names, parallel, prefix)
    items = parser.feed(text, final=True)
    content = "".join(i for i in items if isinstance(i, str))
    return (content or None) if parser.calls else content, parser.calls

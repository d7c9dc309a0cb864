"""Gemma 4's thinking mode: switching it on in the prompt, and the thought channel parsed out of
the answer into `reasoning_content`.

Gemma 4's chat template switches thinking on with `enable_thinking=True`, which writes `<|think|>`
at the very start of the first system turn (a system turn is opened for it when the chat has
none). A thinking model then writes its thoughts in a channel before the answer:

    <|channel>thought\n...the model's reasoning...<channel|>The answer.

`<|channel>` and `<channel|>` are special tokens (plain decoding drops them), and `thought\n` is
the channel's label, like `user\n` after `<|turn>`. As vLLM's `gemma4` reasoning parser does, the
channel's text without the label is the reasoning and the rest is the content; tool calls are
parsed from the content only (tools/calls.py runs after this). The server wires it in (docs/server.md,
"Thinking").
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from .tools.calls import partial_tail
from .tools.render import join_contents
from .tools.syntax import TOOL_CALL

THINK = "<|think|>"
CHANNEL, CHANNEL_END = "<|channel>", "<channel|>"
THOUGHT_LABEL = "thought\n"
_SPACE = " \t\r\n"


# ------------------------------------------------------------------------------------ the prompt
def template_thinks(template: str | None) -> bool:
    """Whether the chat template switches thinking itself (it reads `enable_thinking`: Gemma 4's does)."""
    return bool(template) and "enable_thinking" in template


def think_in_system_turn(messages: list[dict]) -> list[dict]:
    """`<|think|>` at the start of the first system message (one is added when there is none), as
    Gemma 4's template writes it, for a template that knows nothing of thinking."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": join_contents(THINK, messages[0]["content"])}, *messages[1:]]
    return [{"role": "system", "content": THINK}, *messages]


def keeping_channel(tokenizer, decode: Callable[[list[int]], str]) -> Callable[[list[int]], str]:
    """`decode` with the channel markers kept in the text (Gemma 4's tokenizer marks <|channel>
    and <channel|> special, so decoding skips them); the ids between markers go through `decode`
    (the tool decoder keeps the tool-call tokens too)."""
    marks = {i: t for t in (CHANNEL, CHANNEL_END) if (i := tokenizer.token_to_id(t)) is not None}
    if not marks:
        return decode

    def decode_keeping(ids: list[int]) -> str:
        runs = itertools.groupby(ids, marks.__contains__)
        return "".join("".join(marks[t] for t in run) if marked else decode(list(run)) for marked, run in runs)

    return decode_keeping


# ------------------------------------------------------------------------------------ parsing
@dataclass(frozen=True)
class Thought:
    """A piece of the model's reasoning (content pieces are plain strings)."""

    text: str


class ReasoningParser:
    """One request's committed text in, reasoning (Thought) and content (str) pieces out, in order.

    Text in a `<|channel>...<channel|>` span is reasoning, its leading `thought\\n` label dropped,
    whitespace at its end and at the start of the content after it dropped; everything else is
    content, verbatim. A `<|tool_call>` inside a channel ends the thought (a call is never part of
    the reasoning); a channel still open when the answer ends (max_tokens) is all reasoning; a
    `<channel|>` with no channel open is dropped. Text that may still be the start of a marker, or
    of the label, is held back until the next piece decides it."""

    def __init__(self):
        self.buffer = ""  # undecided text
        self.thinking = False  # inside a channel
        self.thought = False  # a channel was opened (the answer has reasoning, maybe empty)
        self._label = False  # the channel's label may still come
        self._after = False  # content right after a channel: leading whitespace is dropped

    def feed(self, text: str, final: bool = False) -> list[str | Thought]:
        """New text (with `final`, the end of the answer): the pieces to send."""
        self.buffer += text
        out: list[str | Thought] = []
        while self.buffer and (self._thought(out, final) if self.thinking else self._content(out, final)):
            pass
        if final:
            self.buffer = ""
        return out

    def _thought(self, out: list, final: bool) -> bool:
        """Reasoning from the buffer; True when a marker ended it (the rest is content)."""
        if self._label:
            if not final and len(self.buffer) < len(THOUGHT_LABEL) and THOUGHT_LABEL.startswith(self.buffer):
                return False
            self.buffer = self.buffer.removeprefix(THOUGHT_LABEL)
            self._label = False
        found = [(j, m) for m in (CHANNEL_END, TOOL_CALL) if (j := self.buffer.find(m)) >= 0]
        if found:
            j, marker = min(found)
            _emit(out, Thought(self.buffer[:j].rstrip(_SPACE)))
            self.buffer = self.buffer[j + len(CHANNEL_END) :] if marker == CHANNEL_END else self.buffer[j:]
            self.thinking, self._after = False, True
            return True
        # trailing whitespace waits: dropped if the channel closes after it
        end = len(self.buffer) if final else len(self.buffer) - partial_tail(self.buffer, 0, (CHANNEL_END, TOOL_CALL))
        body = self.buffer[:end].rstrip(_SPACE)
        _emit(out, Thought(body))
        self.buffer = self.buffer[len(body) :]
        return False

    def _content(self, out: list, final: bool) -> bool:
        """Content from the buffer; True when a channel opened (the rest is reasoning)."""
        if self._after:
            self.buffer = self.buffer.lstrip(_SPACE)
            if not self.buffer:
                return False
            self._after = False
        found = [(j, m) for m in (CHANNEL, CHANNEL_END) if (j := self.buffer.find(m)) >= 0]
        if found:
            j, marker = min(found)
            _emit(out, self.buffer[:j])
            self.buffer = self.buffer[j + len(marker) :]
            if marker == CHANNEL:
                self.thinking = self.thought = self._label = True
            return True
        end = len(self.buffer) if final else len(self.buffer) - partial_tail(self.buffer, 0, (CHANNEL, CHANNEL_END))
        _emit(out, self.buffer[:end])
        self.buffer = self.buffer[end:]
        return False


def _emit(out: list, piece: str | Thought) -> None:
    """Append a piece, joined to the last one when they are of a kind; empty pieces are dropped."""
    text = piece.text if isinstance(piece, Thought) else piece
    if not text:
        return
    if out and type(out[-1]) is type(piece):
        out[-1] = Thought(out[-1].text + text) if isinstance(piece, Thought) else out[-1] + text
    else:
        out.append(piece)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """A whole answer as (reasoning, content): reasoning None when the model opened no channel."""
    parser = ReasoningParser()
    pieces = parser.feed(text, final=True)
    content = "".join(p for p in pieces if isinstance(p, str))
    reasoning = "".join(p.text for p in pieces if isinstance(p, Thought))
    return (reasoning if parser.thought else None), content

"""A request's answer, shaped from its choices' updates: a completion or chat completion, whole or streamed.

Streamed answers are server-sent events (`data: {...}` chunks, then `data: [DONE]`); the chunks of
the `n` choices interleave as they come. With thinking or tools, each choice's text goes through
its own parsers (reasoning.py, tools/) before the client sees it; with logprobs, each chunk
carries those of the tokens it commits (logprobs.py). docs/server.md has the shapes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import Response, StreamingResponse
from starlette.requests import Request

from ...engine.events import TokenLogprob
from ...inputs.model_inputs import ModelInputs
from ..engine_thread import EngineFailure, Generation, Update
from ..errors import ApiError, error_body, json_response
from ..http.connection import watch_disconnect
from ..reasoning import ReasoningParser, Thought
from ..service import Service, insertion_reason
from ..tools.calls import ToolCallParser
from ..tools.specs import ToolSpec
from .insert import Insertion
from .logprobs import TextOffsets, chat_logprobs, completion_logprobs
from .protocol import CompletionParams, RequestParams, request_top_logprobs

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _cancel_all(gens: list[Generation]) -> Callable[[], None]:
    """What cancels every choice of a request whose client has gone."""

    def cancel() -> None:
        for gen in gens:
            gen.cancel()

    return cancel


def _sse(obj: Any) -> bytes:
    """One server-sent event holding `obj` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=True).encode() + b"\n\n"


class Choice:
    """One choice of a response: its generation, its own parsers (tool calls, reasoning: each
    choice is an answer of its own) and how many of its tokens' log probabilities were sent."""

    def __init__(self, index: int, gen: Generation, spec: ToolSpec | None, thinking: bool, offsets: TextOffsets | None):
        self.index, self.gen = index, gen
        self.parser = (
            ToolCallParser(spec.names, spec.parallel, spec.prefill) if spec is not None and spec.active else None
        )
        self.reasoning = ReasoningParser() if thinking else None
        self.offsets = offsets  # completions with logprobs: text_offset
        self.sent = 0  # tokens whose log probabilities were sent
        self.recorded = False

    def _parse(self, text: str, final: bool = False) -> list:
        """Content strings and calls from newly committed text; stops the request once the answer
        is complete (one call without parallel_tool_calls, or a <|tool_response>)."""
        items = self.parser.feed(text, final)
        if self.parser.done and not final:
            self.gen.stop()
        return items

    def items(self, text: str, final: bool = False) -> list:
        """Newly committed text as what the client gets, in order: content strings, Thought pieces
        and calls (parsed from the content only); without either parser, the text as it came."""
        if self.reasoning is None and self.parser is None:
            return [] if final else [text]
        pieces = self.reasoning.feed(text, final) if self.reasoning is not None else [text]
        if self.parser is None:
            return pieces
        items: list = []
        for piece in pieces:
            if self.parser.done:  # the answer ended (a <|tool_response>, the one call): nothing after it
                break
            items += [piece] if isinstance(piece, Thought) else self._parse(piece)
        return items + (self._parse("", final=True) if final else [])

    def reason(self) -> str:
        reason = self.gen.finish_reason or "cancelled"
        return "tool_calls" if self.parser is not None and self.parser.calls and reason == "stop" else reason

    def new_logprobs(self) -> list[TokenLogprob]:
        """Log probabilities of the tokens committed since the last call, up to the answer's end
        (the completion tokens: through a stop string's last token)."""
        end = min(self.gen.completion_tokens, len(self.gen.logprobs))
        out = self.gen.logprobs[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def record(self, service: Service, reason: str) -> None:
        if not self.recorded:
            self.recorded = True
            service.record(self.gen, reason)


class Responder:
    """Shapes one request's updates as a completion or chat completion, whole or streamed.

    Each of the `n` choices (one Generation each) has its own parsers. With thinking (the prompt
    holds <|think|>), committed text first goes through a ReasoningParser: the thought channel
    comes out as `reasoning_content` (a message field; a delta field when streaming), the rest as
    content. With tools active, that content goes through a ToolCallParser: content as it is
    decided, each call as one `tool_calls` delta once it has closed and parsed, and finish_reason
    "tool_calls" when the answer holds calls (and stopped on its own, not at max_tokens). Streamed,
    the choices' chunks interleave as they come, each with its choice's index; with logprobs, a
    chunk carries those of the tokens committed since the choice's last chunk."""

    def __init__(
        self,
        service: Service,
        chat: bool,
        prompt: ModelInputs,
        gens: list[Generation],
        params: RequestParams,
        spec: ToolSpec | None = None,
        thinking: bool = False,
    ):
        self.service, self.chat, self.prompt, self.gens, self.params = service, chat, prompt, gens, params
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.texts = service.token_texts() if request_top_logprobs(params) is not None else None
        self.pieces = service.token_texts() if params.stream_drafts else None  # draft frames' token texts
        offsets = (lambda g: TextOffsets(g.text.decode)) if self.texts is not None and not chat else (lambda g: None)
        self.choices = [Choice(i, g, spec, thinking, offsets(g)) for i, g in enumerate(gens)]

    def _envelope(self, choices: list, object_: str) -> dict:
        body = {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.service.model_name(self.params.model),
            "choices": choices,
        }
        if getattr(self.params, "service_tier", None) is not None:
            body["service_tier"] = "default"  # the tier that served it, as OpenAI reports it: the only one
        return body

    def _logprobs(self, choice: Choice, entries: list[TokenLogprob] | None) -> dict | None:
        if self.texts is None or entries is None:
            return None
        return (
            chat_logprobs(entries, self.texts)
            if self.chat
            else completion_logprobs(entries, self.texts, choice.offsets)
        )

    def _chunk(
        self,
        choice: Choice,
        text: str | None,
        finish_reason: str | None = None,
        draft: dict | None = None,
        role: bool = False,
        tool_call: dict | None = None,
        reasoning: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            if reasoning is not None:
                delta = {"reasoning_content": reasoning}
            if tool_call is not None:  # its index: its place among the answer's calls
                index = next(k for k, c in enumerate(choice.parser.calls) if c is tool_call)
                delta = {"tool_calls": [{"index": index, **tool_call}]}
            body = {"index": choice.index, "delta": delta}
        else:
            body = {"index": choice.index, "text": text or ""}
        body |= {"logprobs": self._logprobs(choice, logprobs), "finish_reason": finish_reason}
        if draft is not None:
            body["draft"] = draft
        return self._envelope([body], "chat.completion.chunk" if self.chat else "text_completion")

    def _failed(self, error: EngineFailure) -> dict:
        for choice in self.choices:
            choice.gen.cancel()
            choice.record(self.service, "error")
        return error_body(ApiError(500, f"generation failed: {error}", code="engine_error"))

    async def _collect(self, choice: Choice) -> dict:
        """A choice run to its end, as the choices entry of a whole response."""
        parts, items, entries = [], [], []
        async for update in choice.gen.updates():
            parts.append(update.text)
            items += choice.items(update.text)
            entries += choice.new_logprobs()
        reason = choice.reason()
        choice.record(self.service, reason)
        logprobs = self._logprobs(choice, entries)
        if not self.chat:
            return {"index": choice.index, "text": "".join(parts), "logprobs": logprobs, "finish_reason": reason}
        items += choice.items("", final=True)
        content = "".join(i for i in items if isinstance(i, str))
        calls = choice.parser.calls if choice.parser is not None else []
        message = {"role": "assistant", "content": (content or None) if calls else content}
        if choice.reasoning is not None:
            message["reasoning_content"] = "".join(i.text for i in items if isinstance(i, Thought)) or None
        if calls:
            message["tool_calls"] = calls
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    async def respond(self, request: Request) -> Response:
        """The answer: server-sent events with `stream`, else one body once every choice has ended."""
        if self.params.stream:
            return StreamingResponse(self.stream(request), media_type="text/event-stream", headers=SSE_HEADERS)
        return await self.whole(request)

    async def whole(self, request: Request) -> Response:
        loop = asyncio.get_running_loop()
        watcher = loop.create_task(watch_disconnect(request, _cancel_all(self.gens)))
        tasks = [loop.create_task(self._collect(c)) for c in self.choices]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()  # those still running after a failure
        failure = next((t.exception() for t in done if t.exception() is not None), None)
        if isinstance(failure, EngineFailure):
            return json_response(self._failed(failure), 500)
        if failure is not None:
            raise failure
        body = self._envelope([t.result() for t in tasks], "chat.completion" if self.chat else "text_completion")
        body["usage"] = self.service.usage(self.prompt, self.gens)
        return json_response(body)

    async def _choice_chunks(self, choice: Choice) -> AsyncIterator[dict]:
        """One choice's chunks: role (chat), committed text as it comes (and drafts), its finish."""
        if self.chat:
            yield self._chunk(choice, None, role=True)
        async for update in choice.gen.updates():
            if update.kind == "draft":
                yield self._chunk(choice, None, draft=self._draft_frame(update))
                continue
            for k, item in enumerate(choice.items(update.text)):
                yield self._item(choice, item, choice.new_logprobs() if k == 0 else None)
        for k, item in enumerate(choice.items("", final=True)):
            yield self._item(choice, item, choice.new_logprobs() if k == 0 else None)
        reason = choice.reason()
        choice.record(self.service, reason)
        yield self._chunk(choice, None, finish_reason=reason, logprobs=choice.new_logprobs() or None)

    def _draft_frame(self, update: Update) -> dict:
        """A draft frame (docs/server.md): the text that would commit now, and the whole canvas
        position by position: token ids, their texts, accepted or re-noised, entropy; with turbo,
        which positions are frozen (no longer computed). Without turbo the frame has no `frozen`."""
        draft = update.draft
        frame = {
            "block": update.block,
            "step": update.step,
            "text": update.text,
            "tokens": draft.canvas,
            "pieces": [self.pieces(t)[0] for t in draft.canvas],
            "accepted": draft.accepted,
            "entropy": draft.entropy,
        }
        if draft.frozen:
            frame["frozen"] = draft.frozen
        return frame

    async def _pump(self, choice: Choice, out: asyncio.Queue) -> None:
        """A choice's chunks into the response's queue (the reader's pace: one waits at a time),
        then None; an EngineFailure goes in as it is."""
        try:
            async for chunk in self._choice_chunks(choice):
                await out.put(_sse(chunk))
        except EngineFailure as e:
            await out.put(e)
            return
        await out.put(None)

    async def stream(self, request: Request) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        watcher = loop.create_task(watch_disconnect(request, _cancel_all(self.gens)))
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        pumps = [loop.create_task(self._pump(c, queue)) for c in self.choices]
        finished = False
        try:
            running = len(pumps)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, EngineFailure):
                    raise item
                else:
                    yield item
            finished = True
            if self.params.stream_options and self.params.stream_options.include_usage:
                usage = self._envelope([], "chat.completion.chunk" if self.chat else "text_completion")
                usage["usage"] = self.service.usage(self.prompt, self.gens)
                yield _sse(usage)
            yield b"data: [DONE]\n\n"
        except EngineFailure as e:
            finished = True
            yield _sse(self._failed(e))
        finally:
            watcher.cancel()
            for pump in pumps:
                pump.cancel()
            if not finished:  # the client went away mid-stream
                for choice in self.choices:
                    choice.gen.cancel()
                    choice.record(self.service, "cancelled")

    def _item(self, choice: Choice, item: str | Thought | dict, logprobs: list[TokenLogprob] | None = None) -> dict:
        if isinstance(item, Thought):
            return self._chunk(choice, None, reasoning=item.text, logprobs=logprobs)
        if isinstance(item, str):
            return self._chunk(choice, item, logprobs=logprobs)
        return self._chunk(choice, None, tool_call=item, logprobs=logprobs)


def insertion_response(
    service: Service, params: CompletionParams, prompt: ModelInputs, found: Insertion | None
) -> Response:
    """An insertion's answer (Service.insert): the span's text whole, or streamed as one chunk and
    its finish; 204 when its client has gone (nobody reads it)."""
    if found is None:
        return Response(status_code=204)
    reason = insertion_reason(found)
    text = service.tokenizer.decode(found.tokens)
    prompt_len = len(prompt.input_ids)
    usage = {
        "prompt_tokens": prompt_len,
        "completion_tokens": found.span_length,
        "total_tokens": prompt_len + found.span_length,
        "decoder_passes": found.decoder_passes,
        "decoder_positions": found.decoder_positions,
        "span_length": found.span_length,
    }
    envelope = {
        "id": "cmpl-" + uuid.uuid4().hex,
        "object": "text_completion",
        "created": int(time.time()),
        "model": service.model_name(params.model),
    }
    if not params.stream:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return json_response({**envelope, "choices": [choice], "usage": usage})

    def chunks():
        yield _sse({**envelope, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]})
        yield _sse({**envelope, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": reason}]})
        if params.stream_options and params.stream_options.include_usage:
            yield _sse({**envelope, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

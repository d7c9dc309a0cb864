"""ollama's answers to `/api/chat` and `/api/generate`, whole or streamed, from the same generation
the OpenAI answers are shaped from (openai/responses.py).

Streamed answers are newline-delimited JSON (`application/x-ndjson`): one object per piece of
committed text (`message.content` for chat, `response` for generate; `thinking` for the thought
channel; a chat's `tool_calls` once a call has closed), each with `"done": false`, then one with
`"done": true`, `done_reason` and the counts and durations (nanoseconds). A failure after the
stream began is a line `{"error": ...}`. The text goes through the same per-choice parsers as the
OpenAI answer's (reasoning.py, tools/calls.py), so both APIs give the same split of the same text.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi.responses import Response, StreamingResponse
from starlette.requests import Request

from ..engine_thread import EngineFailure
from ..errors import ApiError, json_response
from ..http.connection import watch_disconnect
from ..openai.logprobs import chat_logprobs
from ..openai.protocol import request_top_logprobs
from ..openai.responses import Choice
from ..pipeline import Prepared
from ..reasoning import Thought
from ..service import Service, insertion_reason

NDJSON = "application/x-ndjson"
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_REASONS = {"tool_calls": "stop"}  # ollama ends an answer with calls as "stop"; the others keep their names


def created_at() -> str:
    """Now in RFC 3339 (UTC), as ollama stamps each object."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=True).encode() + b"\n"


def _tool_call(call: dict, index: int) -> dict:
    """A parsed call (OpenAI's shape, arguments as JSON text) in ollama's: arguments as an object."""
    fn = call["function"]
    arguments = json.loads(fn["arguments"])  # the parser wrote it from an object
    return {"id": call["id"], "function": {"index": index, "name": fn["name"], "arguments": arguments}}


class OllamaResponder:
    """One /api/chat or /api/generate answer (`chat`: the chat's `message` shape, else generate's
    `response`). `model`: the name the client asked for, echoed as ollama does; `started`: when
    the request arrived (perf_counter), for total_duration."""

    def __init__(self, service: Service, run: Prepared, model: str, started: float, chat: bool):
        self.service, self.run, self.model, self.started, self.chat = service, run, model, started, chat
        (gen,) = run.gens  # ollama asks for one choice
        self.choice = Choice(0, gen, run.spec, run.thinking, None)
        self.texts = service.token_texts() if request_top_logprobs(run.params) is not None else None
        self.calls = 0  # calls sent so far (their index)

    # ---------------------------------------------------------------- shapes
    def _object(self, text: str = "", thinking: str | None = None, calls: list[dict] | None = None) -> dict:
        body: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            body["message"] = message
        else:
            body["response"] = text
            if thinking:
                body["thinking"] = thinking
        body["done"] = False
        return body

    def _piece(self, item: str | Thought | dict) -> dict:
        if isinstance(item, Thought):
            return self._object(thinking=item.text)
        if isinstance(item, str):
            return self._object(item)
        self.calls += 1
        return self._object(calls=[_tool_call(item, self.calls - 1)])

    def _logprobs(self, body: dict, entries: list) -> dict:
        if self.texts is not None and entries:
            body["logprobs"] = chat_logprobs(entries, self.texts)["content"]
        return body

    def _final(self, body: dict, reason: str) -> dict:
        """The last object: done, its reason, and the counts and durations (docs/server.md)."""
        gen, end = self.choice.gen, time.perf_counter()
        first = gen.first_block_at if gen.first_block_at is not None else end
        body.update(
            done=True,
            done_reason=DONE_REASONS.get(reason, reason),
            total_duration=ns(end - self.started),
            load_duration=0,
            prompt_eval_count=len(self.run.prompt.input_ids),
            prompt_eval_duration=ns(first - gen.job.submitted),
            eval_count=gen.completion_tokens,
            eval_duration=ns(end - gen.job.submitted),
        )
        return body

    # ---------------------------------------------------------------- answers
    async def respond(self, request: Request, stream: bool) -> Response:
        if stream:
            return StreamingResponse(self.stream(request), media_type=NDJSON, headers=STREAM_HEADERS)
        return await self.whole(request)

    def _failed(self, error: EngineFailure) -> ApiError:
        self.choice.gen.cancel()
        self.choice.record(self.service, "error")
        return ApiError(500, f"generation failed: {error}", code="engine_error")

    async def whole(self, request: Request) -> Response:
        choice = self.choice
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(request, choice.gen.cancel))
        items, entries = [], []
        try:
            async for update in choice.gen.updates():
                items += choice.items(update.text)
                entries += choice.new_logprobs()
            items += choice.items("", final=True)
            entries += choice.new_logprobs()
        except EngineFailure as e:
            raise self._failed(e) from None
        finally:
            watcher.cancel()
        reason = choice.reason()
        choice.record(self.service, reason)
        text = "".join(i for i in items if isinstance(i, str))
        thinking = "".join(i.text for i in items if isinstance(i, Thought))
        calls = [_tool_call(c, k) for k, c in enumerate(i for i in items if isinstance(i, dict))]
        body = self._logprobs(self._object(text, thinking, calls), entries)
        return json_response(self._final(body, reason))

    async def stream(self, request: Request) -> AsyncIterator[bytes]:
        choice = self.choice
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(request, choice.gen.cancel))
        finished = False
        try:
            async for update in choice.gen.updates():
                for k, item in enumerate(choice.items(update.text)):
                    yield _line(self._logprobs(self._piece(item), choice.new_logprobs() if k == 0 else []))
            for k, item in enumerate(choice.items("", final=True)):
                yield _line(self._logprobs(self._piece(item), choice.new_logprobs() if k == 0 else []))
            reason = choice.reason()
            choice.record(self.service, reason)
            finished = True
            yield _line(self._final(self._logprobs(self._object(), choice.new_logprobs()), reason))
        except EngineFailure as e:
            finished = True
            yield _line({"error": self._failed(e).message})
        finally:
            watcher.cancel()
            if not finished:  # the client went away mid-stream
                choice.gen.cancel()
                choice.record(self.service, "cancelled")


def insertion_answer(
    service: Service, run: Prepared, model: str, started: float, stream: bool, stops: list[str]
) -> Response:
    """An /api/generate insertion (suffix): the span whole, or streamed as one piece and the last
    object; cut before the first of `stops` (the request's stop strings, applied to the span).
    204 when its client has gone (nobody reads it)."""
    found = run.insertion
    if found is None:
        return Response(status_code=204)
    text, reason = service.tokenizer.decode(found.tokens), insertion_reason(found)
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    if cut is not None:
        text, reason = text[:cut], "stop"
    now = time.perf_counter()
    final = {
        "model": model,
        "created_at": created_at(),
        "response": "",
        "done": True,
        "done_reason": reason,
        "total_duration": ns(now - started),
        "load_duration": 0,
        "prompt_eval_count": len(run.prompt.input_ids),
        "prompt_eval_duration": 0,
        "eval_count": found.span_length,
        "eval_duration": ns(now - started),
    }
    if not stream:
        return json_response({**final, "response": text})
    piece = {"model": model, "created_at": final["created_at"], "response": text, "done": False}
    return StreamingResponse(iter([_line(piece), _line(final)]), media_type=NDJSON, headers=STREAM_HEADERS)

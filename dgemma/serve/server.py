"""`dgemma serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`, `GET /health`,
`GET /metrics` (Prometheus text), and the playground page at `GET /` (playground/). Request bodies are parsed and validated here, strictly, so that
anything a client sends gets a 4xx with an OpenAI-style error body naming the problem; the engine
only ever sees requests that fit. Chat messages may carry images and video (media.py: where they
may come from; the checkpoint's processor: what they become). See docs/server.md for the fields
and the streaming extension, docs/media.md for media. Tool calling (tools.py: Gemma 4's format,
checks, rendering, parsing) is wired in here: see docs/server.md, "Tool calling"; so is Gemma 4's
thinking (reasoning.py: the thought channel as `reasoning_content`), "Thinking"; other clients'
fields: "Client compatibility".
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import ipaddress
import json
import logging
import math
import os
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from ..config import ConfigError
from ..engine.constraints import FirstCanvas
from ..engine.engine import Engine, EngineOptions
from ..engine.events import TokenLogprob
from ..engine.constraints.grammar import Grammar, GrammarError
from ..inputs.model_inputs import MediaError, ModelInputs
from .playground import add_playground
from . import media_sources as media
from .access import Access, AccessGuard
from .listener import Limits, ServerThread, bind, uvicorn_config  # noqa: F401 - ServerThread: tests, scripts
from .engine_thread import EngineFailure, EngineThread, Generation, QueueFull, Update
from .logprobs import TextOffsets, TokenTexts, chat_logprobs, completion_logprobs
from .media_sources import MediaPolicy, MediaRef, PartError
from .metrics import Metrics
from .text import TextStream
from .insert import InsertError, fixed_canvas, insert, span_lengths
from .tool_grammar import lark_string, tool_call_grammar
from .structured import GUIDED_FIELDS, GrammarCache, OutputFormat, StructuredError, request_format
from .reasoning import THINK, ReasoningParser, Thought, keeping_channel, template_thinks, think_in_system_turn
from .tools import ToolCallParser, ToolError, ToolSpec, check_messages, keeping_decoder, render_chat, tool_spec
from .threads import CompileWorker
from ..inputs.tokenizer import ChatTemplateError

log = logging.getLogger("dgemma.serve")

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256
SEED_LIMIT = 2**63 - 1
MAX_CHOICES = 16  # n per request (and at most --max-active)


@dataclass(frozen=True)
class Budgets:
    """What one request may cost (`dgemma serve` flags), so that no small request holds every
    slot for long: denoising steps per canvas, and seconds from its arrival to its end."""

    max_denoising_steps: int = 256
    request_timeout: float | None = 600.0  # None: no deadline

    def __post_init__(self) -> None:
        if self.max_denoising_steps < 1:
            raise ValueError(f"--max-denoising-steps must be at least 1 (got {self.max_denoising_steps})")
        if self.request_timeout is not None and not 0 < self.request_timeout < math.inf:
            raise ValueError(f"--request-timeout must be a positive number of seconds, or 0 for none (got {self.request_timeout})")

    def deadline(self) -> float | None:
        """The time.monotonic() value a request arriving now must end by."""
        return None if self.request_timeout is None else time.monotonic() + self.request_timeout


# ------------------------------------------------------------------------------------ errors
class ApiError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {429: "rate_limit_error", 404: "not_found_error"}.get(status, "invalid_request_error")
        if status >= 500:
            self.kind = "server_error"


def json_response(body: Any, status: int = 200) -> Response:
    # ensure_ascii: error messages may quote client strings holding lone surrogates
    return Response(json.dumps(body, ensure_ascii=True), status_code=status, media_type="application/json")


def error_body(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}


def error_response(err: ApiError) -> Response:
    return json_response(error_body(err), err.status)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_error(e: ValidationError) -> ApiError:
    err = e.errors(include_url=False)[0]
    param = _loc(err["loc"])
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field '{param}'", param, "unknown_parameter")
    if err["type"] == "missing":
        return ApiError(400, f"missing required field '{param}'", param, "missing_required_parameter")
    return ApiError(400, f"{param}: {err['msg']} (got {_short(err.get('input'))})", param, "invalid_value")


# ------------------------------------------------------------------------------------ request bodies
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # accepted: dgemma adds no obfuscation padding to chunks


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Prediction(_Strict):
    """A predicted output (OpenAI's speed-up for edits): accepted and ignored."""

    type: Literal["content"]
    content: str | list[TextPart]


class PromptCacheOptions(_Strict):
    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m"] = "30m"


class ChatMessage(_Strict):
    role: str
    content: Any = None
    name: str | None = None
    tool_calls: Any = None  # assistant messages (checked by tools.check_messages)
    tool_call_id: Any = None  # role "tool" messages
    # an assistant message as a response returned it (or OpenAI's assistant message param):
    # accepted, not rendered (Gemma 4's template drops earlier thoughts); see _unsupported
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    function_call: Any = None
    audio: Any = None


def _num(lo: float | None = None, hi: float | None = None, gt: float | None = None) -> Any:
    return Field(None, ge=lo, le=hi, gt=gt, allow_inf_nan=False)


class _Params(_Strict):
    """Fields shared by both endpoints: OpenAI ones, then the diffusion knobs (extra body fields)."""

    model: str
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    seed: int | None = Field(None, ge=0, le=SEED_LIMIT)
    stop: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # ignored
    # accepted for client compatibility; see docs/server.md
    temperature: float | None = _num(0, 2)
    top_p: float | None = _num(0, 1)
    n: int | None = Field(None, ge=1, le=128)  # choices (see "n"; Service.check_choices caps it lower)
    presence_penalty: float | None = _num(-2, 2)
    frequency_penalty: float | None = _num(-2, 2)
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extras, accepted at their neutral values (the sampler has no such truncation)
    top_k: int | None = None
    min_p: float | None = _num(0, 1)
    repetition_penalty: float | None = _num(gt=0)
    # dgemma extensions
    max_denoising_steps: int | None = Field(None, ge=1, le=4096)
    entropy_bound: float | None = _num(hi=1e6, gt=0)
    t_min: float | None = _num(0, 100)
    t_max: float | None = _num(0, 100)
    stability_threshold: int | None = Field(None, ge=0, le=4096)
    confidence_threshold: float | None = _num(hi=1e6, gt=0)
    ignore_eos: bool = False
    stream_drafts: bool = False
    # structured output (structured.py): OpenAI's response_format, vLLM's guided_* fields
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionParams(_Params):
    prompt: Any
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None  # insert mode (insert.py)
    # dgemma extensions (insert.py): the span's length in tokens with `suffix`; tokens to fix in the first canvas
    span_length: Any = None
    canvas: Any = None


class ChatParams(_Params):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Any = None  # checked by tools.tool_spec, for messages that name the problem
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: Any = None  # deprecated by OpenAI for tools: refused by name
    function_call: Any = None
    # the openai SDK's newer fields (see docs/server.md, "Client compatibility")
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[str] | None = None
    prediction: Prediction | None = None
    audio: Any = None
    web_search_options: Any = None
    moderation: Any = None
    safety_identifier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    # vLLM's: variables for the chat template (enable_thinking, see "Thinking")
    chat_template_kwargs: dict[str, Any] | None = None
    # dgemma extensions: soft tokens per image and per video frame (70, 140, 280, 560 or 1120;
    # default: the checkpoint's processor config)
    max_soft_tokens: int | None = None
    video_max_soft_tokens: int | None = None


def _unsupported(params: _Params) -> None:
    """Refuse, by name, features the engine does not have, when a client asks for more than the default."""
    checks = [
        ("presence_penalty", bool(params.presence_penalty), "token penalties are not supported; omit it or send 0"),
        ("frequency_penalty", bool(params.frequency_penalty), "token penalties are not supported; omit it or send 0"),
        ("logit_bias", bool(params.logit_bias), "logit_bias is not supported"),
        ("top_logprobs", getattr(params, "top_logprobs", None) is not None and not getattr(params, "logprobs", None),
         "top_logprobs needs logprobs: true"),
        ("echo", bool(getattr(params, "echo", None)), "echo is not supported"),
        ("best_of", getattr(params, "best_of", None) not in (None, 1), "best_of is not supported"),
        ("stream_options", params.stream_options is not None and not params.stream, "stream_options needs stream: true"),
        ("stream_drafts", params.stream_drafts and not params.stream, "stream_drafts needs stream: true"),
    ]
    checks += _client_checks(params)
    for name, bad, why in checks:
        if bad:
            raise ApiError(400, f"{name}: {why}", name, "unsupported_parameter")


def request_top_logprobs(params: _Params) -> int | None:
    """Alternatives per token the client asks log probabilities with (0: the token's own only),
    or None for no logprobs: completions' `logprobs` (0-20), chat's `logprobs: true` with
    `top_logprobs` (0-20, default 0)."""
    if isinstance(params, ChatParams):
        return (params.top_logprobs or 0) if params.logprobs else None
    return params.logprobs


DEPRECATED = "deprecated by OpenAI and not supported"
REFUSED_FIELDS = {  # chat fields whose every non-null value asks for what dgemma has not got
    "audio": "audio output is not supported",
    "web_search_options": "web search is not available on this server",
    "moderation": "moderation is not available on this server",
    "functions": f"functions are {DEPRECATED}; send tools instead",
    "function_call": f"function_call is {DEPRECATED}; send tool_choice (with tools) instead",
}


def _client_checks(params: _Params) -> list[tuple[str, bool, str]]:
    """The fields other clients send (vLLM's sampling extras, the openai SDK's newer fields) that
    ask for what dgemma cannot do: (field, refused, why), for `_unsupported`."""
    checks = [
        ("top_k", params.top_k not in (None, -1, 0), "top-k truncation is not supported; omit it or send -1 (all tokens)"),
        ("min_p", bool(params.min_p), "min-p truncation is not supported; omit it or send 0"),
        ("repetition_penalty", params.repetition_penalty not in (None, 1), "repetition penalties are not supported; omit it or send 1"),
    ]
    if not isinstance(params, ChatParams):
        return checks
    checks += [(name, getattr(params, name) is not None, why) for name, why in REFUSED_FIELDS.items()]
    long = next(((k, v) for k, v in (params.metadata or {}).items() if len(k) > 64 or len(v) > 512), None)
    checks += [
        ("modalities", any(m != "text" for m in params.modalities or []),
         f"only text output is supported: send ['text'] (got {_short(params.modalities)})"),
        ("metadata", long is not None, f"keys are at most 64 characters and values at most 512 (got {_short(long)})"),
    ]  # fmt: skip
    for i, m in enumerate(params.messages):
        p = f"messages[{i}]"
        checks += [
            (f"{p}.function_call", m.function_call is not None, f"function_call is {DEPRECATED}; send tool_calls instead"),
            (f"{p}.audio", m.audio is not None, "audio is not supported"),
        ]
        for name in ("reasoning_content", "reasoning", "refusal"):
            checks += [(f"{p}.{name}", getattr(m, name) is not None and m.role != "assistant", "only assistant messages carry it")]
    return checks


def parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, f"stop must be a string or a list of strings (got {_short(stop)})", "stop", "invalid_value")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop", "invalid_value")
    if any(not s or len(s) > MAX_STOP_LENGTH for s in stops):
        raise ApiError(400, f"stop strings must be 1 to {MAX_STOP_LENGTH} characters long", "stop", "invalid_value")
    return stops


def soft_token_budgets(params: "ChatParams") -> dict:
    """The request's soft-token budgets per image and per video frame, checked (400 naming the field)."""
    out = {}
    for name in ("max_soft_tokens", "video_max_soft_tokens"):
        try:
            value = media.check_soft_tokens(getattr(params, name), name)
        except MediaError as e:
            raise ApiError(400, str(e), name, "invalid_value") from None
        if value is not None:
            out[name] = value
    return out


def request_tools(params: "ChatParams") -> ToolSpec:
    """The request's tools, tool_choice and parallel_tool_calls, checked (400 naming the field)."""
    try:
        return tool_spec(params.tools, params.tool_choice, params.parallel_tool_calls)
    except ToolError as e:
        raise ApiError(400, str(e), e.param, "invalid_value") from None


def output_format(params: _Params, spec: ToolSpec | None) -> OutputFormat | None:
    """The request's structured-output format, checked (400 naming the field)."""
    try:
        fmt = request_format(params.response_format, {k: getattr(params, k) for k in GUIDED_FIELDS})
    except StructuredError as e:
        raise ApiError(400, str(e), e.param, "invalid_value") from None
    if fmt is not None and spec is not None and spec.active:
        raise ApiError(400, f"{fmt.param}: structured output and tools in one request are not supported; send "
                            "tool_choice 'none' or no tools (a forced tool call is enforced by its own grammar)",
                       fmt.param, "unsupported_parameter")  # fmt: skip
    if fmt is not None and params.ignore_eos:
        raise ApiError(400, f"{fmt.param}: structured output ends with EOS; ignore_eos cannot be used with it",
                       "ignore_eos", "unsupported_parameter")  # fmt: skip
    return fmt


# template variables the server sets itself (or the processor, or jinja's globals)
RESERVED_TEMPLATE_KWARGS = {
    "messages", "tools", "add_generation_prompt", "tokenize", "continue_final_message", "chat_template", "bos_token",
    "eos_token", "image_token", "video_token", "boi_token", "eoi_token", "max_soft_tokens", "video_max_soft_tokens",
    "raise_exception", "strftime_now",
}  # fmt: skip


def request_template_kwargs(params: "ChatParams") -> dict:
    """The request's chat template variables: chat_template_kwargs, with enable_thinking set by
    reasoning_effort when it is given ("none": off, any other effort: on); 400 naming the field."""
    kwargs = dict(params.chat_template_kwargs or {})
    for key in kwargs:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
            why = "is set by the server" if key in RESERVED_TEMPLATE_KWARGS else "is not a template variable name"
            raise ApiError(400, f"chat_template_kwargs.{key} {why}", f"chat_template_kwargs.{key}", "invalid_value")
    enable, effort = kwargs.get("enable_thinking"), params.reasoning_effort
    if enable is not None and not isinstance(enable, bool):
        raise ApiError(400, f"chat_template_kwargs.enable_thinking must be a boolean (got {_short(enable)})",
                       "chat_template_kwargs.enable_thinking", "invalid_value")  # fmt: skip
    if effort is None:
        return kwargs
    if enable is not None and enable != (effort != "none"):
        raise ApiError(400, f"reasoning_effort {effort!r} contradicts chat_template_kwargs.enable_thinking={enable}; "
                            "send one of them", "reasoning_effort", "invalid_value")  # fmt: skip
    kwargs["enable_thinking"] = effort != "none"
    return kwargs


def media_error(e: MediaError) -> ApiError:
    """A media problem as a 400 naming the content part it came from (or the messages, when the
    processor cannot tell which)."""
    param = e.param if isinstance(e, PartError) else "messages"
    message = str(e) if isinstance(e, PartError) else f"messages: {e}"
    return ApiError(400, message, param, "invalid_media")


# ------------------------------------------------------------------------------------ the service
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MEDIA_WORKERS = 4  # requests whose media is fetched and decoded at once


def _has_media(messages: list[ChatMessage]) -> bool:
    """Whether any message holds a content part that is not text (media, or a part to refuse)."""
    return any(isinstance(m.content, list) and any(not isinstance(p, dict) or p.get("type") not in media.TEXT_PARTS
                                                   for p in m.content) for m in messages)  # fmt: skip


def _text_chars(message: ChatMessage) -> int:
    """Characters of text a message adds to the prompt: its text content, and the strings and
    keys of its tool calls (walked without recursion: they are not checked yet)."""
    content = message.content
    if isinstance(content, str):
        chars = len(content)
    elif isinstance(content, list):
        chars = sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    else:
        chars = 0
    stack = [message.tool_calls]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, dict):
            chars += sum(len(k) for k in value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return chars


def _processor_content(content: list, loaded) -> str | list[dict]:
    """A message's content for the processor: text pieces and the next loaded media parts in
    order; a message without media stays a string."""
    if all(isinstance(p, str) for p in content):
        return "".join(content)
    return [{"type": "text", "text": p} if isinstance(p, str) else next(loaded) for p in content]


def _chat_role(i: int, m: ChatMessage) -> str:
    """The role the chat template sees (developer is rendered as system)."""
    if m.role not in CHAT_ROLES:
        raise ApiError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)} (got {_short(m.role)})",
                       f"messages[{i}].role", "invalid_value")  # fmt: skip
    return "system" if m.role == "developer" else m.role


class Service:
    """What the routes share: model, tokenizer, the engine thread, metrics and limits."""

    def __init__(
        self,
        model,
        served_model_name: str,
        max_active: int,
        max_queue: int,
        max_context: int,
        options: EngineOptions | None = None,
        media_policy: MediaPolicy | None = None,
        budgets: Budgets | None = None,
    ):
        if model.tokenizer is None:
            raise ValueError(f"{model.path} has no tokenizer.json: the server needs one")
        self.model, self.tokenizer, self.name = model, model.tokenizer, served_model_name
        self.tool_decode = keeping_decoder(self.tokenizer)
        self.media = media_policy or MediaPolicy()
        self.budgets = budgets or Budgets()
        # fetching and decoding media: a small pool of their own, so that slow remote images do not
        # starve the default pool every other request's tokenizing uses
        self.media_pool = ThreadPoolExecutor(MEDIA_WORKERS, thread_name_prefix="dgemma-media")
        # no prompt that fits the context holds more characters than this: checked before rendering
        self.max_prompt_chars = max_context * model.tokenizer.max_token_chars
        self.canvas = model.config.canvas_length
        self.context = max_context
        self.created = int(time.time())
        self.metrics = Metrics()
        options = replace(options or EngineOptions(), max_active=max_active)
        net = model.engine_net

        def new_engine() -> Engine:
            return Engine(net, options)

        self.engine_thread = EngineThread(new_engine, max_active, max_queue, self.metrics)
        self._grammars: GrammarCache | None = None
        self._grammars_lock = threading.Lock()
        # grammars are checked, written and compiled on one thread with a 64 MiB stack (llguidance
        # compiles recursively: see grammar_limits.py), off the event loop
        self.compile_worker = CompileWorker()
        self._token_texts: TokenTexts | None = None

    def forced_call_format(self, spec: ToolSpec) -> OutputFormat | None:
        """The grammar of a forced tool call (tool_choice "required" or a named function), or None.
        Blocking (the first call reads tokenizer.json): run it on `compile_worker`."""
        if spec.choice not in ("required", "function"):
            return None
        try:
            lark = tool_call_grammar(spec, self._marker)
        except ToolError as e:
            raise ApiError(400, str(e), e.param, "invalid_value") from None
        except GrammarError as e:  # no EOS token: the call cannot be enforced
            raise ApiError(400, f"tool_choice: {e}", "tool_choice", "unsupported_parameter") from None
        # written from tools that check_tools held to the tool limits: no Lark limits of its own
        return OutputFormat("lark", lark, "tool_choice", generated=True)

    def _marker(self, text: str) -> str:
        """A Gemma 4 marker in Lark: its token where the tokenizer makes it one special token
        (grammar literals only match text), else its text."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.model.grammars.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return lark_string(text)

    def grammar(self, fmt: OutputFormat) -> Grammar:
        """`fmt` checked against the grammar limits and compiled against the checkpoint's
        tokenizer (cached). Blocking, and llguidance recurses natively: run it on `compile_worker`."""
        try:
            with self._grammars_lock:
                if self._grammars is None:
                    self._grammars = GrammarCache(self.model.grammars)
            return self._grammars.get(fmt)
        except StructuredError as e:
            raise ApiError(400, str(e), e.param, "invalid_value") from None
        except GrammarError as e:  # the checkpoint cannot do structured output at all
            raise ApiError(400, f"{fmt.param}: {e}", fmt.param, "unsupported_parameter") from None
        except RecursionError:  # not expected past the limits; the grammar's fault all the same
            raise ApiError(400, f"{fmt.param}: nested too deeply", fmt.param, "invalid_value") from None

    # ---------------------------------------------------------------- parsing
    async def off_loop(self, with_media: bool, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` on a worker thread (tokenizing, rendering, media), so the event loop keeps
        answering: on the media pool when the request holds media, else on the default pool."""
        if not with_media:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self.media_pool, functools.partial(fn, *args))

    def check_prompt_size(self, params: _Params, spec: ToolSpec | None) -> None:
        """Refuse text that cannot fit the context before any of it is rendered or tokenized: no
        token covers more than the vocabulary's longest token of characters."""
        if isinstance(params, ChatParams):
            chars, param = sum(_text_chars(m) for m in params.messages), "messages"
            chars += len(json.dumps(spec.tools)) if spec is not None and spec.tools else 0
        else:
            prompt = params.prompt[0] if isinstance(params.prompt, list) and len(params.prompt) == 1 else params.prompt
            chars, param = (len(prompt) if isinstance(prompt, str) else 0) + len(params.suffix or ""), "prompt"
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"{param} holds {chars} characters of text; a prompt that fits this server's context of "
                                f"{self.context} tokens holds at most {self.max_prompt_chars} ({self.context} x the longest "
                                f"token, {self.tokenizer.max_token_chars} characters)", param, "context_length_exceeded")  # fmt: skip

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise ApiError(404, f"model {_short(name)} does not exist; this server serves '{self.name}'", "model", "model_not_found")

    def _encode(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except Exception as e:  # lone surrogates and other text the tokenizer rejects
            raise ApiError(400, f"prompt could not be tokenized: {e}", "prompt", "invalid_value") from None

    def completion_prompt(self, prompt: Any) -> list[int]:
        """A string, a token-id list, or a one-element list of either."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.model.config.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"prompt holds token id {bad}, outside the vocabulary [0, {vocab})", "prompt", "invalid_value")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, f"prompt: one prompt per request is supported (got {len(prompt)})", "prompt", "invalid_value")
        raise ApiError(
            400, f"prompt must be a non-empty string or a non-empty list of token ids (got {_short(prompt)})",
            "prompt", "invalid_value",
        )  # fmt: skip

    def chat_prompt(
        self, messages: list[ChatMessage], soft_tokens: dict | None = None, spec: ToolSpec | None = None,
        template_kwargs: dict | None = None,
    ) -> ModelInputs:
        """The chat rendered and tokenized; with media parts, through the checkpoint's processor
        with `soft_tokens` (its max_soft_tokens, video_max_soft_tokens); with `spec`'s tools
        declared and tool calls / results rendered in Gemma 4's format (tools.render_chat), then
        the text the answer must start with (tool_choice) after the generation prompt;
        `template_kwargs` passed to the template (enable_thinking: <|think|> written into the
        system turn when the template does not). Blocking: media is fetched and decoded here, so
        callers run it off the event loop."""
        soft_tokens = soft_tokens or {}
        try:
            turns = [(_chat_role(i, m), media.parse_content(i, m.content)) for i, m in enumerate(messages)]
            try:
                extras = check_messages([
                    {"role": r, "content": m.content, "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id}
                    for (r, _), m in zip(turns, messages)
                ])  # fmt: skip
            except ToolError as e:
                raise ApiError(400, str(e), e.param, "invalid_value") from None
            refs = [p for _, content in turns for p in content if isinstance(p, MediaRef)]
            if refs:
                self._check_media(refs)
            processor = self.model.processor if refs else None
            loaded = iter([media.processor_part(ref, self.media, processor) for ref in refs])
            rendered = [{"role": r, "content": _processor_content(c, loaded)} for r, c in turns]
            chat = render_chat(rendered, extras, spec, self.tokenizer.chat_template)
            turns, kwargs = chat.messages, {**(template_kwargs or {}), **chat.kwargs}
            if kwargs.get("enable_thinking") and not template_thinks(self.tokenizer.chat_template):
                turns = self._think(turns)
            if processor is None:
                inputs = ModelInputs(self._render(self.tokenizer, turns, **kwargs))
            else:
                inputs = self._render(processor, turns, **kwargs, **soft_tokens)
            if chat.suffix:  # text only (calls, results, a call's opening): after the generation prompt
                inputs.input_ids = inputs.input_ids + self._encode_text(chat.suffix)
            return inputs
        except MediaError as e:
            raise media_error(e) from None

    def _think(self, turns: list[dict]) -> list[dict]:
        """Thinking switched on by dgemma for a template that does not read enable_thinking."""
        if self.tokenizer.token_to_id(THINK) is None:
            raise ApiError(400, "reasoning_effort / chat_template_kwargs.enable_thinking: this checkpoint cannot think "
                                f"(its chat template does not read enable_thinking and its tokenizer has no {THINK} token)",
                           "reasoning_effort", "unsupported_parameter")  # fmt: skip
        return think_in_system_turn(turns)

    def thinks(self, prompt: ModelInputs) -> bool:
        """Whether the prompt switches thinking on (<|think|>: the template wrote it, or a client did)."""
        think = self.tokenizer.token_to_id(THINK)
        return think is not None and think in prompt.input_ids

    def _encode_text(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=False)
        except Exception as e:  # lone surrogates
            raise ApiError(400, f"messages could not be tokenized: {e}", "messages", "invalid_value") from None

    def _check_media(self, refs: list[MediaRef]) -> None:
        """Refuse media the checkpoint or the limits cannot take, before fetching any of it."""
        if not self.model.supports_images:
            raise ApiError(400, f"{refs[0].param}: this model has no vision tower (or no processor config), so only "
                                f"text parts are accepted (got {refs[0].kind} parts)", refs[0].param, "invalid_media")  # fmt: skip
        if len(refs) > self.media.max_items:
            raise ApiError(400, f"messages: {len(refs)} images and videos in one request; this server takes at most "
                                f"{self.media.max_items} (--max-images-per-request)", "messages", "invalid_media")  # fmt: skip

    @staticmethod
    def _render(template_owner, rendered: list[dict], **kwargs):
        """`apply_chat_template` of the tokenizer (text: ids) or the processor (media: ModelInputs),
        its failures as 400s; MediaError passes through, to be tied to its part."""
        try:
            return template_owner.apply_chat_template(rendered, add_generation_prompt=True, **kwargs)
        except ChatTemplateError as e:
            raise ApiError(400, f"messages: {e}", "messages", "invalid_value") from None
        except MediaError:
            raise
        except Exception as e:  # text the tokenizer rejects (lone surrogates)
            raise ApiError(400, f"messages could not be tokenized: {e}", "messages", "invalid_value") from None

    def generation_config(self, params: _Params, prompt: ModelInputs, max_tokens: int | None, partial: bool = False):
        """The per-request GenerationConfig: checkpoint defaults, the client's knobs, and what fits
        the context (image soft tokens take positions like any prompt token). `partial`: blocks
        may commit fewer tokens than a canvas (a grammar), so the last canvas may start anywhere."""
        c, prompt_len = self.canvas, len(prompt.input_ids)
        room = self.context - prompt_len - c + 1 if partial else (self.context - prompt_len) // c * c
        if room < 1:
            images = f" ({prompt.num_image_tokens} of them image tokens; a smaller max_soft_tokens makes fewer)"
            raise ApiError(
                400,
                f"prompt is too long: {prompt_len} tokens{images if prompt.images else ''}; the context is "
                f"{self.context} positions per request and output comes in blocks of {c}, so a prompt may hold at "
                f"most {self.context - c} tokens",
                "prompt" if isinstance(params, CompletionParams) else "messages",
                "context_length_exceeded",
            )
        defaults = self.model.generation_config
        if max_tokens is None:
            max_tokens = min(defaults.max_new_tokens, room)
        elif max_tokens > room:
            raise ApiError(
                400,
                f"max_tokens={max_tokens} does not fit: the prompt has {prompt_len} tokens and the context is "
                f"{self.context} positions, with output in blocks of {c}; at most {room} tokens fit",
                "max_tokens",
                "context_length_exceeded",
            )
        why = self.engine_thread.engine.scheduler.refusal(prompt_len, max_tokens, partial)
        if why is not None:
            raise ApiError(400, why, "max_tokens", "context_length_exceeded")
        steps, limit = params.max_denoising_steps, self.budgets.max_denoising_steps
        if steps is not None and steps > limit:
            raise ApiError(400, f"max_denoising_steps={steps} is above this server's limit of {limit} steps per canvas "
                                "(--max-denoising-steps)", "max_denoising_steps", "invalid_value")  # fmt: skip
        if steps is None and defaults.max_denoising_steps > limit:
            steps = limit
        try:
            return defaults.with_overrides(
                max_new_tokens=max_tokens,
                max_denoising_steps=steps,
                entropy_bound=params.entropy_bound,
                t_min=params.t_min,
                t_max=params.t_max,
                stability_threshold=params.stability_threshold,
                confidence_threshold=params.confidence_threshold,
                eos_token_ids=() if params.ignore_eos else None,
            )
        except ConfigError as e:
            raise ApiError(400, str(e), None, "invalid_value") from None

    # ---------------------------------------------------------------- running
    def start(
        self, params: _Params, prompt: ModelInputs, max_tokens: int | None, tools: bool = False, grammar: Grammar | None = None,
        thinking: bool = False, first_canvas: FirstCanvas | None = None, deadline: float | None = None,
    ) -> list[Generation]:
        """Submit the request's `n` choices, each an engine request of its own (seed: the
        request's seed + its index; without one, random each) with its own grammar state; with
        `tools`, their text keeps the tool-call tokens (for the parser); with `grammar`, their
        output is enforced to match it; with `thinking`, the text keeps the channel markers
        (for the reasoning parser). The engine encodes the shared prompt once (its scheduler
        holds the later choices until the first has put the prompt's blocks in the prefix cache).
        Past `deadline` (Budgets.deadline) the choices end with finish_reason "timeout"."""
        stops = parse_stop(params.stop)
        config = self.generation_config(params, prompt, max_tokens, partial=grammar is not None)
        count = params.n or 1
        seeds = [params.seed + i for i in range(count)] if params.seed is not None else [
            random.SystemRandom().randrange(SEED_LIMIT) for _ in range(count)
        ]  # fmt: skip
        top = request_top_logprobs(params)
        extra = {} if top is None else {"top_logprobs": top}
        if not self.engine_thread.alive:
            raise ApiError(503, "the engine is not running", code="engine_stopped")
        decode = self.tool_decode if tools else self.tokenizer.decode
        if thinking:
            decode = keeping_channel(self.tokenizer, decode)
        gens: list[Generation] = []
        for seed in seeds:
            constraints = first_canvas if grammar is None else self.model.grammars.canvas(grammar, self.canvas)
            try:
                job = self.engine_thread.submit(prompt.input_ids, config, seed, drafts=params.stream_drafts,
                                                images=prompt.images, constraints=constraints, deadline=deadline, **extra)  # fmt: skip
            except QueueFull as e:
                for gen in gens:  # all the choices or none
                    gen.cancel()
                raise ApiError(429, str(e), None, "queue_full") from None
            text = TextStream(decode, stops, config.eos_token_ids, config.max_new_tokens)
            gens.append(Generation(self.engine_thread, job, text))
        return gens

    def first_canvas(self, params: "CompletionParams", grammar: Grammar | None) -> FirstCanvas | None:
        """The `canvas` extension field as the first canvas's fixed tokens (400 naming it)."""
        if params.canvas is None:
            return None
        if grammar is not None:
            raise ApiError(400, "canvas: fixed canvas tokens and structured output in one request are not supported",
                           "canvas", "unsupported_parameter")  # fmt: skip
        try:
            return fixed_canvas(params.canvas, self.canvas, self.model.config.vocab_size)
        except (InsertError, ValueError) as e:
            raise ApiError(400, str(e), getattr(e, "param", "canvas"), "invalid_value") from None

    async def insertion(self, request: Request, params: "CompletionParams", prompt: ModelInputs,
                        deadline: float | None = None) -> Response:  # fmt: skip
        """Insert mode: the text between the prompt and `suffix` (insert.py), whole or as one
        chunk. Its candidate spans are engine requests of their own: at most --max-active of
        them, all cancelled when the client goes away; past `deadline` the best candidate that
        finished wins, with finish_reason "timeout"."""
        for name, bad in (("n", (params.n or 1) > 1), ("logprobs", params.logprobs is not None),
                          ("stream_drafts", params.stream_drafts), ("canvas", params.canvas is not None),
                          ("stop", params.stop is not None), ("ignore_eos", params.ignore_eos)):  # fmt: skip
            if bad:
                raise ApiError(400, f"{name}: not supported with suffix (insert mode)", name, "unsupported_parameter")
        if params.suffix is None:
            raise ApiError(400, "span_length needs suffix (insert mode)", "span_length", "invalid_value")
        try:
            lengths = span_lengths(params.span_length, params.max_tokens, self.canvas, self.engine_thread.max_active)
            end_tokens = self.model.end_tokens()
        except (InsertError, ValueError) as e:
            raise ApiError(400, str(e), getattr(e, "param", "suffix"), "invalid_value") from None
        suffix = await asyncio.to_thread(self._encode_text, params.suffix)
        config = self.generation_config(params, prompt, self.canvas).with_overrides(eos_token_ids=())
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(SEED_LIMIT)
        if not self.engine_thread.alive:
            raise ApiError(503, "the engine is not running", code="engine_stopped")
        started = time.perf_counter()
        work = asyncio.ensure_future(insert(self.engine_thread, prompt.input_ids, suffix, lengths, config, seed,
                                            self.canvas, self.model.config.vocab_size, end_tokens, deadline))  # fmt: skip
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(request, work.cancel))
        try:
            found = await work
        except asyncio.CancelledError:
            if not watcher.done():
                raise  # this handler itself was cancelled (shutdown)
            with self.metrics.lock:
                self.metrics.requests.inc(finish_reason="cancelled")
            return Response(status_code=204)  # nobody reads it: the client has gone
        except QueueFull as e:
            raise ApiError(429, str(e), None, "queue_full") from None
        except EngineFailure as e:
            raise ApiError(500, f"generation failed: {e}", code="engine_error") from None
        finally:
            watcher.cancel()
        reason = "timeout" if found.timed_out else "stop"
        with self.metrics.lock:
            self.metrics.requests.inc(finish_reason=reason)
            self.metrics.request_seconds.observe(time.perf_counter() - started)
        text = self.tokenizer.decode(found.tokens)
        prompt_len = len(prompt.input_ids)
        usage = {"prompt_tokens": prompt_len, "completion_tokens": found.span_length,
                 "total_tokens": prompt_len + found.span_length, "decoder_passes": found.decoder_passes,
                 "span_length": found.span_length}  # fmt: skip
        envelope = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()), "model": self.name}
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

    def check_choices(self, params: _Params) -> None:
        """`n` within what one request may ask: MAX_CHOICES and --max-active (the choices
        denoise side by side); 400 naming `n` otherwise."""
        limit = min(MAX_CHOICES, self.engine_thread.max_active)
        if (params.n or 1) > limit:
            raise ApiError(400, f"n={params.n}: at most {limit} choices per request on this server ({MAX_CHOICES}, "
                                f"and at most --max-active={self.engine_thread.max_active})", "n", "invalid_value")  # fmt: skip

    def token_texts(self) -> TokenTexts:
        """Token texts and bytes for logprobs (built on first use from llguidance's reading of
        tokenizer.json, which may take a second: run it off the loop)."""
        with self._grammars_lock:
            if self._token_texts is None:
                try:
                    decode_bytes = self.model.grammars.tokenizer.decode_bytes
                    self._token_texts = TokenTexts(lambda t: decode_bytes([t]))
                except GrammarError:  # no EOS token for llguidance: the tokenizer's own decoding
                    self._token_texts = TokenTexts(lambda t: self.tokenizer.decode([t], skip_special_tokens=False).encode())
            return self._token_texts

    def usage(self, prompt: ModelInputs, gens: list[Generation]) -> dict:
        """The request's usage: its prompt counted once, the completion tokens and decoder passes
        of all its choices; cached tokens as the first choice found them (the fewest: the others
        also find the blocks it encoded)."""
        done, prompt_len = sum(g.completion_tokens for g in gens), len(prompt.input_ids)
        passes, cached = sum(g.decoder_passes for g in gens), min(g.cached_tokens for g in gens)
        per_forward = gens[0].tokens_per_forward if len(gens) == 1 else (
            sum(g.tokens_per_forward * g.decoder_passes for g in gens) / passes if passes else 0.0
        )  # fmt: skip
        return {
            "prompt_tokens": prompt_len,
            "completion_tokens": done,
            "total_tokens": prompt_len + done,
            "prompt_tokens_details": {"cached_tokens": cached, "image_tokens": prompt.num_image_tokens},
            "decoder_passes": passes,
            "tokens_per_forward": round(per_forward, 3),
        }

    def record(self, gen: Generation, reason: str) -> None:
        now = time.perf_counter()
        with self.metrics.lock:
            self.metrics.requests.inc(finish_reason=reason)
            if reason != "cancelled":
                self.metrics.request_seconds.observe(now - gen.job.submitted)
            if gen.first_block_at is not None:
                self.metrics.first_block_seconds.observe(gen.first_block_at - gen.job.submitted)


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], Any]) -> None:
    """Call `on_disconnect` (cancel the request's work: its slots are freed at the next step)
    when its client goes away, and say so in one log line."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            log.info("%s went away before its answer to %s was complete; cancelled its request", _client(request), request.url.path)
            on_disconnect()
            return


def _client(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "a client"


def _cancel_all(gens: list[Generation]) -> Callable[[], None]:
    def cancel() -> None:
        for gen in gens:
            gen.cancel()

    return cancel


class ClientGone(Exception):
    """The client disconnected before its request was read: nothing to answer (logged once)."""


async def _read_body(request: Request) -> bytearray:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body exceeds the limit of {MAX_BODY_BYTES} bytes")
    return body


async def read_json(request: Request, timeout: float) -> dict:
    """The request's JSON object body, read within `timeout` seconds (--read-timeout) and
    MAX_BODY_BYTES."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}")
    try:
        body = await asyncio.wait_for(_read_body(request), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {timeout:g} s (--read-timeout)") from None
    except ClientDisconnect:
        log.info("%s went away while sending its request body to %s", _client(request), request.url.path)
        raise ClientGone() from None
    if not body:
        raise ApiError(400, "request body is empty; send a JSON object")

    def no_constants(name: str):
        raise ValueError(f"{name} is not a valid JSON number")

    try:
        data = json.loads(bytes(body), parse_constant=no_constants)
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    except ValueError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, not {type(data).__name__}")
    return data


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=True).encode() + b"\n\n"


class _Choice:
    """One choice of a response: its generation, its own parsers (tool calls, reasoning: each
    choice is an answer of its own) and how many of its tokens' log probabilities were sent."""

    def __init__(self, index: int, gen: Generation, spec: ToolSpec | None, thinking: bool, offsets: TextOffsets | None):
        self.index, self.gen = index, gen
        self.parser = ToolCallParser(spec.names, spec.parallel, spec.prefill) if spec is not None and spec.active else None
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


class _Responder:
    """Shapes one request's updates as a completion or chat completion, whole or streamed.

    Each of the `n` choices (one Generation each) has its own parsers. With thinking (the prompt
    holds <|think|>), committed text first goes through a ReasoningParser: the thought channel
    comes out as `reasoning_content` (a message field; a delta field when streaming), the rest as
    content. With tools active, that content goes through a ToolCallParser: content as it is
    decided, each call as one `tool_calls` delta once it has closed and parsed, and finish_reason
    "tool_calls" when the answer holds calls (and stopped on its own, not at max_tokens). Streamed,
    the choices' chunks interleave as they come, each with its choice's index; with logprobs, a
    chunk carries those of the tokens committed since the choice's last chunk."""

    def __init__(self, service: Service, chat: bool, prompt: ModelInputs, gens: list[Generation], params: _Params,
                 spec: ToolSpec | None = None, thinking: bool = False):  # fmt: skip
        self.service, self.chat, self.prompt, self.gens, self.params = service, chat, prompt, gens, params
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.texts = service.token_texts() if request_top_logprobs(params) is not None else None
        self.pieces = service.token_texts() if params.stream_drafts else None  # draft frames' token texts
        offsets = (lambda g: TextOffsets(g.text.decode)) if self.texts is not None and not chat else (lambda g: None)
        self.choices = [_Choice(i, g, spec, thinking, offsets(g)) for i, g in enumerate(gens)]

    def _envelope(self, choices: list, object_: str) -> dict:
        body = {"id": self.id, "object": object_, "created": self.created, "model": self.service.name, "choices": choices}
        if getattr(self.params, "service_tier", None) is not None:
            body["service_tier"] = "default"  # the tier that served it, as OpenAI reports it: the only one
        return body

    def _logprobs(self, choice: _Choice, entries: list[TokenLogprob] | None) -> dict | None:
        if self.texts is None or entries is None:
            return None
        return chat_logprobs(entries, self.texts) if self.chat else completion_logprobs(entries, self.texts, choice.offsets)

    def _chunk(self, choice: _Choice, text: str | None, finish_reason: str | None = None, draft: dict | None = None,
               role: bool = False, tool_call: dict | None = None, reasoning: str | None = None,
               logprobs: list[TokenLogprob] | None = None) -> dict:  # fmt: skip
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

    async def _collect(self, choice: _Choice) -> dict:
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

    async def whole(self, request: Request) -> Response:
        loop = asyncio.get_running_loop()
        watcher = loop.create_task(_watch_disconnect(request, _cancel_all(self.gens)))
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

    async def _choice_chunks(self, choice: _Choice) -> AsyncIterator[dict]:
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
        position by position: token ids, their texts, accepted or re-noised, entropy."""
        draft = update.draft
        return {"block": update.block, "step": update.step, "text": update.text, "tokens": draft.canvas,
                "pieces": [self.pieces(t)[0] for t in draft.canvas], "accepted": draft.accepted,
                "entropy": draft.entropy}  # fmt: skip

    async def _pump(self, choice: _Choice, out: asyncio.Queue) -> None:
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
        watcher = loop.create_task(_watch_disconnect(request, _cancel_all(self.gens)))
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

    def _item(self, choice: _Choice, item: str | Thought | dict, logprobs: list[TokenLogprob] | None = None) -> dict:
        if isinstance(item, Thought):
            return self._chunk(choice, None, reasoning=item.text, logprobs=logprobs)
        if isinstance(item, str):
            return self._chunk(choice, item, logprobs=logprobs)
        return self._chunk(choice, None, tool_call=item, logprobs=logprobs)


# ------------------------------------------------------------------------------------ the app
class _CountResponses:
    """ASGI middleware: count responses by status code for /metrics."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                with self.metrics.lock:
                    self.metrics.http.inc(code=str(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(
    model,
    served_model_name: str = "dgemma",
    max_active: int = 8,
    max_queue: int = 64,
    max_context: int | None = None,
    options: EngineOptions | None = None,
    media_policy: MediaPolicy | None = None,
    ui: bool = True,
    access: Access | None = None,
    budgets: Budgets | None = None,
    limits: Limits | None = None,
    docs: bool = True,
) -> FastAPI:
    """The FastAPI app serving `model` (a `dgemma.Model`); its engine thread runs while the app is up.

    `max_context` caps prompt plus output per request (default: the model's
    max_position_embeddings; the KV cache's size decides what fits at once). `media_policy`:
    where images and video may come from and how large (default: data URLs only). `ui`: the
    playground page at `GET /` (playground/). `access`: API key, Host and Origin rules
    (access.py; default: no key, local names, no cross-site pages). `budgets`: denoising steps
    and seconds per request. `limits`: the listener's read timeout and connection cap (read by
    ServerThread and `dgemma serve` from `app.state.limits`). `docs`: `/openapi.json` and `/docs`."""
    if max_active < 1 or max_queue < 0:
        raise ValueError(f"--max-active must be >= 1 and --max-queue >= 0 (got {max_active}, {max_queue})")
    context = model.config.max_position_embeddings if max_context is None else max_context
    canvas = model.config.canvas_length
    if not canvas < context <= model.config.max_position_embeddings:
        raise ValueError(
            f"max_context must be between {canvas + 1} (one block of {canvas} plus a prompt token) and "
            f"{model.config.max_position_embeddings} (the model's max_position_embeddings); got {context}"
        )
    service = Service(model, served_model_name, max_active, max_queue, context, options, media_policy, budgets)
    access = access or Access()
    limits = limits or Limits()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.engine_thread.start()
        yield
        service.engine_thread.stop()
        service.compile_worker.close()
        service.media_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dgemma", version=__version__, description=API_DESCRIPTION, lifespan=lifespan,
                  docs_url="/docs" if docs else None, openapi_url="/openapi.json" if docs else None, redoc_url=None)  # fmt: skip
    app.state.service, app.state.limits = service, limits
    if access.cors:  # inside the guard: only allowed origins reach it
        app.add_middleware(CORSMiddleware, allow_origins=list(access.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])  # fmt: skip
    app.add_middleware(AccessGuard, access=access)
    app.add_middleware(_CountResponses, metrics=service.metrics)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, err: ClientGone) -> Response:
        return Response(status_code=400)  # nobody reads it

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> Response:
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> Response:
        text = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
        return error_response(ApiError(err.status_code, text.get(err.status_code, str(err.detail))))

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(ApiError(500, "internal server error", code="internal_error"))

    @app.get("/health")
    async def health() -> Response:
        if not service.engine_thread.alive:
            return json_response({"status": "engine stopped"}, 503)
        return json_response({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    gen = model.generation_config
    defaults = {k: getattr(gen, k) for k in ("max_denoising_steps", "entropy_bound", "t_min", "t_max")}

    def model_card() -> dict:  # OpenAI's fields, vLLM's max_model_len, and what the playground shows
        return {"id": service.name, "object": "model", "created": service.created, "owned_by": "dgemma",
                "max_model_len": service.context, "canvas_length": model.config.canvas_length,
                "vision": model.supports_images, "sampler_defaults": defaults}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str) -> Response:
        service.check_model(name)
        return json_response(model_card())

    if ui:
        add_playground(app)

    async def run(request: Request, chat: bool) -> Response:
        deadline = service.budgets.deadline()
        body = await read_json(request, limits.read_timeout)
        try:
            params = (ChatParams if chat else CompletionParams).model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        service.check_model(params.model)
        _unsupported(params)
        service.check_choices(params)
        # tokenizing a long prompt, fetching and decoding media take a while: off the event loop,
        # so streams keep flowing
        spec = request_tools(params) if chat else None
        service.check_prompt_size(params, spec)
        if chat:
            prompt = await service.off_loop(_has_media(params.messages), service.chat_prompt, params.messages,
                                            soft_token_budgets(params), spec, request_template_kwargs(params))  # fmt: skip
            max_tokens = params.max_completion_tokens or params.max_tokens
        else:
            prompt = ModelInputs(await service.off_loop(False, service.completion_prompt, params.prompt))
            max_tokens = params.max_tokens
        fmt = output_format(params, spec)
        if fmt is None and spec is not None and spec.choice in ("required", "function"):  # written on the compile thread
            fmt = await asyncio.wrap_future(service.compile_worker.submit(service.forced_call_format, spec))
        if not chat and (params.suffix is not None or params.span_length is not None):
            if fmt is not None:
                raise ApiError(400, f"{fmt.param}: not supported with suffix (insert mode)", fmt.param, "unsupported_parameter")
            return await service.insertion(request, params, prompt, deadline)
        grammar = None if fmt is None else await asyncio.wrap_future(service.compile_worker.submit(service.grammar, fmt))
        first_canvas = None if chat else service.first_canvas(params, grammar)
        thinking = chat and service.thinks(prompt)
        if request_top_logprobs(params) is not None or params.stream_drafts:
            await asyncio.to_thread(service.token_texts)  # built once (reads tokenizer.json): off the loop
        gens = service.start(params, prompt, max_tokens, tools=spec is not None and spec.active, grammar=grammar,
                             thinking=thinking, first_canvas=first_canvas, deadline=deadline)  # fmt: skip
        responder = _Responder(service, chat, prompt, gens, params, spec, thinking)
        if params.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(responder.stream(request), media_type="text/event-stream", headers=headers)
        return await responder.whole(request)

    @app.post("/v1/completions", openapi_extra=_body_schema("CompletionRequest"))
    async def completions(request: Request) -> Response:
        return await run(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        return await run(request, chat=True)

    app.openapi = lambda: _openapi(app, service.name)
    return app


API_DESCRIPTION = ("OpenAI-compatible completions and chat completions served by dgemma's block-diffusion engine; "
                   "fields and extensions: docs/server.md. With --api-key, send 'Authorization: Bearer KEY'.")  # fmt: skip
def _body_schema(name: str) -> dict:
    """The route's declared JSON body (the routes read raw JSON, so FastAPI cannot see it)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def _openapi(app: FastAPI, served_model_name: str) -> dict:
    """The app's OpenAPI description with the request bodies' schemas from their pydantic models
    (`model`: the one model this server serves)."""
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, model in (("CompletionRequest", CompletionParams), ("ChatCompletionRequest", ChatParams)):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            body["properties"]["model"] = {"type": "string", "enum": [served_model_name], "title": "Model"}
            components[name] = body
        app.openapi_schema = schema
    return app.openapi_schema


# ------------------------------------------------------------------------------------ running it
def add_cli(sub: argparse._SubParsersAction) -> None:
    """Register `dgemma serve`."""
    from ..cli import add_chat_template_flag, add_engine_flags, add_model_flags, add_threads_flag

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_flags(p)
    add_threads_flag(p)
    add_chat_template_flag(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    p.add_argument("--max-active", type=int, default=8, help="requests admitted at once, each denoising its canvas (default: 8)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for admission; more get HTTP 429 (default: 64)")
    p.add_argument("--max-context", type=int, default=None,
                   help="prompt plus output positions per request (default: the model's max_position_embeddings)")  # fmt: skip
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the checkpoint directory name)")
    add_engine_flags(p)
    add_media_flags(p)
    add_safety_flags(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="what the server logs: uvicorn's lines and dgemma's (refusals, clients that left) (default: info)")  # fmt: skip
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--no-ui", dest="ui", action="store_false", help="no playground page at GET / (the API only)")
    p.add_argument("--no-docs", dest="docs", action="store_false", help="no /openapi.json and /docs (the API's description)")
    p.set_defaults(func=cmd_serve)


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def add_safety_flags(p: argparse.ArgumentParser) -> None:
    """Who may use the server and what one request may cost (see docs/security.md)."""
    b, limits = Budgets(), Limits()
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every API route and /metrics (default: $DGEMMA_API_KEY; "
                        "none: no key)")  # fmt: skip
    p.add_argument("--allowed-hosts", type=_names, default=(),
                   help="more Host names to answer to, comma-separated, e.g. a proxy's name ('*': any); by default only "
                        "local names and IP literals (localhost, this machine's name, *.local, private addresses)")  # fmt: skip
    p.add_argument("--allowed-origins", type=_names, default=(),
                   help="origins whose web pages may call the API (CORS), comma-separated, e.g. http://localhost:3000 "
                        "(default: none; the playground page is served by the server itself)")  # fmt: skip
    p.add_argument("--max-denoising-steps", type=int, default=b.max_denoising_steps,
                   help=f"denoising steps per canvas a request may ask for (default: {b.max_denoising_steps})")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=b.request_timeout,
                   help=f"seconds a request may take from arrival to its end; then it ends with finish_reason 'timeout' "
                        f"(default: {b.request_timeout:g}; 0: no limit)")  # fmt: skip
    p.add_argument("--read-timeout", type=float, default=limits.read_timeout,
                   help=f"seconds a client has to send a request's headers, and again its body (default: {limits.read_timeout:g})")  # fmt: skip
    p.add_argument("--limit-concurrency", type=int, default=limits.limit_concurrency,
                   help=f"open connections at once; more get HTTP 503 (default: {limits.limit_concurrency})")  # fmt: skip


def safety(args) -> tuple[Access, Budgets, Limits]:
    key = args.api_key if args.api_key is not None else (os.environ.get("DGEMMA_API_KEY") or None)
    access = Access(api_key=key, allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
                    bind_host=args.host)  # fmt: skip
    budgets = Budgets(args.max_denoising_steps, args.request_timeout or None)
    return access, budgets, Limits(args.read_timeout, args.limit_concurrency)


def add_media_flags(p: argparse.ArgumentParser) -> None:
    """Where chat images and video may come from, and how much of them (see docs/media.md)."""
    from ..cli import parse_size

    d = MediaPolicy()
    p.add_argument("--allowed-media-dir", type=Path, default=None,
                   help="serve file:// image/video URLs from below this directory (default: file URLs are off)")  # fmt: skip
    p.add_argument("--allow-remote-media", action="store_true",
                   help="fetch http(s):// image/video URLs, from public addresses only (not loopback, private, "
                        "link-local or other internal ones; see --allowed-media-domains)")  # fmt: skip
    p.add_argument("--allowed-media-domains", type=_names, default=(), metavar="HOST,...",
                   help="with --allow-remote-media: hosts whose URLs are fetched whatever their address, e.g. an "
                        "internal media server; comma-separated, exact names, '*.example.com' for subdomains "
                        "(default: none)")  # fmt: skip
    p.add_argument("--max-media-bytes", type=parse_size, default=d.max_bytes,
                   help=f"bytes per image or video, e.g. 20MB (default: {d.max_bytes})")  # fmt: skip
    p.add_argument("--media-timeout", type=float, default=d.timeout,
                   help=f"seconds one remote fetch may take (default: {d.timeout:g})")  # fmt: skip
    p.add_argument("--max-images-per-request", type=int, default=d.max_items,
                   help=f"images plus videos in one request; a video counts once (default: {d.max_items})")  # fmt: skip


def media_policy(args) -> MediaPolicy:
    return MediaPolicy(
        allowed_dir=args.allowed_media_dir, allow_remote=args.allow_remote_media,
        allowed_domains=args.allowed_media_domains, max_bytes=args.max_media_bytes, timeout=args.media_timeout,
        max_items=args.max_images_per_request,
    )  # fmt: skip


def media_summary(model, policy: MediaPolicy) -> str:
    """What the startup line says of media: off without a vision tower, else where it may come from."""
    if not model.supports_images:
        return "images off (no vision tower)"
    sources = ["data URLs"] + ([f"files below {policy.allowed_dir}"] if policy.allowed_dir else [])
    if policy.allow_remote:
        named = f" and {', '.join(policy.allowed_domains)}" if policy.allowed_domains else ""
        sources.append(f"http(s) URLs of public addresses{named}")
    return f"images and video from {', '.join(sources)}"


def check_device_memory(args, device) -> None:
    """Refuse, before loading, a plan that cannot fit the GPU `device` (engine/memory_plan.py),
    saying what would; the plan is in the dtype `dgemma.load` will choose (`resolve_dtype`)."""
    import torch

    from ..api import default_model_dir, resolve_dtype
    from ..cli import CliError
    from ..config import load_model_config
    from ..engine.memory_plan import check_fits, plan_memory

    if not torch.cuda.is_available():
        raise CliError(f"--device {args.device}: torch sees no CUDA device")
    path = args.model or default_model_dir()
    config = load_model_config(path)
    dtype = resolve_dtype(args.dtype, device, path)
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    plan = plan_memory(config, dtype, getattr(args, "quantization", None), getattr(args, "group_size", None),
                       args.max_active, args.max_context, args.kv_cache_memory, args.prefill_chunk)  # fmt: skip
    try:
        check_fits(plan, total, config, dtype, getattr(args, "group_size", None))
    except ValueError as e:
        raise CliError(str(e)) from None


def cmd_serve(args) -> int:
    import uvicorn

    from ..api import resolve_device
    from ..cli import CliError, apply_chat_template_file, apply_threads, engine_options, load_model, read_chat_template

    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535], got {args.port}")
    logging.getLogger("dgemma").setLevel(args.log_level.upper())  # refusals, clients that left, timeouts
    try:  # the operator's limits, checked before minutes of loading
        policy = media_policy(args)
        access, budgets, limits = safety(args)
    except ValueError as e:
        raise CliError(str(e)) from None
    apply_threads(args)
    template = read_chat_template(args)
    device = resolve_device(args.device)  # a bad --device or a missing GPU: one line, before loading
    if device.type == "cuda":
        check_device_memory(args, device)
    model = load_model(args)
    apply_chat_template_file(model, args, template)
    name = args.served_model_name or (model.path.name if model.path else "dgemma")
    try:
        app = create_app(model, name, args.max_active, args.max_queue, args.max_context, engine_options(args), policy,
                         args.ui, access, budgets, limits, args.docs)  # fmt: skip
        sock = bind(args.host, args.port)
    except (ValueError, OSError) as e:
        raise CliError(str(e)) from None
    except (RuntimeError, MemoryError) as e:  # the KV pools do not fit in memory
        first = str(e).splitlines()[-1] if str(e) else type(e).__name__
        raise CliError(f"cannot allocate the engine's KV cache ({args.kv_cache_memory or 'default size'}): {first}") from None
    host, port = sock.getsockname()[:2]
    engine = app.state.service.engine_thread.engine
    usage = engine.kv_usage()
    kv = ", ".join(f"{k} {u['total']}" for k, u in usage.items())
    print(
        f"dgemma: serving '{name}' on http://{host}:{port} (max-active {args.max_active}, max-queue {args.max_queue}, "
        f"context {app.state.service.context}, KV blocks of {engine.options.block_size}: {kv}; "
        f"prefix cache {'on' if engine.options.prefix_cache else 'off'}; {media_summary(model, policy)}; device {model.device})"
        + (f"; playground at http://{host}:{port}/" if args.ui else "")
        + f"; API key {'required' if access.api_key else 'off'}",
        flush=True,
    )
    if access.api_key is None and not _loopback(args.host):
        print(f"dgemma: warning: listening on {args.host} without --api-key: anyone who can reach this address can use "
              "the model (docs/security.md)", flush=True)  # fmt: skip
    uvicorn.Server(uvicorn_config(app, limits, args.log_level, args.access_log)).run(sockets=[sock])
    return 0


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"

"""ollama's request bodies (`/api/chat`, `/api/generate`, `/api/show`) and their translation into the
OpenAI ones the server already checks and runs (openai/protocol.py's ChatParams / CompletionParams).

Nothing is validated twice: these models check only what is ollama's own (its field types, its
`options` map, base64 images, tool calls with object arguments, `think`, `raw`, `suffix`), and the
translation hands everything else to the OpenAI pipeline (pipeline.py). The refusals that come
back from it name OpenAI fields; `OllamaNames` renames them after the ollama field a client sent
(`max_tokens` -> `options.num_predict`, `response_format` -> `format`, ...). Unknown fields and
unknown options are ignored, as ollama ignores them. docs/server.md, "ollama-compatible API".
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...knobs import KNOBS
from ..errors import ApiError, excerpt, validation_error
from ..openai.protocol import ChatParams, CompletionParams, RequestParams

THINK_LEVELS = ("low", "medium", "high", "max")
IMAGE_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "image/png",
    b"\xff\xd8\xff": "image/jpeg",
    b"GIF87a": "image/gif",
    b"GIF89a": "image/gif",
}


# ------------------------------------------------------------------------------------ request bodies
class _Body(BaseModel):
    """ollama's bodies: JSON types checked strictly, unknown fields ignored (as ollama's server does)."""

    model_config = ConfigDict(strict=True, extra="ignore")


class ToolCallFunction(_Body):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)  # an object (ollama); a JSON string is taken too
    index: int | None = None


class ToolCall(_Body):
    id: str | None = None
    function: ToolCallFunction


class Message(_Body):
    role: str
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    thinking: str | None = None  # an earlier answer's thought: accepted, not rendered (as on the OpenAI route)


class _Generating(_Body):
    model: str = Field(min_length=1)
    stream: bool | None = None  # ollama's default: true
    format: Any = None  # "json", a JSON schema object, or ""/null for text
    options: dict[str, Any] | None = None
    keep_alive: int | float | str | None = None  # accepted; the model stays loaded
    think: bool | Literal["low", "medium", "high", "max"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncate: bool | None = None  # accepted: a prompt that does not fit is refused, never cut
    shift: bool | None = None  # accepted: the context is never shifted


class ChatRequest(_Generating):
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generating):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None


class ShowRequest(_Body):
    model: str | None = None
    name: str | None = None  # older clients send the name here
    verbose: bool | None = None


def parse_body(kind: type[_Body], body: dict) -> Any:
    """An ollama body checked against its model (400 naming the field)."""
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


# ------------------------------------------------------------------------------------ options
INT, FLOAT, BOOL, STRINGS = "integer", "float", "boolean", "array of strings"
# ollama's own options and their JSON types (api/types.go: Options and Runner); num_predict, seed and stop
# keep ollama's meaning, the others are type-checked and ignored
OLLAMA_OPTIONS = {
    **dict.fromkeys(
        (
            "num_keep",
            "seed",
            "num_predict",
            "top_k",
            "repeat_last_n",
            "mirostat",
            "num_ctx",
            "num_batch",
            "num_gpu",
            "main_gpu",
            "num_thread",
            "draft_num_predict",
            "num_gqa",
        ),
        INT,
    ),
    **dict.fromkeys(
        (
            "top_p",
            "min_p",
            "typical_p",
            "temperature",
            "repeat_penalty",
            "presence_penalty",
            "frequency_penalty",
            "tfs_z",
            "mirostat_tau",
            "mirostat_eta",
            "rope_frequency_base",
            "rope_frequency_scale",
        ),
        FLOAT,
    ),
    **dict.fromkeys(
        (
            "numa",
            "low_vram",
            "f16_kv",
            "logits_all",
            "vocab_only",
            "use_mmap",
            "use_mlock",
            "embedding_only",
            "penalize_newline",
        ),
        BOOL,
    ),
    "stop": STRINGS,
}
# dgemma's sampler knobs (knobs.py's table; docs/server.md, "Request fields"): option -> the OpenAI request
# field it sets (the same name)
KNOB_OPTIONS = {k.ollama: k.openai for k in KNOBS if k.ollama and k.ollama not in OLLAMA_OPTIONS}
JSON_TYPES = {int: INT, float: FLOAT, bool: BOOL}
OPTION_TYPES = {
    **OLLAMA_OPTIONS,
    **{k.ollama: JSON_TYPES[k.kind] for k in KNOBS if k.ollama in KNOB_OPTIONS},
    "max_soft_tokens": INT,  # a chat's soft tokens per image
}


def _typed(name: str, value: Any, kind: str) -> Any:
    """An option's value if it has its JSON type (integers as ollama reads them: whole numbers,
    also written 5.0); else a 400 in ollama's words."""
    ok = {
        INT: isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer(),
        FLOAT: isinstance(value, (int, float)) and not isinstance(value, bool),
        BOOL: isinstance(value, bool),
        STRINGS: isinstance(value, list) and all(isinstance(s, str) for s in value),
    }[kind]
    if not ok:
        message = f'option "{name}" must be of type {kind} (got {excerpt(value)})'
        raise ApiError(400, message, f"options.{name}", "invalid_value")
    return int(value) if kind == INT else value


def sampler_fields(options: dict[str, Any] | None, chat: bool) -> dict[str, Any]:
    """The OpenAI request fields an ollama `options` map sets: num_predict -> max_tokens (0 or
    less: the default, as far as the context allows), seed (negative: random), stop, dgemma's
    sampler knobs by name, and for a chat max_soft_tokens (per image). Every known option's type
    is checked; the others (temperature, top_p, top_k, penalties, num_ctx, hardware settings, ...)
    are accepted and ignored, unknown ones too."""
    out: dict[str, Any] = {}
    for name, value in (options or {}).items():
        kind = OPTION_TYPES.get(name)
        if kind is None or value is None:
            continue
        value = _typed(name, value, kind)
        if name == "num_predict" and value > 0:
            out["max_tokens"] = value
        elif name == "seed" and value >= 0:
            out["seed"] = value
        elif name == "stop" and value:
            out["stop"] = value
        elif name in KNOB_OPTIONS:
            out[KNOB_OPTIONS[name]] = value
        elif name == "max_soft_tokens" and chat:
            out[name] = value
    return out


# ------------------------------------------------------------------------------------ renaming refusals
@dataclass
class OllamaNames:
    """How an OpenAI field of the translated request is named in the ollama body it came from, so a
    refusal from the shared pipeline names what the client sent. Rules are regexes on the field
    path, tried in order; each renames the `param` and its mentions in the message."""

    rules: list[tuple[str, str]] = field(default_factory=list)

    COMMON = [
        (r"max_(?:completion_)?tokens", "options.num_predict"),
        (r"seed", "options.seed"),
        (r"stop", "options.stop"),
        *((re.escape(sent), f"options.{option}") for option, sent in KNOB_OPTIONS.items()),
        ("max_soft_tokens", "options.max_soft_tokens"),
        (r"response_format(?:\.json_schema\.schema)?|guided_json", "format"),
        (r"reasoning_effort|chat_template_kwargs\.enable_thinking", "think"),
    ]

    def add(self, pattern: str, name: str) -> None:
        self.rules.append((pattern, name))

    @contextmanager
    def renaming(self) -> Iterator[None]:
        """Within it, an ApiError leaves renamed (`rename`): the shared pipeline's refusals name
        what the ollama client sent."""
        try:
            yield
        except ApiError as e:
            raise self.rename(e) from None

    def rename(self, err: ApiError) -> ApiError:
        """`err` naming the ollama field: the first rule that matches the start of its `param`
        renames the param and that field's mentions in the message."""
        if not err.param:
            return err
        for pattern, name in self.rules + self.COMMON:
            rule = re.compile(rf"(?<![\w.\[])(?:{pattern})(?![\w])")
            if rule.match(err.param):
                message = rule.sub(name, err.message).replace(f"{name} / {name}", name)
                return ApiError(err.status, message, rule.sub(name, err.param, count=1), err.code, err.kind)
        return err


# ------------------------------------------------------------------------------------ translation
def _image_url(data: str, param: str) -> str:
    """A base64 image (ollama sends bare base64; a data: URL is taken as it is) as a data URL
    for the media pipeline, its type read from its first bytes; a 400 naming `param` when it is
    not base64 or not an image the processor opens."""
    if data.startswith("data:"):
        return data
    packed = "".join(data.split())
    try:
        head = base64.b64decode(packed, validate=True)[:16]
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"{param}: not valid base64 ({e})", param, "invalid_media") from None
    mime = next((m for sig, m in IMAGE_SIGNATURES.items() if head.startswith(sig)), None)
    if mime is None and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        mime = "image/webp"
    if mime is None:
        raise ApiError(
            400,
            f"{param}: not a PNG, JPEG, WebP or GIF image (got {len(packed)} base64 characters "
            f"starting {excerpt(packed[:12])})",
            param,
            "invalid_media",
        )
    return f"data:{mime};base64,{packed}"


def _content(text: str | None, images: list[str] | None, where: str, names: OllamaNames, openai_param: str) -> Any:
    """A message's text and images as OpenAI content: a string, or parts (the images first, then
    the text, as ollama's Gemma templates place them). `where`: how the body names the message
    ("messages[i]." or "" for generate's own `images`); `openai_param`: how the pipeline will."""
    if not images:
        return text or ""
    parts: list[dict] = []
    for j, data in enumerate(images):
        parts.append({"type": "image_url", "image_url": {"url": _image_url(data, f"{where}images[{j}]")}})
        names.add(re.escape(f"{openai_param}.content[{j}]"), f"{where}images[{j}]")
    if text:
        parts.append({"type": "text", "text": text})
    return parts


def _calls(i: int, calls: list[ToolCall]) -> list[dict]:
    """An assistant message's ollama tool calls as OpenAI ones (arguments as JSON text; ids made
    up where the client sent none: tool results find their call by tool_name or by place)."""
    out = []
    for j, call in enumerate(calls):
        args = call.function.arguments
        out.append(
            {
                "id": call.id or f"call_{i}_{j}",
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    return out


def chat_messages(messages: list[Message], names: OllamaNames) -> list[dict]:
    """ollama messages as OpenAI ones: images as image parts, tool calls with ids, and each tool
    result tied to the call it answers (its tool_call_id; else the first unanswered call of the
    assistant message before it with its tool_name; else the next unanswered one)."""
    out: list[dict] = []
    open_calls: list[dict] = []  # the last assistant message's calls not answered yet
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        entry: dict[str, Any] = {"role": m.role, "content": _content(m.content, m.images, f"{p}.", names, p)}
        if m.role == "assistant":
            calls = _calls(i, m.tool_calls or [])
            if calls:
                entry["tool_calls"] = calls
            if m.thinking is not None:
                entry["reasoning_content"] = m.thinking
            open_calls = list(calls)
        elif m.role == "tool":
            entry["tool_call_id"] = _answered_call(i, m, open_calls)
        else:
            open_calls = []
        out.append(entry)
    return out


def _answered_call(i: int, m: Message, open_calls: list[dict]) -> str:
    if m.tool_call_id is not None:
        match = [c for c in open_calls if c["id"] == m.tool_call_id]
        if match:
            open_calls.remove(match[0])
        return m.tool_call_id  # an unknown id: the tool checks name it
    match = [c for c in open_calls if m.tool_name in (None, c["function"]["name"])]
    if not match:
        why = f"no call of '{m.tool_name}' is" if m.tool_name and open_calls else "no tool call is"
        raise ApiError(
            400,
            f"messages[{i}] (role 'tool'): {why} waiting for a result; a tool message follows the "
            "assistant message with the tool_calls it answers",
            f"messages[{i}]",
            "invalid_value",
        )
    open_calls.remove(match[0])
    return match[0]["id"]


def _tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """ollama's tools are OpenAI's function tools (its clients may leave out `type`)."""
    if tools is None:
        return None
    return [{"type": "function", **t} if isinstance(t, dict) and "type" not in t else t for t in tools]


def _format(fmt: Any) -> dict[str, Any]:
    """ollama's `format`: "json" (any JSON object) or a JSON schema, enforced by the grammar."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"guided_json": fmt}
    message = f'format must be "json" or a JSON schema object (got {excerpt(fmt)})'
    raise ApiError(400, message, "format", "invalid_value")


def _common(req: _Generating, served: str, chat: bool) -> dict[str, Any]:
    return {"model": served, **sampler_fields(req.options, chat), **_format(req.format)}


def _checked(kind: type[RequestParams], fields: dict[str, Any]) -> RequestParams:
    try:
        return kind.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e) from None


def _think(think: bool | str | None) -> dict[str, Any]:
    return {} if think is None else {"chat_template_kwargs": {"enable_thinking": think is not False}}


def _logprobs(req: _Generating, chat: bool) -> dict[str, Any]:
    if not req.logprobs:
        return {}
    return {"logprobs": True, "top_logprobs": req.top_logprobs or 0} if chat else {"logprobs": req.top_logprobs or 0}


@dataclass(frozen=True)
class Translated:
    """An ollama body translated: the OpenAI request, whether it is a chat (the prompt through the
    chat template), and, in insert mode (/api/generate's `suffix`), the stop strings to cut the
    span at."""

    params: RequestParams
    chat: bool
    insert_stops: list[str] = field(default_factory=list)


def chat_params(req: ChatRequest, served: str, names: OllamaNames) -> Translated:
    """An /api/chat body as the OpenAI chat request it asks for (`served`: the served name)."""
    fields = {
        **_common(req, served, True),
        "messages": chat_messages(req.messages or [], names),
        "tools": _tools(req.tools),
        **_think(req.think),
        **_logprobs(req, True),
    }
    return Translated(_checked(ChatParams, fields), chat=True)


def generate_params(req: GenerateRequest, served: str, names: OllamaNames) -> Translated:
    """An /api/generate body as the OpenAI request it asks for: with `suffix`, an insert-mode
    completion (the text between prompt and suffix; its stop strings cut the span afterwards);
    with `raw`, a completion of the prompt as it is; else a chat of one user turn (with `system`
    before it), as ollama's template would render it."""
    if req.context:
        raise ApiError(
            400,
            "context: not supported (dgemma keeps no conversation state); send the conversation with "
            "/api/chat, or the whole prompt",
            "context",
            "unsupported_parameter",
        )
    completion = bool(req.suffix or req.raw)
    fields = _common(req, served, chat=not completion)
    if completion:
        for name in [n for n, asked in (("images", req.images), ("think", req.think)) if asked]:
            why = "needs the chat template: send it without raw and suffix"
            raise ApiError(400, f"{name}: {why}", name, "unsupported_parameter")
        fields["prompt"] = req.prompt or ""
        if not req.suffix:
            return Translated(_checked(CompletionParams, {**fields, **_logprobs(req, False)}), chat=False)
        stops = fields.pop("stop", [])
        params = _checked(CompletionParams, {**fields, "suffix": req.suffix})
        return Translated(params, chat=False, insert_stops=stops)
    if req.template:
        raise ApiError(
            400,
            "template: ollama's Go templates are not supported; the checkpoint's chat template renders "
            "the prompt (or send raw: true with a prompt you formatted)",
            "template",
            "unsupported_parameter",
        )
    messages = [{"role": "system", "content": req.system}] if req.system else []
    user = f"messages[{len(messages)}]"
    messages.append({"role": "user", "content": _content(req.prompt, req.images, "", names, user)})
    names.add(r"messages(?:\[\d+\](?:\.content)?)?", "prompt")  # after the images' rules: they match first
    params = _checked(ChatParams, {**fields, "messages": messages, **_think(req.think), **_logprobs(req, True)})
    return Translated(params, chat=True)


def is_load_request(req: ChatRequest | GenerateRequest) -> bool:
    """A request that asks for nothing but the model to be loaded (or unloaded): ollama answers it
    at once with done_reason "load" ("unload" with keep_alive 0)."""
    if isinstance(req, ChatRequest):
        return not req.messages
    return not req.prompt and not req.images and not req.suffix and not req.system


def unloads(req: ChatRequest | GenerateRequest) -> bool:
    return req.keep_alive in (0, "0", "0s", "0m")

"""What a request to `/v1/completions` and `/v1/chat/completions` may hold, and what one may cost.

The request bodies are pydantic models, strict (a field of the wrong type or one nobody knows is a
400 naming it); the checks after them refuse, by name, what parses but asks for more than the
engine has (token penalties, audio, ...) and turn the fields that other modules read (stop, tools,
structured output, template variables, soft-token budgets) into checked values. Every refusal is
an `ApiError` naming its field (errors.py). The fields: docs/server.md.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...engine.request import SEED_MAX
from ...inputs.model_inputs import MediaError
from ...knobs import KNOBS, knob
from ..errors import ApiError, excerpt
from ..media.policy import check_soft_tokens
from ..structured.formats import GUIDED_FIELDS, OutputFormat, StructuredError, request_format
from ..tools.specs import ToolError, ToolSpec, tool_spec

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256
MAX_CHOICES_PER_REQUEST = 16  # n per request (and at most --max-active)


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
            raise ValueError(
                f"--request-timeout must be a positive number of seconds, or 0 for none (got {self.request_timeout})"
            )

    def deadline(self) -> float | None:
        """The time.monotonic() value a request arriving now must end by."""
        return None if self.request_timeout is None else time.monotonic() + self.request_timeout


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
    # accepted, not rendered (Gemma 4's template drops earlier thoughts); see refuse_unsupported
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    function_call: Any = None
    audio: Any = None


def _num(lo: float | None = None, hi: float | None = None, gt: float | None = None) -> Any:
    return Field(None, ge=lo, le=hi, gt=gt, allow_inf_nan=False)


def _knob(name: str) -> Any:
    """The request field of the GenerationConfig field `name`: null (the server's default) or a value
    within knobs.py's bounds (numbers finite)."""
    k = knob(name)
    return _num(k.lo, k.hi, k.above) if k.kind is float else Field(None, ge=k.lo, le=k.hi, gt=k.above)


class RequestParams(_Strict):
    """Fields shared by both endpoints: OpenAI ones, then the diffusion knobs (extra body fields)."""

    model: str
    max_tokens: int | None = _knob("max_new_tokens")
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
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
    # dgemma extensions: the sampler's knobs (knobs.py's table: their bounds, and the fields they set)
    max_denoising_steps: int | None = _knob("max_denoising_steps")
    entropy_bound: float | None = _knob("entropy_bound")
    t_min: float | None = _knob("t_min")
    t_max: float | None = _knob("t_max")
    stability_threshold: int | None = _knob("stability_threshold")
    confidence_threshold: float | None = _knob("confidence_threshold")
    ignore_eos: bool = False
    stream_drafts: bool = False
    # turbo denoising (engine/turbo.py): null takes the server's default (`dgemma serve --turbo`)
    turbo: bool | None = None
    turbo_freeze_passes: int | None = _knob("turbo_freeze_passes")
    turbo_freeze_entropy: float | None = _knob("turbo_freeze_entropy")
    turbo_refresh_every: int | None = _knob("turbo_refresh_every")
    turbo_dormant_entropy: float | None = _knob("turbo_dormant_entropy")
    # structured output (structured/formats.py): OpenAI's response_format, vLLM's guided_* fields
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionParams(RequestParams):
    prompt: Any
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None  # insert mode (insert.py)
    # dgemma extensions (insert.py): the span's length in tokens with `suffix`; tokens to fix in the first canvas
    span_length: Any = None
    canvas: Any = None


class ChatParams(RequestParams):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_completion_tokens: int | None = _knob("max_new_tokens")
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


# ------------------------------------------------------------------------------------ refusals and checked fields
def refuse_unsupported(params: RequestParams) -> None:
    """Refuse, by name, features the engine does not have, when a client asks for more than the default."""
    checks = [
        ("presence_penalty", bool(params.presence_penalty), "token penalties are not supported; omit it or send 0"),
        ("frequency_penalty", bool(params.frequency_penalty), "token penalties are not supported; omit it or send 0"),
        ("logit_bias", bool(params.logit_bias), "logit_bias is not supported"),
        (
            "top_logprobs",
            getattr(params, "top_logprobs", None) is not None and not getattr(params, "logprobs", None),
            "top_logprobs needs logprobs: true",
        ),
        ("echo", bool(getattr(params, "echo", None)), "echo is not supported"),
        ("best_of", getattr(params, "best_of", None) not in (None, 1), "best_of is not supported"),
        (
            "stream_options",
            params.stream_options is not None and not params.stream,
            "stream_options needs stream: true",
        ),
        ("stream_drafts", params.stream_drafts and not params.stream, "stream_drafts needs stream: true"),
    ]
    checks += _client_checks(params)
    for name, bad, why in checks:
        if bad:
            raise ApiError(400, f"{name}: {why}", name, "unsupported_parameter")


def sampler_overrides(params: RequestParams) -> dict[str, Any]:
    """The GenerationConfig fields the request's knob fields set, by knobs.py's table (None where it sent
    none: the server's default holds). The service fits max_new_tokens to the context and
    max_denoising_steps to its budget over these."""
    return {k.name: k.config_value(getattr(params, k.openai)) for k in KNOBS if k.openai}


def request_top_logprobs(params: RequestParams) -> int | None:
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


def _client_checks(params: RequestParams) -> list[tuple[str, bool, str]]:
    """The fields other clients send (vLLM's sampling extras, the openai SDK's newer fields) that
    ask for what dgemma cannot do: (field, refused, why), for `refuse_unsupported`."""
    checks = [
        (
            "top_k",
            params.top_k not in (None, -1, 0),
            "top-k truncation is not supported; omit it or send -1 (all tokens)",
        ),
        ("min_p", bool(params.min_p), "min-p truncation is not supported; omit it or send 0"),
        (
            "repetition_penalty",
            params.repetition_penalty not in (None, 1),
            "repetition penalties are not supported; omit it or send 1",
        ),
    ]
    if not isinstance(params, ChatParams):
        return checks
    checks += [(name, getattr(params, name) is not None, why) for name, why in REFUSED_FIELDS.items()]
    long = next(((k, v) for k, v in (params.metadata or {}).items() if len(k) > 64 or len(v) > 512), None)
    checks += [
        (
            "modalities",
            any(m != "text" for m in params.modalities or []),
            f"only text output is supported: send ['text'] (got {excerpt(params.modalities)})",
        ),
        ("metadata", long is not None, f"keys are at most 64 characters and values at most 512 (got {excerpt(long)})"),
    ]
    for i, m in enumerate(params.messages):
        p = f"messages[{i}]"
        checks += [
            (
                f"{p}.function_call",
                m.function_call is not None,
                f"function_call is {DEPRECATED}; send tool_calls instead",
            ),
            (f"{p}.audio", m.audio is not None, "audio is not supported"),
        ]
        for name in ("reasoning_content", "reasoning", "refusal"):
            checks += [
                (
                    f"{p}.{name}",
                    getattr(m, name) is not None and m.role != "assistant",
                    "only assistant messages carry it",
                )
            ]
    return checks


def parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(
            400, f"stop must be a string or a list of strings (got {excerpt(stop)})", "stop", "invalid_value"
        )
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(
            400, f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop", "invalid_value"
        )
    if any(not s or len(s) > MAX_STOP_LENGTH for s in stops):
        raise ApiError(400, f"stop strings must be 1 to {MAX_STOP_LENGTH} characters long", "stop", "invalid_value")
    return stops


def soft_token_budgets(params: ChatParams) -> dict:
    """The request's soft-token budgets per image and per video frame, checked (400 naming the field)."""
    out = {}
    for name in ("max_soft_tokens", "video_max_soft_tokens"):
        try:
            value = check_soft_tokens(getattr(params, name), name)
        except MediaError as e:
            raise ApiError(400, str(e), name, "invalid_value") from None
        if value is not None:
            out[name] = value
    return out


def request_tools(params: ChatParams) -> ToolSpec:
    """The request's tools, tool_choice and parallel_tool_calls, checked (400 naming the field)."""
    try:
        return tool_spec(params.tools, params.tool_choice, params.parallel_tool_calls)
    except ToolError as e:
        raise ApiError(400, str(e), e.param, "invalid_value") from None


def output_format(params: RequestParams, spec: ToolSpec | None) -> OutputFormat | None:
    """The request's structured-output format, checked (400 naming the field)."""
    try:
        fmt = request_format(params.response_format, {k: getattr(params, k) for k in GUIDED_FIELDS})
    except StructuredError as e:
        raise ApiError(400, str(e), e.param, "invalid_value") from None
    if fmt is not None and spec is not None and spec.active:
        raise ApiError(
            400,
            f"{fmt.param}: structured output and tools in one request are not supported; send "
            "tool_choice 'none' or no tools (a forced tool call is enforced by its own grammar)",
            fmt.param,
            "unsupported_parameter",
        )
    if fmt is not None and params.ignore_eos:
        raise ApiError(
            400,
            f"{fmt.param}: structured output ends with EOS; ignore_eos cannot be used with it",
            "ignore_eos",
            "unsupported_parameter",
        )
    return fmt


# template variables the server sets itself (or the processor, or jinja's globals)
RESERVED_TEMPLATE_KWARGS = {
    "messages",
    "tools",
    "add_generation_prompt",
    "tokenize",
    "continue_final_message",
    "chat_template",
    "bos_token",
    "eos_token",
    "image_token",
    "video_token",
    "boi_token",
    "eoi_token",
    "max_soft_tokens",
    "video_max_soft_tokens",
    "raise_exception",
    "strftime_now",
}


def request_template_kwargs(params: ChatParams) -> dict:
    """The request's chat template variables: chat_template_kwargs, with enable_thinking set by
    reasoning_effort when it is given ("none": off, any other effort: on); 400 naming the field."""
    kwargs = dict(params.chat_template_kwargs or {})
    for key in kwargs:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
            why = "is set by the server" if key in RESERVED_TEMPLATE_KWARGS else "is not a template variable name"
            raise ApiError(400, f"chat_template_kwargs.{key} {why}", f"chat_template_kwargs.{key}", "invalid_value")
    enable, effort = kwargs.get("enable_thinking"), params.reasoning_effort
    if enable is not None and not isinstance(enable, bool):
        raise ApiError(
            400,
            f"chat_template_kwargs.enable_thinking must be a boolean (got {excerpt(enable)})",
            "chat_template_kwargs.enable_thinking",
            "invalid_value",
        )
    if effort is None:
        return kwargs
    if enable is not None and enable != (effort != "none"):
        raise ApiError(
            400,
            f"reasoning_effort {effort!r} contradicts chat_template_kwargs.enable_thinking={enable}; send one of them",
            "reasoning_effort",
            "invalid_value",
        )
    kwargs["enable_thinking"] = effort != "none"
    return kwargs


# ------------------------------------------------------------------------------------ adapters at run time
class LoadLoraParams(_Strict):
    """`POST /v1/load_lora_adapter`'s body, vLLM's: the adapter's name and its directory (under
    `--lora-dir`)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraParams(_Strict):
    """`POST /v1/unload_lora_adapter`'s body, vLLM's (its `lora_int_id` is taken and not needed:
    names are unique here)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None

"""One request's way from a checked body to its running generation, whatever API it came in by.

The OpenAI routes (openai/routes.py) and the ollama ones (ollama/routes.py) differ in their bodies
and answers only: each turns its body into `ChatParams` / `CompletionParams` (openai/protocol.py), and `prepare`
does the rest the same way for both (the checks, the prompt, the grammar, the engine requests),
so that the same request gets the same prompt, sampler settings and text on either API.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from ..inputs.model_inputs import ModelInputs
from .engine_thread import Generation
from .errors import ApiError, validation_error
from .openai.insert import Insertion
from .openai.protocol import (
    ChatParams,
    CompletionParams,
    RequestParams,
    output_format,
    refuse_unsupported,
    request_template_kwargs,
    request_tools,
    request_top_logprobs,
    soft_token_budgets,
)
from .prompts import has_media
from .service import Service
from .tools.specs import ToolSpec


@dataclass
class Prepared:
    """A request under way: its prompt and its choices' generations, or its insertion's result
    (insert mode: `inserted`, with `insertion` None when the client went away meanwhile)."""

    params: RequestParams
    chat: bool
    prompt: ModelInputs
    spec: ToolSpec | None = None
    thinking: bool = False
    gens: list[Generation] = field(default_factory=list)
    inserted: bool = False
    insertion: Insertion | None = None


def parse_params(body: dict, chat: bool) -> RequestParams:
    """An OpenAI request body checked against the strict request model (400 naming the field)."""
    return parse_body(ChatParams if chat else CompletionParams, body)


def parse_body(kind: type[BaseModel], body: dict) -> Any:
    """A JSON body checked against a strict pydantic model (400 naming the field)."""
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


async def prepare(
    service: Service, request: Request, params: RequestParams, chat: bool, deadline: float | None
) -> Prepared:
    """Check `params`, render its prompt and start its generations on the engine (or run its
    insertion, which ends before its answer begins). Every refusal is an ApiError naming the field."""
    adapter = service.check_model(params.model)
    refuse_unsupported(params)
    service.check_choices(params)
    # tokenizing a long prompt, fetching and decoding media take a while: off the event loop,
    # so streams keep flowing
    spec = request_tools(params) if chat else None
    prompts = service.prompts
    prompts.check_size(params, spec)
    if chat:
        prompt = await service.off_loop(
            has_media(params.messages),
            prompts.chat_inputs,
            params.messages,
            soft_token_budgets(params),
            spec,
            request_template_kwargs(params),
        )
        max_tokens = params.max_completion_tokens or params.max_tokens
    else:
        prompt = ModelInputs(await service.off_loop(False, prompts.completion_ids, params.prompt))
        max_tokens = params.max_tokens
    fmt = output_format(params, spec)
    if fmt is None and spec is not None and spec.choice in ("required", "function"):  # written on the compile thread
        fmt = await asyncio.wrap_future(service.compile_worker.submit(service.forced_call_format, spec))
    if not chat and (params.suffix is not None or params.span_length is not None):
        if fmt is not None:
            raise ApiError(
                400, f"{fmt.param}: not supported with suffix (insert mode)", fmt.param, "unsupported_parameter"
            )
        found = await service.insert(request, params, prompt, deadline, adapter)
        return Prepared(params, chat, prompt, inserted=True, insertion=found)
    grammar = None if fmt is None else await asyncio.wrap_future(service.compile_worker.submit(service.grammar, fmt))
    first_canvas = None if chat else service.first_canvas(params, grammar)
    thinking = chat and prompts.thinks(prompt)
    if request_top_logprobs(params) is not None or params.stream_drafts:
        await asyncio.to_thread(service.token_texts)  # built once (reads tokenizer.json): off the loop
    gens = service.start(
        params,
        prompt,
        max_tokens,
        tools=spec is not None and spec.active,
        grammar=grammar,
        thinking=thinking,
        first_canvas=first_canvas,
        deadline=deadline,
        adapter=adapter,
    )
    return Prepared(params, chat, prompt, spec, thinking, gens)

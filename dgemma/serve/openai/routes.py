"""OpenAI's routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions` and
`POST /v1/chat/completions`, vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(serve/adapters.py), and the OpenAPI description of their bodies.

A completion or chat body is read within its limits (http/connection.py), checked against the strict
request model (protocol.py), run by the pipeline both APIs share (pipeline.py) and answered whole or
streamed (responses.py). app.py registers these beside the ollama routes (ollama/routes.py); the
server-wide ones (`/health`, `/metrics`) and the error handlers stay there. docs/server.md.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..adapters import RuntimeAdapters
from ..errors import json_response
from ..http.connection import read_json
from ..pipeline import parse_body, parse_params, prepare
from ..service import Service
from .protocol import ChatParams, CompletionParams, LoadLoraParams, UnloadLoraParams
from .responses import Responder, insertion_response

SAMPLER_DEFAULTS = ("max_denoising_steps", "entropy_bound", "t_min", "t_max", "turbo")  # the model card shows them


def add_openai_routes(app: FastAPI, service: Service, read_timeout: float) -> None:
    """Register the OpenAI routes on `app` (`read_timeout`: how long a body may take to arrive), and the
    app's OpenAPI description with their request bodies."""
    gen, config = service.defaults, service.model.config
    defaults = {k: getattr(gen, k) for k in SAMPLER_DEFAULTS}

    def model_card(adapter: str | None = None) -> dict:  # OpenAI's fields, vLLM's max_model_len and
        # (adapters) root and parent, and what the playground shows
        card = {
            "id": adapter or service.name,
            "object": "model",
            "created": service.created,
            "owned_by": "dgemma",
            "root": service.name,
            "parent": None,
            "max_model_len": service.context,
            "canvas_length": config.canvas_length,
            "vision": service.model.supports_images,
            "sampler_defaults": defaults,
        }
        entry = service.adapters.get(adapter) if adapter is not None else None
        if entry is not None:
            card |= {"root": entry.source, "parent": service.name, "lora_rank": entry.rank}
        return card

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card(None)] + [model_card(n) for n in adapters()]})

    def adapters() -> list[str]:
        return [] if service.adapters is None else service.adapters.names

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str) -> Response:
        return json_response(model_card(service.check_model(name)))

    @app.post("/v1/load_lora_adapter", openapi_extra=_body_schema("LoadLoraAdapterRequest"))
    async def load_lora_adapter(request: Request) -> Response:
        body = parse_body(LoadLoraParams, await read_json(request, read_timeout))
        return json_response(await runtime_adapters.load(body.lora_name, body.lora_path))

    @app.post("/v1/unload_lora_adapter", openapi_extra=_body_schema("UnloadLoraAdapterRequest"))
    async def unload_lora_adapter(request: Request) -> Response:
        body = parse_body(UnloadLoraParams, await read_json(request, read_timeout))
        return json_response(await runtime_adapters.unload(body.lora_name))

    runtime_adapters = RuntimeAdapters(service)

    @app.post("/v1/completions", openapi_extra=_body_schema("CompletionRequest"))
    async def completions(request: Request) -> Response:
        return await answer(service, request, read_timeout, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        return await answer(service, request, read_timeout, chat=True)

    app.openapi = lambda: _openapi(app, service.name, service.adapters is not None)


async def answer(service: Service, request: Request, read_timeout: float, chat: bool) -> Response:
    """One completion (`chat` False) or chat completion request, from its body to its answer
    (pipeline.py runs it; responses.py shapes the answer)."""
    deadline = service.budgets.deadline()
    params = parse_params(await read_json(request, read_timeout), chat)
    run = await prepare(service, request, params, chat, deadline)
    if run.inserted:
        return insertion_response(service, params, run.prompt, run.insertion)
    return await Responder(service, chat, run.prompt, run.gens, params, run.spec, run.thinking).respond(request)


def _body_schema(name: str) -> dict:
    """The route's declared JSON body (the routes read raw JSON, so FastAPI cannot see it)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        }
    }


def _openapi(app: FastAPI, served_model_name: str, adapters: bool = False) -> dict:
    """The app's OpenAPI description with the request bodies' schemas from their pydantic models
    (`model`: the one model this server serves, or with `adapters` also an adapter's name)."""
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, model in (("CompletionRequest", CompletionParams), ("ChatCompletionRequest", ChatParams)):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            body["properties"]["model"] = (
                {"type": "string", "enum": [served_model_name], "title": "Model"}
                if not adapters
                else {
                    "type": "string",
                    "title": "Model",
                    "description": f"'{served_model_name}', or a loaded LoRA adapter's name (GET /v1/models)",
                }
            )
            components[name] = body
        for name, model in (("LoadLoraAdapterRequest", LoadLoraParams), ("UnloadLoraAdapterRequest", UnloadLoraParams)):
            components[name] = model.model_json_schema(ref_template="#/components/schemas/{model}")
        app.openapi_schema = schema
    return app.openapi_schema

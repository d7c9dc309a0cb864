"""An ollama-compatible API beside the OpenAI one, on the same server and engine: what the local-model
tools (Open WebUI, Continue, LangChain's and LlamaIndex's ollama integrations, the `ollama` clients)
speak.

Routes: `GET /api/version`, `GET /api/tags`, `POST /api/show`, `GET /api/ps`, `POST /api/chat`,
`POST /api/generate`, and `HEAD /` (200: ollama's liveness probe; `GET /` stays the playground).
A chat or generate body is checked as ollama's (protocol.py), translated into the OpenAI
request it asks for and run by the same pipeline (pipeline.py), so both APIs give the same prompt,
sampler settings and text; its answer is shaped as ollama's (responses.py). The served
name `X` is listed as `X:latest`, and requests to either API may name either. Refusals are ollama's
`{"error": "..."}` with the same status codes as on the OpenAI routes; the access rules (key,
Host, Origin) are the same (http/access.py). docs/server.md, "ollama-compatible API".
"""

from __future__ import annotations

import hashlib
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import __version__
from ..errors import ApiError, excerpt, json_response
from ..http.connection import read_json
from ..pipeline import prepare
from ..reasoning import THINK, template_thinks
from ..service import Service, listed_name
from .protocol import (
    ChatRequest,
    GenerateRequest,
    OllamaNames,
    ShowRequest,
    chat_params,
    generate_params,
    is_load_request,
    parse_body,
    unloads,
)
from .responses import OllamaResponder, created_at, insertion_answer

OLLAMA_VERSION = "0.12.0"  # the ollama API whose fields these routes answer (tools, structured outputs, thinking)
PREFIX = "/api/"
NEVER = "9999-12-31T23:59:59Z"  # /api/ps expires_at: the model stays loaded while the server runs
DTYPE_LEVELS = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def is_ollama_path(path: str) -> bool:
    """Whether a request path belongs to the ollama API (its errors then take ollama's shape)."""
    return path.startswith(PREFIX) or path == "/api"


def ollama_error_response(err: ApiError) -> Response:
    """An ApiError as ollama answers errors: `{"error": "message"}` with its status."""
    return json_response({"error": err.message}, err.status)


def _parameter_size(n: int) -> str:
    """A parameter count as ollama writes it: 7.6B, 10.2M."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat().replace("+00:00", "Z")


class ModelCard:
    """What the model-info routes say about the served model, worked out once."""

    def __init__(self, service: Service):
        model, config = service.model, service.model.config
        self.service, self.model = service, model
        served = service.name
        self.listed, self.accepted = listed_name(served), service.names
        path: Path | None = model.path
        config_file = path / "config.json" if path is not None else None
        has_config = config_file is not None and config_file.is_file()
        shards = path.glob("*.safetensors") if path is not None and path.is_dir() else []
        self.size = sum(f.stat().st_size for f in shards)
        self.digest = hashlib.sha256(config_file.read_bytes() if has_config else served.encode()).hexdigest()
        self.modified_at = _rfc3339(config_file.stat().st_mtime if has_config else service.created)
        self.family = str(config.raw.get("model_type", "diffusion_gemma"))
        quant = getattr(model.net, "quantization", None)
        self.details = {
            "parent_model": "",
            "format": "safetensors",
            "family": self.family,
            "families": [self.family],
            "parameter_size": _parameter_size(config.num_parameters()),
            "quantization_level": quant[0].upper() if quant else DTYPE_LEVELS.get(model.dtype, str(model.dtype)),
        }

    def check(self, name: Any) -> str:
        """The served name a request's model stands for: the base's, or a loaded adapter's (NAME or
        NAME:latest); ollama's 404 for a name this server does not serve."""
        if name in self.accepted:
            return self.service.name
        try:
            adapter = self.service.check_model(name) if isinstance(name, str) else None
        except ApiError:
            adapter = None
        if adapter is None:
            shown = name if isinstance(name, str) else excerpt(name)
            served = ", ".join(listed_name(n) for n in self.service.served_names)
            raise ApiError(404, f"model '{shown}' not found (served: {served})", "model", "model_not_found")
        return adapter

    def entry(self, adapter: str | None = None) -> dict:
        """The model as /api/tags lists it (an adapter: `NAME:latest`, the base as its parent)."""
        listed = self.listed if adapter is None else listed_name(adapter)
        details = self.details if adapter is None else {**self.details, "parent_model": self.listed}
        digest = self.digest
        if adapter is not None:
            entry = self.service.adapters.get(adapter)
            digest = entry.key.hex() if entry is not None else digest
        return {
            "name": listed,
            "model": listed,
            "modified_at": self.modified_at,
            "size": self.size,
            "digest": digest,
            "details": details,
        }

    def entries(self) -> list[dict]:
        """The base, then each loaded adapter."""
        names = [] if self.service.adapters is None else self.service.adapters.names
        return [self.entry()] + [self.entry(name) for name in names]

    def running(self) -> dict:
        """The model as /api/ps lists it: loaded for as long as the server runs."""
        on_gpu = self.model.device.type == "cuda"
        return {
            **self.entry(),
            "expires_at": NEVER,
            "size_vram": self.size if on_gpu else 0,
            "context_length": self.service.context,
        }

    def capabilities(self) -> list[str]:
        tokenizer = self.service.tokenizer
        caps = ["completion", "tools", "insert"]
        if self.model.supports_images:
            caps.append("vision")
        if template_thinks(tokenizer.chat_template) or tokenizer.token_to_id(THINK) is not None:
            caps.append("thinking")
        return caps

    def show(self) -> dict:
        """/api/show: details, model_info (ollama's keys; `<family>.context_length` is --max-context),
        capabilities, the sampler defaults as `parameters`, and the chat template (Jinja)."""
        config, arch, gen = self.model.config, self.family, self.service.defaults  # the server's: --turbo included
        info = {
            "general.architecture": arch,
            "general.basename": self.service.name,
            "general.parameter_count": config.num_parameters(),
            f"{arch}.context_length": self.service.context,
            f"{arch}.embedding_length": config.hidden_size,
            f"{arch}.block_count": config.num_layers,
            f"{arch}.attention.head_count": config.num_heads,
            f"{arch}.vocab_size": config.vocab_size,
            f"{arch}.expert_count": config.num_experts,
            f"{arch}.expert_used_count": config.top_k_experts,
            f"{arch}.canvas_length": config.canvas_length,
        }
        knobs = (
            "max_denoising_steps",
            "entropy_bound",
            "t_min",
            "t_max",
            "stability_threshold",
            "confidence_threshold",
            "turbo",
        )
        parameters = "\n".join(f"{k:<30} {getattr(gen, k)}" for k in knobs if getattr(gen, k, None) is not None)
        source = self.model.path or "the model"
        return {
            "modelfile": f"# served by dgemma {__version__} from {source}; dgemma reads no Modelfile\n",
            "parameters": parameters,
            "template": self.service.tokenizer.chat_template or "",
            "details": self.details,
            "model_info": info,
            "capabilities": self.capabilities(),
            "modified_at": self.modified_at,
        }


def _load_answer(req: ChatRequest | GenerateRequest, chat: bool) -> Response:
    """ollama's answer to a request that only loads (or unloads) the model; dgemma's model is
    loaded for as long as the server runs, so there is nothing to do."""
    body: dict[str, Any] = {"model": req.model, "created_at": created_at()}
    body |= {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return json_response({**body, "done": True, "done_reason": "unload" if unloads(req) else "load"})


def add_ollama_routes(app: FastAPI, service: Service, read_timeout: float, ui: bool) -> None:
    """Register the ollama routes on `app` (outside the OpenAPI description: they read raw JSON);
    `ui`: whether `GET /` is the playground page (else it stays no route)."""
    card = ModelCard(service)

    @app.api_route("/", methods=["HEAD"] if ui else ["HEAD", "GET"], include_in_schema=False)
    async def alive(request: Request) -> Response:  # ollama's clients probe the server with HEAD /
        if request.method != "HEAD":  # GET / is the playground; without it (--no-ui), no route as before
            raise StarletteHTTPException(404)
        return Response(status_code=200, media_type="text/plain")

    @app.api_route("/api/version", methods=["GET", "HEAD"], include_in_schema=False)
    async def version() -> Response:
        return json_response({"version": OLLAMA_VERSION, "dgemma": __version__})

    @app.api_route("/api/tags", methods=["GET", "HEAD"], include_in_schema=False)
    async def tags() -> Response:
        return json_response({"models": card.entries()})

    @app.get("/api/ps", include_in_schema=False)
    async def ps() -> Response:
        return json_response({"models": [card.running()]})

    @app.post("/api/show", include_in_schema=False)
    async def show(request: Request) -> Response:
        req = parse_body(ShowRequest, await read_json(request, read_timeout))
        if req.model is None and req.name is None:
            raise ApiError(400, "missing required field 'model'", "model", "missing_required_parameter")
        card.check(req.model if req.model is not None else req.name)
        return json_response(card.show())

    async def answer(request: Request, chat: bool) -> Response:
        """/api/chat and /api/generate, one way: the body read and checked, a load request answered
        at once, else translated into the OpenAI request it asks for, run, and answered in this
        route's shape (an insert-mode generate: its span)."""
        started, deadline = time.perf_counter(), service.budgets.deadline()
        req = parse_body(ChatRequest if chat else GenerateRequest, await read_json(request, read_timeout))
        served = card.check(req.model)  # the base's served name, or the adapter the request names
        if is_load_request(req):
            return _load_answer(req, chat)
        names = OllamaNames()
        with names.renaming():
            asked = chat_params(req, served, names) if chat else generate_params(req, served, names)
            run = await prepare(service, request, asked.params, asked.chat, deadline)
        stream = req.stream is not False
        if run.inserted:
            return insertion_answer(service, run, req.model, started, stream, asked.insert_stops)
        return await OllamaResponder(service, run, req.model, started, chat=chat).respond(request, stream)

    @app.post("/api/chat", include_in_schema=False)
    async def chat(request: Request) -> Response:
        return await answer(request, chat=True)

    @app.post("/api/generate", include_in_schema=False)
    async def generate(request: Request) -> Response:
        return await answer(request, chat=False)

    routes = "GET /api/version, GET /api/tags, POST /api/show, GET /api/ps, POST /api/chat, POST /api/generate"

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"]

    @app.api_route("/api/{rest:path}", methods=methods, include_in_schema=False)
    async def elsewhere(request: Request, rest: str) -> Response:  # after the routes above: what they do not answer
        raise ApiError(
            404,
            f"no route {request.method} {request.url.path}: dgemma's ollama-compatible API answers "
            f"{routes} "
            "(models are fetched with `dgemma pull`, not over the API)",
        )

"""`create_app`: the FastAPI app of `dgemma serve`, an OpenAI-compatible HTTP server over the engine.

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (openai/routes.py),
`GET /health`, `GET /metrics` (Prometheus text), the playground page at `GET /` (playground/), and an
ollama-compatible API under `/api/` over the same engine (ollama/routes.py). Here: the middleware (the
access guard, counting, the request log), the error handlers (each API's error shape), and the routes
registered. One request's path: its body is read (http/connection.py) and checked, strictly, so that
anything a client sends gets a 4xx with an OpenAI-style error body naming the problem
(openai/protocol.py, errors.py); its prompt is rendered (prompts.py); it runs on the engine
(pipeline.py, service.py) and its answer is shaped, whole or streamed (openai/responses.py). Chat
messages may carry images and video (media/: where they may come from; the checkpoint's processor:
what they become), tools (tools/) and Gemma 4's thinking (reasoning.py). See docs/server.md for the
fields and the streaming extension, docs/media.md for media, and "Client compatibility" for other
clients' fields.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine.engine import EngineOptions
from .errors import ApiError, error_response, json_response
from .http.access import Access, AccessGuard
from .http.connection import ClientGone
from .http.listener import Limits
from .http.request_log import RequestLog
from .media.policy import MediaPolicy
from .metrics import Metrics
from .ollama.routes import add_ollama_routes, is_ollama_path, ollama_error_response
from .openai.protocol import Budgets
from .openai.routes import add_openai_routes
from .playground import add_playground
from .service import RuntimeLora, Service

log = logging.getLogger("dgemma.serve")


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
    sampler: dict | None = None,
    request_log: bool = False,
    runtime_lora: RuntimeLora | None = None,
) -> FastAPI:
    """The FastAPI app serving `model` (a `dgemma.Model`); its engine thread runs while the app is up.

    `max_context` caps prompt plus output per request (default: the model's
    max_position_embeddings; the KV cache's size decides what fits at once). `media_policy`:
    where images and video may come from and how large (default: data URLs only). `ui`: the
    playground page at `GET /` (playground/). `access`: API key, Host and Origin rules
    (http/access.py; default: no key, local names, no cross-site pages). `budgets`: denoising steps
    and seconds per request. `limits`: the listener's read timeout and connection cap (read by
    ServerThread and `dgemma serve` from `app.state.limits`). `docs`: `/openapi.json` and `/docs`.
    `sampler`: GenerationConfig fields over the checkpoint's, the defaults of requests that do not
    set them (`dgemma serve --turbo` and its knobs; a bad value is a ConfigError naming it).
    `request_log`: a line a request on the "dgemma.serve.requests" logger (http/request_log.py).
    `runtime_lora`: whether clients may load and unload LoRA adapters (adapters.py) and from where;
    the adapters served from the start are the model's own (`Model.add_adapter`, `dgemma serve --lora`)."""
    if max_active < 1 or max_queue < 0:
        raise ValueError(f"--max-active must be >= 1 and --max-queue >= 0 (got {max_active}, {max_queue})")
    context = model.config.max_position_embeddings if max_context is None else max_context
    canvas = model.config.canvas_length
    if not canvas < context <= model.config.max_position_embeddings:
        raise ValueError(
            f"max_context must be between {canvas + 1} (one block of {canvas} plus a prompt token) and "
            f"{model.config.max_position_embeddings} (the model's max_position_embeddings); got {context}"
        )
    service = Service(
        model, served_model_name, max_active, max_queue, context, options, media_policy, budgets, sampler, runtime_lora
    )
    access = access or Access()
    limits = limits or Limits()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.engine_thread.start()
        yield
        service.engine_thread.stop()
        service.compile_worker.close()
        service.media_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="dgemma",
        version=__version__,
        description=API_DESCRIPTION,
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        openapi_url="/openapi.json" if docs else None,
        redoc_url=None,
    )
    app.state.service, app.state.limits = service, limits
    if access.cors:  # inside the guard: only allowed origins reach it
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(access.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(AccessGuard, access=access)
    app.add_middleware(_CountResponses, metrics=service.metrics)
    if request_log:  # outermost: a refused request is a line too, timed from its arrival
        app.add_middleware(RequestLog)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, err: ClientGone) -> Response:
        return Response(status_code=400)  # nobody reads it

    def refusal(request: Request, err: ApiError) -> Response:  # ollama's error shape on its routes (ollama/routes.py)
        return (ollama_error_response if is_ollama_path(request.url.path) else error_response)(err)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> Response:
        return refusal(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> Response:
        text = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
        return refusal(request, ApiError(err.status_code, text.get(err.status_code, str(err.detail))))

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return refusal(request, ApiError(500, "internal server error", code="internal_error"))

    @app.get("/health")
    async def health() -> Response:
        if not service.engine_thread.alive:
            return json_response({"status": "engine stopped"}, 503)
        return json_response({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    add_openai_routes(app, service, limits.read_timeout)  # /v1/* (openai/routes.py)
    if ui:
        add_playground(app)
    add_ollama_routes(app, service, limits.read_timeout, ui)  # /api/*, and HEAD / (ollama/routes.py)
    return app


API_DESCRIPTION = (
    "OpenAI-compatible completions and chat completions served by dgemma's block-diffusion engine; "
    "fields and extensions: docs/server.md. With --api-key, send 'Authorization: Bearer KEY'."
)

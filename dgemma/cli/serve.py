"""`dgemma serve`: its flags (the model, the engine, media sources, who may call it and what a
request may cost), the model loaded after its memory check (cli/common.py), and the uvicorn
server around the app (serve/app.py). docs/server.md, docs/security.md and docs/media.md describe
the flags."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path

from ..adapters import DEFAULT_MAX_LORAS, DEFAULT_MAX_RANK, AdapterError, parse_lora_flag, read_adapter
from ..serve.app import create_app
from ..serve.http.access import Access
from ..serve.http.listener import Limits, bind, uvicorn_config
from ..serve.media.policy import MediaPolicy
from ..serve.openai.protocol import Budgets
from ..serve.service import RuntimeLora, listed_name
from .common import (
    CliError,
    add_chat_template_flag,
    add_engine_flags,
    add_model_flags,
    add_threads_flag,
    add_turbo_flags,
    apply_chat_template_file,
    apply_threads,
    engine_options,
    load_model,
    parse_size,
    read_chat_template,
    turbo_knobs,
)


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Register `dgemma serve`."""
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_flags(p)
    add_threads_flag(p)
    add_chat_template_flag(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    p.add_argument(
        "--max-active", type=int, default=8, help="requests admitted at once, each denoising its canvas (default: 8)"
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait for admission; more get HTTP 429 (default: 64)",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="prompt plus output positions per request (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send (default: the hub id, owner/name, or the checkpoint directory's name)",
    )
    add_engine_flags(p)
    add_turbo_flags(p)  # the default of requests without a `turbo` field (and of the knobs when they turn it on)
    add_lora_flags(p)
    add_media_flags(p)
    add_safety_flags(p)
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="what the server logs: uvicorn's lines and dgemma's (refusals, clients that left) (default: info)",
    )
    p.add_argument("--access-log", action="store_true", help="uvicorn's line for every HTTP request too")
    p.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no line a request (client, method, path, status, tokens generated, seconds; logged at info)",
    )
    p.add_argument("--no-ui", dest="ui", action="store_false", help="no playground page at GET / (the API only)")
    p.add_argument(
        "--no-docs", dest="docs", action="store_false", help="no /openapi.json and /docs (the API's description)"
    )
    p.set_defaults(func=cmd_serve)


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated flag value as its names."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def add_safety_flags(p: argparse.ArgumentParser) -> None:
    """Who may use the server and what one request may cost (see docs/security.md)."""
    b, limits = Budgets(), Limits()
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every API route and /metrics (default: $DGEMMA_API_KEY; "
        "none: no key)",
    )
    p.add_argument(
        "--allowed-hosts",
        type=_names,
        default=(),
        help="more Host names to answer to, comma-separated, e.g. a proxy's name ('*': any); by default only "
        "local names and IP literals (localhost, this machine's name, *.local, private addresses)",
    )
    p.add_argument(
        "--allowed-origins",
        type=_names,
        default=(),
        help="origins whose web pages may call the API (CORS), comma-separated, e.g. http://localhost:3000 "
        "(default: none; the playground page is served by the server itself)",
    )
    p.add_argument(
        "--max-denoising-steps",
        type=int,
        default=b.max_denoising_steps,
        help=f"denoising steps per canvas a request may ask for (default: {b.max_denoising_steps})",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=b.request_timeout,
        help=f"seconds a request may take from arrival to its end; then it ends with finish_reason 'timeout' "
        f"(default: {b.request_timeout:g}; 0: no limit)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=limits.read_timeout,
        help=f"seconds a client has to send a request's headers, and again its body (default: {limits.read_timeout:g})",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=limits.limit_concurrency,
        help=f"open connections at once; more get HTTP 503 (default: {limits.limit_concurrency})",
    )


def safety(args: argparse.Namespace) -> tuple[Access, Budgets, Limits]:
    """Who may call the server, what a request may cost, and the listener's limits, from the
    flags (ValueError naming the flag on a bad value)."""
    key = args.api_key if args.api_key is not None else (os.environ.get("DGEMMA_API_KEY") or None)
    access = Access(
        api_key=key, allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins, bind_host=args.host
    )
    budgets = Budgets(args.max_denoising_steps, args.request_timeout or None)
    return access, budgets, Limits(args.read_timeout, args.limit_concurrency)


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """LoRA adapters served beside the base, chosen by a request's `model` (docs/server.md, "Adapters")."""
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the LoRA adapter at PATH (a PEFT-format directory, or a hub id owner/name) as model NAME; "
        "repeatable",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=DEFAULT_MAX_LORAS,
        help=f"adapters resident at once, each in a preallocated slot (default: {DEFAULT_MAX_LORAS})",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=DEFAULT_MAX_RANK,
        help=f"the largest adapter rank served; higher ones are refused (default: {DEFAULT_MAX_RANK})",
    )
    p.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key; reads only "
        "under --lora-dir)",
    )
    p.add_argument("--lora-dir", type=Path, default=None, help="the directory runtime-loaded adapters are read from")


def lora_setup(args: argparse.Namespace) -> tuple[list, RuntimeLora]:
    """The --lora adapters read and checked (before the model loads its weights: one line each),
    and the runtime-loading rule; CliError naming the flag otherwise."""
    if args.max_loras < 1 or args.max_lora_rank < 1:
        raise CliError(f"--max-loras and --max-lora-rank must be >= 1 (got {args.max_loras}, {args.max_lora_rank})")
    if (args.lora or args.allow_runtime_lora) and (getattr(args, "tensor_parallel_size", 1) or 1) > 1:
        raise CliError("--lora: adapters do not run on a model cut across ranks yet (--tensor-parallel-size)")
    if len(args.lora) > args.max_loras:
        raise CliError(f"{len(args.lora)} --lora adapters but --max-loras {args.max_loras}: raise --max-loras")
    try:
        runtime = RuntimeLora(args.allow_runtime_lora, args.lora_dir)
        named = [parse_lora_flag(text) for text in args.lora]
    except (ValueError, AdapterError) as e:
        raise CliError(str(e)) from None
    names = [n for n, _ in named]
    if len(set(names)) < len(names):
        raise CliError(f"--lora names an adapter twice: {sorted({n for n in names if names.count(n) > 1})[0]}")
    return named, runtime


def attach_loras(model, named: list, args: argparse.Namespace, served: str) -> None:
    """Read, check and install the --lora adapters (one line for the first that does not fit)."""
    if not named and not args.allow_runtime_lora:
        return
    try:
        if model.net.shards is not None and model.net.shards.size > 1:
            raise AdapterError("--lora: adapters do not run on a model cut across ranks yet (tensor parallelism)")
        read = []
        for name, source in named:
            if name in (served, listed_name(served)):
                raise AdapterError(f"--lora {name}: that is the base model's served name")
            read.append(read_adapter(name, source, model.config, args.max_lora_rank))
        bank = model.enable_adapters(args.max_loras, args.max_lora_rank)
        for adapter in read:
            bank.install(adapter)
    except (AdapterError, ValueError) as e:
        raise CliError(str(e)) from None


def add_media_flags(p: argparse.ArgumentParser) -> None:
    """Where `dgemma serve`'s chat images and video may come from, and how much of them (see
    docs/media.md); `dgemma run`'s --image/--video are other flags."""
    d = MediaPolicy()
    p.add_argument(
        "--allowed-media-dir",
        type=Path,
        default=None,
        help="serve file:// image/video URLs from below this directory (default: file URLs are off)",
    )
    p.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="fetch http(s):// image/video URLs, from public addresses only (not loopback, private, "
        "link-local or other internal ones; see --allowed-media-domains)",
    )
    p.add_argument(
        "--allowed-media-domains",
        type=_names,
        default=(),
        metavar="HOST,...",
        help="with --allow-remote-media: hosts whose URLs are fetched whatever their address, e.g. an "
        "internal media server; comma-separated, exact names, '*.example.com' for subdomains "
        "(default: none)",
    )
    p.add_argument(
        "--max-media-bytes",
        type=parse_size,
        default=d.max_bytes,
        help=f"bytes per image or video, e.g. 20MB (default: {d.max_bytes})",
    )
    p.add_argument(
        "--media-timeout",
        type=float,
        default=d.timeout,
        help=f"seconds one remote fetch may take (default: {d.timeout:g})",
    )
    p.add_argument(
        "--max-images-per-request",
        type=int,
        default=d.max_items,
        help=f"images plus videos in one request; a video counts once (default: {d.max_items})",
    )


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    """The media flags as a MediaPolicy (ValueError naming the flag on a bad value)."""
    return MediaPolicy(
        allowed_dir=args.allowed_media_dir,
        allow_remote=args.allow_remote_media,
        allowed_domains=args.allowed_media_domains,
        max_bytes=args.max_media_bytes,
        timeout=args.media_timeout,
        max_items=args.max_images_per_request,
    )


def media_summary(model, policy: MediaPolicy) -> str:
    """What the startup line says of media: off without a vision tower, else where it may come from."""
    if not model.supports_images:
        return "images off (no vision tower)"
    sources = ["data URLs"] + ([f"files below {policy.allowed_dir}"] if policy.allowed_dir else [])
    if policy.allow_remote:
        named = f" and {', '.join(policy.allowed_domains)}" if policy.allowed_domains else ""
        sources.append(f"http(s) URLs of public addresses{named}")
    return f"images and video from {', '.join(sources)}"


def cmd_serve(args: argparse.Namespace) -> int:
    """Check the flags, load the model, and serve it until interrupted."""
    import uvicorn

    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in [0, 65535], got {args.port}")
    logging.getLogger("dgemma").setLevel(args.log_level.upper())  # refusals, clients that left, timeouts
    sampler = turbo_knobs(args)  # checked before loading too (a ConfigError: reported by its flag)
    try:  # the operator's limits, checked before minutes of loading
        policy = media_policy(args)
        access, budgets, limits = safety(args)
    except ValueError as e:
        raise CliError(str(e)) from None
    apply_threads(args)
    template = read_chat_template(args)
    named, runtime_lora = lora_setup(args)
    model = load_model(args)  # a bad --device first, then a hub id fetched after its memory plan's check
    if model.net.shards is not None and model.net.shards.rank > 0:  # a worker rank: replay rank 0's steps
        return follow_leader(model, args)
    apply_chat_template_file(model, args, template)
    name = args.served_model_name or model.name
    attach_loras(model, named, args, name)
    try:
        app = create_app(
            model,
            name,
            args.max_active,
            args.max_queue,
            args.max_context,
            engine_options(args),
            policy,
            args.ui,
            access,
            budgets,
            limits,
            args.docs,
            sampler,
            request_log=not args.quiet,
            runtime_lora=runtime_lora,
        )
        sock = bind(args.host, args.port)
    except (ValueError, OSError) as e:
        raise CliError(str(e)) from None
    except (RuntimeError, MemoryError) as e:  # the KV pools do not fit in memory
        first = str(e).splitlines()[-1] if str(e) else type(e).__name__
        raise CliError(
            f"cannot allocate the engine's KV cache ({args.kv_cache_memory or 'default size'}): {first}"
        ) from None
    host, port = sock.getsockname()[:2]
    engine = app.state.service.engine_thread.engine
    # what runs (as `dgemma bench` reports it), not what does not; asking builds what the model
    # needs and is not built yet, before the server says it serves
    from ..kernels.cpu import describe

    kernels = describe(model.engine_net) if model.device.type == "cpu" else None
    usage = engine.kv_usage()
    kv = ", ".join(f"{k} {u['total']}" for k, u in usage.items())
    print(
        f"dgemma: serving '{name}' on http://{host}:{port} (max-active {args.max_active}, max-queue {args.max_queue}, "
        f"context {app.state.service.context}, KV blocks of {engine.options.block_size}: {kv}; "
        f"prefix cache {'on' if engine.options.prefix_cache else 'off'}; {media_summary(model, policy)}; device {model.device}"
        + ('; turbo on unless a request says "turbo": false' if app.state.service.defaults.turbo else "")
        + ")"
        + (f"; playground at http://{host}:{port}/" if args.ui else "")
        + f"; API key {'required' if access.api_key else 'off'}",
        flush=True,
    )
    if model.adapters is not None:
        runtime = f"; runtime loading from {runtime_lora.directory}" if runtime_lora.allowed else ""
        listed = ", ".join(f"'{a.name}' (rank {a.rank})" for a in model.adapters.adapters) or "none yet"
        print(
            f"dgemma: LoRA adapters: {listed}; {args.max_loras} slots of rank up to {args.max_lora_rank}{runtime}",
            flush=True,
        )
    if kernels is not None:  # (after the line scripts wait for)
        print(f"dgemma: kernels: {kernels}", flush=True)
    if access.api_key is None and not _loopback(args.host):
        print(
            f"dgemma: warning: listening on {args.host} without --api-key: anyone who can reach this address can use "
            "the model (docs/security.md)",
            flush=True,
        )
    uvicorn.Server(uvicorn_config(app, limits, args.log_level, args.access_log)).run(sockets=[sock])
    if hasattr(engine, "stop"):  # a split model: the worker ranks leave their loops
        engine.stop()
    return 0


def follow_leader(model, args: argparse.Namespace) -> int:
    """A worker rank of `serve --tensor-parallel-size`: the same engine as rank 0's, replaying
    the requests rank 0 admits (parallel/lockstep.py), until rank 0 stops."""
    from dataclasses import replace

    from ..engine.engine import Engine
    from ..parallel.lockstep import follow

    follow(Engine(model.engine_net, replace(engine_options(args), max_active=args.max_active)), model)
    return 0


def _loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or localhost): no one else can reach it."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"

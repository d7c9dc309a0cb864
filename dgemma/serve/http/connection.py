"""The HTTP side of one request: reading its body within limits, and noticing when its client leaves.

uvicorn bounds the headers (listener.py); the body is read here, within --read-timeout and
MAX_BODY_BYTES. A client that goes away while its answer is being made has its work cancelled, so
that its engine slots are freed at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request

from ..errors import ApiError

log = logging.getLogger("dgemma.serve")

MAX_BODY_BYTES = 8 * 1024 * 1024


class ClientGone(Exception):
    """The client disconnected before its request was read: nothing to answer (logged once)."""


def client_label(request: Request) -> str:
    """The client's address for a log line."""
    return f"{request.client.host}:{request.client.port}" if request.client else "a client"


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
        log.info("%s went away while sending its request body to %s", client_label(request), request.url.path)
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


async def watch_disconnect(request: Request, on_disconnect: Callable[[], Any]) -> None:
    """Call `on_disconnect` (cancel the request's work: its slots are freed at the next step)
    when its client goes away, and say so in one log line."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            log.info(
                "%s went away before its answer to %s was complete; cancelled its request",
                client_label(request),
                request.url.path,
            )
            on_disconnect()
            return

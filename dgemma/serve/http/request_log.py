"""One line a request on the server's log, as vLLM and ollama print: the client, method, path,
status, the completion tokens it generated and its seconds (`dgemma serve`; `--quiet`: none).

The line is written when the response has ended (a stream's last chunk, or the client gone), so
a streamed request's tokens are all counted. The tokens come from `Service.record`, which runs
in the request's own task or a task it started: the middleware puts the request's `RequestTally`
in a context variable, which those tasks see (a task copies its context; the tally is shared)."""

from __future__ import annotations

import logging
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass

log = logging.getLogger("dgemma.serve.requests")
MAX_PATH = 200  # characters of a path the line shows (a hostile client's path can be any length)


def printable(path: str) -> str:
    """`path` as one field of one line: control characters escaped (a client's path could otherwise
    write lines of its own into the log), spaces as %20 (the line's fields stay apart), cut at
    MAX_PATH characters."""
    shown = re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", lambda m: f"\\x{ord(m.group()):02x}", path[:MAX_PATH])
    shown = shown.replace(" ", "%20")
    return shown + ("..." if len(path) > MAX_PATH else "")


@dataclass
class RequestTally:
    """What one HTTP request generated (every choice of it)."""

    tokens: int = 0


_TALLY: ContextVar[RequestTally | None] = ContextVar("dgemma_request_tally", default=None)


def count_completion_tokens(tokens: int) -> None:
    """Add a finished generation's tokens to its request's line (nothing outside a request)."""
    tally = _TALLY.get()
    if tally is not None:
        tally.tokens += tokens


class RequestLog:
    """ASGI middleware: a line a request, once its response has ended."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tally, started, status = RequestTally(), time.perf_counter(), [None]

        async def noting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        reset = _TALLY.set(tally)
        try:
            await self.app(scope, receive, noting_send)
        finally:
            _TALLY.reset(reset)
            client = scope.get("client")
            log.info(
                "%s %s %s %s %d tokens %.2f s",
                client[0] if client else "-",
                scope.get("method", "-"),
                printable(scope.get("path", "-")),
                status[0] if status[0] is not None else "-",
                tally.tokens,
                time.perf_counter() - started,
            )

"""The socket side of `dgemma serve`: binding, uvicorn's settings, and the timeouts uvicorn lacks.

uvicorn closes an idle keep-alive connection only after a response; a client that connects and
sends nothing, or sends its headers a byte a minute (slowloris), holds a connection forever.
`TimedProtocol` gives every request `read_timeout` seconds from the connection (or the previous
response) to the end of its headers; the body has its own deadline where the server reads it
(connection.read_json). `limit_concurrency` bounds connections and tasks (more get a 503).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("dgemma.serve")


@dataclass(frozen=True)
class Limits:
    """Per-connection limits of the HTTP listener (`dgemma serve` flags)."""

    read_timeout: float = 30.0  # seconds for a request's headers, and again for its body
    limit_concurrency: int = 512  # open connections (and running requests) before 503s

    def __post_init__(self) -> None:
        if not 0 < self.read_timeout < math.inf:
            raise ValueError(f"--read-timeout must be a positive number of seconds (got {self.read_timeout})")
        if self.limit_concurrency < 1:
            raise ValueError(f"--limit-concurrency must be at least 1 (got {self.limit_concurrency})")


class TimedProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers (`header_timeout`, set by
    `timed_protocol`): connections that send nothing, or too little, are closed."""

    header_timeout = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_of = None  # the cycle whose headers arrived last
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.info(
                "closed the connection of %s: no complete request headers within %g s (--read-timeout)",
                client,
                self.header_timeout,
            )
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self._headers_of:  # a request's headers arrived
            self._headers_of = self.cycle
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def timed_protocol(header_timeout: float) -> type[TimedProtocol]:
    return type("TimedProtocol", (TimedProtocol,), {"header_timeout": header_timeout})


def uvicorn_config(app, limits: Limits, log_level: str = "warning", access_log: bool = False):
    import uvicorn

    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=5,
        http=timed_protocol(limits.read_timeout),
        limit_concurrency=limits.limit_concurrency,
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket, so that a busy port is a clear error (and port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class ServerThread:
    """uvicorn serving an app from a background thread (tests, the load script): `with ServerThread(app) as s: s.url`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, limits: Limits | None = None):
        import uvicorn

        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        limits = limits or getattr(getattr(app, "state", None), "limits", None) or Limits()
        self.server = uvicorn.Server(uvicorn_config(app, limits))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()

"""Who may talk to `dgemma serve`: the API key, the Host allow-list and the Origin rule.

The threat model (docs/security.md): the server listens on 127.0.0.1 or a LAN, and the user's
browser visits hostile pages. Three checks, in one ASGI middleware, before any route runs:

- **Host**: a request must name this server by a name it can have (localhost, `*.localhost`, the
  machine's name, `*.local`, `*.internal`, a loopback, private or unspecified IP literal, the
  address it is bound to) or one given with `--allowed-hosts`. A DNS-rebinding page reaches
  127.0.0.1 under its own name, so its requests fail here (as ollama does).
- **Origin**: a browser names the page that sends a request. Present and neither this server
  itself nor one of `--allowed-origins`, the request is refused: a cross-site page cannot drive
  the API (its simple `text/plain` POSTs need no preflight), while `curl -d` (no Origin) works.
- **API key** (`--api-key`, or `DGEMMA_API_KEY`): `Authorization: Bearer KEY` on every API route,
  the ollama API's `/api/*` and `/metrics` included, compared in constant time; `/health`, the
  playground page (and `HEAD /`, ollama's liveness probe) and its files, and the API description
  (`/openapi.json`, `/docs`) stay open.

Refusals on `/api/*` take the ollama API's shape, `{"error": "..."}`; elsewhere OpenAI's.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

log = logging.getLogger("dgemma.serve")

LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
# open without a key: liveness, the playground page and its assets, the API description
OPEN_PATHS = ("/health", "/", "/openapi.json", "/docs", "/docs/oauth2-redirect")
OPEN_PREFIXES = ("/ui/",)


@dataclass(frozen=True)
class Access:
    """The operator's access rules (`dgemma serve` flags); the defaults: no key, local names only,
    no cross-origin browser requests."""

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # more Host names (a proxy's); "*" allows any
    allowed_origins: tuple[str, ...] = ()  # origins (scheme://host[:port]) whose pages may call the API; "*": any
    bind_host: str | None = None  # the address the server listens on (allowed as a Host too)
    machine_names: tuple[str, ...] = field(default_factory=lambda: _machine_names())

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise ValueError("--api-key must be a non-empty string without surrounding whitespace")
        for origin in self.allowed_origins:
            if origin != "*" and _origin_key(origin) is None:
                raise ValueError(
                    f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port], e.g. http://localhost:3000)"
                )
        object.__setattr__(
            self, "allowed_hosts", tuple(h.strip().lower().rstrip(".") for h in self.allowed_hosts if h.strip())
        )

    @property
    def cors(self) -> bool:
        """Whether browsers on other origins may call the API (CORS headers are sent)."""
        return bool(self.allowed_origins)


def _machine_names() -> tuple[str, ...]:
    """This machine's name (no DNS lookup: a resolver that does not answer must not delay a start)."""
    name = socket.gethostname().lower().rstrip(".")
    return (name,) if name else ()


def split_host(host_header: str) -> str | None:
    """The host name of a Host header (port and IPv6 brackets removed), lower-cased; None if malformed."""
    host = host_header.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        if end < 0 or (host[end + 1 :] and not host[end + 1 :].startswith(":")):
            return None
        return host[1:end]
    name, _, port = host.partition(":")
    if port and not port.isdigit():
        return None
    return name.rstrip(".")


def host_allowed(host: str, access: Access) -> bool:
    """Whether a request naming `host` (split_host's form) is meant for this server."""
    if "*" in access.allowed_hosts or host in access.allowed_hosts:
        return True
    if host in ("", "localhost") or host in access.machine_names or host == (access.bind_host or "").lower():
        return True
    if host.endswith(LOCAL_SUFFIXES):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_private or ip.is_unspecified


def _origin_key(origin: str) -> tuple[str, str] | None:
    """(scheme, host[:port]) of an Origin value, lower-cased; None if it is not one."""
    try:
        parts = urlsplit(origin.strip())
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/") or parts.query:
        return None
    return parts.scheme, parts.netloc.lower()


def origin_allowed(origin: str, host_header: str, access: Access) -> bool:
    """A browser request from `origin` to this server: its own pages (same host and port) or the
    operator's --allowed-origins."""
    if "*" in access.allowed_origins:
        return True
    key = _origin_key(origin)
    if key is None:  # "null" (sandboxed frames, file:// pages) and garbage
        return False
    if key[1] == host_header.strip().lower():
        return True
    return any(_origin_key(o) == key for o in access.allowed_origins if o != "*")


def key_required(path: str) -> bool:
    return path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES)


def key_matches(authorization: str, api_key: str) -> bool:
    """`Authorization: Bearer KEY`, compared in constant time."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


class AccessGuard:
    """ASGI middleware applying `Access` to every HTTP request before the app sees it."""

    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self.refusal(scope)
        if refusal is None:
            return await self.app(scope, receive, send)
        status, message, code = refusal
        log.info("refused %s %s from %s: %s", scope["method"], scope["path"], _client(scope), message)
        if scope["path"].startswith("/api/"):  # the ollama API's error shape (ollama/routes.py)
            body = json.dumps({"error": message})
        else:
            body = json.dumps(
                {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
            )
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body.encode()})

    def refusal(self, scope) -> tuple[int, str, str] | None:
        """(status, message, code) of a request that may not pass, or None."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host_header = headers.get("host", "")
        host = split_host(host_header)
        if host is None or not host_allowed(host, self.access):
            shown = host_header[:80]
            return (
                403,
                (
                    f"Host {shown!r} is not allowed: this server answers to local names only; start it with "
                    f"--allowed-hosts {host or 'NAME'} to serve that name (e.g. behind a proxy)"
                ),
                "host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not origin_allowed(origin, host_header, self.access):
            return (
                403,
                (
                    f"Origin {origin[:80]!r} is not allowed: pages on other sites may not call this server; "
                    "start it with --allowed-origins ORIGIN to let one"
                ),
                "origin_not_allowed",
            )
        preflight = scope["method"] == "OPTIONS" and "access-control-request-method" in headers
        if self.access.api_key is None or not key_required(scope["path"]) or (preflight and self.access.cors):
            return None
        if not key_matches(headers.get("authorization", ""), self.access.api_key):
            return (
                401,
                "missing or wrong API key: send 'Authorization: Bearer KEY' (this server was started with --api-key)",
                "invalid_api_key",
            )
        return None


def _client(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "unknown client"

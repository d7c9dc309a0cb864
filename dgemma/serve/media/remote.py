"""Remote media: an http(s) URL fetched within the policy's byte and time limits, only to public
addresses (or hosts the operator named), every connection checked where it is made
(`GuardedBackend`), so that DNS rebinding gains nothing. A fetch that gets no 200 answer says so
in one message whatever the cause, so that errors do not map the server's network."""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpcore
import httpx

from .policy import MediaPolicy, MediaRef, PartError, check_size, ip_address, normal_host, shown

MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
FETCH_HEADERS = {"Accept": "image/*, video/*, */*;q=0.5", "Accept-Encoding": "identity", "User-Agent": "dgemma"}
# Not global, though Python 3.11's `is_global` says they are: IPv4-compatible IPv6 (deprecated,
# it embeds an IPv4 address) and NAT64's local-use prefix. 100.64/10 (shared) is refused too.
NOT_GLOBAL = tuple(ipaddress.ip_network(n) for n in ("::/96", "64:ff9b:1::/48", "100.64.0.0/10"))
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # the well-known prefix: its last 32 bits are an IPv4 address
# What keeps a fetch from an answer: bad URLs, DNS, refused or disallowed connections, TLS, resets,
# protocol errors, timeouts.
FETCH_ERRORS = (
    httpx.InvalidURL,
    httpcore.NetworkError,
    httpcore.TimeoutException,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
    httpcore.ConnectionNotAvailable,
    OSError,
    UnicodeError,
)


def host_allowed(host: str, domains: Sequence[str]) -> bool:
    """Whether a URL's host is one the operator named (`--allowed-media-domains`): the same name,
    case-insensitively, or a subdomain of a `*.name` entry."""
    host = normal_host(host)
    return any(host.endswith(d[1:]) if d.startswith("*.") else host == d for d in map(normal_host, domains))


def address_allowed(address: str) -> bool:
    """Whether a remote fetch may connect to `address`: a globally routable unicast address. An
    IPv6 form that embeds an IPv4 address (IPv4-mapped, 6to4, Teredo, NAT64) must embed an allowed
    one too. Spelled out: Python 3.11's `is_global` misjudges some of these forms."""
    ip = ip_address(address)
    if ip is None:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None or ip in NAT64:  # the IPv4 address they stand for is what counts
            return address_allowed(str(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)))
        if ip.is_site_local or any(not address_allowed(str(v4)) for v4 in [ip.sixtofour, *(ip.teredo or ())] if v4):
            return False
    if any(ip in net for net in NOT_GLOBAL if net.version == ip.version):
        return False
    flags = (ip.is_private, ip.is_loopback, ip.is_link_local, ip.is_multicast, ip.is_reserved, ip.is_unspecified)
    return ip.is_global and not any(flags)


class GuardedBackend(httpcore.SyncBackend):
    """httpcore's network backend, connecting only to addresses `address_allowed` allows (any
    address, for a host the operator named). The host is resolved here and each allowed address
    tried in turn; the address actually connected to is checked again (getpeername) before a byte
    is sent, so DNS rebinding gains nothing. TLS is httpcore's as before: it verifies the
    certificate for the URL's host name (SNI), not for the address."""

    def __init__(self, allowed_domains: Sequence[str] = (), deadline: float | None = None):
        self.allowed_domains, self.deadline = tuple(allowed_domains), deadline

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.NetworkStream:
        trusted = host_allowed(host, self.allowed_domains)
        error: Exception = httpcore.ConnectError(f"{host} has no address this server may connect to")
        for address in self._addresses(host, port):
            if not (trusted or address_allowed(address)):
                continue
            try:
                stream = super().connect_tcp(address, port, self._timeout(timeout), local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                error = e
                continue
            peer = stream.get_extra_info("server_addr")[0]
            if trusted or address_allowed(peer):
                return stream
            stream.close()
            error = httpcore.ConnectError(f"{host} connected to {peer}, an address this server may not connect to")
        raise error

    @staticmethod
    def _addresses(host: str, port: int) -> list[str]:
        """The host's addresses, in the resolver's order, each once."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            raise httpcore.ConnectError(f"cannot resolve {host}: {e}") from None
        return list(dict.fromkeys(str(info[4][0]) for info in infos))

    def _timeout(self, timeout: float | None) -> float | None:
        """The connect timeout, cut to what is left of the whole fetch."""
        if self.deadline is None:
            return timeout
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.ConnectTimeout("no time left for the fetch")
        return left if timeout is None else min(timeout, left)


def _unfetchable(ref: MediaRef) -> PartError:
    """The one message for every fetch that gets no 200 answer, whatever the cause."""
    return PartError(
        ref.param,
        f"could not fetch {shown(ref.url)!r} (unreachable, not allowed on this server, or not an HTTP 200 answer)",
    )


def _timed_out(ref: MediaRef, policy: MediaPolicy) -> PartError:
    return PartError(ref.param, f"fetching {shown(ref.url)!r} timed out after {policy.timeout:g} s (--media-timeout)")


def fetch(ref: MediaRef, policy: MediaPolicy) -> bytes:
    """GET an http(s) URL within the byte and time limits, following at most MAX_REDIRECTS
    redirects and only to http(s), every hop's connection checked by `GuardedBackend`. No proxy:
    httpcore reads no environment."""
    deadline, url = time.monotonic() + policy.timeout, ref.url
    backend = GuardedBackend(policy.allowed_domains, deadline)
    with httpcore.ConnectionPool(network_backend=backend) as pool:
        for _ in range(MAX_REDIRECTS + 1):
            with _get(ref, pool, url, deadline) as response:
                if response.status not in REDIRECTS:
                    return _read_body(ref, response, deadline, policy)
                url = _redirect_target(ref, url, response)
    raise _unfetchable(ref)


@contextmanager
def _get(ref: MediaRef, pool: httpcore.ConnectionPool, url: str, deadline: float) -> Iterator[httpcore.Response]:
    """The streamed response to a GET of `url`; any failure to get it (or to read its body) is
    `_unfetchable`. httpx parses the URL and writes the Host header; httpcore sends the request."""
    try:
        left = deadline - time.monotonic()
        request = httpx.Request("GET", url, headers=FETCH_HEADERS)
        if left <= 0 or request.url.scheme not in ("http", "https"):
            raise _unfetchable(ref)
        target = httpcore.URL(
            scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port, target=request.url.raw_path
        )
        timeouts = dict.fromkeys(("connect", "read", "write", "pool"), left)
        with pool.stream("GET", target, headers=request.headers.raw, extensions={"timeout": timeouts}) as response:
            yield response
    except PartError:
        raise
    except FETCH_ERRORS:
        raise _unfetchable(ref) from None


def _header(response: httpcore.Response, name: bytes) -> str:
    return next((v.decode("latin-1") for k, v in response.headers if k.lower() == name), "")


def _redirect_target(ref: MediaRef, url: str, response: httpcore.Response) -> str:
    location = _header(response, b"location").strip()
    target = urljoin(url, location)
    if not location or urlsplit(target).scheme.lower() not in ("http", "https"):
        raise _unfetchable(ref)
    return target


def _read_body(ref: MediaRef, response: httpcore.Response, deadline: float, policy: MediaPolicy) -> bytes:
    """The body of a 200 answer, stopped as soon as it passes the byte limit or the deadline."""
    if response.status != 200:
        raise _unfetchable(ref)
    declared = _header(response, b"content-length")
    if declared.isdigit():
        check_size(ref, int(declared), policy, whole=False)
    body = bytearray()
    try:
        for chunk in response.iter_stream():
            body += chunk
            check_size(ref, len(body), policy, whole=False)
            if time.monotonic() > deadline:
                raise _timed_out(ref, policy)
    except httpcore.TimeoutException:
        raise _timed_out(ref, policy) from None
    check_size(ref, len(body), policy)
    return bytes(body)

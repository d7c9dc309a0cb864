"""Media in the server: OpenAI content parts (`image_url`, `video_url`, `input_image`) turned into
the processor's parts, whose bytes the processor decodes when it reaches them (`LoadedMedia`).

Where media may come from is the operator's choice (`MediaPolicy`): `data:` URLs always,
`file://` only below `--allowed-media-dir`, `http(s)://` only with `--allow-remote-media` and only
to public addresses (or hosts named in `--allowed-media-domains`), each bounded in bytes (and
remote fetches in time). Everything a client can get wrong raises `MediaError` naming the part
(`messages[i].content[j]`) and the problem; the server answers 400. A remote fetch that gets no
200 answer says so in one message whatever the cause, so that errors do not map the server's
network. Fetching and reading are blocking: the server calls these from a worker thread.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import re
import socket
import stat
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

import httpcore
import httpx

from ...inputs.model_inputs import MediaError

IMAGE_MIME = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")  # what inputs/decode.py opens
VIDEO_MIME = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/x-msvideo", "video/mpeg")
MIME = {"image": IMAGE_MIME, "video": VIDEO_MIME}
# OpenAI part type -> (our kind, the key holding the URL or {"url": ...})
MEDIA_PARTS = {"image_url": ("image", "image_url"), "input_image": ("image", "image_url"), "video_url": ("video", "video_url")}
TEXT_PARTS = ("text", "input_text")
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
URL_SHOWN = 80  # characters of a URL an error message quotes
FETCH_HEADERS = {"Accept": "image/*, video/*, */*;q=0.5", "Accept-Encoding": "identity", "User-Agent": "dgemma"}
# Not global, though Python 3.11's `is_global` says they are: IPv4-compatible IPv6 (deprecated,
# it embeds an IPv4 address) and NAT64's local-use prefix. 100.64/10 (shared) is refused too.
NOT_GLOBAL = tuple(ipaddress.ip_network(n) for n in ("::/96", "64:ff9b:1::/48", "100.64.0.0/10"))
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # the well-known prefix: its last 32 bits are an IPv4 address
HOST_NAME = re.compile(r"(\*\.)?[a-z0-9_-]+(\.[a-z0-9_-]+)*")


class PartError(MediaError):
    """A MediaError tied to the request field it came from, so the 400 can name it in `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class MediaPolicy:
    """What the operator allows (`dgemma serve` flags); the defaults allow data URLs only."""

    allowed_dir: Path | None = None  # file:// URLs below it; None: file URLs are off
    allow_remote: bool = False  # http(s):// URLs, to public addresses
    allowed_domains: tuple[str, ...] = ()  # hosts remote URLs may name whatever their address; "*.x" its subdomains
    max_bytes: int = 20 * 10**6  # per item, decoded data URL, file or download
    timeout: float = 10.0  # seconds for one remote fetch, redirects included
    max_items: int = 8  # images plus videos per request (a video counts once, whatever its frames)

    def __post_init__(self) -> None:
        checks = [("--max-media-bytes", self.max_bytes, self.max_bytes >= 1, "positive"),
                  ("--media-timeout", self.timeout, self.timeout > 0, "positive"),
                  ("--max-images-per-request", self.max_items, self.max_items >= 0, "0 or more")]  # fmt: skip
        for flag, value, ok, what in checks:
            if not ok:
                raise ValueError(f"{flag} must be {what} (got {value})")
        if self.allowed_dir is not None:
            resolved = Path(self.allowed_dir).expanduser().resolve()
            if not resolved.is_dir():
                raise ValueError(f"--allowed-media-dir {self.allowed_dir} is not a directory")
            object.__setattr__(self, "allowed_dir", resolved)
        domains = tuple(normal_host(d) for d in self.allowed_domains)
        for name in domains:
            if not (HOST_NAME.fullmatch(name) or _ip(name)):
                raise ValueError(f"--allowed-media-domains: {name!r} is not a host name (e.g. media.internal or *.example.com)")
        if domains and not self.allow_remote:
            raise ValueError("--allowed-media-domains needs --allow-remote-media")
        object.__setattr__(self, "allowed_domains", domains)


@dataclass(frozen=True)
class MediaRef:
    """One media part of a request, parsed but not loaded yet."""

    kind: str  # "image" or "video"
    url: str
    param: str  # messages[i].content[j]


def check_soft_tokens(value: Any, param: str = "max_soft_tokens") -> int | None:
    """A request's soft-token budget per image (None: the processor's default), checked before
    any media is fetched."""
    from ...inputs.processor import check_budget

    if value is None:
        return None
    try:
        return check_budget(value)
    except MediaError as e:
        raise PartError(param, str(e).removeprefix("max_soft_tokens ")) from None


def _shown(url: str) -> str:
    if url.startswith("data:"):
        return url[: url.find(",") + 1 if "," in url else 30][:40] + "..."
    return url if len(url) <= URL_SHOWN else url[: URL_SHOWN - 3] + "..."


# ------------------------------------------------------------------------------------ parsing
def _part_url(part: dict, key: str, param: str) -> str:
    """The URL of an image_url/video_url part: `{key: {"url": ...}}` or `{key: "..."}`."""
    value = part.get(key)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise PartError(param, f"{part['type']} part needs '{key}': {{'url': '...'}} or a URL string (got {value!r:.60})")
    return url


def parse_content(i: int, content: Any) -> list[str | MediaRef]:
    """A message's content as text pieces and media refs, in order (nothing fetched yet)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise PartError(f"messages[{i}].content", f"must be a string or a list of content parts (got {content!r:.60})")
    out: list[str | MediaRef] = []
    for j, part in enumerate(content):
        param = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind in MEDIA_PARTS:
            media, key = MEDIA_PARTS[kind]
            out.append(MediaRef(media, _part_url(part, key, param), param))
        else:
            raise PartError(
                param,
                f"unsupported content part {part!r:.60}; parts are {{'type': 'text', 'text': ...}}, "
                f"{{'type': 'image_url', 'image_url': {{'url': ...}}}} or {{'type': 'video_url', 'video_url': {{'url': ...}}}}",
            )
    return out


# ------------------------------------------------------------------------------------ loading
@dataclass(frozen=True)
class LoadedMedia:
    """A part's bytes, loaded within the policy, for the processor to decode when it reaches the
    part (a `MediaLoader`): a request then holds one decoded image or video at a time, each reduced
    to its patches before the next is decoded. Decoding errors name the part."""

    ref: MediaRef
    raw: bytes = field(repr=False)
    mime: str | None = None  # the declared type: picks a video's container format

    def __call__(self, processor: Any, max_soft_tokens: int | None) -> Any:
        from ...inputs.decode import open_video

        try:
            if self.ref.kind == "image":
                return processor.image(self.raw, max_soft_tokens)
            video = open_video(self.raw, processor.sample_indices, processor.max_pixels, processor.max_frames, self.mime)
            return processor.video(video, max_soft_tokens)
        except MediaError as e:
            raise PartError(self.ref.param, str(e)) from None


def processor_part(ref: MediaRef, policy: MediaPolicy, processor: Any = None) -> dict:
    """The processor's part for `ref`: its bytes loaded here, decoded by the processor in prompt
    order (`LoadedMedia`; `processor` is not needed for that)."""
    return {"type": ref.kind, ref.kind: LoadedMedia(ref, load(ref, policy), declared_mime(ref))}


def declared_mime(ref: MediaRef) -> str | None:
    """The MIME type a URL declares: a data URL's, or what a file's extension says; None for
    remote URLs (a Content-Type is often wrong; the container whitelist applies all the same)."""
    from ...inputs.decode import video_mime

    parts = urlsplit(ref.url)
    if parts.scheme.lower() == "data":
        return ref.url[5:].partition(",")[0].split(";")[0].strip().lower()
    if parts.scheme.lower() == "file":
        return video_mime(unquote(parts.path))
    return None


def load(ref: MediaRef, policy: MediaPolicy) -> bytes:
    """The bytes behind a part's URL, as far as the policy allows."""
    scheme = urlsplit(ref.url).scheme.lower()
    if scheme == "data":
        return data_url_bytes(ref, policy)
    if scheme == "file":
        return file_bytes(ref, policy)
    if scheme in ("http", "https"):
        if not policy.allow_remote:
            raise PartError(ref.param, "remote media (http/https URLs) is off on this server (--allow-remote-media); send a data: URL")
        return fetch(ref, policy)
    raise PartError(ref.param, f"unsupported URL scheme {scheme or 'none'!r} in {_shown(ref.url)!r}; use data:, file:// or http(s)://")


def data_url_bytes(ref: MediaRef, policy: MediaPolicy) -> bytes:
    """`data:<mime>;base64,<data>` decoded; the mime type must fit the part (an image in image_url)."""
    head, comma, data = ref.url[5:].partition(",")
    fields = [f.strip().lower() for f in head.split(";")]
    mime = fields[0]
    if not comma:
        raise PartError(ref.param, "data URL has no ',' before its data (expected data:<mime>;base64,<data>)")
    if "base64" not in fields[1:]:
        raise PartError(ref.param, "data URL must be base64-encoded (data:<mime>;base64,<data>)")
    if mime not in MIME[ref.kind]:
        raise PartError(ref.param, f"unsupported mime type {mime or 'none'!r}; {ref.kind}s may be {', '.join(MIME[ref.kind])}")
    packed = "".join(data.split())
    if not packed:
        raise PartError(ref.param, "data URL holds no data")
    if len(packed) // 4 * 3 > policy.max_bytes + 2:
        raise PartError(ref.param, f"data URL holds more than the limit of {policy.max_bytes} bytes (--max-media-bytes)")
    try:
        raw = base64.b64decode(packed, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PartError(ref.param, f"data URL is not valid base64: {e}") from None
    _check_size(ref, len(raw), policy)
    return raw


def _check_size(ref: MediaRef, size: int, policy: MediaPolicy, whole: bool = True) -> None:
    """Refuse more than --max-media-bytes; and, once `whole`, nothing at all."""
    if size > policy.max_bytes:
        raise PartError(ref.param, f"{_shown(ref.url)!r} holds more than the limit of {policy.max_bytes} bytes (--max-media-bytes)")
    if whole and size == 0:
        raise PartError(ref.param, f"{_shown(ref.url)!r} is empty")


# ------------------------------------------------------------------------------------ files
def file_bytes(ref: MediaRef, policy: MediaPolicy) -> bytes:
    """A file:// URL's file, read only if it lies below --allowed-media-dir once symlinks and '..'
    are resolved. Containment is checked before existence, so every path outside gets the same
    answer whether it exists or not; only a regular file is opened (never a FIFO or a device)."""
    if policy.allowed_dir is None:
        raise PartError(ref.param, "file:// URLs are off on this server (start it with --allowed-media-dir DIR)")
    parts = urlsplit(ref.url)
    if parts.netloc not in ("", "localhost"):
        raise PartError(ref.param, f"file:// URL names host {parts.netloc!r}; only local files (file:///path) are read")
    name = unquote(parts.path)
    if "\0" in name:
        raise PartError(ref.param, f"{_shown(ref.url)!r} holds a NUL byte (raw or %00), which no file path holds")
    if not name.startswith("/"):
        raise PartError(ref.param, f"{_shown(ref.url)!r} holds no absolute path (expected file:///path)")
    try:  # realpath, not Path.resolve: it stats the result, which would tell a symlink loop outside
        path = Path(os.path.realpath(name))
    except ValueError:  # a lone surrogate
        raise PartError(ref.param, f"{_shown(ref.url)!r} is not a valid file path") from None
    if not path.is_relative_to(policy.allowed_dir):
        raise PartError(ref.param, f"{_shown(ref.url)!r} is outside the allowed media directory (--allowed-media-dir); "
                                   "only files below it are read, after resolving symlinks and '..'")  # fmt: skip
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise PartError(ref.param, f"{_shown(ref.url)!r} does not exist") from None
    except OSError as e:
        raise PartError(ref.param, f"{_shown(ref.url)!r} cannot be read: {e.strerror}") from None
    _check_regular(ref, info)
    _check_size(ref, info.st_size, policy)
    return _read_regular(ref, path, policy)


def _check_regular(ref: MediaRef, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise PartError(ref.param, f"{_shown(ref.url)!r} is not a regular file")


def _read_regular(ref: MediaRef, path: Path, policy: MediaPolicy) -> bytes:
    """Up to max_bytes + 1 of a file that was a regular file when stat'ed: opened without blocking
    and without following a symlink, and checked again once open (it may have been swapped)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise PartError(ref.param, f"{_shown(ref.url)!r} cannot be read: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        _check_regular(ref, os.fstat(f.fileno()))
        raw = f.read(policy.max_bytes + 1)
    _check_size(ref, len(raw), policy)
    return raw


# ------------------------------------------------------------------------------------ remote
def normal_host(host: str) -> str:
    """A host name as compared: lower case, without a trailing dot or IPv6 brackets."""
    return host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.partition("%")[0])  # an IPv6 scope (fe80::1%eth0) is link-local anyway
    except ValueError:
        return None


def host_allowed(host: str, domains: Sequence[str]) -> bool:
    """Whether a URL's host is one the operator named (`--allowed-media-domains`): the same name,
    case-insensitively, or a subdomain of a `*.name` entry."""
    host = normal_host(host)
    return any(host.endswith(d[1:]) if d.startswith("*.") else host == d for d in map(normal_host, domains))


def address_allowed(address: str) -> bool:
    """Whether a remote fetch may connect to `address`: a globally routable unicast address. An
    IPv6 form that embeds an IPv4 address (IPv4-mapped, 6to4, Teredo, NAT64) must embed an allowed
    one too. Spelled out: Python 3.11's `is_global` misjudges some of these forms."""
    ip = _ip(address)
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

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:  # fmt: skip
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


# What keeps a fetch from an answer: bad URLs, DNS, refused or disallowed connections, TLS, resets,
# protocol errors, timeouts.
FETCH_ERRORS = (httpx.InvalidURL, httpcore.NetworkError, httpcore.TimeoutException, httpcore.ProtocolError,
                httpcore.UnsupportedProtocol, httpcore.ConnectionNotAvailable, OSError, UnicodeError)  # fmt: skip


def _unfetchable(ref: MediaRef) -> PartError:
    """The one message for every fetch that gets no 200 answer, whatever the cause."""
    return PartError(ref.param, f"could not fetch {_shown(ref.url)!r} "
                                "(unreachable, not allowed on this server, or not an HTTP 200 answer)")  # fmt: skip


def _timed_out(ref: MediaRef, policy: MediaPolicy) -> PartError:
    return PartError(ref.param, f"fetching {_shown(ref.url)!r} timed out after {policy.timeout:g} s (--media-timeout)")


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
        target = httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port,
                              target=request.url.raw_path)  # fmt: skip
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
        _check_size(ref, int(declared), policy, whole=False)
    body = bytearray()
    try:
        for chunk in response.iter_stream():
            body += chunk
            _check_size(ref, len(body), policy, whole=False)
            if time.monotonic() > deadline:
                raise _timed_out(ref, policy)
    except httpcore.TimeoutException:
        raise _timed_out(ref, policy) from None
    _check_size(ref, len(body), policy)
    return bytes(body)

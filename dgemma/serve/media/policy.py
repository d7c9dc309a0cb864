"""Where media may come from, the operator's choice (`MediaPolicy`, from `dgemma serve`'s flags), the
parts a request names (`MediaRef`) and the error that names one (`PartError`): what sources.py and
remote.py share."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...inputs.model_inputs import MediaError

IMAGE_MIME = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")  # what inputs/decode.py opens
VIDEO_MIME = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/x-msvideo", "video/mpeg")
MIME = {"image": IMAGE_MIME, "video": VIDEO_MIME}
URL_SHOWN = 80  # characters of a URL an error message quotes
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
        checks = [
            ("--max-media-bytes", self.max_bytes, self.max_bytes >= 1, "positive"),
            ("--media-timeout", self.timeout, self.timeout > 0, "positive"),
            ("--max-images-per-request", self.max_items, self.max_items >= 0, "0 or more"),
        ]
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
            if not (HOST_NAME.fullmatch(name) or ip_address(name)):
                raise ValueError(
                    f"--allowed-media-domains: {name!r} is not a host name (e.g. media.internal or *.example.com)"
                )
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


def shown(url: str) -> str:
    if url.startswith("data:"):
        return url[: url.find(",") + 1 if "," in url else 30][:40] + "..."
    return url if len(url) <= URL_SHOWN else url[: URL_SHOWN - 3] + "..."


def check_size(ref: MediaRef, size: int, policy: MediaPolicy, whole: bool = True) -> None:
    """Refuse more than --max-media-bytes; and, once `whole`, nothing at all."""
    if size > policy.max_bytes:
        raise PartError(
            ref.param, f"{shown(ref.url)!r} holds more than the limit of {policy.max_bytes} bytes (--max-media-bytes)"
        )
    if whole and size == 0:
        raise PartError(ref.param, f"{shown(ref.url)!r} is empty")


def normal_host(host: str) -> str:
    """A host name as compared: lower case, without a trailing dot or IPv6 brackets."""
    return host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")


def ip_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.partition("%")[0])  # an IPv6 scope (fe80::1%eth0) is link-local anyway
    except ValueError:
        return None

"""Media in the server: OpenAI content parts (`image_url`, `video_url`, `input_image`) turned into
the processor's parts (`{"type": "image", "image": PIL image}`, `{"type": "video", "video": Video}`).

Where media may come from is the operator's choice (`MediaPolicy`): `data:` URLs always,
`file://` only below `--allowed-media-dir`, `http(s)://` only with `--allow-remote-media`, each
bounded in bytes (and remote fetches in time). Everything a client can get wrong raises
`MediaError` naming the part (`messages[i].content[j]`) and the problem; the server answers 400.
Fetching and reading are blocking: the server calls these from a worker thread.
"""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

from ..media.inputs import MediaError

IMAGE_MIME = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")  # what media/decode.py opens
VIDEO_MIME = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/x-msvideo", "video/mpeg")
MIME = {"image": IMAGE_MIME, "video": VIDEO_MIME}
# OpenAI part type -> (our kind, the key holding the URL or {"url": ...})
MEDIA_PARTS = {"image_url": ("image", "image_url"), "input_image": ("image", "image_url"), "video_url": ("video", "video_url")}
TEXT_PARTS = ("text", "input_text")
MAX_REDIRECTS = 5
URL_SHOWN = 80  # characters of a URL an error message quotes


class PartError(MediaError):
    """A MediaError tied to the request field it came from, so the 400 can name it in `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class MediaPolicy:
    """What the operator allows (`dgemma serve` flags); the defaults allow data URLs only."""

    allowed_dir: Path | None = None  # file:// URLs below it; None: file URLs are off
    allow_remote: bool = False  # http(s):// URLs
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


@dataclass(frozen=True)
class MediaRef:
    """One media part of a request, parsed but not loaded yet."""

    kind: str  # "image" or "video"
    url: str
    param: str  # messages[i].content[j]


def check_soft_tokens(value: Any, param: str = "max_soft_tokens") -> int | None:
    """A request's soft-token budget per image (None: the processor's default), checked before
    any media is fetched."""
    from ..media.processor import check_budget

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
def processor_part(ref: MediaRef, policy: MediaPolicy, processor) -> dict:
    """The processor's part for `ref`: loaded and decoded here (a PIL image; a video's sampled
    frames), with the processor's limits, so that a bad image or video is reported against its
    own part (the processor cannot tell which it was)."""
    from ..media.decode import open_image, open_video

    raw = load(ref, policy)
    try:
        if ref.kind == "image":
            return {"type": "image", "image": open_image(raw, processor.max_pixels)}
        video = open_video(raw, processor.sample_indices, processor.max_pixels, processor.max_frames)
        return {"type": "video", "video": video}
    except MediaError as e:
        raise PartError(ref.param, str(e)) from None


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


def _timed_out(ref: MediaRef, url: str, policy: MediaPolicy) -> PartError:
    return PartError(ref.param, f"fetching {_shown(url)!r} timed out after {policy.timeout:g} s (--media-timeout)")


def file_bytes(ref: MediaRef, policy: MediaPolicy) -> bytes:
    """A file:// URL's file, read only if it lies below --allowed-media-dir once symlinks and '..' are resolved."""
    if policy.allowed_dir is None:
        raise PartError(ref.param, "file:// URLs are off on this server (start it with --allowed-media-dir DIR)")
    parts = urlsplit(ref.url)
    if parts.netloc not in ("", "localhost"):
        raise PartError(ref.param, f"file:// URL names host {parts.netloc!r}; only local files (file:///path) are read")
    if not unquote(parts.path).startswith("/"):
        raise PartError(ref.param, f"{_shown(ref.url)!r} holds no absolute path (expected file:///path)")
    try:
        path = Path(unquote(parts.path)).resolve(strict=True)
    except (OSError, RuntimeError):
        raise PartError(ref.param, f"{_shown(ref.url)!r} does not exist") from None
    if not path.is_relative_to(policy.allowed_dir):
        raise PartError(ref.param, f"{_shown(ref.url)!r} is outside the allowed media directory (--allowed-media-dir); "
                                   "only files below it are read, after resolving symlinks and '..'")  # fmt: skip
    if not path.is_file():
        raise PartError(ref.param, f"{_shown(ref.url)!r} is not a regular file")
    _check_size(ref, path.stat().st_size, policy)
    with path.open("rb") as f:
        raw = f.read(policy.max_bytes + 1)
    _check_size(ref, len(raw), policy)
    return raw


def fetch(ref: MediaRef, policy: MediaPolicy) -> bytes:
    """GET an http(s) URL within the byte and time limits, following at most MAX_REDIRECTS
    redirects and only to http(s). Proxy environment variables are not used."""
    import httpx

    deadline, url = time.monotonic() + policy.timeout, ref.url
    try:
        with httpx.Client(timeout=policy.timeout, follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                with client.stream("GET", url) as response:
                    if not response.is_redirect:
                        return _read_body(ref, url, response, deadline, policy)
                    url = _redirect_target(ref, url, response.headers.get("location", ""))
    except httpx.TimeoutException:
        raise _timed_out(ref, url, policy) from None
    except httpx.HTTPError as e:
        raise PartError(ref.param, f"fetching {_shown(url)!r} failed: {e or type(e).__name__}") from None
    raise PartError(ref.param, f"fetching {_shown(ref.url)!r} was redirected more than {MAX_REDIRECTS} times")


def _redirect_target(ref: MediaRef, url: str, location: str) -> str:
    target = urljoin(url, location)
    if urlsplit(target).scheme.lower() not in ("http", "https"):
        raise PartError(ref.param, f"fetching {_shown(ref.url)!r} redirected to {_shown(target)!r}; only http(s) redirects are followed")
    return target


def _read_body(ref: MediaRef, url: str, response, deadline: float, policy: MediaPolicy) -> bytes:
    """The response body, stopped as soon as it passes the byte limit or the deadline."""
    if response.status_code != 200:
        raise PartError(ref.param, f"fetching {_shown(url)!r} failed: HTTP {response.status_code}")
    declared = response.headers.get("content-length", "")
    if declared.isdigit():
        _check_size(ref, int(declared), policy, whole=False)
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        _check_size(ref, len(body), policy, whole=False)
        if time.monotonic() > deadline:
            raise _timed_out(ref, url, policy)
    _check_size(ref, len(body), policy)
    return bytes(body)

"""Media in the server: OpenAI content parts (`image_url`, `video_url`, `input_image`) turned into
the processor's parts, whose bytes the processor decodes when it reaches them (`LoadedMedia`).

Where media may come from is the operator's choice (`MediaPolicy`): `data:` URLs always,
`file://` only below `--allowed-media-dir`, `http(s)://` only with `--allow-remote-media` and only
to public addresses (or hosts named in `--allowed-media-domains`), each bounded in bytes (and
remote fetches in time). Everything a client can get wrong raises `MediaError` naming the part
(`messages[i].content[j]`) and the problem; the server answers 400. The policy and the parts'
types are policy.py's; remote fetches remote.py's. Fetching and reading are blocking: the server
calls these from a worker thread.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ...inputs.model_inputs import MediaError
from .policy import MIME, MediaPolicy, MediaRef, PartError, check_size, shown
from .remote import fetch

# OpenAI part type -> (our kind, the key holding the URL or {"url": ...})
MEDIA_PARTS = {
    "image_url": ("image", "image_url"),
    "input_image": ("image", "image_url"),
    "video_url": ("video", "video_url"),
}
TEXT_PARTS = ("text", "input_text")


def _part_url(part: dict, key: str, param: str) -> str:
    """The URL of an image_url/video_url part: `{key: {"url": ...}}` or `{key: "..."}`."""
    value = part.get(key)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise PartError(
            param, f"{part['type']} part needs '{key}': {{'url': '...'}} or a URL string (got {value!r:.60})"
        )
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
            video = open_video(
                self.raw, processor.sample_indices, processor.max_pixels, processor.max_frames, self.mime
            )
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
            raise PartError(
                ref.param,
                "remote media (http/https URLs) is off on this server (--allow-remote-media); send a data: URL",
            )
        return fetch(ref, policy)
    raise PartError(
        ref.param,
        f"unsupported URL scheme {scheme or 'none'!r} in {shown(ref.url)!r}; use data:, file:// or http(s)://",
    )


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
        raise PartError(
            ref.param, f"unsupported mime type {mime or 'none'!r}; {ref.kind}s may be {', '.join(MIME[ref.kind])}"
        )
    packed = "".join(data.split())
    if not packed:
        raise PartError(ref.param, "data URL holds no data")
    if len(packed) // 4 * 3 > policy.max_bytes + 2:
        raise PartError(
            ref.param, f"data URL holds more than the limit of {policy.max_bytes} bytes (--max-media-bytes)"
        )
    try:
        raw = base64.b64decode(packed, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PartError(ref.param, f"data URL is not valid base64: {e}") from None
    check_size(ref, len(raw), policy)
    return raw


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
        raise PartError(ref.param, f"{shown(ref.url)!r} holds a NUL byte (raw or %00), which no file path holds")
    if not name.startswith("/"):
        raise PartError(ref.param, f"{shown(ref.url)!r} holds no absolute path (expected file:///path)")
    try:  # realpath, not Path.resolve: it stats the result, which would tell a symlink loop outside
        path = Path(os.path.realpath(name))
    except ValueError:  # a lone surrogate
        raise PartError(ref.param, f"{shown(ref.url)!r} is not a valid file path") from None
    if not path.is_relative_to(policy.allowed_dir):
        raise PartError(
            ref.param,
            f"{shown(ref.url)!r} is outside the allowed media directory (--allowed-media-dir); "
            "only files below it are read, after resolving symlinks and '..'",
        )
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise PartError(ref.param, f"{shown(ref.url)!r} does not exist") from None
    except OSError as e:
        raise PartError(ref.param, f"{shown(ref.url)!r} cannot be read: {e.strerror}") from None
    _check_regular(ref, info)
    check_size(ref, info.st_size, policy)
    return _read_regular(ref, path, policy)


def _check_regular(ref: MediaRef, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise PartError(ref.param, f"{shown(ref.url)!r} is not a regular file")


def _read_regular(ref: MediaRef, path: Path, policy: MediaPolicy) -> bytes:
    """Up to max_bytes + 1 of a file that was a regular file when stat'ed: opened without blocking
    and without following a symlink, and checked again once open (it may have been swapped)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise PartError(ref.param, f"{shown(ref.url)!r} cannot be read: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        _check_regular(ref, os.fstat(f.fileno()))
        raw = f.read(policy.max_bytes + 1)
    check_size(ref, len(raw), policy)
    return raw

"""Decoding images (Pillow) and video (PyAV) from a path, bytes or a PIL image.

Every failure a client can cause (no such file, empty or truncated data, not an image, a format
we do not take, too many pixels) is a `MediaError` with a one-line message: the server answers it
with a 400, never a traceback. Bytes are decoded from memory; nothing is written to disk.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .model_inputs import MediaError

# Larger images are refused before their pixels are decoded (a decompression bomb is a small
# file that decodes to gigabytes).
DEFAULT_MAX_PIXELS = 50_000_000
# Formats a client may send; Pillow reads more (TIFF, ICO, PSD, ...), but those stay out.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# Frames kept from one video; sampling (32 frames by default) stays well below it.
DEFAULT_MAX_FRAMES = 256
# FFmpeg demuxers a video may be read with (`format_whitelist`, checked before a demuxer reads its
# header): real containers only. Script and playlist formats (concat, HLS, image sequences, ...)
# would open other files or URLs beside the server.
VIDEO_DEMUXERS = ("mov", "mp4", "matroska", "webm", "avi", "mpeg", "mpegts")
# The demuxer a declared MIME type names; video/mpeg (program or transport stream) is probed.
VIDEO_FORMAT_OF_MIME = {
    "video/mp4": "mp4",
    "video/quicktime": "mov",
    "video/webm": "webm",
    "video/x-matroska": "matroska",
    "video/x-msvideo": "avi",
}
# The MIME type a file name's extension declares.
VIDEO_MIME_OF_SUFFIX = {
    ".mp4": "video/mp4",
    ".m4v": "video/mp4",
    ".mov": "video/quicktime",
    ".webm": "video/webm",
    ".mkv": "video/x-matroska",
    ".avi": "video/x-msvideo",
    ".mpg": "video/mpeg",
    ".mpeg": "video/mpeg",
    ".ts": "video/mpeg",
}

ImageSource = Image.Image | str | Path | bytes | bytearray | memoryview
VideoSource = str | Path | bytes | bytearray | memoryview


def _megapixels(width: int, height: int) -> str:
    return f"{width}x{height} ({width * height / 1e6:.1f} megapixels)"


def check_pixels(width: int, height: int, max_pixels: int, what: str = "image") -> None:
    """Refuse media whose frames hold more than `max_pixels` pixels."""
    if width * height > max_pixels:
        raise MediaError(f"{what} is {_megapixels(width, height)}, over the limit of {max_pixels / 1e6:g} megapixels")


def _read_source(source: object, what: str) -> io.BytesIO | str:
    """A path that exists, or the bytes in memory; MediaError for anything else."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise MediaError(f"empty {what} data")
        return io.BytesIO(bytes(source))
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            size = path.stat().st_size if path.is_file() else None
        except (OSError, ValueError):  # a name too long, or not a name at all
            size = None
        if size is None:
            raise MediaError(f"{what} file not found: {str(source)[:200]}")
        if size == 0:
            raise MediaError(f"empty {what} file: {path}")
        return str(path)
    raise MediaError(f"unsupported {what} source type {type(source).__name__} (expected a file path or bytes)")


def convert_to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited onto white, as transformers' `convert_to_rgb` does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _too_large(max_pixels: int) -> MediaError:
    return MediaError(f"image is too large to decode safely (limit {max_pixels / 1e6:g} megapixels)")


def _decode_file(data: io.BytesIO | str, max_pixels: int) -> Image.Image:
    """Open, check format and size from the header, then decode the first frame upright (a copy:
    the file is closed on return)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            opened = Image.open(data)
        except UnidentifiedImageError:
            raise MediaError("not an image, or an image format that cannot be read") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise _too_large(max_pixels) from None
        with opened as image:
            if image.format not in IMAGE_FORMATS:
                raise MediaError(f"unsupported image format {image.format} (supported: PNG, JPEG, WebP, GIF)")
            check_pixels(image.width, image.height, max_pixels)
            try:
                image.seek(0)  # the first frame of an animated GIF / WebP
                image.load()
                return ImageOps.exif_transpose(image)
            except (Image.DecompressionBombError, Image.DecompressionBombWarning):
                raise _too_large(max_pixels) from None
            except (OSError, ValueError, SyntaxError, EOFError) as e:
                raise MediaError(f"truncated or corrupt {image.format} image: {e}") from None


def open_image(source: ImageSource, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """The RGB PIL image of `source`: a PIL image, a file path, or encoded bytes (PNG, JPEG, WebP,
    GIF's first frame), EXIF orientation applied to decoded files.

    A PIL image is taken as it is (no EXIF rotation, as transformers takes it), only size-checked
    and converted to RGB."""
    if isinstance(source, Image.Image):
        check_pixels(source.width, source.height, max_pixels)
        try:
            source.load()
        except (OSError, ValueError) as e:
            raise MediaError(f"truncated or corrupt image: {e}") from None
        return convert_to_rgb(source)
    image = _decode_file(_read_source(source, "image"), max_pixels)
    return convert_to_rgb(image)


@dataclass
class VideoMetadata:
    """What transformers' `VideoMetadata` holds: the stream's frame count and rate, and which
    frames were kept (the timestamps in the prompt come from them)."""

    total_num_frames: int
    fps: float | None
    duration: float | None
    width: int
    height: int
    frames_indices: list[int] = field(default_factory=list)

    @property
    def timestamps(self) -> list[float]:
        """Seconds of each kept frame (24 fps when the stream does not say, as transformers assumes)."""
        fps = self.fps or 24.0
        return [i / fps for i in self.frames_indices]


@dataclass
class Video:
    """Decoded frames [num_frames, height, width, 3] uint8 RGB and their metadata."""

    frames: np.ndarray
    metadata: VideoMetadata


def _count_frames(container, stream) -> int:
    """Frames in a stream whose header does not say: its packets, counted without decoding."""
    count = sum(1 for packet in container.demux(stream) if packet.size)
    container.seek(0)
    return count


def _stream_metadata(container, stream) -> VideoMetadata:
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else None
    total = int(stream.frames or 0) or _count_frames(container, stream)
    if total <= 0:
        raise MediaError("video has no frames")
    duration = total / fps if fps else None
    ctx = stream.codec_context
    return VideoMetadata(total, fps, duration, int(ctx.width), int(ctx.height))


def _decode_frames(container, stream, indices: Sequence[int]) -> tuple[list[int], list[np.ndarray]]:
    """The frames at `indices` (in decode order), stopping after the last one."""
    wanted, last = set(indices), max(indices)
    kept, frames = [], []
    for i, frame in enumerate(container.decode(stream)):
        if i > last:
            break
        if i in wanted:
            kept.append(i)
            frames.append(frame.to_ndarray(format="rgb24"))
    return kept, frames


def video_mime(name: str) -> str | None:
    """The video MIME type a file name's extension declares (None: not one we know)."""
    return VIDEO_MIME_OF_SUFFIX.get(Path(name).suffix.lower())


def _open_container(data: io.BytesIO | str, mime: str | None):
    """PyAV's container of `data`, read only by a whitelisted demuxer (the one `mime` names, if any)."""
    import av

    fmt = VIDEO_FORMAT_OF_MIME.get(mime or "")
    try:
        return av.open(data, format=fmt, options={"format_whitelist": ",".join(VIDEO_DEMUXERS)})
    except av.error.ArgumentError:  # EINVAL: the probed format is not on the whitelist
        raise MediaError(
            "cannot decode video: not a container format this server reads "
            "(MP4/MOV, WebM/Matroska, AVI, MPEG program or transport stream)"
        ) from None
    except (av.error.FFmpegError, OSError, ValueError) as e:
        declared = f"not a valid {fmt} file (its declared type is {mime}): " if fmt else ""
        raise MediaError(f"cannot decode video: {declared}{getattr(e, 'strerror', None) or e}") from None


def open_video(
    source: VideoSource,
    sample_indices: Callable[[VideoMetadata], Sequence[int]] | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_frames: int = DEFAULT_MAX_FRAMES,
    mime: str | None = None,
) -> Video:
    """Decode the frames of `source` (a file path or bytes) that `sample_indices(metadata)` picks
    (all frames without it), with the stream's metadata. Only real container formats are read:
    `mime` (for a path, its extension when None) picks the demuxer; without one FFmpeg probes
    among VIDEO_DEMUXERS."""
    import av

    data = _read_source(source, "video")
    if mime is None and isinstance(data, str):
        mime = video_mime(data)
    try:
        with _open_container(data, mime) as container:
            if not container.streams.video:
                raise MediaError("no video stream in the file")
            stream = container.streams.video[0]
            metadata = _stream_metadata(container, stream)
            check_pixels(metadata.width, metadata.height, max_pixels, "video frame")
            picked = sample_indices(metadata) if sample_indices else range(metadata.total_num_frames)
            indices = [int(i) for i in picked]
            if not indices:
                raise MediaError("no video frames were sampled")
            if len(indices) > max_frames:
                raise MediaError(f"{len(indices)} video frames requested, over the limit of {max_frames}")
            kept, frames = _decode_frames(container, stream, indices)
    except MediaError:
        raise
    except (av.error.FFmpegError, OSError, ValueError, EOFError, IndexError) as e:
        raise MediaError(f"cannot decode video: {e}") from None
    if not frames:
        raise MediaError("video has no decodable frames")
    metadata.frames_indices = kept
    return Video(np.stack(frames), metadata)

"""Media made in memory for the tests: small PNGs and MP4s, a lossless 3 s clip whose frames each
have a known solid colour, and the OpenAI message parts (data URLs, image parts) that carry them."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
from PIL import Image

FPS, FRAMES, WIDTH, HEIGHT = 10, 30, 64, 48  # make_clip's clip: 3 s


def png_bytes(width: int = 40, height: int = 30, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def mp4_bytes(frames: int = 3, size: int = 32) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), 40 * i, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def colour(i: int) -> tuple[int, int, int]:
    """The solid colour of make_clip's frame i."""
    return ((i * 8) % 256, 255 - i * 8, (i * 37) % 256)


def make_clip(container: str = "matroska", codec: str = "ffv1", pix_fmt: str = "bgr0") -> bytes:
    """A 3 s clip, one solid colour a frame (ffv1 is lossless; Matroska does not store a frame count)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, pix_fmt
        for i in range(FRAMES):
            frame = np.empty((HEIGHT, WIDTH, 3), np.uint8)
            frame[:] = colour(i)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts, text: str = "what is this?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


PNG = png_bytes()

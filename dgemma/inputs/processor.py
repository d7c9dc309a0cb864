"""The Gemma 4 image and video processor: what transformers 5.23's `Gemma4Processor` computes
(`Gemma4ImageProcessorPil` for images, `Gemma4VideoProcessor` for video), without transformers.

An image is resized, keeping its aspect ratio, to the largest size whose sides are multiples of
`pooling_kernel_size * patch_size` and that fits the soft-token budget, rescaled to [0, 1], cut
into `patch_size` squares (row-major, each patch's pixels row-major with RGB innermost) and padded
to the budget's patch count. Its placeholder in the prompt becomes `<boi>` + `<image>` x N + `<eoi>`
with N = patches / pooling_kernel_size^2.

A video becomes its sampled frames, each such an image (the video budget, 70 soft tokens by
default), laid out as Gemma 4 lays them: `MM:SS <boi><image>...<eoi>` per frame, joined by spaces.
DiffusionGemma's encoder only replaces image tokens, so every frame's placeholders are the image
token (transformers' Gemma 4 writes its video token there).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..config import ConfigError
from . import decode
from .decode import DEFAULT_MAX_FRAMES, DEFAULT_MAX_PIXELS, Video, VideoMetadata, open_video
from .model_inputs import SOFT_TOKEN_BUDGETS as SUPPORTED_SOFT_TOKENS
from .model_inputs import ImagePatches, MediaError, ModelInputs
from .tokenizer import Tokenizer

# Gemma 4's token strings, used when tokenizer_config.json does not name them.
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN, VIDEO_TOKEN = "<|image|>", "<|image>", "<image|>", "<|video|>"
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
# PIL filters a video frame can be resized with, as torch's interpolate modes (transformers' video
# processor resizes with torchvision, which calls torch's interpolate).
TORCH_INTERPOLATION = {0: "nearest", 2: "bilinear", 3: "bicubic"}
# An image or video its owner loads itself: called as `loader(processor, max_soft_tokens)` when the
# processor reaches it in the prompt, it returns what `Processor.image` / `Processor.video` would.
# Media is then decoded one item at a time, each reduced to its patches before the next is decoded
# (the server hands over fetched bytes this way, with errors naming the request's part).
MediaLoader = Callable[["Processor", "int | None"], Any]


def check_budget(max_soft_tokens: Any, error: type[ValueError] = MediaError) -> int:
    """A soft-token budget Gemma 4's vision tower was trained with, or `error` naming them."""
    if isinstance(max_soft_tokens, bool) or max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        allowed = ", ".join(map(str, SUPPORTED_SOFT_TOKENS))
        raise error(f"max_soft_tokens must be one of {allowed} (got {max_soft_tokens!r})")
    return int(max_soft_tokens)


# ---------------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class ImageProcessorConfig:
    """`Gemma4ImageProcessorPil`'s settings (its defaults here), as processor_config.json holds them."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    resample: int = 3  # PIL's BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)

    def __post_init__(self):
        check_budget(self.max_soft_tokens, ConfigError)
        for name in ("patch_size", "pooling_kernel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer (got {value!r})")
        if self.resample not in (0, 1, 2, 3, 4, 5):
            raise ConfigError(f"resample must be a PIL filter number 0-5 (got {self.resample!r})")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or not all(self.image_std):
            raise ConfigError("image_mean and image_std must hold 3 values, the std ones non-zero")

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """The known keys of a (sub-)config dict; the others (types, tokens, ...) are ignored."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        for k in ("image_mean", "image_std"):
            if k in kwargs:
                v = kwargs[k]
                kwargs[k] = tuple(v) if isinstance(v, (list, tuple)) else (v,) * 3
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ConfigError(f"bad processor config: {e}") from None

    def max_patches(self, max_soft_tokens: int) -> int:
        return max_soft_tokens * self.pooling_kernel_size**2


@dataclass(frozen=True)
class VideoProcessorConfig(ImageProcessorConfig):
    """`Gemma4VideoProcessor`'s settings: a smaller per-frame budget and frame sampling (`num_frames`
    frames spread over the clip, or `fps` frames a second when num_frames is null)."""

    max_soft_tokens: int = 70
    do_normalize: bool = True
    num_frames: int | None = 32
    fps: float | None = None
    do_sample_frames: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.resample not in TORCH_INTERPOLATION:
            raise ConfigError(f"video resample must be one of {sorted(TORCH_INTERPOLATION)} (got {self.resample!r})")
        if self.num_frames is not None and (not isinstance(self.num_frames, int) or self.num_frames <= 0):
            raise ConfigError(f"num_frames must be a positive integer or null (got {self.num_frames!r})")
        if self.fps is not None and not (isinstance(self.fps, (int, float)) and self.fps > 0):
            raise ConfigError(f"fps must be a positive number or null (got {self.fps!r})")


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def processor_sub_configs(path: str | Path) -> tuple[dict | None, dict | None]:
    """The image and video processor dicts of a checkpoint, in either layout: transformers 5's
    processor_config.json (sub-configs under `image_processor` / `video_processor`; some
    checkpoints put that composite in preprocessor_config.json), or the older flat
    preprocessor_config.json and video_preprocessor_config.json."""
    path = Path(path)
    composite, flat_image, flat_video = (_read_json(path / name) for name in PROCESSOR_FILES)
    image = video = None
    for d in (composite, flat_image):
        if d is not None:
            image = image or d.get("image_processor")
            video = video or d.get("video_processor")
    if image is None and flat_image is not None and "feature_extractor_type" not in flat_image:
        image = flat_image
    if video is None and flat_video is not None:
        video = flat_video
    for name, d in (("image_processor", image), ("video_processor", video)):
        if d is not None and not isinstance(d, dict):
            raise ConfigError(f"{path}: {name} must be a JSON object")
    return image, video


# ----------------------------------------------------------------------------------------- images
def get_aspect_ratio_preserving_size(
    height: int, width: int, patch_size: int, max_patches: int, pooling_kernel_size: int
) -> tuple[int, int]:
    """(height, width) to resize to: the largest multiples of pooling_kernel_size * patch_size
    that keep the aspect ratio within `max_patches` patches; a side that rounds to 0 gets one
    unit and the other side its ratio (capped), as transformers does for very thin images."""
    unit = pooling_kernel_size * patch_size
    target_px = max_patches * patch_size**2
    scale = math.sqrt(target_px / (height * width))
    new_h = int(math.floor(scale * height / unit)) * unit
    new_w = int(math.floor(scale * width / unit)) * unit
    if new_h == 0 and new_w == 0:
        raise MediaError(f"a {width}x{height} image cannot be resized to a multiple of {unit} pixels")
    longest = (max_patches // pooling_kernel_size**2) * unit
    if new_h == 0:
        new_h, new_w = unit, min(int(math.floor(width / height)) * unit, longest)
    elif new_w == 0:
        new_h, new_w = min(int(math.floor(height / width)) * unit, longest), unit
    if new_h * new_w > target_px:
        raise MediaError(f"a {width}x{height} image resized to {new_w}x{new_h} exceeds {max_patches} patches")
    return new_h, new_w


def convert_image_to_patches(image: np.ndarray, patch_size: int) -> np.ndarray:
    """[H, W, C] -> [patches, patch_size^2 * C]: patches row-major, pixels row-major, channels innermost."""
    h, w, c = image.shape
    ph, pw = h // patch_size, w // patch_size
    grid = image.reshape(ph, patch_size, pw, patch_size, c).transpose(0, 2, 1, 3, 4)
    return grid.reshape(ph * pw, patch_size * patch_size * c)


def patch_positions(patch_height: int, patch_width: int) -> np.ndarray:
    """(x, y) of each patch, in patch order: [patches, 2] int64."""
    ys, xs = np.divmod(np.arange(patch_height * patch_width, dtype=np.int64), patch_width)
    return np.stack([xs, ys], axis=-1)


def to_image_patches(pixels: np.ndarray, config: ImageProcessorConfig, max_soft_tokens: int) -> ImagePatches:
    """A resized, rescaled [H, W, 3] float32 image patchified and padded to the budget (0 / -1)."""
    p, k = config.patch_size, config.pooling_kernel_size
    patches = convert_image_to_patches(pixels, p)
    positions = patch_positions(pixels.shape[0] // p, pixels.shape[1] // p)
    max_patches = config.max_patches(max_soft_tokens)
    n = patches.shape[0]
    padded = np.zeros((max_patches, patches.shape[1]), dtype=np.float32)
    padded[:n] = patches
    padded_positions = np.full((max_patches, 2), -1, dtype=np.int64)
    padded_positions[:n] = positions
    return ImagePatches(padded, padded_positions, n // k**2)


def _target_size(width: int, height: int, config: ImageProcessorConfig, max_soft_tokens: int) -> tuple[int, int]:
    if width <= 0 or height <= 0:
        raise MediaError(f"image has no pixels ({width}x{height})")
    if not config.do_resize:
        return height, width
    return get_aspect_ratio_preserving_size(
        height, width, config.patch_size, config.max_patches(max_soft_tokens), config.pooling_kernel_size
    )


def preprocess_image(
    image: Image.Image, config: ImageProcessorConfig, max_soft_tokens: int | None = None
) -> ImagePatches:
    """One RGB image as `Gemma4ImageProcessorPil` gives it: PIL resize of the uint8 image, then
    rescale in float64 cast to float32 and normalize in float32 (its numpy arithmetic)."""
    budget = check_budget(config.max_soft_tokens if max_soft_tokens is None else max_soft_tokens)
    if image.mode != "RGB":
        raise MediaError(f"preprocess_image takes RGB images (got mode {image.mode}); use open_image")
    height, width = _target_size(image.width, image.height, config, budget)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), resample=config.resample)
    pixels = np.asarray(image)
    if config.do_rescale:
        pixels = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    else:
        pixels = pixels.astype(np.float32)
    if config.do_normalize:
        pixels = (pixels - np.asarray(config.image_mean, np.float32)) / np.asarray(config.image_std, np.float32)
    return to_image_patches(pixels, config, budget)


# ------------------------------------------------------------------------------------------ video
def sample_frame_indices(
    total_num_frames: int, video_fps: float | None, num_frames: int | None = None, fps: float | None = None
) -> list[int]:
    """Frames transformers' `default_sample_indices_fn` picks: `num_frames` (else `fps` frames a
    second, at least one) spread evenly from frame 0, or every frame when neither is set.
    Unlike transformers, which refuses a clip shorter than num_frames, such a clip gives all its frames."""
    if num_frames is None and fps is not None:
        if not video_fps:
            raise MediaError("the video does not say its frame rate, so it cannot be sampled at a rate in fps")
        num_frames = max(1, int(total_num_frames / video_fps * fps))
    if num_frames is None:
        return list(range(total_num_frames))
    n = min(num_frames, total_num_frames)
    return [i * total_num_frames // n for i in range(n)]


def format_timestamp(seconds: float) -> str:
    """MM:SS, as Gemma 4 writes a frame's time."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def preprocess_video_frames(
    frames: np.ndarray, config: VideoProcessorConfig, max_soft_tokens: int | None = None
) -> list[ImagePatches]:
    """Sampled frames [T, H, W, 3] uint8 as `Gemma4VideoProcessor` gives them, one ImagePatches a
    frame: torch's antialiased interpolate of the uint8 frames (what torchvision's resize does on
    CPU), then rescale and normalize fused in float32 as transformers' torchvision backend does."""
    import torch

    budget = check_budget(config.max_soft_tokens if max_soft_tokens is None else max_soft_tokens)
    height, width = _target_size(frames.shape[2], frames.shape[1], config, budget)
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    if (height, width) != tuple(video.shape[-2:]):
        mode = TORCH_INTERPOLATION[config.resample]
        video = torch.nn.functional.interpolate(
            video,
            size=[height, width],
            mode=mode,
            align_corners=None if mode == "nearest" else False,
            antialias=mode != "nearest",
        )
    video = video.to(torch.float32)
    mean, std = torch.tensor(config.image_mean), torch.tensor(config.image_std)
    if config.do_rescale and config.do_normalize:
        mean, std = mean * (1.0 / config.rescale_factor), std * (1.0 / config.rescale_factor)
    if config.do_normalize:
        video = (video - mean[:, None, None]) / std[:, None, None]
    elif config.do_rescale:
        video = video * config.rescale_factor
    pixels = video.permute(0, 2, 3, 1).numpy()
    return [to_image_patches(frame, config, budget) for frame in pixels]


def video_replacement(timestamps: Sequence[float], num_soft_tokens: int, boi: str, token: str, eoi: str) -> str:
    """Gemma 4's text for a video's frames: `MM:SS <boi><token>...<eoi>` per frame, space-joined."""
    frame = f"{boi}{token * num_soft_tokens}{eoi}"
    return " ".join(f"{format_timestamp(t)} {frame}" for t in timestamps)


# -------------------------------------------------------------------------------------- processor
def _token_string(config: dict, key: str, default: str) -> str:
    """A model-specific token as transformers 5 saves it: a top-level `key` in tokenizer_config.json
    (or in its `model_specific_special_tokens` / dict-form `extra_special_tokens`)."""
    for d in (config, config.get("model_specific_special_tokens"), config.get("extra_special_tokens")):
        if isinstance(d, dict) and d.get(key) is not None:
            value = d[key]
            return value.get("content", default) if isinstance(value, dict) else str(value)
    return default


def _as_list(media: Any) -> list:
    """Media given as one item (an image, a path, bytes, a Video) or as a sequence of them."""
    if media is None:
        return []
    if isinstance(media, (Image.Image, str, Path, bytes, bytearray, memoryview, Video)) or callable(media):
        return [media]
    return list(media)


def _media_parts(messages: Any) -> tuple[list, list]:
    """Images and videos of OpenAI/transformers-style content parts, in order. transformers takes
    the source from the part's `image`/`video`, `url` or `path` key."""
    images, videos = [], []
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image", "video"):
                source = next((part[k] for k in (kind, "url", "path") if part.get(k) is not None), None)
                if source is None:
                    raise MediaError(f"message {i}: content part {j} ({kind}) has no '{kind}', 'url' or 'path'")
                (images if kind == "image" else videos).append(source)
            elif kind != "text":
                raise MediaError(f"message {i}: content part {j} has type {kind!r}; parts are text, image or video")
    return images, videos


class Processor:
    """Text with `<|image|>` / `<|video|>` placeholders, and the images and videos they stand for,
    to `ModelInputs`, as transformers' `Gemma4Processor` builds them."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        image_config: ImageProcessorConfig | None = None,
        video_config: VideoProcessorConfig | None = None,
        image_token: str = IMAGE_TOKEN,
        boi_token: str = BOI_TOKEN,
        eoi_token: str = EOI_TOKEN,
        video_token: str = VIDEO_TOKEN,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_frames: int = DEFAULT_MAX_FRAMES,
    ):
        self.tokenizer = tokenizer
        self.image_config = image_config or ImageProcessorConfig()
        self.video_config = video_config or VideoProcessorConfig(
            patch_size=self.image_config.patch_size, pooling_kernel_size=self.image_config.pooling_kernel_size
        )
        self.image_token, self.boi_token, self.eoi_token = image_token, boi_token, eoi_token
        self.video_token = video_token
        ids = {t: tokenizer.token_to_id(t) for t in (image_token, boi_token, eoi_token)}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ConfigError(f"the tokenizer has no token {', '.join(missing)}: it cannot take images")
        self.image_token_id, self.boi_token_id, self.eoi_token_id = ids[image_token], ids[boi_token], ids[eoi_token]
        self.max_pixels, self.max_frames = max_pixels, max_frames
        self._placeholder = re.compile(f"({re.escape(image_token)}|{re.escape(video_token)})")

    @classmethod
    def from_dir(cls, path: str | Path, tokenizer: Tokenizer, **kwargs: Any) -> Processor | None:
        """The checkpoint's processor, or None when it has no image processor config or its
        tokenizer no image token."""
        image, video = processor_sub_configs(path)
        if image is None:
            return None
        config = tokenizer.config
        image_token = _token_string(config, "image_token", IMAGE_TOKEN)
        if tokenizer.token_to_id(image_token) is None:
            return None
        image_config = ImageProcessorConfig.from_dict(image)
        video_config = VideoProcessorConfig.from_dict(video) if video is not None else None
        return cls(
            tokenizer,
            image_config,
            video_config,
            image_token=image_token,
            boi_token=_token_string(config, "boi_token", BOI_TOKEN),
            eoi_token=_token_string(config, "eoi_token", EOI_TOKEN),
            video_token=_token_string(config, "video_token", VIDEO_TOKEN),
            **kwargs,
        )

    # ------------------------------------------------------------------ media
    def image(self, source: Any, max_soft_tokens: int | None = None) -> ImagePatches:
        """One image (PIL image, path or bytes) decoded and preprocessed; a MediaLoader does it itself."""
        if callable(source):
            return source(self, max_soft_tokens)
        return preprocess_image(decode.open_image(source, self.max_pixels), self.image_config, max_soft_tokens)

    def sample_indices(self, metadata: VideoMetadata) -> list[int]:
        c = self.video_config
        if not c.do_sample_frames:
            return list(range(metadata.total_num_frames))
        return sample_frame_indices(metadata.total_num_frames, metadata.fps, c.num_frames, c.fps)

    def video(self, source: Any, max_soft_tokens: int | None = None) -> tuple[list[ImagePatches], list[float]]:
        """A video's sampled frames, preprocessed, and their timestamps in seconds. `source` is a
        path, bytes, or a `Video` from open_video (taken as already sampled); a MediaLoader does it itself."""
        if callable(source):
            return source(self, max_soft_tokens)
        video = source
        if not isinstance(video, Video):
            video = open_video(source, self.sample_indices, self.max_pixels, self.max_frames)
        frames = preprocess_video_frames(video.frames, self.video_config, max_soft_tokens)
        return frames, video.metadata.timestamps

    def image_replacement(self, num_soft_tokens: int) -> str:
        return f"{self.boi_token}{self.image_token * num_soft_tokens}{self.eoi_token}"

    # ------------------------------------------------------------------ prompts
    def _check_counts(self, pieces: list[str], images: list, videos: list) -> None:
        """transformers' rule: one placeholder in the text per image and per video given."""
        for token, items, kind in ((self.image_token, images, "image"), (self.video_token, videos, "video")):
            found = pieces.count(token)
            if found == len(items):
                continue
            if not found:
                raise MediaError(
                    f"{len(items)} {kind}(s) given but the text has no {token} placeholder: "
                    f"put one {token} in the text where each {kind} goes"
                )
            raise MediaError(f"the text has {found} {token} placeholder(s) but {len(items)} {kind}(s) were given")

    def __call__(
        self,
        text: str,
        images: Iterable | None = None,
        videos: Iterable | None = None,
        max_soft_tokens: int | None = None,
        video_max_soft_tokens: int | None = None,
        add_special_tokens: bool = True,
    ) -> ModelInputs:
        """`text` with one image placeholder (`<|image|>`) per image and one `<|video|>` per video,
        in order (images: PIL images, paths or bytes; videos: paths, bytes or `Video`s; either may be
        a MediaLoader), each expanded as Gemma 4 expands it, media decoded and preprocessed in text
        order, one item at a time; then tokenized as transformers' processor tokenizes
        (add_special_tokens: the tokenizer's <bos>)."""
        if not isinstance(text, str):
            raise MediaError(f"text must be a string (got {type(text).__name__})")
        images, videos = _as_list(images), _as_list(videos)
        pieces = self._placeholder.split(text)
        self._check_counts(pieces, images, videos)
        next_image, next_video = iter(images), iter(videos)
        out, patches = [], []
        for piece in pieces:
            if piece == self.image_token:
                image = self.image(next(next_image), max_soft_tokens)
                patches.append(image)
                out.append(self.image_replacement(image.num_soft_tokens))
            elif piece == self.video_token:
                frames, times = self.video(next(next_video), video_max_soft_tokens)
                patches.extend(frames)
                n = frames[0].num_soft_tokens
                out.append(video_replacement(times, n, self.boi_token, self.image_token, self.eoi_token))
            else:
                out.append(piece)
        ids = self.tokenizer.encode("".join(out), add_special_tokens=add_special_tokens)
        inputs = ModelInputs(ids, patches, self.image_token_id)
        if ids.count(self.image_token_id) != inputs.num_image_tokens:  # transformers checks it too
            raise ConfigError(
                f"the prompt holds {ids.count(self.image_token_id)} {self.image_token} tokens once tokenized but its "
                f"images need {inputs.num_image_tokens}: the tokenizer does not keep {self.image_token} as one token"
            )
        return inputs

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The chat template applied to messages whose content may be a list of parts; the
        template also sees the media token strings, as transformers passes its special tokens."""
        tokens = {
            "image_token": self.image_token,
            "boi_token": self.boi_token,
            "eoi_token": self.eoi_token,
            "video_token": self.video_token,
        }
        return self.tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt, **{**tokens, **kwargs})

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        max_soft_tokens: int | None = None,
        video_max_soft_tokens: int | None = None,
        **kwargs: Any,
    ) -> ModelInputs:
        """OpenAI/transformers-style messages (content a string or a list of `{"type": "text" |
        "image" | "video", ...}` parts) rendered with the chat template, then processed. As in
        transformers, a rendered prompt that starts with <bos> gets no second one."""
        images, videos = _media_parts(messages)
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        bos = self.tokenizer.bos_token
        add_special = not (bos and text.startswith(bos))
        return self(text, images, videos, max_soft_tokens, video_max_soft_tokens, add_special)

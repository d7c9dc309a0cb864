"""What the processor hands the model: prompt token ids with image placeholders, and each
image's patches (the arrays transformers' `Gemma4ImageProcessorPil` gives, one image at a time).

A video arrives here as its sampled frames, each one image (see processor.py); the model only
ever sees images.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # soft tokens per image Gemma 4 supports
MAX_SOFT_TOKENS = max(SOFT_TOKEN_BUDGETS)


class MediaError(ValueError):
    """An image or video that cannot be used: undecodable, too large, not allowed, or sent to a
    checkpoint without a vision tower. The message names the problem (the server answers 400)."""


@dataclass(frozen=True)
class ImagePatches:
    """One image, patchified: `pixel_values` [max_patches, 3 * patch^2] float32 in [0, 1] and
    `position_ids` [max_patches, 2] int64 (x, y) of each patch, padded to the budget's patch
    count with zeros / -1 as transformers pads them; `num_soft_tokens` placeholders stand for it."""

    pixel_values: np.ndarray
    position_ids: np.ndarray
    num_soft_tokens: int

    @property
    def num_patches(self) -> int:
        """Patches that are not padding."""
        return int((self.position_ids[:, 0] >= 0).sum())

    @cached_property
    def key(self) -> bytes:
        """Content hash of the image as the model sees it (the vision cache's and prefix cache's key;
        computed once: the scheduler asks for it at every committed block)."""
        n = self.num_patches
        h = hashlib.blake2b(digest_size=16)
        h.update(np.ascontiguousarray(self.pixel_values[:n], dtype=np.float32).tobytes())
        h.update(np.ascontiguousarray(self.position_ids[:n], dtype=np.int64).tobytes())
        return h.digest()


@dataclass
class ModelInputs:
    """A prompt ready for the model: `input_ids` hold, for images[i], `images[i].num_soft_tokens`
    consecutive image tokens (between begin- and end-of-image tokens), in order."""

    input_ids: list[int]
    images: list[ImagePatches] = field(default_factory=list)
    image_token_id: int | None = None

    @property
    def num_image_tokens(self) -> int:
        return sum(im.num_soft_tokens for im in self.images)

    @property
    def mm_token_type_ids(self) -> list[int]:
        """1 at image tokens, 0 elsewhere (transformers' `mm_token_type_ids`)."""
        return [int(t == self.image_token_id) for t in self.input_ids]


def image_token_runs(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of image tokens in `ids`: one run per image (the processor puts
    begin- and end-of-image tokens around each)."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] != image_token_id:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == image_token_id:
            j += 1
        runs.append((i, j))
        i = j
    return runs


def splits_image(position: int, spans: list[tuple[int, int]]) -> bool:
    """Whether a cut at `position` falls strictly inside an image's tokens."""
    return any(a < position < b for a, b in spans)


def image_safe_end(start: int, end: int, spans: list[tuple[int, int]]) -> int:
    """Where a pass (or a prefill chunk) from `start` that would end at `end` ends instead, so that
    it never splits an image: image tokens attend to each other, so one pass holds all of an
    image's remaining tokens. Cut before an image that starts inside it; take the whole image if it
    starts the pass. A pure function of the positions, so cold and prefix-cached runs cut alike."""
    for a, b in spans:
        if a < end < b:
            return a if a > start else b
    return end

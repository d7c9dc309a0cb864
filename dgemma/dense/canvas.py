"""Scoring canvases outside the engine (`Model.canvas_logits`): one decoder pass over given canvases
after their prompts, each prompt at its own positions in a dense cache, as the reference computes
it; and a prompt's images placed as the reference places them (the reference loop takes them so too).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..engine.prefill import prefill
from ..engine.request import image_spans, validate_prompts
from ..inputs.model_inputs import ImagePatches
from ..model.diffusion_gemma import DiffusionGemma
from .kv_cache import DenseKVCache


def placed_images(net: DiffusionGemma, ids: list[int], images: list[ImagePatches]) -> list:
    """Each image's soft tokens placed at its placeholders; the vision tower runs here on the
    reference's padded batch of the prompt's images (so that it rounds as the reference does)."""
    spans = image_spans(ids, images, net.config.vision.image_token_id)
    features: list = [None] * len(images)
    for size in sorted({im.pixel_values.shape[0] for im in images}):  # one batch per patch budget
        batch = [k for k, im in enumerate(images) if im.pixel_values.shape[0] == size]
        pixels = torch.from_numpy(np.stack([images[k].pixel_values for k in batch])).to(net.device)
        positions = torch.from_numpy(np.stack([images[k].position_ids for k in batch])).to(net.device)
        stacked = net.vision.image_features(pixels, positions)
        for k, part in zip(batch, stacked.split([images[k].num_soft_tokens for k in batch])):
            features[k] = part
    return [(start, f) for (start, _), f in zip(spans, features)]


@torch.no_grad()
def canvas_logits(
    net: DiffusionGemma,
    prompts: list[list[int]],
    images: list[list[ImagePatches]],
    canvas_ids: Sequence | torch.Tensor,
    self_conditioning_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 logits [B, canvas_len, vocab] of one decoder pass over `canvas_ids` after encoding
    `prompts` (with their `images`), optionally self-conditioned on `self_conditioning_logits`."""
    vocab = net.config.vocab_size
    validate_prompts(prompts, vocab)
    canvas = torch.as_tensor(canvas_ids, dtype=torch.long, device=net.device)
    if canvas.dim() != 2 or canvas.shape[0] != len(prompts) or canvas.shape[1] == 0:
        raise ValueError(f"canvas_ids must be [num_prompts={len(prompts)}, canvas_len], got {tuple(canvas.shape)}")
    if canvas.min() < 0 or canvas.max() >= vocab:
        raise ValueError("canvas_ids hold ids outside the vocabulary")
    lengths = [len(p) for p in prompts]
    cache = DenseKVCache(net.kv_config, len(prompts), max(lengths) + canvas.shape[1], net.device, net.dtype)
    placed = [placed_images(net, p, im) if im else [] for p, im in zip(prompts, images)]
    prefill(net, cache, list(range(len(prompts))), prompts, images=placed)
    soft = None
    if self_conditioning_logits is not None:
        sc = torch.as_tensor(self_conditioning_logits, device=net.device)
        if sc.shape != (*canvas.shape, vocab):
            raise ValueError(f"self_conditioning_logits must be {(*canvas.shape, vocab)}")
        soft = net.soft_embed_from_logits(sc)
    hidden = net.decode(canvas, cache.plan_decoder(canvas.shape[1]), soft)
    return net.whole_logits(hidden)

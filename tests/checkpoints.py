"""Checkpoint helpers shared by the tests: the EOS ids of the reference checkpoints, the reference's
rows cut as dgemma cuts them, one denoising step's logits through the dense cache, and the vision
checkpoint with its processor."""

from __future__ import annotations

from pathlib import Path

import torch

from vision_checkpoint import write_vision_checkpoint

EOS = list(range(40, 52))  # a dozen EOS ids, so that EOS turns up inside canvases


def cut(row: list[int], max_new: int, eos: list[int] = EOS) -> list[int]:
    """A reference row as dgemma returns it: at most max_new tokens, ending at the first EOS."""
    out = []
    for t in row[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


def step_logits(
    net, prompt: torch.Tensor, canvas: torch.Tensor, soft: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's logits over the prompt and the decoder's over the canvas, through a dense cache."""
    from dgemma.dense.kv_cache import DenseKVCache

    cache = DenseKVCache(net.config, prompt.shape[0], prompt.shape[1] + canvas.shape[1], "cpu", net.dtype)
    plan = cache.plan_encoder(prompt.shape[1])
    enc = net.encode(prompt, plan)
    cache.commit(plan)
    return net.logits(enc), net.logits(net.decode(canvas, cache.plan_decoder(canvas.shape[1]), soft))


def write_vision_with_processor(path: Path) -> Path:
    """The vision checkpoint with its processor, written to `path`; returns `path`."""
    write_vision_checkpoint(path)
    return path

"""Tiny random DiffusionGemma checkpoints written by transformers 5.23 (the numerical oracle).

Tests only: runtime code never imports transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_VISION = dict(
    model_type="gemma4_vision",
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=8,
)

SHAPES = {
    # GQA on sliding layers (4 heads / 2 KV), K=V global layer with 1 KV head, top-2 of 4 experts.
    "gqa": dict(
        text=dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            global_head_dim=16,
            num_global_key_value_heads=1,
            sliding_window=8,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=16,
        ),
        canvas_length=8,
    ),
    # Two global layers with 2 KV heads (K=V), three experts active of six, window 6, canvas 16.
    "wide": dict(
        text=dict(
            vocab_size=160,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=12,
            global_head_dim=24,
            num_global_key_value_heads=2,
            sliding_window=6,
            num_experts=6,
            top_k_experts=3,
            moe_intermediate_size=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        ),
        canvas_length=16,
    ),
}


def build_reference(
    path: Path,
    shape: str = "gqa",
    seed: int = 0,
    init: float = 0.5,
    generation: dict | None = None,
    text_overrides: dict | None = None,
):
    """Save a random reference model to `path`; returns the reloaded transformers model (eval, float32)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    spec = SHAPES[shape]
    text = dict(spec["text"], initializer_range=init, max_position_embeddings=1024, **(text_overrides or {}))
    config = DiffusionGemmaConfig(
        text_config=text, vision_config=TINY_VISION, canvas_length=spec["canvas_length"], initializer_range=init
    )
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config)
    with torch.no_grad():  # give the scalars and per-expert scales non-trivial values
        for name, p in model.named_parameters():
            if name.endswith("per_expert_scale"):
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    if generation is not None:
        (Path(path) / "generation_config.json").write_text(json.dumps(generation))
    return DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()

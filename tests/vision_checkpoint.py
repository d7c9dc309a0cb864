"""A tiny random DiffusionGemma checkpoint with a vision tower, written by transformers 5.23
(`save_pretrained`), with a processor saved by `Gemma4Processor.save_pretrained` when the test
processor fixture is available. Tests only: runtime code never imports transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from oracle import SHAPES, TINY_VISION

VISION = dict(  # a tower that does some work: two layers, two heads, standardize and clamps on
    TINY_VISION,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    position_embedding_size=256,
    standardize=True,
    use_clipped_linears=True,
)

# Placeholder ids when no processor is written (hand-made prompts); a saved processor's tokenizer decides otherwise.
TOKEN_IDS = {"boi_token_id": 10, "eoi_token_id": 11, "image_token_id": 12}


def write_vision_checkpoint(
    path: Path, seed: int = 0, bidirectional: bool = True, processor: bool = True, generation: dict | None = None
):
    """Write the checkpoint (and its processor files) to `path`; returns the reloaded transformers model."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    path = Path(path)
    ids = dict(TOKEN_IDS)
    if processor:
        from media_fixtures import save_gemma4_processor

        proc = save_gemma4_processor(path)
        tok = proc.tokenizer
        ids = {
            "boi_token_id": tok.convert_tokens_to_ids(proc.boi_token),
            "eoi_token_id": tok.convert_tokens_to_ids(proc.eoi_token),
            "image_token_id": proc.image_token_id,
        }
    spec = SHAPES["gqa"]
    text = dict(spec["text"], initializer_range=0.5, max_position_embeddings=4096)
    if processor:  # room for the test tokenizer's byte symbols (a multiple of 16, as the native kernels like)
        text["vocab_size"] = -(-len(tok) // 16) * 16
    if bidirectional:
        text["use_bidirectional_attention"] = "vision"
    config = DiffusionGemmaConfig(
        text_config=text, vision_config=VISION, canvas_length=spec["canvas_length"], initializer_range=0.5, **ids
    )
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config)
    with torch.no_grad():  # non-trivial scalars, scales, position tables, standardization and clamps
        for name, p in model.named_parameters():
            if name.endswith("per_expert_scale"):
                p.uniform_(0.5, 1.5)
            if name.endswith("position_embedding_table"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
            elif name.endswith("std_bias"):
                b.normal_(0, 0.5)
            elif name.endswith("std_scale"):
                b.uniform_(0.5, 1.5)
            elif name.endswith(("input_min", "output_min")):
                b.fill_(-3.0)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(3.0)
    model.save_pretrained(path)
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()

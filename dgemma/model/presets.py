"""Named model sizes: keyword arguments of `dgemma.model.checkpoint.make_config`.

One table for every tool that builds a model from a name: `dgemma train --config NAME`,
`dgemma bench --size NAME`, `dgemma make-tiny` ("micro"), scripts/gpu_check.py and
scripts/step_breakdown.py. Plain data (no torch), so that anything can import it.
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # dgemma-tiny, the shipped model: every feature of the real architecture (sliding + global layers with
    # K=V and partial RoPE, dense MLP + 8-expert top-2 MoE, self-conditioning) at a size a 2-core CPU trains.
    "tiny": dict(
        vocab_size=4096,
        hidden_size=256,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        global_head_dim=128,
        num_global_kv_heads=1,
        intermediate_size=512,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=128,
        sliding_window=128,
        canvas_length=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        max_position_embeddings=2048,
    ),
    # The training tests' model: 3 layers, canvas 8, trains a few steps in seconds.
    "test": dict(
        vocab_size=384,
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_kv_heads=1,
        intermediate_size=128,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        sliding_window=16,
        canvas_length=8,
        max_position_embeddings=512,
    ),
    # `dgemma make-tiny`'s random checkpoint (byte tokenizer, vocab 384), used by the server tests.
    "micro": dict(
        vocab_size=384,
        hidden_size=64,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_kv_heads=1,
        intermediate_size=128,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
        sliding_window=64,
        canvas_length=32,
    ),
    # The mid-size CPU benchmark model (docs/performance.md).
    "mid": dict(
        vocab_size=32768,
        hidden_size=1024,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=128,
        global_head_dim=256,
        num_global_kv_heads=2,
        intermediate_size=2048,
        num_experts=32,
        top_k_experts=4,
        moe_intermediate_size=512,
        sliding_window=1024,
        canvas_length=256,
    ),
    # The released DiffusionGemma 26B-A4B text stack (model.md), for GPUs.
    "real": dict(
        vocab_size=262144,
        hidden_size=2816,
        num_layers=30,
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        global_head_dim=512,
        num_global_kv_heads=2,
        intermediate_size=2112,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
        sliding_window=1024,
        canvas_length=256,
        max_position_embeddings=131072,
    ),
}

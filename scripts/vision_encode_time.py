"""Time the vision tower on one image, at the released model's tower size, on this machine.

    python scripts/vision_encode_time.py [--budgets 70 280 1120] [--dtype float32 bfloat16] [--repeats 2]

Random weights (the cost does not depend on them): 27 layers of hidden 1152 as published for the
released tower; intermediate 4304 and 16 heads of 72 are assumed (SigLIP-so400m's). One image of
each soft-token budget, square, real patches only, as the engine runs it (packed CPU linears).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from dgemma.config import VisionConfig
from dgemma.kernels.cpu import packed_modules
from dgemma.kernels.cpu import supported as cpu_supported
from dgemma.kernels.native import cpu_model
from dgemma.model.vision import Vision

RELEASED_TOWER = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_layers=27,
    num_heads=16,
    num_kv_heads=16,
    head_dim=72,
    patch_size=16,
    pooling_kernel_size=3,
    position_embedding_size=10240,
    rope_theta=100.0,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    use_clipped_linears=False,
    standardize=True,
    output_dims=1152,
    image_token_id=0,
    boi_token_id=0,
    eoi_token_id=0,
    bidirectional=True,
)


def square_patches(soft_tokens: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    side = int(soft_tokens**0.5) * k  # patches per side: the largest square grid within the budget
    gx, gy = np.meshgrid(np.arange(side), np.arange(side), indexing="xy")
    positions = torch.from_numpy(np.stack([gx, gy], -1).reshape(-1, 2))[None]
    return torch.rand(1, side * side, 3 * 16 * 16), positions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[70, 280])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}", flush=True)
    cfg = VisionConfig(**RELEASED_TOWER)
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        with torch.device("meta"):
            vision = Vision(cfg, 2816)
        vision = vision.to_empty(device="cpu").to(dtype)
        for param in vision.parameters():
            torch.nn.init.normal_(param, std=0.02)
        fast = packed_modules(vision) if cpu_supported(dtype) else vision
        for budget in args.budgets:
            pixels, positions = square_patches(budget, cfg.pooling_kernel_size)
            fast.image_features(pixels, positions)  # warm-up
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                out = fast.image_features(pixels, positions)
                times.append(time.perf_counter() - t)
            print(
                f"{dtype_name:9s} budget {budget:5d}: {pixels.shape[1]:5d} patches -> {out.shape[0]:4d} soft tokens, "
                f"best {min(times) * 1000:8.1f} ms, median {sorted(times)[len(times) // 2] * 1000:8.1f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()

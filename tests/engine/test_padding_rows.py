"""Padding rows (a group smaller than its captured graph's bucket) route through the MoE like
the real rows: their outputs are dropped, but their expert work is not (issue 54)."""

import torch

from dgemma.dense.canvas import canvas_logits
from dgemma.engine.step_ops import padding_canvas
from dgemma.model.checkpoint import make_config
from dgemma.model.diffusion_gemma import DiffusionGemma, Router
from dgemma.model.presets import PRESETS


def busiest_expert_shares(net: DiffusionGemma, canvas: torch.Tensor) -> list[float]:
    """Per layer, the busiest expert's (position, slot) pairs over an even share's."""
    cfg = net.config
    picks: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: picks.append(out[2].reshape(-1)))
        for m in net.modules()
        if isinstance(m, Router)
    ]
    try:
        with torch.no_grad():
            canvas_logits(net, [[2]], [[]], canvas[None])
    finally:
        for h in hooks:
            h.remove()
    even = canvas.numel() * cfg.top_k_experts / cfg.num_experts
    canvas_passes = [p for p in picks if p.numel() == canvas.numel() * cfg.top_k_experts]
    return [torch.bincount(p, minlength=cfg.num_experts).max().item() / even for p in canvas_passes]


def test_a_padding_rows_positions_spread_over_the_experts():
    """Random weights at the mid size's MoE (32 experts, top 4, a 256-position canvas): a canvas of
    token 0 (the padding before) sends (nearly) every position to the same 4 experts, ~8x an even share;
    `padding_canvas` stays within 2x in every layer."""
    torch.manual_seed(0)
    cfg = make_config(**{**PRESETS["mid"], "num_layers": 3})
    net = DiffusionGemma(cfg).eval()
    canvas = padding_canvas(cfg.canvas_length, cfg.vocab_size)
    assert canvas.unique().numel() == cfg.canvas_length and 0 <= canvas.min() and canvas.max() < cfg.vocab_size
    assert min(busiest_expert_shares(net, torch.zeros_like(canvas))) > 4  # ~8x: every position the same 4
    assert max(busiest_expert_shares(net, canvas)) <= 2.0

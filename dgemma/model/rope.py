"""Rotary position embeddings (pure functions).

Sliding layers rotate every pair of the head ("default" RoPE, theta 1e4). Global layers use
"proportional" RoPE: only the first `partial_rotary_factor` of the pairs rotate (theta 1e6), with
frequencies computed against the full head_dim; the remaining pairs get frequency 0 (identity).
The vision tower uses 2D "axial" RoPE over patch (x, y) positions.
"""

from __future__ import annotations

import torch

from ..config import LayerSpec


def inv_freq(spec: LayerSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies (float32, length head_dim // 2) for one layer kind."""
    base, head_dim = spec.rope_theta, spec.head_dim
    if spec.rope_type == "proportional":
        rope_angles = int(spec.partial_rotary_factor * head_dim // 2)
        exponents = torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
        rotated = 1.0 / (base ** (exponents / head_dim))
        nope = head_dim // 2 - rope_angles
        freqs = torch.cat((rotated, torch.zeros(nope, dtype=torch.float32, device=device))) if nope > 0 else rotated
        return freqs / spec.rope_factor
    dim = int(head_dim * spec.partial_rotary_factor)
    if dim != head_dim:
        raise ValueError("default RoPE with partial_rotary_factor < 1 is not supported")
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))


def cos_sin(positions: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, T, head_dim] for integer positions [B, T]."""
    angles = positions[..., None].float() * freqs.to(device=positions.device, dtype=torch.float)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, heads, head_dim] by tables [B, T, head_dim]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (x * cos) + (rotate_half(x) * sin)


def axial_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """2D RoPE tables [..., P, head_dim] for patch positions [..., P, 2]: the first half of each head
    rotates with x, the second with y, each half with the same head_dim / 4 frequencies."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device=positions.device) / half))
    freqs = positions[..., None].float() * inv_freq  # [..., P, 2, head_dim / 4]
    fx, fy = freqs[..., 0, :], freqs[..., 1, :]
    angles = torch.cat([fx, fx, fy, fy], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., P, heads, D]: ordinary rotate-half RoPE applied to each half of the head separately."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., None, :], sin[..., None, :]
    parts = [
        x[..., s] * cos[..., s] + rotate_half(x[..., s]) * sin[..., s] for s in (slice(0, half), slice(half, None))
    ]
    return torch.cat(parts, dim=-1)

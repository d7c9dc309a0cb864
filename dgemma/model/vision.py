"""The Gemma 4 vision tower and its projection into the text model (`model.encoder.vision_tower.*`,
`model.encoder.embed_vision.*`).

An image arrives as patches (see inputs/model_inputs.py) and leaves as `num_soft_tokens` embeddings of
the text hidden size, which replace the image's placeholder tokens in the prompt:

    patches -> 2 (p - 0.5) -> input_proj + x/y position embeddings
            -> layers of bidirectional attention (2D axial RoPE, q/k/v norms) and gated MLP
            -> k x k average pooling over the patch grid -> x sqrt(hidden) -> standardize
            -> embed_vision: scale-free RMSNorm -> linear to the text hidden size

The engine runs one image at a time, its real patches only: the reference pads every image to the
budget's patch count and masks the padding out of attention, so the real patches' outputs are the
same up to float rounding. The reference-exact paths run the reference's padded batch. Operations follow transformers' `Gemma4VisionModel` one for one (float32 pooling and
scaling, RMSNorm via pow(-0.5)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import VisionConfig
from .attention import sdpa
from .layers import RMSNorm, gated_mlp
from .rope import apply_axial_rope, axial_cos_sin


class ClippableLinear(nn.Module):
    """A bias-free linear whose input and output may be clamped to stored ranges
    (`use_clipped_linears`: the checkpoint then holds input_min/max and output_min/max)."""

    def __init__(self, in_features: int, out_features: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "output_min"):
                self.register_buffer(name, torch.tensor(-float("inf")))
            for name in ("input_max", "output_max"):
                self.register_buffer(name, torch.tensor(float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.ones(2, cfg.position_embedding_size, cfg.hidden_size))

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        """pixels [n, P, 3 p^2] in [0, 1], positions [n, P, 2] (x, y; -1 at padding) -> [n, P, hidden]."""
        table = self.position_embedding_table  # (its dtype is the model's: the engine may pack input_proj)
        h = self.input_proj((2 * (pixels - 0.5)).to(table.dtype))
        at = positions.clamp(min=0)
        pos = F.embedding(at[..., 0], table[0]) + F.embedding(at[..., 1], table[1])
        if padding is not None:
            pos = torch.where(padding[..., None], 0.0, pos)
        return h + pos


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        h, hd, clip = cfg.hidden_size, cfg.head_dim, cfg.use_clipped_linears
        self.q_proj = ClippableLinear(h, cfg.num_heads * hd, clip)
        self.k_proj = ClippableLinear(h, cfg.num_kv_heads * hd, clip)
        self.v_proj = ClippableLinear(h, cfg.num_kv_heads * hd, clip)
        self.o_proj = ClippableLinear(cfg.num_heads * hd, h, clip)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(hd, cfg.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        shape = (*x.shape[:2], -1, self.cfg.head_dim)
        q = apply_axial_rope(self.q_norm(self.q_proj(x).view(shape)), cos, sin)
        k = apply_axial_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        v = self.v_norm(self.v_proj(x).view(shape))
        # [n, heads, P, D]; every real patch sees every real patch, scale 1.0 (q and k are normed)
        out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, False)
        return self.o_proj(out.reshape(*x.shape[:2], -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        clip = cfg.use_clipped_linears
        self.approximate = cfg.gelu_approximate
        self.gate_proj = ClippableLinear(cfg.hidden_size, cfg.intermediate_size, clip)
        self.up_proj = ClippableLinear(cfg.hidden_size, cfg.intermediate_size, clip)
        self.down_proj = ClippableLinear(cfg.intermediate_size, cfg.hidden_size, clip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self, x)


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(cfg.num_layers))


def average_pool(
    hidden: torch.Tensor, positions: torch.Tensor, k: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of each k x k cell of each image's patch grid, cells in row-major order (float32):
    [n, P, h] -> ([n, length, h], which of the `length` cells hold patches [n, length]). Padding
    patches (zero hidden states, position -1 read as 0) add nothing."""
    at = positions.clamp(min=0)
    cells_x = (at[..., 0].max(dim=-1, keepdim=True)[0] + 1) // k
    cell = at[..., 0] // k + cells_x * (at[..., 1] // k)
    weights = F.one_hot(cell, length).float() / (k * k)
    return weights.transpose(1, 2) @ hidden.float(), (weights != 0).any(dim=1)


class VisionTower(nn.Module):
    """`Gemma4VisionModel` (patch_embedder, encoder, pooler, std_bias/std_scale)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = VisionEncoder(cfg)
        if cfg.standardize:
            self.register_buffer("std_bias", torch.zeros(cfg.hidden_size))
            self.register_buffer("std_scale", torch.ones(cfg.hidden_size))

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Images pixels [n, P, 3 p^2], positions [n, P, 2] (rows padded with position -1, as the
        processor pads them; the engine passes one image's real patches) -> the soft tokens of
        every image, concatenated [sum of num_soft_tokens, hidden]."""
        cfg, dtype = self.cfg, self.patch_embedder.position_embedding_table.dtype
        padding = (positions == -1).all(dim=-1)
        padded = bool(padding.any())
        padding = padding if padded else None
        x = self.patch_embedder(pixels, positions, padding)
        mask = ~padding[:, None, None, :] if padded else None  # real patches attend to real patches
        cos, sin = axial_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin, mask)
        if padded:
            x = x.masked_fill(padding[..., None], 0.0)
        k = cfg.pooling_kernel_size
        length = x.shape[1] // (k * k)
        if length != x.shape[1]:
            pooled, cells = average_pool(x, positions, k, length)
            x = pooled.to(x.dtype)[cells]
        else:
            x = x[~padding] if padded else x.reshape(-1, x.shape[-1])
        x = x.float() * cfg.hidden_size**0.5
        if cfg.standardize:
            x = (x - self.std_bias.float()) * self.std_scale.float()
        return x.to(dtype)


class VisionEmbedder(nn.Module):
    """`embed_vision`: soft tokens into the text model's space."""

    def __init__(self, cfg: VisionConfig, text_hidden: int):
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(cfg.output_dims, cfg.rms_norm_eps, with_scale=False)
        self.embedding_projection = nn.Linear(cfg.output_dims, text_hidden, bias=False)

    def forward(self, soft_tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(soft_tokens))


class Vision(nn.Module):
    """The tower and its projection: what `DiffusionGemmaEncoderModel.get_image_features` computes."""

    def __init__(self, cfg: VisionConfig, text_hidden: int):
        super().__init__()
        self.vision_tower = VisionTower(cfg)
        self.embed_vision = VisionEmbedder(cfg, text_hidden)

    @torch.no_grad()
    def image_features(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Patches of n images [n, P, 3 p^2], positions [n, P, 2] -> their soft-token embeddings,
        concatenated [sum of num_soft_tokens, text hidden]. Real patches only (one image) is the
        fast way; the reference's padded batch of every image rounds exactly as it does."""
        return self.embed_vision(self.vision_tower(pixels, positions))

"""Attention masks and the scaled-dot-product call (pure functions).

Positions in the KV cache are storage indices: row r's tokens sit at [0, length_r), so a key's index
is its position. Masks are boolean [B, 1, Q, K] (True = attend). Where the reference lets SDPA
build the mask itself (`is_causal`, or no mask at all), so do we: the same kernel path gives the
same float32 rounding, which is what makes `sampling="reference"` token-exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def encoder_mask(
    query_index: torch.Tensor,
    key_lo: int,
    key_hi: int,
    key_valid: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """Causal (optionally sliding-window) mask for queries at storage indices [B, Q].

    A query attends to keys k with k <= q (and k > q - window on sliding layers) that are valid.
    A padding query may see no key at all; SDPA returns zeros for such a row, as in the reference.
    """
    k = torch.arange(key_lo, key_hi, device=query_index.device)
    q = query_index[:, None, :, None]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (k > q - window)
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, key_lo:key_hi]
    return allowed


def decoder_mask(key_lo: int, key_hi: int, key_valid: torch.Tensor, num_queries: int) -> torch.Tensor:
    """Bidirectional mask: every canvas query sees every valid key in [key_lo, key_hi)."""
    valid = key_valid[:, None, None, key_lo:key_hi]
    return valid.expand(-1, 1, num_queries, -1)


def within_images(
    mask: torch.Tensor | None, is_causal: bool, groups: torch.Tensor, offsets: list[int], num_keys: int
) -> torch.Tensor:
    """An encoder pass's mask with each image's tokens seeing each other (`use_bidirectional_attention
    = "vision"`): query q and the pass's own token j (key index offsets[row] + j) attend when
    groups[row, q] == groups[row, j] >= 0, on top of what `mask` allows (the reference ORs this
    overlay into its causal and sliding masks). `mask` None means SDPA's causal flag (`is_causal`)
    or no mask, over keys that are all the pass's own; groups [B, T] is -1 at text tokens."""
    n, t = groups.shape
    if mask is None:
        k = torch.arange(num_keys, device=groups.device)
        q = torch.arange(t, device=groups.device) + (num_keys - t)
        base = (
            k[None, :] <= q[:, None] if is_causal else torch.ones(t, num_keys, dtype=torch.bool, device=groups.device)
        )
        mask = base.expand(n, 1, t, num_keys)
    mask = mask.clone()
    same = (groups[:, :, None] == groups[:, None, :]) & (groups[:, :, None] >= 0)
    for row, offset in enumerate(offsets):
        mask[row, 0, :, offset : offset + t] |= same[row]
    return mask


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
) -> torch.Tensor:
    """Attention with scale 1.0 (q and k are RMS-normed) and grouped KV heads.

    q [B, H, Q, D], k/v [B, Hkv, K, D] -> [B, Q, H, D]. The GQA handling follows the reference's:
    SDPA's own GQA when there is no mask and head_dim <= 256, packed heads for a single query,
    repeated KV heads otherwise.
    """
    batch, heads, q_len, _ = q.shape
    groups = heads // k.shape[1]
    kwargs = {}
    if groups > 1:
        if mask is None and k.shape[-1] <= 256:
            kwargs["enable_gqa"] = True
        elif q_len == 1:
            q = q.reshape(batch, heads // groups, groups, q.shape[-1])
        else:
            k = _repeat_kv(k, groups)
            v = _repeat_kv(v, groups)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, is_causal=is_causal, **kwargs)
    out = out.reshape(out.shape[0], -1, q_len, v.shape[-1])
    return out.transpose(1, 2)


def attend_then_sdpa(
    cache_pass, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """The usual way a cache pass attends: it stores k/v and hands back the keys/values to attend
    over with their mask (`cache_pass.attend`), then `sdpa`. -> [B, Q, H, D]"""
    k_all, v_all, mask, is_causal = cache_pass.attend(layer, sliding, k, v)
    return sdpa(q, k_all, v_all, mask, is_causal)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)

"""The fused layer's row kernels: each RMSNorm with the residual adds, scales and casts around it
in one pass over a token's hidden row, rounding where the torch bf16 chain rounds.

A layer of the torch model (model/diffusion_gemma.py) runs, per token, nine RMSNorms and the adds
between them as ~70 float32 kernels (`RMSNorm.forward` is ~9: cast, square, mean, add, pow,
multiply, cast the weight, multiply, cast back). Here three kernels cover them all, one program
per token row (the whole hidden row in registers):

    kernel           reads                               writes
    embed_norm       token ids (or embeddings), the      h (the residual stream) and x, layer 0's
                     self-conditioning MLP's output      input_layernorm(h)
    post_attention   h, the attention's o_proj output    h' = h + post_attention_layernorm(attn) and
                                                         the three feed-forward inputs: dense,
                                                         MoE and router (norm * scale * hidden^-0.5)
    combine          h, the dense MLP's output, the      h'' = (h + post_ff(post_ff1(dense) +
                     experts' rows per (token, slot),    post_ff2(sum_k w_k y_k))) * layer_scalar,
                     the routing weights                 and x = the next layer's input norm of h''
                                                         (the final norm after the last layer)
    rms_norm         x                                   rmsnorm(x) [* weight] (self-conditioning)

Rounding. Every value torch rounds to the model's dtype is rounded here at the same point (`triton_support.round_if`:
round to nearest even in float32, then an exact cast), and computed in float32 between, as torch
computes each op in float32 and rounds its result. So a bf16 output equals torch's chain but for
float32 rounding inside a norm (a sum's order, rsqrt vs pow): within 1 bf16 ulp in practice
(tests/kernels/test_triton_norms.py). float32 models round nowhere.

Rows are `BLOCK_H` = next_power_of_two(hidden) wide (4096 for the released 2816, masked).
"""

from __future__ import annotations

import torch

from .triton_support import HAVE_TRITON, interpreted, round_if, runs_on, tl, triton

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAVE_TRITON:

    @triton.jit
    def _inv_rms(x, H, eps):
        """1 / sqrt(mean(x^2) + eps) of float32 rows [R, BLOCK_H] (zeros past H add nothing) -> [R, 1]."""
        return (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / H + eps))[:, None]

    @triton.jit
    def _tile(T, H, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """This program's rows (int64 [BLOCK_T, 1]), columns [1, BLOCK_H] and their mask."""
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_H)
        return t[:, None], cols[None, :], (t < T)[:, None] & (cols < H)[None, :]

    @triton.jit
    def _embed_norm_kernel(
        ids_ptr, table_ptr, embeds_ptr, sc_ptr, w_next_ptr, h_ptr, x_ptr,
        T, H, scale, eps,
        stride_table, stride_embeds, stride_sc, stride_h, stride_x,
        FROM_IDS: tl.constexpr, DECODER: tl.constexpr, HAS_SC: tl.constexpr,
        ROUND: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """h = embed (table[id] * scale, or the given embeddings); a decoder pass: h =
        post_norm(h + self_conditioning), scale-free; x = input_layernorm(h) * w_next."""
        t, cols, inside = _tile(T, H, BLOCK_T, BLOCK_H)
        if FROM_IDS:
            token = tl.load(ids_ptr + t, mask=t < T, other=0).to(tl.int64)
            e = tl.load(table_ptr + token * stride_table + cols, mask=inside, other=0.0).to(tl.float32)
            h = round_if(e * scale, ROUND)
        else:
            h = tl.load(embeds_ptr + t * stride_embeds + cols, mask=inside, other=0.0).to(tl.float32)
        if DECODER:
            if HAS_SC:
                sc = tl.load(sc_ptr + t * stride_sc + cols, mask=inside, other=0.0).to(tl.float32)
                h = round_if(h + sc, ROUND)
            h = round_if(h * _inv_rms(h, H, eps), ROUND)
        w = tl.load(w_next_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        x = round_if(h * _inv_rms(h, H, eps) * w, ROUND)
        tl.store(h_ptr + t * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=inside)
        tl.store(x_ptr + t * stride_x + cols, x.to(x_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _post_attention_kernel(
        h_ptr, attn_ptr, w_attn_ptr, w_dense_ptr, w_moe_ptr, router_scale_ptr,
        h_out_ptr, dense_ptr, moe_ptr, router_ptr,
        T, H, root, eps,
        stride_h, stride_attn, stride_h_out, stride_dense, stride_moe, stride_router,
        ROUND: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """h' = h + post_attention_layernorm(attn); from h': the dense MLP's input
        (pre_feedforward_layernorm), the experts' (pre_feedforward_layernorm_2) and the router's
        (scale-free norm, * router.scale, * hidden^-0.5, each rounded as torch rounds it)."""
        t, cols, inside = _tile(T, H, BLOCK_T, BLOCK_H)
        a = tl.load(attn_ptr + t * stride_attn + cols, mask=inside, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + t * stride_h + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_attn_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        h = round_if(h + round_if(a * _inv_rms(a, H, eps) * w, ROUND), ROUND)
        tl.store(h_out_ptr + t * stride_h_out + cols, h.to(h_out_ptr.dtype.element_ty), mask=inside)
        n = h * _inv_rms(h, H, eps)
        w = tl.load(w_dense_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        tl.store(
            dense_ptr + t * stride_dense + cols, round_if(n * w, ROUND).to(dense_ptr.dtype.element_ty), mask=inside
        )
        w = tl.load(w_moe_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        tl.store(moe_ptr + t * stride_moe + cols, round_if(n * w, ROUND).to(moe_ptr.dtype.element_ty), mask=inside)
        s = tl.load(router_scale_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        r = round_if(round_if(round_if(n, ROUND) * s, ROUND) * root, ROUND)
        tl.store(router_ptr + t * stride_router + cols, r.to(router_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _combine_kernel(
        h_ptr, dense_ptr, y_ptr, topw_ptr, w1_ptr, w2_ptr, w3_ptr, scalar_ptr, w_next_ptr, h_out_ptr, x_ptr,
        T, H, eps,
        stride_h, stride_dense, stride_y, stride_h_out, stride_x,
        TOP_K: tl.constexpr, ROUND: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """The layer's end for token t: moe = sum_k topw[t, k] * y[t * TOP_K + k] (float32, k in
        order, one rounding); h' = (h + post_ff(post_ff1(dense) + post_ff2(moe))) * layer_scalar;
        x = the next layer's input norm of h' (w_next)."""
        t, cols, inside = _tile(T, H, BLOCK_T, BLOCK_H)
        moe = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            pair = t * TOP_K + k
            wk = tl.load(topw_ptr + pair, mask=t < T, other=0.0).to(tl.float32)
            moe += wk * tl.load(y_ptr + pair * stride_y + cols, mask=inside, other=0.0).to(tl.float32)
        moe = round_if(moe, ROUND)
        dense = tl.load(dense_ptr + t * stride_dense + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w1_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        dense = round_if(dense * _inv_rms(dense, H, eps) * w, ROUND)
        w = tl.load(w2_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        moe = round_if(moe * _inv_rms(moe, H, eps) * w, ROUND)
        s = round_if(dense + moe, ROUND)
        w = tl.load(w3_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        f = round_if(s * _inv_rms(s, H, eps) * w, ROUND)
        h = tl.load(h_ptr + t * stride_h + cols, mask=inside, other=0.0).to(tl.float32)
        h = round_if(round_if(h + f, ROUND) * tl.load(scalar_ptr).to(tl.float32), ROUND)
        tl.store(h_out_ptr + t * stride_h_out + cols, h.to(h_out_ptr.dtype.element_ty), mask=inside)
        w = tl.load(w_next_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        x = round_if(h * _inv_rms(h, H, eps) * w, ROUND)
        tl.store(x_ptr + t * stride_x + cols, x.to(x_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _norm_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        T,
        H,
        eps,
        stride_x,
        stride_y,
        HAS_WEIGHT: tl.constexpr,
        ROUND: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        t, cols, inside = _tile(T, H, BLOCK_T, BLOCK_H)
        x = tl.load(x_ptr + t * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        y = x * _inv_rms(x, H, eps)
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_y + cols, round_if(y, ROUND).to(y_ptr.dtype.element_ty), mask=inside)

    INTERPRETED = interpreted(_norm_kernel)
else:  # pragma: no cover
    INTERPRETED = False


def available(device: torch.device | str) -> bool:
    """Whether these kernels can run on `device` (triton_support.runs_on)."""
    return runs_on(device, INTERPRETED)


def _rows(x: torch.Tensor, name: str, hidden: int) -> torch.Tensor:
    """x as [T, hidden] with unit stride along hidden (a view where it can be)."""
    if x.shape[-1] != hidden:
        raise ValueError(f"{name} must end in the hidden size {hidden}, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    x = x.reshape(-1, hidden)
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(rows: int, hidden: int, dtype: torch.dtype) -> tuple[tuple[int], dict]:
    """The grid and launch arguments of a row kernel: one row a program on a GPU (a token's row
    is the unit of parallel work), up to 16 under the interpreter (which runs programs one by one)."""
    block = triton.next_power_of_2(hidden)
    block_t = min(16, triton.next_power_of_2(rows)) if INTERPRETED else 1
    grid = (triton.cdiv(rows, block_t),)
    return grid, dict(
        ROUND=dtype == torch.bfloat16, BLOCK_T=block_t, BLOCK_H=block, num_warps=8 if block >= 2048 else 4
    )


def embed_norm(
    table: torch.Tensor,
    scale: float,
    w_next: torch.Tensor,
    eps: float,
    ids: torch.Tensor | None = None,
    embeds: torch.Tensor | None = None,
    decoder: bool = False,
    self_conditioning: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream entering layer 0 and its input norm: (h [T, H], x [T, H]) in the
    table's dtype. h = table[ids] * scale (or `embeds`); a decoder pass then adds the
    self-conditioning MLP's output [T, H] (None: the first step's zero) and applies the
    scale-free post norm. x = rmsnorm(h) * w_next."""
    hidden, dtype = table.shape[1], table.dtype
    if (ids is None) == (embeds is None):
        raise ValueError("embed_norm takes token ids or embeddings, one of them")
    if ids is not None:
        ids = ids.reshape(-1)
        rows = ids.shape[0]
        src = table
    else:
        src = _rows(embeds, "embeds", hidden)
        rows = src.shape[0]
    sc = _rows(self_conditioning, "self_conditioning", hidden) if self_conditioning is not None else None
    h = torch.empty(rows, hidden, dtype=dtype, device=table.device)
    x = torch.empty_like(h)
    if rows:
        grid, args = _launch(rows, hidden, dtype)
        _embed_norm_kernel[grid](
            ids if ids is not None else h, table, src, sc if sc is not None else h, w_next, h, x,
            rows, hidden, float(scale), float(eps),
            table.stride(0), src.stride(0), (sc if sc is not None else h).stride(0), h.stride(0), x.stride(0),
            FROM_IDS=ids is not None, DECODER=decoder, HAS_SC=sc is not None, **args,
        )  # fmt: skip
    return h, x


def post_attention(
    h: torch.Tensor,
    attn: torch.Tensor,
    w_attn: torch.Tensor,
    w_dense: torch.Tensor,
    w_moe: torch.Tensor,
    router_scale: torch.Tensor,
    root: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h', dense_in, moe_in, router_in), each [T, H] in h's dtype: see `_post_attention_kernel`."""
    hidden = h.shape[-1]
    h2, a2 = _rows(h, "h", hidden), _rows(attn, "attn", hidden)
    rows = h2.shape[0]
    outs = [torch.empty(rows, hidden, dtype=h.dtype, device=h.device) for _ in range(4)]
    if rows:
        grid, args = _launch(rows, hidden, h.dtype)
        _post_attention_kernel[grid](
            h2, a2, w_attn, w_dense, w_moe, router_scale, *outs,
            rows, hidden, float(root), float(eps),
            h2.stride(0), a2.stride(0), *(o.stride(0) for o in outs),
            **args,
        )  # fmt: skip
    return tuple(outs)


def combine(
    h: torch.Tensor,
    dense: torch.Tensor,
    y: torch.Tensor,
    top_weights: torch.Tensor,
    w_ff1: torch.Tensor,
    w_ff2: torch.Tensor,
    w_ff: torch.Tensor,
    layer_scalar: torch.Tensor,
    w_next: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h'', x_next), each [T, H] in h's dtype: see `_combine_kernel`. y [T * top_k, H]: the
    experts' output rows in (token, slot) order; top_weights [T, top_k] (float32)."""
    hidden = h.shape[-1]
    h2, d2, y2 = _rows(h, "h", hidden), _rows(dense, "dense", hidden), _rows(y, "y", hidden)
    rows = h2.shape[0]
    top_k = top_weights.shape[-1] if top_weights.dim() else 1
    if y2.shape[0] != rows * top_k or top_weights.numel() != rows * top_k:
        raise ValueError(
            f"combine needs y [{rows * top_k}, {hidden}] and top_weights [{rows}, {top_k}], "
            f"got {tuple(y2.shape)} and {tuple(top_weights.shape)}"
        )
    tw = top_weights.reshape(-1).contiguous()
    h_out = torch.empty(rows, hidden, dtype=h.dtype, device=h.device)
    x = torch.empty_like(h_out)
    if rows:
        grid, args = _launch(rows, hidden, h.dtype)
        _combine_kernel[grid](
            h2, d2, y2, tw, w_ff1, w_ff2, w_ff, layer_scalar, w_next, h_out, x,
            rows, hidden, float(eps),
            h2.stride(0), d2.stride(0), y2.stride(0), h_out.stride(0), x.stride(0),
            TOP_K=top_k, **args,
        )  # fmt: skip
    return h_out, x


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm.forward of x [..., H] in one kernel (float32 inside, one rounding)."""
    hidden = x.shape[-1]
    x2 = _rows(x, "x", hidden)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        grid, args = _launch(x2.shape[0], hidden, x.dtype)
        _norm_kernel[grid](
            x2,
            weight if weight is not None else x2,
            y,
            x2.shape[0],
            hidden,
            float(eps),
            x2.stride(0),
            y.stride(0),
            HAS_WEIGHT=weight is not None,
            **args,
        )
    return y.view(x.shape)

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

from .triton_quant import Fp8Rows, arch, fp8_in_hardware
from .triton_support import HAVE_TRITON, interpreted, round_if, runs_on, tl, triton

if HAVE_TRITON:
    from .triton_decode import fp8_rows

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
    def _store_fp8(x, t, cols, inside, q_ptr, s_ptr, stride_q, T, FP8_CVT: tl.constexpr):
        """x's rows quantised per token (`fp8_rows`): e4m3 bytes at q_ptr, a float32 scale a row at s_ptr."""
        codes, scale = fp8_rows(tl.where(inside, x, 0.0), FP8_CVT)
        tl.store(q_ptr + t * stride_q + cols, codes, mask=inside)
        tl.store(s_ptr + t, scale, mask=t < T)

    @triton.jit
    def _embed_norm_kernel(
        ids_ptr, table_ptr, embeds_ptr, sc_ptr, w_next_ptr, h_ptr, x_ptr, xq_ptr, xs_ptr,
        T, H, scale, eps,
        stride_table, stride_embeds, stride_sc, stride_h, stride_x, stride_xq,
        FROM_IDS: tl.constexpr, DECODER: tl.constexpr, HAS_SC: tl.constexpr,
        ROUND: tl.constexpr, QUANT: tl.constexpr, FP8_CVT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """h = embed (table[id] * scale, or the given embeddings); a decoder pass: h =
        post_norm(h + self_conditioning), scale-free; x = input_layernorm(h) * w_next. QUANT: x
        quantised per token too (xq, xs: the W8A8 q|k|v GEMM's input)."""
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
        if QUANT:
            _store_fp8(x, t, cols, inside, xq_ptr, xs_ptr, stride_xq, T, FP8_CVT)

    @triton.jit
    def _post_attention_kernel(
        h_ptr, attn_ptr, w_attn_ptr, w_dense_ptr, w_moe_ptr, router_scale_ptr,
        h_out_ptr, dense_ptr, moe_ptr, router_ptr, dq_ptr, ds_ptr, mq_ptr, ms_ptr,
        T, H, root, eps,
        stride_h, stride_attn, stride_h_out, stride_dense, stride_moe, stride_router, stride_dq, stride_mq,
        ROUND: tl.constexpr, QUANT: tl.constexpr, QUANT_MOE: tl.constexpr, FP8_CVT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """h' = h + post_attention_layernorm(attn); from h': the dense MLP's input
        (pre_feedforward_layernorm), the experts' (pre_feedforward_layernorm_2) and the router's
        (scale-free norm, * router.scale, * hidden^-0.5, each rounded as torch rounds it). QUANT: the
        dense input quantised per token too (dq, ds: the W8A8 gate|up GEMM's input); QUANT_MOE: the
        experts' (mq, ms: their W8A8 gate|up's, the rows gathered by token)."""
        t, cols, inside = _tile(T, H, BLOCK_T, BLOCK_H)
        a = tl.load(attn_ptr + t * stride_attn + cols, mask=inside, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + t * stride_h + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_attn_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        h = round_if(h + round_if(a * _inv_rms(a, H, eps) * w, ROUND), ROUND)
        tl.store(h_out_ptr + t * stride_h_out + cols, h.to(h_out_ptr.dtype.element_ty), mask=inside)
        n = h * _inv_rms(h, H, eps)
        w = tl.load(w_dense_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        dense = round_if(n * w, ROUND)
        tl.store(dense_ptr + t * stride_dense + cols, dense.to(dense_ptr.dtype.element_ty), mask=inside)
        if QUANT:
            _store_fp8(dense, t, cols, inside, dq_ptr, ds_ptr, stride_dq, T, FP8_CVT)
        w = tl.load(w_moe_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        moe = round_if(n * w, ROUND)
        tl.store(moe_ptr + t * stride_moe + cols, moe.to(moe_ptr.dtype.element_ty), mask=inside)
        if QUANT_MOE:
            _store_fp8(moe, t, cols, inside, mq_ptr, ms_ptr, stride_mq, T, FP8_CVT)
        s = tl.load(router_scale_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        r = round_if(round_if(round_if(n, ROUND) * s, ROUND) * root, ROUND)
        tl.store(router_ptr + t * stride_router + cols, r.to(router_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _combine_kernel(
        h_ptr, dense_ptr, y_ptr, topw_ptr, w1_ptr, w2_ptr, w3_ptr, scalar_ptr, w_next_ptr, h_out_ptr, x_ptr,
        xq_ptr, xs_ptr,
        T, H, eps,
        stride_h, stride_dense, stride_y, stride_h_out, stride_x, stride_xq,
        TOP_K: tl.constexpr, ROUND: tl.constexpr, QUANT: tl.constexpr, FP8_CVT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """The layer's end for token t: moe = sum_k topw[t, k] * y[t * TOP_K + k] (float32, k in
        order, one rounding); h' = (h + post_ff(post_ff1(dense) + post_ff2(moe))) * layer_scalar;
        x = the next layer's input norm of h' (w_next); QUANT: x quantised per token too (xq, xs)."""
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
        if QUANT:
            _store_fp8(x, t, cols, inside, xq_ptr, xs_ptr, stride_xq, T, FP8_CVT)

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, q_ptr, s_ptr, T, H, stride_x, stride_q,
        FP8_CVT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """Rows of x quantised per token (`fp8_rows`): where no kernel of ours produced them (the
        attention's output, the dense MLP's gelu * up)."""
        t, cols, inside = _tile(T, H, BLOCK_T, BLOCK_H)
        x = tl.load(x_ptr + t * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        _store_fp8(x, t, cols, inside, q_ptr, s_ptr, stride_q, T, FP8_CVT)

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


def _fp8_out(rows: int, hidden: int, dtype: torch.dtype, device: torch.device, quant: bool) -> Fp8Rows | None:
    """Where a kernel writes its output quantised per token (`quant`): e4m3 bytes [rows, hidden] and
    a float32 scale a row, standing for `dtype` activations (triton_quant.Fp8Rows); else None."""
    if not quant:
        return None
    codes = torch.empty(rows, hidden, dtype=torch.uint8, device=device)
    return Fp8Rows(codes, torch.empty(rows, dtype=torch.float32, device=device), dtype)


def _fp8_args(out: Fp8Rows | None, fallback: torch.Tensor) -> tuple:
    """A kernel's (codes, scales, codes' row stride, QUANT=, FP8_CVT=) for `out` (None: unused
    pointers, QUANT off). FP8_CVT: the hardware's e4m3 conversion (sm89+; not the interpreter)."""
    if out is None:
        return fallback, fallback, 0, dict(QUANT=False, FP8_CVT=False)
    cvt = fp8_in_hardware(arch(out.codes.device))
    return out.codes, out.scales, out.codes.stride(0), dict(QUANT=True, FP8_CVT=cvt)


def embed_norm(
    table: torch.Tensor,
    scale: float,
    w_next: torch.Tensor,
    eps: float,
    ids: torch.Tensor | None = None,
    embeds: torch.Tensor | None = None,
    decoder: bool = False,
    self_conditioning: torch.Tensor | None = None,
    quant: bool = False,
) -> tuple:
    """The residual stream entering layer 0 and its input norm: (h [T, H], x [T, H]) in the
    table's dtype. h = table[ids] * scale (or `embeds`); a decoder pass then adds the
    self-conditioning MLP's output [T, H] (None: the first step's zero) and applies the
    scale-free post norm. x = rmsnorm(h) * w_next. `quant`: (h, x, x quantised per token as
    triton_quant.Fp8Rows), for a W8A8 q|k|v GEMM."""
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
    xq = _fp8_out(rows, hidden, dtype, h.device, quant)
    if rows:
        grid, args = _launch(rows, hidden, dtype)
        q, qs, stride_q, flags = _fp8_args(xq, h)
        _embed_norm_kernel[grid](
            ids if ids is not None else h, table, src, sc if sc is not None else h, w_next, h, x, q, qs,
            rows, hidden, float(scale), float(eps),
            table.stride(0), src.stride(0), (sc if sc is not None else h).stride(0), h.stride(0), x.stride(0), stride_q,
            FROM_IDS=ids is not None, DECODER=decoder, HAS_SC=sc is not None, **flags, **args,
        )  # fmt: skip
    return (h, x, xq) if quant else (h, x)


def post_attention(
    h: torch.Tensor,
    attn: torch.Tensor,
    w_attn: torch.Tensor,
    w_dense: torch.Tensor,
    w_moe: torch.Tensor,
    router_scale: torch.Tensor,
    root: float,
    eps: float,
    quant: bool = False,
    quant_moe: bool = False,
) -> tuple:
    """(h', dense_in, moe_in, router_in), each [T, H] in h's dtype: see `_post_attention_kernel`.
    With `quant` or `quant_moe`: and (dense_in, moe_in) quantised per token (triton_quant.Fp8Rows,
    None where not asked), for W8A8 gate|up GEMMs (the dense MLP's, the experts')."""
    hidden = h.shape[-1]
    h2, a2 = _rows(h, "h", hidden), _rows(attn, "attn", hidden)
    rows = h2.shape[0]
    outs = [torch.empty(rows, hidden, dtype=h.dtype, device=h.device) for _ in range(4)]
    dq = _fp8_out(rows, hidden, h.dtype, h.device, quant)
    mq = _fp8_out(rows, hidden, h.dtype, h.device, quant_moe)
    if rows:
        grid, args = _launch(rows, hidden, h.dtype)
        q, qs, stride_q, flags = _fp8_args(dq, h2)
        m, ms, stride_m, moe_flags = _fp8_args(mq, h2)
        flags.update(FP8_CVT=flags["FP8_CVT"] or moe_flags["FP8_CVT"], QUANT_MOE=moe_flags["QUANT"])
        _post_attention_kernel[grid](
            h2, a2, w_attn, w_dense, w_moe, router_scale, *outs, q, qs, m, ms,
            rows, hidden, float(root), float(eps),
            h2.stride(0), a2.stride(0), *(o.stride(0) for o in outs), stride_q, stride_m,
            **flags, **args,
        )  # fmt: skip
    return (*outs, dq, mq) if quant or quant_moe else tuple(outs)


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
    quant: bool = False,
) -> tuple:
    """(h'', x_next), each [T, H] in h's dtype: see `_combine_kernel`. y [T * top_k, H]: the
    experts' output rows in (token, slot) order; top_weights [T, top_k] (float32). `quant`: (h'',
    x_next, x_next quantised per token as triton_quant.Fp8Rows), for the next layer's W8A8 q|k|v."""
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
    xq = _fp8_out(rows, hidden, h.dtype, h.device, quant)
    if rows:
        grid, args = _launch(rows, hidden, h.dtype)
        q, qs, stride_q, flags = _fp8_args(xq, h_out)
        _combine_kernel[grid](
            h2, d2, y2, tw, w_ff1, w_ff2, w_ff, layer_scalar, w_next, h_out, x, q, qs,
            rows, hidden, float(eps),
            h2.stride(0), d2.stride(0), y2.stride(0), h_out.stride(0), x.stride(0), stride_q,
            TOP_K=top_k, **flags, **args,
        )  # fmt: skip
    return (h_out, x, xq) if quant else (h_out, x)


def quantize_rows(x: torch.Tensor) -> Fp8Rows:
    """x [T, K] quantised per token (triton_quant.Fp8Rows) in one kernel: the W8A8 GEMM's input
    where the kernel that made x does not write it quantised (the attention's output for o_proj,
    gelu * up for the dense down projection): one launch, a row a program."""
    hidden = x.shape[-1]
    x2 = _rows(x, "x", hidden)
    out = _fp8_out(x2.shape[0], hidden, x.dtype, x.device, True)
    if x2.shape[0]:
        grid, args = _launch(x2.shape[0], hidden, x.dtype)
        q, qs, stride_q, flags = _fp8_args(out, x2)
        args.pop("ROUND")
        _quantize_rows_kernel[grid](
            x2, q, qs, x2.shape[0], hidden, x2.stride(0), stride_q, FP8_CVT=flags["FP8_CVT"], **args
        )
    return out


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

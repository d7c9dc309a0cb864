"""Fused Triton kernels for the elementwise tails of a layer: fewer passes over memory, one rounding.

Each kernel replaces a chain of torch ops that reads and writes its tensor several times (and, in
bf16, rounds after every op) with one pass that computes in float32 and rounds once, at the store:

    kernel        replaces (torch, per op a pass and a rounding to the tensor's dtype)
    norm_rope     RMSNorm(x) [* weight]  ->  .type_as(x)  ->  rope.apply_rope(., cos, sin)
                  (x * cos, rotate_half(x) * sin, their sum)  ->  flat_pool.index_copy_(0, slots, .)
    gelu_mul      gate, up = gate_up.chunk(2, -1)  ->  F.gelu(gate, approximate)  ->  * up
    combine_topk  y * weights[perm, None]  ->  [inverse]  ->  .view(N, top_k, H).sum(1)  ->  .to(dtype)

`moe_experts` runs the whole of `Experts.forward` with the last two, around the same
`grouped_matmul` calls.

Rounding. float32 inputs give float32 results within ~1e-6 of the torch chains (rsqrt / exp on a
GPU are approximations of a few ulps; sums run in another order). In bf16 the torch chain of
norm_rope rounds to bf16 after the norm, and again after each of the three RoPE ops; the kernel
keeps the normed, rotated value in float32 and rounds it once, so its result is the float32
computation rounded to nearest (<= 1/2 ulp, where torch's chain drifts by a few). Likewise
gelu_mul rounds once where torch rounds gelu(gate) and then the product. combine_topk computes
what torch does (bf16 rows times float32 weights, summed in float32) and rounds once, as torch.

Stores to bf16 round to nearest-even by bit manipulation in float32 first (`triton_support.round_bf16`):
Triton's interpreter truncates float32 -> bf16 casts, GPUs round; this makes both agree (and
costs a few integer ops in memory-bound kernels).

Grids. norm_rope: one program per block of BLOCK_R (token, head) rows, each row's D elements
loaded as its two halves (rotate-half RoPE pairs d with d + D/2, so no gather). gelu_mul and
combine_topk: a 2D grid of (row block, column block) tiles. combine_topk gathers each token's
top_k rows itself and sums them in registers: deterministic, no atomics.

Public: `available`, `norm_rope`, `gelu_mul`, `combine_topk`, `moe_experts`. The kernels run on
CUDA tensors, or on CPU tensors when built for the interpreter (TRITON_INTERPRET=1 before triton
is imported; `INTERPRETED`). Block sizes are heuristics, not tuned on hardware.
"""

from __future__ import annotations

import torch

from .triton_support import HAVE_TRITON, interpreted, round_bf16, round_if, runs_on, tl, triton

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 512
GELU_APPROXIMATIONS = ("none", "tanh")

if HAVE_TRITON:

    @triton.jit
    def _norm_rope_kernel(
        x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, pool_ptr, slots_ptr,
        ROWS, HEADS, eps,
        stride_xt, stride_xh, stride_xd,
        stride_ct, stride_cd, stride_st, stride_sd,
        stride_yt, stride_yh, stride_yd,
        stride_pn, stride_ph, stride_pd,
        HAS_WEIGHT: tl.constexpr, HAS_ROPE: tl.constexpr, HAS_POOL: tl.constexpr,
        ROUND_Y: tl.constexpr, ROUND_POOL: tl.constexpr,
        HALF: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        """Rows r = t * HEADS + h of x [T, HEADS, 2 * HALF]: y = rope(rmsnorm(x) * w) in float32,
        stored to y and (HAS_POOL, slots[t] >= 0) to pool[slots[t], h]."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_mask = rows < ROWS
        t = (rows // HEADS).to(tl.int64)
        h = (rows % HEADS).to(tl.int64)
        d = tl.arange(0, HALF)
        mask = row_mask[:, None]
        x_row = x_ptr + (t * stride_xt + h * stride_xh)[:, None]
        x1 = tl.load(x_row + d[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + (d + HALF)[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
        ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        r = tl.rsqrt(ms + eps)[:, None]
        n1 = x1 * r
        n2 = x2 * r
        if HAS_WEIGHT:
            n1 = n1 * tl.load(w_ptr + d).to(tl.float32)[None, :]
            n2 = n2 * tl.load(w_ptr + d + HALF).to(tl.float32)[None, :]
        if HAS_ROPE:  # out[d] = x[d] cos[d] - x[d + half] sin[d]; out[d + half] = x[d + half] cos + x[d] sin
            c_row = cos_ptr + (t * stride_ct)[:, None]
            s_row = sin_ptr + (t * stride_st)[:, None]
            c1 = tl.load(c_row + d[None, :] * stride_cd, mask=mask, other=0.0).to(tl.float32)
            c2 = tl.load(c_row + (d + HALF)[None, :] * stride_cd, mask=mask, other=0.0).to(tl.float32)
            s1 = tl.load(s_row + d[None, :] * stride_sd, mask=mask, other=0.0).to(tl.float32)
            s2 = tl.load(s_row + (d + HALF)[None, :] * stride_sd, mask=mask, other=0.0).to(tl.float32)
            y1 = n1 * c1 - n2 * s1
            y2 = n2 * c2 + n1 * s2
        else:
            y1 = n1
            y2 = n2
        if ROUND_Y:
            y1 = round_bf16(y1)
            y2 = round_bf16(y2)
        y1 = y1.to(y_ptr.dtype.element_ty)
        y2 = y2.to(y_ptr.dtype.element_ty)
        y_row = y_ptr + (t * stride_yt + h * stride_yh)[:, None]
        tl.store(y_row + d[None, :] * stride_yd, y1, mask=mask)
        tl.store(y_row + (d + HALF)[None, :] * stride_yd, y2, mask=mask)
        if HAS_POOL:  # the pool gets y as stored (in y's dtype), cast to the pool's dtype
            slot = tl.load(slots_ptr + t, mask=row_mask, other=-1).to(tl.int64)
            p1 = y1.to(tl.float32)
            p2 = y2.to(tl.float32)
            if ROUND_POOL:
                p1 = round_bf16(p1)
                p2 = round_bf16(p2)
            p_row = pool_ptr + (slot * stride_pn + h * stride_ph)[:, None]
            p_mask = (row_mask & (slot >= 0))[:, None]
            tl.store(p_row + d[None, :] * stride_pd, p1.to(pool_ptr.dtype.element_ty), mask=p_mask)
            tl.store(p_row + (d + HALF)[None, :] * stride_pd, p2.to(pool_ptr.dtype.element_ty), mask=p_mask)

    @triton.jit
    def _gelu_mul_kernel(
        gu_ptr,
        out_ptr,
        S,
        INTER,
        stride_gs,
        stride_gi,
        stride_os,
        stride_oi,
        TANH: tl.constexpr,
        ROUND: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_I: tl.constexpr,
    ):
        """out[s, i] = gelu(gate_up[s, i]) * gate_up[s, INTER + i], in float32."""
        rows = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask = (rows < S)[:, None] & (cols < INTER)[None, :]
        g_ptr = gu_ptr + rows[:, None] * stride_gs + cols[None, :] * stride_gi
        g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(g_ptr + INTER * stride_gi, mask=mask, other=0.0).to(tl.float32)
        if TANH:  # 0.5 g (1 + tanh(z)) = g * sigmoid(2z), without tanh's cancellation near -1
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            act = g / (1.0 + tl.exp(-2.0 * z))
        else:
            act = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        out = act * u
        if ROUND:
            out = round_bf16(out)
        tl.store(
            out_ptr + rows[:, None] * stride_os + cols[None, :] * stride_oi, out.to(out_ptr.dtype.element_ty), mask=mask
        )

    @triton.jit
    def _combine_kernel(
        y_ptr,
        inv_ptr,
        w_ptr,
        out_ptr,
        N,
        H,
        stride_ys,
        stride_yh,
        stride_inv,
        stride_w,
        stride_on,
        stride_oh,
        TOP_K: tl.constexpr,
        ROUND: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """out[t] = sum_k w[t * TOP_K + k] * y[inv[t * TOP_K + k]], k in order, in float32."""
        toks = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        tok_mask = toks < N
        mask = tok_mask[:, None] & (cols < H)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            pair = toks * TOP_K + k
            row = tl.load(inv_ptr + pair * stride_inv, mask=tok_mask, other=0).to(tl.int64)
            w = tl.load(w_ptr + pair * stride_w, mask=tok_mask, other=0.0).to(tl.float32)
            vals = tl.load(y_ptr + row[:, None] * stride_ys + cols[None, :] * stride_yh, mask=mask, other=0.0)
            acc += w[:, None] * vals.to(tl.float32)
        if ROUND:
            acc = round_bf16(acc)
        tl.store(
            out_ptr + toks[:, None] * stride_on + cols[None, :] * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=mask
        )

    @triton.jit
    def _qkv_kernel(
        qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, out_ptr, kpool_ptr, vpool_ptr, slots_ptr,
        ROWS, HQ, HKV, V_COL, ROPE_COL, eps,
        stride_qkv, stride_ct, stride_st, stride_ot, stride_oh,
        stride_kpn, stride_kph, stride_vpn, stride_vph,
        HAS_POOL: tl.constexpr, ROUND: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        """Head rows r = t * (HQ + 2 HKV) + hh of one token's fused q|k|v projection: q heads
        (q_norm, RoPE), k heads (k_norm, RoPE), v heads (scale-free norm; read from V_COL, which is
        the k columns where a layer has no v_proj), each rounded where the torch chain rounds;
        stored to out [T, HQ + 2 HKV, 2 HALF] and, HAS_POOL, k and v to the pools at slots[t]."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < ROWS
        heads = HQ + 2 * HKV
        t = (rows // heads).to(tl.int64)
        hh = rows % heads
        is_q = hh < HQ
        is_k = (hh >= HQ) & (hh < HQ + HKV)
        is_v = hh >= HQ + HKV
        src = tl.where(is_v, V_COL + (hh - HQ - HKV) * (2 * HALF), hh * (2 * HALF)).to(tl.int64)
        d = tl.arange(0, HALF)
        mask = row_ok[:, None]
        x_row = qkv_ptr + (t * stride_qkv + src)[:, None]
        x1 = tl.load(x_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + (d + HALF)[None, :], mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.where(
            is_q[:, None], tl.load(qw_ptr + d)[None, :].to(tl.float32), tl.load(kw_ptr + d)[None, :].to(tl.float32)
        )
        w2 = tl.where(
            is_q[:, None],
            tl.load(qw_ptr + HALF + d)[None, :].to(tl.float32),
            tl.load(kw_ptr + HALF + d)[None, :].to(tl.float32),
        )
        w1 = tl.where(is_v[:, None], 1.0, w1)
        w2 = tl.where(is_v[:, None], 1.0, w2)
        n1 = round_if(x1 * r[:, None] * w1, ROUND)
        n2 = round_if(x2 * r[:, None] * w2, ROUND)
        rope = (~is_v)[:, None] & mask
        c = tl.load(cos_ptr + (t * stride_ct + ROPE_COL)[:, None] + d[None, :], mask=rope, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + (t * stride_st + ROPE_COL)[:, None] + d[None, :], mask=rope, other=0.0).to(tl.float32)
        y1 = round_if(
            round_if(n1 * c, ROUND) - round_if(n2 * s, ROUND), ROUND
        )  # x c + rotate_half(x) s, as torch rounds it
        y2 = round_if(round_if(n2 * c, ROUND) + round_if(n1 * s, ROUND), ROUND)
        o_row = out_ptr + (t * stride_ot + hh.to(tl.int64) * stride_oh)[:, None]
        tl.store(o_row + d[None, :], y1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o_row + (d + HALF)[None, :], y2.to(out_ptr.dtype.element_ty), mask=mask)
        if HAS_POOL:  # an encoder pass: its keys and values into the pool (slot < 0: padding)
            slot = tl.load(slots_ptr + t, mask=row_ok, other=-1).to(tl.int64)
            kmask = (row_ok & is_k & (slot >= 0))[:, None]
            vmask = (row_ok & is_v & (slot >= 0))[:, None]
            kh = (hh - HQ).to(tl.int64)
            vh = (hh - HQ - HKV).to(tl.int64)
            k_row = kpool_ptr + (slot * stride_kpn + kh * stride_kph)[:, None]
            v_row = vpool_ptr + (slot * stride_vpn + vh * stride_vph)[:, None]
            tl.store(k_row + d[None, :], y1.to(kpool_ptr.dtype.element_ty), mask=kmask)
            tl.store(k_row + (d + HALF)[None, :], y2.to(kpool_ptr.dtype.element_ty), mask=kmask)
            tl.store(v_row + d[None, :], y1.to(vpool_ptr.dtype.element_ty), mask=vmask)
            tl.store(v_row + (d + HALF)[None, :], y2.to(vpool_ptr.dtype.element_ty), mask=vmask)

    INTERPRETED = interpreted(_norm_rope_kernel)
else:  # pragma: no cover
    INTERPRETED = False


def available(device: torch.device | str) -> bool:
    """Whether these kernels can run on `device` (triton_support.runs_on)."""
    return runs_on(device, INTERPRETED)


def _require(device: torch.device) -> None:
    if not available(device):
        why = "triton is not installed" if not HAVE_TRITON else f"the device is {device.type}, not CUDA"
        raise RuntimeError(f"the fused layer kernels cannot run here ({why}); use the torch ops")


def _float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")


def _pow2_at_most(n: int, cap: int) -> int:
    return max(1, min(cap, triton.next_power_of_2(max(n, 1))))


# ------------------------------------------------------------------------------ norm + RoPE
def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    out: torch.Tensor | None = None,
    pool: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """rope(rmsnorm(x) * weight) for x [T, heads, D] (any strides), in one pass, float32 inside.

    weight [D] or None (the scale-free norm, V's); cos / sin [T, D] (rope.cos_sin's tables with
    the batch flattened, any float dtype) or both None (no rotation: V, global layers' V). The
    result is stored in x's dtype, into `out` [T, heads, D] when given (out may be x itself: each
    row is read whole before it is written). With pool [num_slots, heads, D] (a layer's pool
    viewed flat, keys.view(-1, Hkv, D)) and slots [T] (int32 / int64 flat slot per token), the
    result is also written to pool[slots[t]] in the pool's dtype, as index_copy_ would; a slot
    < 0 is skipped (padding). Slots are not range-checked: that would need a host sync."""
    if x.dim() != 3:
        raise ValueError(f"norm_rope needs x as [T, heads, D], got shape {tuple(x.shape)}")
    _float("x", x)
    t, heads, d = x.shape
    if d < 2 or d > MAX_HEAD_DIM or d & (d - 1):
        raise ValueError(f"norm_rope needs a head dim D that is a power of two in [2, {MAX_HEAD_DIM}], got {d}")
    if weight is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"norm_rope weight must be [{d}], got shape {tuple(weight.shape)}")
    if (cos is None) != (sin is None):
        raise ValueError("norm_rope needs both cos and sin, or neither")
    if cos is not None and (tuple(cos.shape) != (t, d) or tuple(sin.shape) != (t, d)):
        raise ValueError(f"norm_rope cos / sin must be [{t}, {d}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if out is None:
        out = torch.empty(t, heads, d, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (t, heads, d) or out.dtype != x.dtype:
        raise ValueError(f"norm_rope out must be [{t}, {heads}, {d}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if (pool is None) != (slots is None):
        raise ValueError("norm_rope needs both pool and slots, or neither")
    if pool is not None:
        if pool.dim() != 3 or tuple(pool.shape[1:]) != (heads, d):
            raise ValueError(f"norm_rope pool must be [num_slots, {heads}, {d}], got shape {tuple(pool.shape)}")
        _float("pool", pool)
        if tuple(slots.shape) != (t,) or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"norm_rope slots must be int32 / int64 [{t}], got {tuple(slots.shape)} {slots.dtype}")
    _require(x.device)
    rows = t * heads
    if rows == 0:
        return out
    block_r = _pow2_at_most(rows, max(1, 4096 // d))
    c = cos if cos is not None else x
    s = sin if sin is not None else x
    p = pool if pool is not None else out
    grid = (triton.cdiv(rows, block_r),)
    _norm_rope_kernel[grid](
        x, weight if weight is not None else x, c, s, out, p, slots if slots is not None else x,
        rows, heads, float(eps),
        x.stride(0), x.stride(1), x.stride(2),
        c.stride(0), c.stride(-1), s.stride(0), s.stride(-1),
        out.stride(0), out.stride(1), out.stride(2),
        p.stride(0), p.stride(1), p.stride(2),
        HAS_WEIGHT=weight is not None, HAS_ROPE=cos is not None, HAS_POOL=pool is not None,
        ROUND_Y=out.dtype == torch.bfloat16, ROUND_POOL=pool is not None and pool.dtype == torch.bfloat16,
        HALF=d // 2, BLOCK_R=block_r,
        num_warps=4,
        enable_fp_fusion=True,  # triton's default until 3.10 (3.9 warns when it is left unsaid)
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------- q, k, v in one launch
def rope_tables(positions: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, F] for float32 frequencies [F] (every layer kind's side by side:
    `qkv_norm_rope` reads a kind's columns from its offset): rope.cos_sin's values (angles in
    float32, cast to `dtype`), one half of each kind's table (its other half repeats it), in 3
    launches per pass."""
    angles = positions.reshape(-1)[:, None] * freqs[None, :]
    cos = torch.empty(angles.shape, dtype=dtype, device=angles.device)
    sin = torch.empty_like(cos)
    torch.cos(angles, out=cos)
    torch.sin(angles, out=sin)
    return cos, sin


def qkv_norm_rope(
    qkv: torch.Tensor,
    heads: tuple[int, int],
    head_dim: int,
    has_v: bool,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_col: int,
    pools: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention.project after the projection, in one launch: qkv [T, (HQ + HKV (+ HKV)) * D], one
    token's q, k (and v) projections side by side (V = K's projection where `has_v` is False) ->
    q [T, HQ, D], k and v [T, HKV, D] (views of one buffer): q and k RMS-normed with their weights
    and rotated by the tables' columns from `rope_col` (`rope_tables`), v normed without a scale,
    rounded as torch's bf16 chain rounds. `pools` (keys, values [slots, HKV, D], slots [T], < 0
    skipped): an encoder pass's keys and values are written there too (slots not range-checked)."""
    hq, hkv = heads
    d = head_dim
    if d < 2 or d > MAX_HEAD_DIM or d & (d - 1):
        raise ValueError(f"qkv_norm_rope needs a head dim that is a power of two in [2, {MAX_HEAD_DIM}], got {d}")
    width = (hq + (2 if has_v else 1) * hkv) * d
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv_norm_rope needs qkv [T, {width}] with contiguous rows, got {tuple(qkv.shape)}")
    _float("qkv", qkv)
    t = qkv.shape[0]
    if cos.shape[0] != t or sin.shape != cos.shape or rope_col + d // 2 > cos.shape[1]:
        raise ValueError(f"qkv_norm_rope tables must be [{t}, >= {rope_col + d // 2}], got {tuple(cos.shape)}")
    _require(qkv.device)
    out = torch.empty(t, hq + 2 * hkv, d, dtype=qkv.dtype, device=qkv.device)
    rows = t * (hq + 2 * hkv)
    if rows:
        if pools is not None:
            keys, values, slots = pools
            kp, vp = keys.view(-1, *keys.shape[-2:]), values.view(-1, *values.shape[-2:])
        else:
            kp = vp = slots = out
        block_r = _pow2_at_most(rows, max(1, 2048 // d))  # sm90: 4096 // d spills at D = 256
        _qkv_kernel[(triton.cdiv(rows, block_r),)](
            qkv, cos, sin, q_weight, k_weight, out, kp, vp, slots,
            rows, hq, hkv, (hq + hkv) * d if has_v else hq * d, rope_col, float(eps),
            qkv.stride(0), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
            kp.stride(0), kp.stride(1), vp.stride(0), vp.stride(1),
            HAS_POOL=pools is not None, ROUND=qkv.dtype == torch.bfloat16, HALF=d // 2, BLOCK_R=block_r,
            num_warps=4, enable_fp_fusion=False,  # products rounded one by one, as torch's ops
        )  # fmt: skip
    return out[:, :hq], out[:, hq : hq + hkv], out[:, hq + hkv :]


# ------------------------------------------------------------------------------------- MoE
def gelu_mul(gate_up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up for gate_up [..., 2I] (gate first, as gate_up.chunk(2, -1)) -> [..., I]:
    gelu exactly as F.gelu(approximate=...) ("tanh" or "none"), in float32, stored in
    gate_up's dtype (one rounding, where torch rounds gelu and then the product)."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"gelu_mul approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gelu_mul needs gate_up [..., 2I] with an even last dim, got shape {tuple(gate_up.shape)}")
    _float("gate_up", gate_up)
    _require(gate_up.device)
    lead, i = gate_up.shape[:-1], gate_up.shape[-1] // 2
    g2 = gate_up.reshape(-1, 2 * i)
    s = g2.shape[0]
    out = torch.empty(s, i, dtype=gate_up.dtype, device=gate_up.device)
    if s == 0 or i == 0:
        return out.reshape(*lead, i)
    block_i = _pow2_at_most(i, 512)
    block_s = _pow2_at_most(s, max(1, 4096 // block_i))
    grid = (triton.cdiv(s, block_s), triton.cdiv(i, block_i))
    _gelu_mul_kernel[grid](
        g2,
        out,
        s,
        i,
        g2.stride(0),
        g2.stride(1),
        out.stride(0),
        out.stride(1),
        TANH=approximate == "tanh",
        ROUND=out.dtype == torch.bfloat16,
        BLOCK_S=block_s,
        BLOCK_I=block_i,
        num_warps=4,
        enable_fp_fusion=True,
    )
    return out.reshape(*lead, i)


def combine_topk(
    y: torch.Tensor,
    inverse: torch.Tensor,
    weights: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The experts' outputs y [N * top_k, H] (rows sorted by expert) summed back per token:
    out[t] = sum_k weights[t * top_k + k] * y[inverse[t * top_k + k]] -> [N, H], where inverse
    (int32 / int64 [N * top_k]) maps each (token, slot) pair, in the original order, to its row of
    y and weights [N * top_k] are the pairs' routing weights in the original order. Accumulated in
    float32 in k order, stored in out_dtype (default y's dtype); deterministic (no atomics).
    `inverse` is not range-checked (a host sync)."""
    if top_k < 1:
        raise ValueError(f"combine_topk needs top_k >= 1, got {top_k}")
    if y.dim() != 2:
        raise ValueError(f"combine_topk needs y as [N * top_k, H], got shape {tuple(y.shape)}")
    pairs = y.shape[0]
    if pairs % top_k:
        raise ValueError(f"combine_topk: y has {pairs} rows, not a multiple of top_k = {top_k}")
    if inverse.numel() != pairs or weights.numel() != pairs:
        raise ValueError(
            f"combine_topk needs inverse and weights of {pairs} pairs (y's rows), got {tuple(inverse.shape)} and {tuple(weights.shape)}"
        )
    if inverse.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"combine_topk inverse must be int32 / int64, got {inverse.dtype}")
    _float("y", y)
    _float("weights", weights)
    out_dtype = out_dtype or y.dtype
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"combine_topk out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    _require(y.device)
    n, h = pairs // top_k, y.shape[1]
    out = torch.empty(n, h, dtype=out_dtype, device=y.device)
    if n == 0 or h == 0:
        return out
    inv, w = inverse.reshape(-1), weights.reshape(-1)
    block_h = _pow2_at_most(h, 512)
    block_n = _pow2_at_most(n, max(1, 2048 // block_h))
    grid = (triton.cdiv(n, block_n), triton.cdiv(h, block_h))
    _combine_kernel[grid](
        y,
        inv,
        w,
        out,
        n,
        h,
        y.stride(0),
        y.stride(1),
        inv.stride(0),
        w.stride(0),
        out.stride(0),
        out.stride(1),
        TOP_K=top_k,
        ROUND=out_dtype == torch.bfloat16,
        BLOCK_N=block_n,
        BLOCK_H=block_h,
        num_warps=4,
        enable_fp_fusion=True,
    )
    return out


def moe_experts(experts, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Experts.forward with the fused tails: x [N, H], top_k_index / top_k_weights [N, top_k]
    -> [N, H] in x's dtype. `experts` is a dgemma.model.diffusion_gemma.Experts (gate_up_proj
    [E, 2I, H], down_proj [E, H, I], approximate, num_experts).

    Pairs are sorted by expert; the cumulative rows per expert come from searchsorted on the
    sorted ids (int32, on the device: no host sync, unlike bincount on CUDA); both matmuls are
    the same grouped_matmul as Experts.forward (F.grouped_mm where it runs, its loop fallback,
    which syncs, elsewhere); gelu_mul between them, combine_topk at the end."""
    from ..model.diffusion_gemma import grouped_matmul

    if x.dim() != 2 or top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_experts needs x [N, H] and top_k_index [N, top_k], got {tuple(x.shape)} and {tuple(top_k_index.shape)}"
        )
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"moe_experts top_k_weights must match top_k_index {tuple(top_k_index.shape)}, got {tuple(top_k_weights.shape)}"
        )
    e = experts.num_experts
    num_tokens, top_k = top_k_index.shape
    if num_tokens == 0 or top_k == 0:
        return x.new_zeros(num_tokens, x.shape[1])
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    routed = x[perm // top_k]
    bounds = torch.arange(e, device=expert_ids.device, dtype=expert_ids.dtype)
    offsets = torch.searchsorted(expert_ids, bounds, right=True, out_int32=True)  # rows with id <= e
    gate_up = grouped_matmul(routed, experts.gate_up_proj.transpose(-2, -1), offsets)
    hidden = gelu_mul(gate_up, experts.approximate)
    y = grouped_matmul(hidden, experts.down_proj.transpose(-2, -1), offsets)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return combine_topk(y, inverse, top_k_weights.reshape(-1), top_k, out_dtype=x.dtype)

"""The MoE block of the fused layer in Triton: router top-k and expert alignment; the expert GEMMs
are kernels/triton_quant.py's `gemm` (every weight format), with rows gathered and scattered in place.

The block of a layer in four launches, five with few tokens (kernels/fused.py calls `router_topk`, then `moe`):

    router_topk   router logits (the [T, H] x [H, E] GEMM, rounded as torch's output), float32
                  softmax, top-k (the largest first, the lower expert id first among equals),
                  renormalised, times per_expert_scale   -> weights [T, K] float32, experts [T, K]
                  (with few tokens two launches: K split into chunks, then their sums and the pick)
    moe_align     the (token, slot) pairs grouped by expert in one kernel (one program per
                  expert counts the pairs before it and places its own, stable: pair order within
                  an expert)                              -> pairs [T K] int32, ends [E] int32
    gemm (dual)   each expert's gate|up rows x its token rows, gathered in the A-load (no copy of
                  the routed rows), gelu(gate) * up in the epilogue  -> act [T K, I] by expert
    gemm          each expert's down rows, the output rows scattered back to (token, slot) order
                                                          -> y [T K, H] (triton_norms.combine sums)

No host sync anywhere (no bincount, no sizes read back): graph-capturable.
"""

from __future__ import annotations

import torch

from .triton_quant import GemmWeight, dot_args, gemm
from .triton_support import HAVE_TRITON, interpreted, round_if, runs_on, tl, triton

if HAVE_TRITON:

    @triton.jit
    def _token_block(T, E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        """Program i's BLOCK_T tokens and the E experts' lanes, with their bounds."""
        toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        es = tl.arange(0, BLOCK_E)
        return toks, toks < T, es, es < E

    @triton.jit
    def _router_chunk(
        x_ptr,
        w_ptr,
        toks,
        t_ok,
        es,
        e_ok,
        k_lo,
        H,
        stride_x,
        stride_w,
        UPCAST_DOT: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_CHUNK: tl.constexpr,
    ):
        """x @ W.T over H's columns [k_lo, k_lo + K_CHUNK), from zero: [BLOCK_T, BLOCK_E] float32.
        A chunk's sum is the same whichever program computes it, so the logits are the same bits
        whether one program adds the chunks or one program a chunk does (`_router_sum_kernel`)."""
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for k0 in range(k_lo, k_lo + K_CHUNK, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            x = tl.load(
                x_ptr + toks.to(tl.int64)[:, None] * stride_x + ks[None, :],
                mask=t_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + es.to(tl.int64)[:, None] * stride_w + ks[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0
            )
            if UPCAST_DOT:
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)
        return acc

    @triton.jit
    def _router_pick(
        acc,
        toks,
        t_ok,
        es,
        e_ok,
        E,
        scale_ptr,
        top_w_ptr,
        top_i_ptr,
        TOP_K: tl.constexpr,
        ROUND: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_KK: tl.constexpr,
    ):
        """From the logits' float32 sums (rounded as the model's dtype): float32 softmax over the E
        experts, the TOP_K largest (descending; the lower id first among equals), renormalised to
        sum 1, times per_expert_scale[id], stored."""
        logits = tl.where(e_ok[None, :], round_if(acc, ROUND), -float("inf"))
        p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        kk = tl.arange(0, BLOCK_KK)
        vals = tl.zeros((BLOCK_T, BLOCK_KK), dtype=tl.float32)
        picks = tl.zeros((BLOCK_T, BLOCK_KK), dtype=tl.int32)
        for k in tl.static_range(TOP_K):  # the k-th largest: its value, then the lowest id holding it
            best = tl.max(p, axis=1)
            pick = tl.min(tl.where(p == best[:, None], es[None, :], BLOCK_E), axis=1)
            pick = tl.minimum(pick, E - 1)  # a NaN row matches no id: an expert still (never a read past E)
            vals = tl.where(kk[None, :] == k, best[:, None], vals)
            picks = tl.where(kk[None, :] == k, pick[:, None], picks)
            p = tl.where(es[None, :] == pick[:, None], -1.0, p)
        total = tl.sum(vals, axis=1)
        out_ok = t_ok[:, None] & (kk < TOP_K)[None, :]
        s = tl.load(scale_ptr + picks, mask=out_ok, other=0.0).to(tl.float32)
        offs = toks[:, None] * TOP_K + kk[None, :]
        tl.store(top_w_ptr + offs, (vals / total[:, None]) * s, mask=out_ok)
        tl.store(top_i_ptr + offs, picks, mask=out_ok)

    @triton.jit
    def _router_kernel(
        x_ptr,
        w_ptr,
        scale_ptr,
        top_w_ptr,
        top_i_ptr,
        T,
        H,
        E,
        stride_x,
        stride_w,
        TOP_K: tl.constexpr,
        ROUND: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_CHUNK: tl.constexpr,
        BLOCK_KK: tl.constexpr,
    ):
        """For BLOCK_T tokens: logits = x @ W.T (H's chunks summed in order), then `_router_pick`."""
        toks, t_ok, es, e_ok = _token_block(T, E, BLOCK_T, BLOCK_E)
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for k_lo in range(0, H, K_CHUNK):
            acc += _router_chunk(
                x_ptr, w_ptr, toks, t_ok, es, e_ok, k_lo, H, stride_x, stride_w,
                UPCAST_DOT, INPUT_PRECISION, BLOCK_T, BLOCK_E, BLOCK_K, K_CHUNK,
            )  # fmt: skip
        _router_pick(
            acc, toks, t_ok, es, e_ok, E, scale_ptr, top_w_ptr, top_i_ptr, TOP_K, ROUND, BLOCK_T, BLOCK_E, BLOCK_KK
        )

    @triton.jit
    def _router_chunks_kernel(
        x_ptr,
        w_ptr,
        part_ptr,
        T,
        H,
        E,
        stride_x,
        stride_w,
        UPCAST_DOT: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_CHUNK: tl.constexpr,
    ):
        """Split K (few tokens: AR's, a small turbo pass's): program (i, c) writes chunk c's sums of
        token block i, part[c, t, :E] float32."""
        toks, t_ok, es, e_ok = _token_block(T, E, BLOCK_T, BLOCK_E)
        c = tl.program_id(1)
        acc = _router_chunk(
            x_ptr, w_ptr, toks, t_ok, es, e_ok, c * K_CHUNK, H, stride_x, stride_w,
            UPCAST_DOT, INPUT_PRECISION, BLOCK_T, BLOCK_E, BLOCK_K, K_CHUNK,
        )  # fmt: skip
        rows = (c * T + toks).to(tl.int64)
        tl.store(part_ptr + rows[:, None] * E + es[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])

    @triton.jit
    def _router_sum_kernel(
        part_ptr,
        scale_ptr,
        top_w_ptr,
        top_i_ptr,
        T,
        E,
        CHUNKS,
        TOP_K: tl.constexpr,
        ROUND: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_KK: tl.constexpr,
    ):
        """The chunks' sums added in order (as `_router_kernel` adds them), then `_router_pick`."""
        toks, t_ok, es, e_ok = _token_block(T, E, BLOCK_T, BLOCK_E)
        ok = t_ok[:, None] & e_ok[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for c in range(0, CHUNKS):
            rows = (c * T + toks).to(tl.int64)
            acc += tl.load(part_ptr + rows[:, None] * E + es[None, :], mask=ok, other=0.0)
        _router_pick(
            acc, toks, t_ok, es, e_ok, E, scale_ptr, top_w_ptr, top_i_ptr, TOP_K, ROUND, BLOCK_T, BLOCK_E, BLOCK_KK
        )

    @triton.jit
    def _align_kernel(ids_ptr, pairs_ptr, ends_ptr, P, BLOCK: tl.constexpr):
        """Program e: where expert e's pairs start (the pairs with a lower id), then each of its
        pairs (in pair order) at start + its rank among them; ends[e] = start + their count."""
        e = tl.program_id(0)
        before = 0
        for p0 in range(0, P, BLOCK):
            ps = p0 + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + ps, mask=ps < P, other=2**30)
            before += tl.sum((ids < e).to(tl.int32), axis=0)
        placed = before
        for p0 in range(0, P, BLOCK):
            ps = p0 + tl.arange(0, BLOCK)
            mine = (tl.load(ids_ptr + ps, mask=ps < P, other=-1) == e).to(tl.int32)
            rank = tl.cumsum(mine, axis=0) - 1
            tl.store(pairs_ptr + placed + rank, ps, mask=mine != 0)
            placed += tl.sum(mine, axis=0)
        tl.store(ends_ptr + e, placed)

    INTERPRETED = interpreted(_router_kernel)
else:  # pragma: no cover
    INTERPRETED = False


def available(device: torch.device | str) -> bool:
    """Whether these kernels can run on `device` (triton_support.runs_on)."""
    return runs_on(device, INTERPRETED)


ROUTER_K_CHUNK = 128  # H's columns a router chunk sums (the released model's 2,816: 22 chunks)
ROUTER_SPLIT_BELOW = 8  # token blocks under which the router splits K: AR's tokens, a small turbo pass


def router_topk(
    x: torch.Tensor, weight: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int, split: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router.forward after its input norm: (weights [T, top_k] float32, experts [T, top_k] int32).

    With few tokens (fewer than ROUTER_SPLIT_BELOW blocks of 16; `split` forces either way) one
    program per token block would stream the whole [E, H] weight alone (an AR token: 1 CTA, the
    largest share of its step, issue 54): then one program per (block, K chunk) writes the chunk's
    float32 sums and a second launch adds them in order and picks. Both ways add the same chunks in
    the same order: the same bits, so the choice never moves a token."""
    t, h = x.shape
    e = weight.shape[0]
    top_w = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    top_i = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    if t == 0:
        return top_w, top_i
    block_t = 16
    blocks, chunks = triton.cdiv(t, block_t), triton.cdiv(h, ROUTER_K_CHUNK)
    if split is None:
        split = blocks < ROUTER_SPLIT_BELOW and chunks > 1
    shape = dict(
        **dot_args(x.dtype),
        BLOCK_T=block_t,
        BLOCK_E=max(16, triton.next_power_of_2(e)),
        BLOCK_K=32 if INTERPRETED else 64,
        K_CHUNK=ROUTER_K_CHUNK,
        num_warps=4,
    )
    pick = dict(TOP_K=top_k, ROUND=x.dtype == torch.bfloat16, BLOCK_KK=triton.next_power_of_2(top_k))
    if not split:
        _router_kernel[(blocks,)](
            x, weight, per_expert_scale, top_w, top_i, t, h, e, x.stride(0), weight.stride(0), **pick, **shape
        )
        return top_w, top_i
    part = torch.empty(chunks, t, e, dtype=torch.float32, device=x.device)
    _router_chunks_kernel[(blocks, chunks)](x, weight, part, t, h, e, x.stride(0), weight.stride(0), **shape)
    _router_sum_kernel[(blocks,)](
        part, per_expert_scale, top_w, top_i, t, e, chunks, **pick,
        BLOCK_T=block_t, BLOCK_E=shape["BLOCK_E"], num_warps=4,
    )  # fmt: skip
    return top_w, top_i


def moe_align(top_i: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [T K] int32: the (token, slot) pairs grouped by expert, pair order within one;
    ends [E] int32: the cumulative pair count through each expert). One launch, no host sync."""
    ids = top_i.reshape(-1)
    p = ids.shape[0]
    pairs = torch.empty(p, dtype=torch.int32, device=ids.device)
    ends = torch.empty(experts, dtype=torch.int32, device=ids.device)
    _align_kernel[(experts,)](ids, pairs, ends, p, BLOCK=min(1024, max(16, triton.next_power_of_2(p))))
    return pairs, ends


def moe(x: torch.Tensor, top_i: torch.Tensor, gate_up: GemmWeight, down: GemmWeight, approximate: str) -> torch.Tensor:
    """The experts of [T, H] tokens routed to `top_i` [T, K]: y [T K, H], each (token, slot) pair's
    expert output (unweighted) in pair order: `triton_norms.combine` weighs and sums them."""
    t, top_k = top_i.shape
    pairs, ends = moe_align(top_i, gate_up.shape[0])
    avg = -(-t * top_k // gate_up.shape[0])
    act = gemm(x, gate_up, ends, pairs, top_k, gather=True, dual=approximate, rows_per_expert=avg)
    return gemm(act, down, ends, pairs, top_k, scatter=True, rows_per_expert=avg)

"""Attention over the paged KV pool, reading K/V blocks where they lie: a denoising canvas's over
its prefix, and an encoder pass's, causal (`paged_prefix_attention`, at the end).

A decoder (canvas) pass attends, per row, to the row's committed positions [lo, start) in the
layer's block pool and then to the canvas's own C keys, bidirectionally (every canvas query sees
the same keys; sliding-window layers just have lo > 0). The queries are A rows against those C
canvas keys: A = C for a full pass; A < C for a turbo pass over the active positions only, whose
frozen positions still contribute keys / values (from a buffer) but no queries. Since every query
sees the same keys, a query's canvas position plays no part in the kernel.

`PagedKVCache.attend` gathers those blocks into a contiguous buffer per row (`_row_keys`), pads
the rows to the longest and calls `attention.sdpa` with a mask: host-side ranges and shapes that
change with every prefix length, so nothing of it can be captured once in a CUDA graph.
`paged_canvas_attention` replaces that gather + mask + SDPA with one Triton kernel whose only
prefix-dependent inputs are device tensors (block tables, lo, start): one captured graph replays
for any prefix length.

Layout (PagedKVCache): one layer's pool is [num_blocks, block_size, Hkv, D]; logical block j of
row i (positions j * block_size ..) is pool block block_tables[i, j], so position p sits at
(block_tables[i, p // block_size], p % block_size). Table entries outside [lo, start) are never
read (a released sliding block reads -1 there). Canvas keys/values are scratch [n, Hkv, C, D],
never in the pool; queries are [n, H, A, D].

The kernel: a program takes one row, one KV head and BLOCK_M of the G * A queries that share the
head (GQA: query head h reads KV head h // G, G = H / Hkv; the group's heads are packed along M,
so each K/V tile is loaded once for all of them). It streams keys in tiles of BLOCK_N, first the
prefix (the tile's block ids read from the table, keys gathered slot by slot), then the canvas,
with an online softmax: a running row maximum m, sum l and float32 accumulator acc, rescaled by
exp(m_old - m_new) whenever the maximum grows; out = acc / l. Scale is 1.0 (q and k are
RMS-normed), as in `sdpa`. Every tile the loops visit holds at least one valid key, so m is
finite after the first and no NaN arises from -inf - -inf.

The encoder pass (the fused network's prefill, `PagedKVCache.plan_encoder(in_place=True)`): its
queries sit at positions start .. start + count - 1 and its own keys are already in the pool (the
q|k|v kernel wrote them), so a row attends over the pool alone: query p sees keys (p - window, p]
on a sliding layer, [0, p] on a global one, and with bidirectional images the tokens of its own
image wherever they lie (a per-token image id, -1 at text). A KV head's G query heads are packed
position-major (row r: position r // G, head r % G), so a tile spans BLOCK_M / G positions and its
key loop ends at its last query; one launch a layer, no split (G * T query rows a KV head suffice).

Split-K (flash-decoding): with one row and few KV heads there are too few programs to fill a
GPU, so the keys (the prefix, then the canvas's) can be cut into `num_splits` equal chunks of whole
tiles (chunk length computed on the device from lo / start, so still graph-safe) handled by
separate programs that write (m, l, acc) in float32, and a second kernel combines the splits
(weights exp(m_s - max m)). The default picks the split count from shapes only (rows, heads,
table width, the GPU's SM count), never from the prefix length.

Precision: bf16 / fp16 tiles go to tl.dot as they are (tensor cores, float32 accumulation), the
probabilities cast to V's dtype for the P @ V product, as FlashAttention does; float32 inputs use
input_precision="ieee" (no TF32). Under Triton's interpreter a bf16 x bf16 tl.dot multiplies the
raw bits, so there both operands are upcast to float32 first (the same products: bf16 x bf16 is
exact in float32). Pointer offsets into the pool are int64 (a pool passes 2^31 elements easily).

Block sizes (`pick_blocks`) are heuristics, not timed on hardware: the largest tiles whose sm90
compile neither spills registers nor overflows shared memory, for D up to 512; the interpreter
uses 16 x 16 tiles.
"""

from __future__ import annotations

import functools

import torch

from .triton_support import HAVE_TRITON, interpreted, runs_on, tl, triton

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 512
MAX_SPLITS = 8

if HAVE_TRITON:

    @triton.jit
    def _attend_tile(q, k, v, valid, m_i, l_i, acc, UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """One online-softmax step: scores q [BM, D] @ k [BN, D].T (keys not `valid` -> -inf),
        the running max / sum rescaled, acc [BM, D] += p @ v. Returns (m, l, acc)."""
        if UPCAST_DOT:  # the interpreter multiplies bf16's raw bits: the same products in float32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        p = p.to(v.dtype)  # as tensor cores take it (a no-op in float32)
        if UPCAST_DOT:
            acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p, v, acc, input_precision=INPUT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _split_keys(pid_s, lo, start, C, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """Split `pid_s`'s keys: prefix positions [s_lo, s_hi) and canvas keys [c_lo, c_hi). The
        prefix [lo, start) and then the C canvas keys, as one run cut into NUM_SPLITS equal chunks
        of whole tiles (issue 54: the canvas all in the last split made it 6 + 8 tiles against the
        others' 6 in a batch-1 step's sliding layers)."""
        if NUM_SPLITS == 1:
            return lo, start, 0, C
        per = (start - lo + C + NUM_SPLITS - 1) // NUM_SPLITS
        chunk = (per + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        v_lo, v_hi = pid_s * chunk, pid_s * chunk + chunk  # in the run: prefix keys, then the canvas's
        c_lo = tl.minimum(tl.maximum(v_lo - (start - lo), 0), C)
        c_hi = tl.minimum(tl.maximum(v_hi - (start - lo), 0), C)
        return tl.minimum(lo + v_lo, start), tl.minimum(lo + v_hi, start), c_lo, c_hi

    @triton.jit
    def _paged_canvas_kernel(
        q_ptr, kc_ptr, vc_ptr, kp_ptr, vp_ptr, table_ptr, lo_ptr, start_ptr, out_ptr, part_ptr, m_ptr, l_ptr,
        crow_ptr, A, C, G, HKV,
        sq_b, sq_h, sq_a, sq_d,
        skc_b, skc_h, skc_c, skc_d,
        svc_b, svc_h, svc_c, svc_d,
        skp_n, skp_s, skp_h, skp_d,
        svp_n, svp_s, svp_h, svp_d,
        st_b, st_j,
        so_b, so_a, so_h, so_d,
        POOL_BLOCK: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, CANVAS_ROWS: tl.constexpr,
        UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Grid (query tiles, n * Hkv, splits): BLOCK_M of the G * A queries of row b, KV head kvh,
        over split `pid_s`'s share of the keys (the prefix's, then the C canvas keys)."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_s = tl.program_id(2)
        b = pid_bh // HKV
        kvh = pid_bh % HKV
        b64 = b.to(tl.int64)
        kvh64 = kvh.to(tl.int64)

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (head in group, query row)
        row_ok = rows < G * A
        head = (kvh * G + rows // A).to(tl.int64)
        qidx = (rows % A).to(tl.int64)
        d = tl.arange(0, D)
        qd_mask = row_ok[:, None] & (d[None, :] < D)
        q_off = b64 * sq_b + head[:, None] * sq_h + qidx[:, None] * sq_a + d[None, :] * sq_d
        q = tl.load(q_ptr + q_off, mask=qd_mask, other=0.0)

        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)

        lo = tl.load(lo_ptr + b)
        start = tl.load(start_ptr + b)
        s_lo, s_hi, c_lo, c_hi = _split_keys(pid_s, lo, start, C, NUM_SPLITS, BLOCK_N)
        kp_head = kp_ptr + kvh64 * skp_h
        vp_head = vp_ptr + kvh64 * svp_h
        table_row = table_ptr + b64 * st_b
        n_off = tl.arange(0, BLOCK_N)
        for k0 in range(s_lo, s_hi, BLOCK_N):
            pos = k0 + n_off
            ok = pos < s_hi
            blk = tl.load(table_row + (pos // POOL_BLOCK) * st_j, mask=ok, other=0).to(tl.int64)
            slot = (pos % POOL_BLOCK).to(tl.int64)
            kd_mask = ok[:, None] & (d[None, :] < D)
            k = tl.load(kp_head + (blk * skp_n + slot * skp_s)[:, None] + d[None, :] * skp_d, mask=kd_mask, other=0.0)
            v = tl.load(vp_head + (blk * svp_n + slot * svp_s)[:, None] + d[None, :] * svp_d, mask=kd_mask, other=0.0)
            m_i, l_i, acc = _attend_tile(q, k, v, ok, m_i, l_i, acc, UPCAST_DOT, INPUT_PRECISION)

        # then the canvas's own keys [c_lo, c_hi)
        if CANVAS_ROWS:  # row b's canvas keys are row crow[b] of k_canvas (a turbo pass's canvas K/V slot)
            cb = tl.load(crow_ptr + b).to(tl.int64)
        else:
            cb = b64
        kc_head = kc_ptr + cb * skc_b + kvh64 * skc_h
        vc_head = vc_ptr + cb * svc_b + kvh64 * svc_h
        for c0 in range(c_lo, c_hi, BLOCK_N):
            kc = c0 + n_off
            ok = kc < c_hi
            kc64 = kc.to(tl.int64)
            kd_mask = ok[:, None] & (d[None, :] < D)
            k = tl.load(kc_head + kc64[:, None] * skc_c + d[None, :] * skc_d, mask=kd_mask, other=0.0)
            v = tl.load(vc_head + kc64[:, None] * svc_c + d[None, :] * svc_d, mask=kd_mask, other=0.0)
            m_i, l_i, acc = _attend_tile(q, k, v, ok, m_i, l_i, acc, UPCAST_DOT, INPUT_PRECISION)

        if NUM_SPLITS == 1:
            o = acc / l_i[:, None]
            o_off = b64 * so_b + qidx[:, None] * so_a + head[:, None] * so_h + d[None, :] * so_d
            tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=qd_mask)
        else:  # partials [n, H, A, S] (m, l) and [n, H, A, S, D] (acc), float32, contiguous
            part_row = ((b64 * (G * HKV) + head) * A + qidx) * NUM_SPLITS + pid_s
            tl.store(m_ptr + part_row, m_i, mask=row_ok)
            tl.store(l_ptr + part_row, l_i, mask=row_ok)
            tl.store(part_ptr + part_row[:, None] * D + d[None, :], acc, mask=qd_mask)

    @triton.jit
    def _combine_splits_kernel(
        part_ptr,
        m_ptr,
        l_ptr,
        out_ptr,
        A,
        H,
        so_b,
        so_a,
        so_h,
        so_d,
        D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr,
    ):
        """One query (b, h, a) per program: out = sum_s w_s acc_s / sum_s w_s l_s with
        w_s = exp(m_s - max m) (a split that saw no key has m = -inf: weight 0)."""
        r = tl.program_id(0).to(tl.int64)
        b = r // (H * A)
        h = (r // A) % H
        a = r % A
        s = tl.arange(0, SPLITS_P2)
        s_ok = s < NUM_SPLITS
        d = tl.arange(0, D)
        m = tl.load(m_ptr + r * NUM_SPLITS + s, mask=s_ok, other=float("-inf"))
        sums = tl.load(l_ptr + r * NUM_SPLITS + s, mask=s_ok, other=0.0)
        acc = tl.load(
            part_ptr + (r * NUM_SPLITS + s)[:, None] * D + d[None, :], mask=s_ok[:, None] & (d[None, :] < D), other=0.0
        )
        w = tl.exp(m - tl.max(m, 0))
        o = tl.sum(acc * w[:, None], 0) / tl.sum(sums * w, 0)
        tl.store(out_ptr + b * so_b + a * so_a + h * so_h + d * so_d, o.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _attend_masked(q, k, v, see, m_i, l_i, acc, UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """`_attend_tile` with a mask per (query, key) `see` [BM, BN]: a causal tile may hide every
        key from some of its queries, so the running maximum can still be -inf after it, and the
        exponentials are taken from 0 there instead (exp(-inf - 0) = 0: no NaN from -inf - -inf)."""
        if UPCAST_DOT:  # the interpreter multiplies bf16's raw bits: the same products in float32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        p = p.to(v.dtype)
        if UPCAST_DOT:
            acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p, v, acc, input_precision=INPUT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _paged_prefix_kernel(
        q_ptr, kp_ptr, vp_ptr, table_ptr, start_ptr, count_ptr, group_ptr, out_ptr,
        T, G, HKV, WINDOW,
        sq_b, sq_h, sq_t, sq_d,
        skp_n, skp_s, skp_h, skp_d,
        svp_n, svp_s, svp_h, svp_d,
        st_b, st_j, sg_b, sg_t,
        so_b, so_t, so_h, so_d,
        POOL_BLOCK: tl.constexpr, D: tl.constexpr, SLIDING: tl.constexpr, GROUPS: tl.constexpr,
        UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Grid (query tiles, n * Hkv): BLOCK_M packed rows (query position r // G, head r % G of
        the KV head's group) of row b, causal over the pool positions up to each query."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // HKV
        kvh = pid_bh % HKV
        b64 = b.to(tl.int64)
        kvh64 = kvh.to(tl.int64)
        start = tl.load(start_ptr + b)
        last = tl.load(count_ptr + b) - 1  # the row's last new token (later ones are padding)

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < G * T
        qi = rows // G
        head = (kvh * G + rows % G).to(tl.int64)
        qpos = start + tl.minimum(qi, last)  # a padding query attends as the row's last token
        d = tl.arange(0, D)
        qd_mask = row_ok[:, None] & (d[None, :] < D)
        q_off = b64 * sq_b + head[:, None] * sq_h + qi.to(tl.int64)[:, None] * sq_t + d[None, :] * sq_d
        q = tl.load(q_ptr + q_off, mask=qd_mask, other=0.0)

        # the tile's keys: from its first query's window (0 on a global layer) through its last query
        k_lo = 0
        if SLIDING:
            k_lo = tl.maximum(start + tl.minimum(pid_m * BLOCK_M // G, last) - WINDOW + 1, 0)
        k_hi = start + tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, last) + 1
        g_row = group_ptr + b64 * sg_b
        if GROUPS:  # an image token also sees its image's later tokens, and its earlier ones past the window
            q_group = tl.load(g_row + qi.to(tl.int64) * sg_t, mask=row_ok & (qi <= last), other=-1)
            k_hi = start + last + 1
            k_lo = tl.minimum(k_lo, start)

        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        kp_head = kp_ptr + kvh64 * skp_h
        vp_head = vp_ptr + kvh64 * svp_h
        table_row = table_ptr + b64 * st_b
        n_off = tl.arange(0, BLOCK_N)
        for k0 in range(k_lo, k_hi, BLOCK_N):
            pos = k0 + n_off
            ok = pos < k_hi
            blk = tl.load(table_row + (pos // POOL_BLOCK) * st_j, mask=ok, other=0).to(tl.int64)
            slot = (pos % POOL_BLOCK).to(tl.int64)
            kd_mask = ok[:, None] & (d[None, :] < D)
            k = tl.load(kp_head + (blk * skp_n + slot * skp_s)[:, None] + d[None, :] * skp_d, mask=kd_mask, other=0.0)
            v = tl.load(vp_head + (blk * svp_n + slot * svp_s)[:, None] + d[None, :] * svp_d, mask=kd_mask, other=0.0)
            see = ok[None, :] & (pos[None, :] <= qpos[:, None])
            if SLIDING:
                see = see & (pos[None, :] > qpos[:, None] - WINDOW)
            if GROUPS:
                j = pos - start
                k_group = tl.load(g_row + j.to(tl.int64) * sg_t, mask=ok & (j >= 0), other=-1)
                see = see | ((q_group[:, None] == k_group[None, :]) & (k_group[None, :] >= 0))
            m_i, l_i, acc = _attend_masked(q, k, v, see, m_i, l_i, acc, UPCAST_DOT, INPUT_PRECISION)

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row with no key (an empty padding row): zeros
        o_off = b64 * so_b + qi.to(tl.int64)[:, None] * so_t + head[:, None] * so_h + d[None, :] * so_d
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=qd_mask)

    INTERPRETED = interpreted(_paged_canvas_kernel)
else:  # pragma: no cover
    INTERPRETED = False


def available(device: torch.device | str) -> bool:
    """Whether these kernels can run on `device` (triton_support.runs_on)."""
    return runs_on(device, INTERPRETED)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pick_blocks(rows: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for `rows` = G * A packed queries of a KV head.
    The [BLOCK_M, D] float32 accumulator lives in registers and the K / V tiles (times the
    pipeline's stages) in shared memory, so wider heads get fewer query rows or key tiles. Chosen
    from sm90 compiles (triton 3.9's ptxas) as the largest without register spills, bf16:
    D <= 128: 64 x 64, 4 warps, 3 stages (~230 registers, 112 KiB shared at D = 128);
    D = 256: 64 x 32, 8 warps, 3 stages (177-191 registers, 128 KiB); D = 512: 32 x 32, 8 warps,
    2 stages (174-186, 98 KiB; 64 rows spill: 232 bytes at 255 registers, and 192 KiB shared).
    tests/kernels/test_triton_compile.py compiles the released model's (D = 256 and 512, each split
    count) for sm90 and fails on a spill. float32 (ieee products, no tensor cores: a correctness
    path) 16 x 16. tl.dot needs every dimension >= 16; the interpreter uses 16 x 16."""
    if INTERPRETED:
        return 16, 16, 4, 1
    if dtype == torch.float32:
        return 16, 16, 4 if head_dim <= 256 else 8, 2
    cap_m, block_n, num_warps, num_stages = (
        (64, 64, 4, 3) if head_dim <= 128 else (64, 32, 8, 3) if head_dim <= 256 else (32, 32, 8, 2)
    )
    return min(cap_m, max(16, triton.next_power_of_2(rows))), block_n, num_warps, num_stages


def pick_splits(device: torch.device, programs: int, max_prefix: int, block_n: int) -> int:
    """Prefix splits for a grid of `programs` (query tiles x rows x KV heads), from shapes only
    (graph-safe): enough to give every SM a program, at most MAX_SPLITS, and no more than the
    table's capacity `max_prefix` fills with 4 key tiles a split. 1 under the interpreter."""
    if INTERPRETED or device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(sms, programs), max_prefix // (4 * block_n)))


def _check(q, k_canvas, v_canvas, k_pool, v_pool, block_tables, lo, start, canvas_rows=None) -> None:
    """Shapes, dtypes and devices the kernel relies on (it does no bounds checks of its own)."""
    names = ("q", "k_canvas", "v_canvas", "k_pool", "v_pool")
    for name, t in zip(names, (q, k_canvas, v_canvas, k_pool, v_pool)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4D, got shape {tuple(t.shape)}")
    n, h, a, d = q.shape
    hkv, c = k_canvas.shape[1], k_canvas.shape[2]
    if k_canvas.shape != v_canvas.shape:
        raise ValueError(
            f"k_canvas / v_canvas must be [n, Hkv, C, D] alike, got {tuple(k_canvas.shape)} and {tuple(v_canvas.shape)}"
        )
    if canvas_rows is not None:
        if canvas_rows.shape != (n,) or canvas_rows.dtype != torch.int32:
            raise ValueError(f"canvas_rows must be int32 [{n}], got {canvas_rows.dtype} {tuple(canvas_rows.shape)}")
    elif k_canvas.shape[0] != n:
        raise ValueError(
            f"k_canvas / v_canvas must be [n, Hkv, C, D] with q's n = {n} rows, got {tuple(k_canvas.shape)}"
        )
    if k_canvas.shape[3] != d:
        raise ValueError(
            f"k_canvas / v_canvas must be [n, Hkv, C, D] with q's head_dim D = {d}, got {tuple(k_canvas.shape)}"
        )
    if hkv == 0 or h % hkv:
        raise ValueError(f"q's {h} heads do not divide into {hkv} KV heads")
    if k_pool.shape != v_pool.shape or tuple(k_pool.shape[2:]) != (hkv, d):
        raise ValueError(
            f"k_pool / v_pool must both be [num_blocks, block_size, Hkv, D] with Hkv={hkv}, D={d}, "
            f"got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    if d < 16 or d > MAX_HEAD_DIM or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two in 16..{MAX_HEAD_DIM}, got {d}")
    if c < 1:
        raise ValueError("the canvas must have at least one position (C >= 1)")
    if a < 1:
        raise ValueError("q must have at least one query row (A >= 1)")
    if q.dtype not in DTYPES:
        raise ValueError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    for name, t in zip(names[1:], (k_canvas, v_canvas, k_pool, v_pool)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} is {t.dtype}, q is {q.dtype}: all of q, k/v canvas and pools must share a dtype")
    if block_tables.dim() != 2 or block_tables.shape[0] != n or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [n={n}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    for name, t in (("lo", lo), ("start", start)):
        if tuple(t.shape) != (n,) or t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 [n={n}], got {t.dtype} {tuple(t.shape)}")
    for name, t in zip(
        names[1:] + ("block_tables", "lo", "start"), (k_canvas, v_canvas, k_pool, v_pool, block_tables, lo, start)
    ):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def paged_canvas_attention(
    q: torch.Tensor,
    k_canvas: torch.Tensor,
    v_canvas: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lo: torch.Tensor,
    start: torch.Tensor,
    blocks: tuple[int, int] | None = None,
    num_splits: int | None = None,
    canvas_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Canvas attention over the paged prefix, without gathering it: row i's A query rows q[i]
    [H, A, D] attend to pool positions [lo[i], start[i]) (block_tables[i, p // block_size],
    slot p % block_size) and then to all C canvas keys k_canvas[i] [Hkv, C, D]; scale 1.0,
    GQA (query head h reads KV head h // (H / Hkv)). -> [n, A, H, D] in q's dtype, as `sdpa`.
    A = C is a full canvas pass; A < C (any A >= 1) a pass over the active positions, whose
    output rows equal those rows of the full pass (the attention is bidirectional).

    lo / start / block_tables are read on the device only (no host sync, no shape depends on
    the prefix), so a captured CUDA graph replays for any prefix length up to the table's width.
    `blocks` = (BLOCK_M, BLOCK_N), powers of two >= 16 (None: `pick_blocks`); `num_splits`
    splits the prefix across programs (None: `pick_splits`, from shapes only). `canvas_rows` (int32
    [n]): row i's canvas keys are k_canvas[canvas_rows[i]] (k_canvas [S, Hkv, C, D], any S: a turbo
    pass's canvas K/V slots)."""
    _check(q, k_canvas, v_canvas, k_pool, v_pool, block_tables, lo, start, canvas_rows)
    if not available(q.device):
        why = "triton is not installed" if not HAVE_TRITON else f"the device is {q.device.type}, not CUDA"
        raise RuntimeError(f"no Triton paged attention here ({why}); use PagedKVCache.attend and sdpa")
    n, h, a, d = q.shape
    hkv, c = k_canvas.shape[1], k_canvas.shape[2]
    g = h // hkv
    out = torch.empty(n, a, h, d, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    block_m, block_n, num_warps, num_stages = pick_blocks(g * a, d, q.dtype)
    if blocks is not None:
        block_m, block_n = blocks
        if min(blocks) < 16 or block_m & (block_m - 1) or block_n & (block_n - 1):
            raise ValueError(f"blocks must be powers of two >= 16, got {blocks}")
    m_tiles = triton.cdiv(g * a, block_m)
    pool_block = k_pool.shape[1]
    if num_splits is None:
        num_splits = pick_splits(q.device, m_tiles * n * hkv, block_tables.shape[1] * pool_block, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_splits > 1:
        part = torch.empty(n, h, a, num_splits, d, dtype=torch.float32, device=q.device)
        m_part = torch.empty(n, h, a, num_splits, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
    else:
        part = m_part = l_part = out  # unused
    _paged_canvas_kernel[(m_tiles, n * hkv, num_splits)](
        q, k_canvas, v_canvas, k_pool, v_pool, block_tables, lo, start, out, part, m_part, l_part,
        canvas_rows if canvas_rows is not None else lo, a, c, g, hkv,
        *q.stride(), *k_canvas.stride(), *v_canvas.stride(), *k_pool.stride(), *v_pool.stride(),
        *block_tables.stride(), *out.stride(),
        POOL_BLOCK=pool_block, D=d, NUM_SPLITS=num_splits, CANVAS_ROWS=canvas_rows is not None,
        UPCAST_DOT=INTERPRETED and q.dtype == torch.bfloat16,  # the interpreter multiplies bf16's raw bits
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # float32: no TF32 rounding
        BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages,
        enable_fp_fusion=True,  # triton's default until 3.10 (3.9 warns when it is left unsaid)
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(n * h * a,)](
            part,
            m_part,
            l_part,
            out,
            a,
            h,
            *out.stride(),
            D=d,
            NUM_SPLITS=num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            num_warps=4 if d <= 256 else 8,
            enable_fp_fusion=True,
        )
    return out


def _check_prefix(q, k_pool, v_pool, block_tables, start, count, groups) -> None:
    """Shapes, dtypes and devices `paged_prefix_attention`'s kernel relies on (no bounds checks
    of its own: positions and slots are read on the device)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [n, H, T, D], got shape {tuple(q.shape)}")
    n, h, t, d = q.shape
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape or k_pool.shape[3] != d:
        raise ValueError(
            f"k_pool / v_pool must both be [num_blocks, block_size, Hkv, D={d}], "
            f"got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    hkv = k_pool.shape[2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"q's {h} heads do not divide into {hkv} KV heads")
    if d < 16 or d > MAX_HEAD_DIM or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two in 16..{MAX_HEAD_DIM}, got {d}")
    if t < 1:
        raise ValueError("q must have at least one query position (T >= 1)")
    if q.dtype not in DTYPES:
        raise ValueError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"the pools are {k_pool.dtype} / {v_pool.dtype}, q is {q.dtype}: they must share a dtype")
    if block_tables.dim() != 2 or block_tables.shape[0] != n or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [n={n}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    for name, x in (("start", start), ("count", count)):
        if tuple(x.shape) != (n,) or x.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 [n={n}], got {x.dtype} {tuple(x.shape)}")
    if groups is not None and (tuple(groups.shape) != (n, t) or groups.dtype != torch.int32):
        raise ValueError(f"groups must be int32 [n={n}, T={t}], got {groups.dtype} {tuple(groups.shape)}")
    named = dict(k_pool=k_pool, v_pool=v_pool, block_tables=block_tables, start=start, count=count, groups=groups)
    for name, x in named.items():
        if x is not None and x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")


def paged_prefix_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
    window: int | None = None,
    groups: torch.Tensor | None = None,
    blocks: tuple[int, int] | None = None,
) -> torch.Tensor:
    """An encoder pass's causal attention over the paged pool, without gathering it: row i's
    queries q[i] [H, T, D] sit at positions start[i] + t, t < count[i] (the rest are padding, and
    attend as the row's last token), and their keys and values are ALREADY in the pool (the fused
    layer's q|k|v kernel writes them first) at (block_tables[i, p // block_size], p % block_size).
    Query position p sees keys k <= p, and k > p - window on a sliding layer (window None: a
    global one); scale 1.0, GQA (query head h reads KV head h // (H / Hkv)). -> [n, T, H, D] in
    q's dtype, as `sdpa`.

    `groups` (int32 [n, T], -1 at text): each image's tokens also see each other, whatever their
    order or the window (bidirectional vision, `attention.within_images`). start / count / tables /
    groups are read on the device only: no host sync. `blocks` = (BLOCK_M, BLOCK_N), powers of two
    >= 16 (None: `pick_blocks`). One launch, no split: an encoder pass has a query tile a program
    for every G * BLOCK_M of its n * T * H query rows, enough programs for a GPU from a few hundred
    tokens on."""
    _check_prefix(q, k_pool, v_pool, block_tables, start, count, groups)
    if not available(q.device):
        why = "triton is not installed" if not HAVE_TRITON else f"the device is {q.device.type}, not CUDA"
        raise RuntimeError(f"no Triton paged attention here ({why}); use PagedKVCache.attend and sdpa")
    n, h, t, d = q.shape
    hkv = k_pool.shape[2]
    g = h // hkv
    out = torch.empty(n, t, h, d, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    block_m, block_n, num_warps, num_stages = pick_blocks(g * t, d, q.dtype)
    if blocks is not None:
        block_m, block_n = blocks
        if min(blocks) < 16 or block_m & (block_m - 1) or block_n & (block_n - 1):
            raise ValueError(f"blocks must be powers of two >= 16, got {blocks}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (or None: a global layer), got {window}")
    if groups is not None and blocks is None and block_m > 32:  # the image mask's registers: D = 256's
        block_m, num_warps = 32, 4  # 64 rows spill on sm80 (and 32 rows on 8 warps are held to 128 registers)
    grouped = groups if groups is not None else start
    _paged_prefix_kernel[(triton.cdiv(g * t, block_m), n * hkv)](
        q, k_pool, v_pool, block_tables, start, count, grouped, out,
        t, g, hkv, window or 0,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *block_tables.stride(),
        grouped.stride(0), grouped.stride(-1), *out.stride(),
        POOL_BLOCK=k_pool.shape[1], D=d, SLIDING=window is not None, GROUPS=groups is not None,
        UPCAST_DOT=INTERPRETED and q.dtype == torch.bfloat16,  # the interpreter multiplies bf16's raw bits
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # float32: no TF32 rounding
        BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages,
        enable_fp_fusion=True,  # triton's default until 3.10 (3.9 warns when it is left unsaid)
    )  # fmt: skip
    return out

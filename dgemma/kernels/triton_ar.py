"""AR mode's kernels on a GPU (engine/fused/ar.py's captured token step): the greedy token,
each row's one-token pass over the paged pool, and the step's advance, all on the device so the
host reads tokens only once a read-back batch."""

from __future__ import annotations

import torch

from .triton_canvas import rows_per_program, softcapped, vocab_block
from .triton_support import HAVE_TRITON, tl, triton

if HAVE_TRITON:

    @triton.jit
    def _argmax_kernel(
        z_ptr,
        out_ptr,
        best_ptr,
        ROWS,
        V,
        stride_z,
        TILES,
        CAP: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_V: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """Each row's argmax of softcap(z) (the first index among equals), no other work. Program
        (i, c) scans vocabulary tiles [c TILES, (c + 1) TILES) of row block i; split (SPLIT), it
        writes its best value and index (best[c, row], out[c, row]) for `_argmax_pick_kernel`."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows < ROWS
        base = z_ptr + rows.to(tl.int64)[:, None] * stride_z
        best = tl.full((BLOCK_R,), -float("inf"), tl.float32)
        best_index = tl.zeros((BLOCK_R,), tl.int32)
        c = tl.program_id(1)
        for v0 in range(c * TILES * BLOCK_V, (c + 1) * TILES * BLOCK_V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            inside = r_ok[:, None] & (cols < V)[None, :]
            z = tl.where(
                inside,
                softcapped(tl.load(base + cols[None, :], mask=inside, other=0.0).to(tl.float32), CAP),
                -float("inf"),
            )
            tile_best = tl.max(z, axis=1)
            best_index = tl.where(tile_best > best, tl.argmax(z, axis=1) + v0, best_index)
            best = tl.maximum(best, tile_best)
        if SPLIT:
            tl.store(best_ptr + c * ROWS + rows, best, mask=r_ok)
            tl.store(out_ptr + c * ROWS + rows, best_index.to(tl.int64), mask=r_ok)
        else:
            tl.store(out_ptr + rows, best_index.to(tl.int64), mask=r_ok)

    @triton.jit
    def _argmax_pick_kernel(best_ptr, index_ptr, out_ptr, ROWS, SPLITS, BLOCK_R: tl.constexpr):
        """The split scan's parts folded in vocabulary order, a later part taken only where strictly
        larger: the one-program scan's answer (the first index among equals)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows < ROWS
        best = tl.full((BLOCK_R,), -float("inf"), tl.float32)
        best_index = tl.zeros((BLOCK_R,), tl.int64)
        for c in range(0, SPLITS):
            value = tl.load(best_ptr + c * ROWS + rows, mask=r_ok, other=-float("inf"))
            index = tl.load(index_ptr + c * ROWS + rows, mask=r_ok, other=0)
            best_index = tl.where(value > best, index, best_index)
            best = tl.maximum(best, value)
        tl.store(out_ptr + rows, best_index, mask=r_ok)

    @triton.jit
    def _token_slots_kernel(
        pos_ptr,
        table_s_ptr,
        table_g_ptr,
        lo_s_ptr,
        lo_g_ptr,
        start_s_ptr,
        start_g_ptr,
        slot_s_ptr,
        slot_g_ptr,
        N,
        stride_ts,
        stride_tg,
        POOL_BLOCK: tl.constexpr,
        WINDOW: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Each row's one-token pass over its position: per layer kind the keys it sees
        [lo, start) and the flat pool slot its own keys go to."""
        rows = tl.arange(0, BLOCK_N)
        ok = rows < N
        pos = tl.load(pos_ptr + rows, mask=ok, other=0)
        block = pos // POOL_BLOCK
        within = (pos % POOL_BLOCK).to(tl.int64)
        sliding = tl.load(table_s_ptr + rows * stride_ts + block, mask=ok, other=-1).to(tl.int64)
        full = tl.load(table_g_ptr + rows * stride_tg + block, mask=ok, other=-1).to(tl.int64)
        tl.store(slot_s_ptr + rows, tl.where(sliding >= 0, sliding * POOL_BLOCK + within, -1), mask=ok)
        tl.store(slot_g_ptr + rows, tl.where(full >= 0, full * POOL_BLOCK + within, -1), mask=ok)
        tl.store(lo_s_ptr + rows, tl.maximum(pos - (WINDOW - 1), 0), mask=ok)
        tl.store(lo_g_ptr + rows, tl.zeros_like(pos), mask=ok)
        tl.store(start_s_ptr + rows, pos, mask=ok)
        tl.store(start_g_ptr + rows, pos, mask=ok)

    @triton.jit
    def _ar_advance_kernel(
        chosen_ptr,
        tokens_ptr,
        pos_ptr,
        out_ptr,
        step_ptr,
        done_ptr,
        eos_ptr,
        N,
        E,
        stride_out,
        BLOCK_N: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        """The chosen tokens become the rows' last tokens and the step's column of the output;
        a row that chose an end of answer is done; positions and the step count advance."""
        rows = tl.arange(0, BLOCK_N)
        ok = rows < N
        token = tl.load(chosen_ptr + rows, mask=ok, other=0)
        step = tl.load(step_ptr)
        tl.store(tokens_ptr + rows, token, mask=ok)
        tl.store(out_ptr + rows.to(tl.int64) * stride_out + step, token, mask=ok)
        eos = tl.load(eos_ptr + tl.arange(0, BLOCK_E), mask=tl.arange(0, BLOCK_E) < E, other=-1)
        hit = tl.sum((token[:, None] == eos[None, :]).to(tl.int32), axis=1) > 0
        done = tl.load(done_ptr + rows, mask=ok, other=0) != 0
        tl.store(done_ptr + rows, (done | hit).to(tl.int8), mask=ok)
        tl.store(pos_ptr + rows, tl.load(pos_ptr + rows, mask=ok, other=0) + 1, mask=ok)
        tl.store(step_ptr, step + 1)


ARGMAX_SPLIT_BELOW = 64  # row programs under which the vocabulary is split over programs


def softcapped_argmax(logits: torch.Tensor, softcap: float = 0.0, splits: int | None = None) -> torch.Tensor:
    """Each row's argmax [N] (int64) of softcap(logits) [N, V], the first among equals: greedy
    decoding's token, with no float32 logits written and nothing else computed.

    Few rows (an AR token's: one program a row) scan the vocabulary in up to `splits` parts (by
    default enough for ARGMAX_SPLIT_BELOW programs) and a second launch folds the parts: one
    program alone read a row's 262,144 logits (issue 54: ~45 us a token). The same answer."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    block_r, block_v = rows_per_program(rows), vocab_block(vocab)
    blocks, tiles = triton.cdiv(rows, block_r), triton.cdiv(vocab, block_v)
    if splits is None:
        splits = triton.cdiv(ARGMAX_SPLIT_BELOW, blocks) if blocks < ARGMAX_SPLIT_BELOW else 1
    per = triton.cdiv(tiles, max(1, min(splits, tiles)))
    splits = triton.cdiv(tiles, per)
    args = dict(CAP=float(softcap or 0.0), BLOCK_R=block_r, BLOCK_V=block_v, SPLIT=splits > 1)
    if splits == 1:
        _argmax_kernel[(blocks, 1)](logits, out, out, rows, vocab, logits.stride(0), per, **args)
        return out
    best = torch.empty(splits, rows, dtype=torch.float32, device=logits.device)
    index = torch.empty(splits, rows, dtype=torch.long, device=logits.device)
    _argmax_kernel[(blocks, splits)](logits, index, best, rows, vocab, logits.stride(0), per, **args)
    _argmax_pick_kernel[(blocks,)](best, index, out, rows, splits, BLOCK_R=block_r)
    return out


def token_slots(
    positions: torch.Tensor, tables: list, lo: list, start: list, slots: list, block_size: int, window: int
) -> None:
    """A one-token pass's device inputs from each row's position [N] (int32) and block tables
    (sliding, global: int32 [N, W]): lo / start int32 [N] (the keys it sees) and slots int64 [N]
    (where its keys go; -1 where its block is not allocated), written in place."""
    n = positions.shape[0]
    _token_slots_kernel[(1,)](
        positions,
        tables[0],
        tables[1],
        lo[0],
        lo[1],
        start[0],
        start[1],
        slots[0],
        slots[1],
        n,
        tables[0].stride(0),
        tables[1].stride(0),
        POOL_BLOCK=block_size,
        WINDOW=window,
        BLOCK_N=triton.next_power_of_2(max(n, 1)),
    )


def ar_advance(chosen, tokens, positions, out, step, done, eos) -> None:
    """After a one-token step: tokens = chosen, out[:, step] = chosen, done |= chosen is an end
    of answer (`eos` int64 [k]), positions += 1, step += 1 (all [N] / [1] device tensors)."""
    n = tokens.shape[0]
    _ar_advance_kernel[(1,)](
        chosen,
        tokens,
        positions,
        out,
        step,
        done.view(torch.int8),
        eos,
        n,
        eos.shape[0],
        out.stride(0),
        BLOCK_N=triton.next_power_of_2(max(n, 1)),
        BLOCK_E=triton.next_power_of_2(max(eos.shape[0], 1)),
    )

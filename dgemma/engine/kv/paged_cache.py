"""The engine's KV cache: fixed-size blocks, one pool per layer kind.

Every layer keeps its keys and values in a tensor [num_blocks, block_size, kv_heads, head_dim];
the layers of one kind (sliding or global) share block ids, so a block id names `block_size`
positions of a sequence in every layer of that kind. A sequence's `SequenceBlocks` maps its
logical blocks (position // block_size) to block ids, one table per kind; the block manager
(scheduler side) decides which ids, this module only reads and writes the tensors.

A pass's keys are gathered block by block into one buffer per layer (prefix, then the pass's own
keys placed right after it), so attention runs on a contiguous [keys, kv_heads, head_dim] view.
On a CPU the gather costs about 1% of the attention it feeds (a key is read once per copy, then
used by every canvas query of every head). With the Triton kernels (kernels/choice.py decides),
a decoder pass instead reads the prefix's blocks where they are (`plan_canvas`,
kernels/triton_attention.py), and the fused network's encoder pass too (`plan_encoder(in_place=True)`:
its q|k|v kernel writes the keys into the pool, then its causal attention reads them there with the
prefix, nothing gathered). Encoder passes write their keys into the pool; decoder passes never
do: the canvas's keys/values are scratch, placed after the prefix only.

Sliding-window layers only ever see the last `window - 1` committed keys (plus the pass's own),
so the manager releases the sliding blocks behind that and a sequence holds a bounded number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...config import GLOBAL, SLIDING, ModelConfig
from ...model.attention import attend_then_sdpa, encoder_mask, within_images

KINDS = (SLIDING, GLOBAL)


@dataclass
class SequenceBlocks:
    """Where one sequence's keys/values live: a block table per layer kind, and how many
    positions are computed. A released sliding block reads -1 in its table."""

    tables: dict[str, list[int]] = field(default_factory=lambda: {kind: [] for kind in KINDS})
    length: int = 0


@dataclass
class KeyRange:
    """The keys one row attends to in one layer kind: positions [lo, start) come from the pool
    (blocks `blocks`, the first starting at position `first`), then the pass's own tokens."""

    lo: int
    start: int
    first: int
    blocks: torch.Tensor  # long [nb]
    write_slots: torch.Tensor | None  # encoder: flat slot index of each new token; decoder: None


@dataclass
class PagedPass:
    """One forward pass over rows of the paged cache (the model calls `attend` per layer)."""

    cache: PagedKVCache
    rows: list[SequenceBlocks]
    counts: list[int]  # new tokens per row (the canvas length for a decoder pass)
    positions: torch.Tensor  # [n, T] RoPE position of each token
    encoder: bool
    ranges: dict[str, list[KeyRange]]
    masks: dict[str, torch.Tensor | None]
    causal: dict[str, bool]
    # a pass whose attention reads the pool in place (`plan_canvas`, `plan_encoder(in_place=True)`):
    # per kind, the block tables int32 [n, width], lo and start int32 [n], all on the device
    tables: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # a pass whose keys and values the fused layer's q|k|v kernel writes into the pool: per kind,
    # each token's flat pool slot [n * T] (< 0: padding, not written), on the device
    slots: dict[str, torch.Tensor] | None = None
    new_counts: torch.Tensor | None = None  # an in-place encoder pass: `counts` as int32 [n] on the device
    groups: torch.Tensor | None = None  # ... with bidirectional images: each token's image int32 [n, T], -1: text

    def attend(self, layer: int, sliding: bool, k: torch.Tensor, v: torch.Tensor):
        return self.cache.attend(self, layer, SLIDING if sliding else GLOBAL, k, v)

    def pool_writes(self, layer: int, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where the fused layer's q|k|v kernel writes this pass's keys and values (the layer's
        pools, each token's slot), or None: a pass whose keys stay scratch or go in by `attend`."""
        if self.slots is None:
            return None
        return self.cache.keys[layer], self.cache.values[layer], self.slots[kind]

    def attention(
        self,
        layer: int,
        sliding: bool,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        canvas_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[n, C, H, D]: the gathered keys and SDPA, or (`tables`) a Triton kernel that reads
        the row's blocks where they are (kernels/triton_attention.py): an in-place encoder pass's
        causal attention, whose own keys the q|k|v kernel already wrote into the pool (k and v
        unused), or a canvas's over its prefix and k / v (`canvas_rows`: row i's canvas keys are
        k[canvas_rows[i]], a turbo pass's canvas K/V slots)."""
        if self.tables is None:
            return attend_then_sdpa(self, layer, sliding, q, k, v)
        from ...kernels.triton_attention import paged_canvas_attention, paged_prefix_attention

        tables, lo, start = self.tables[SLIDING if sliding else GLOBAL]
        cache = self.cache
        if self.encoder:
            window = cache.window if sliding else None
            keys, values = cache.keys[layer], cache.values[layer]
            return paged_prefix_attention(q, keys, values, tables, start, self.new_counts, window, self.groups)
        return paged_canvas_attention(
            q, k, v, cache.keys[layer], cache.values[layer], tables, lo, start, canvas_rows=canvas_rows
        )

    def see_within_images(self, groups: torch.Tensor) -> None:
        """Let each image's tokens in this encoder pass attend to each other (attention.within_images;
        an in-place pass: the attention kernel's own image mask, from `groups`)."""
        if self.tables is not None:
            self.groups = groups.to(torch.int32)
            return
        for kind in KINDS:
            offsets = [r.start - r.lo for r in self.ranges[kind]]
            keys = (
                max(o + c for o, c in zip(offsets, self.counts))
                if self.masks[kind] is None
                else self.masks[kind].shape[-1]
            )
            self.masks[kind] = within_images(self.masks[kind], self.causal[kind], groups, offsets, keys)
            self.causal[kind] = False


class PagedKVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: dict[str, int],
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.block_size = block_size
        self.window = config.sliding_window
        self.num_blocks = dict(num_blocks)
        self.device = torch.device(device)
        self.kind_of = [spec.kind for spec in config.layers]
        # torch.empty: pages a block never uses are never touched (nor resident)
        self.keys, self.values = [], []
        for spec in config.layers:
            shape = (max(self.num_blocks[spec.kind], 1), block_size, spec.num_kv_heads, spec.head_dim)
            self.keys.append(torch.empty(shape, device=self.device, dtype=dtype))
            self.values.append(torch.empty(shape, device=self.device, dtype=dtype))

    # ---------------------------------------------------------------- planning
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A plan's tensor, built on the host, queued for the device without waiting: a blocking
        copy would make the host wait for every pass already queued (and is illegal while a CUDA
        graph captures)."""
        return t.to(self.device, non_blocking=True)

    @staticmethod
    def length(row: SequenceBlocks) -> int:
        return row.length

    def _lo(self, kind: str, start: int) -> int:
        return max(0, start - (self.window - 1)) if kind == SLIDING else 0

    def _range(self, kind: str, row: SequenceBlocks, start: int, count: int, encoder: bool) -> KeyRange:
        b = self.block_size
        lo = self._lo(kind, start)
        table = row.tables[kind]
        first_block, last_block = lo // b, (start - 1) // b
        ids = table[first_block : last_block + 1] if start > lo else []
        if any(i < 0 for i in ids):
            raise RuntimeError(f"{kind} block released while still in view (positions {lo}..{start})")
        slots = None
        if encoder:
            pos = torch.arange(start, start + count)
            owner = torch.tensor(table[start // b : (start + count - 1) // b + 1], dtype=torch.long)
            slots = self._to_device(owner[pos // b - start // b] * b + pos % b)
        blocks = self._to_device(torch.tensor(ids, dtype=torch.long))
        return KeyRange(lo, start, first_block * b, blocks, slots)

    def _plan(self, rows: list[SequenceBlocks], counts: list[int], width: int, encoder: bool) -> PagedPass:
        starts = [r.length for r in rows]
        positions = self._to_device(torch.tensor(starts)[:, None] + torch.arange(width))
        ranges, masks, causal = {}, {}, {}
        for kind in KINDS:
            ranges[kind] = [self._range(kind, r, s, c, encoder) for r, s, c in zip(rows, starts, counts)]
            masks[kind], causal[kind] = self._mask(kind, ranges[kind], counts, positions, width, encoder)
        return PagedPass(self, rows, counts, positions, encoder, ranges, masks, causal)

    def _mask(self, kind, ranges: list[KeyRange], counts, positions, width: int, encoder: bool):
        """(mask [n, 1, T, K] or None, is_causal) for the buffer layout `attend` builds."""
        window = self.window if kind == SLIDING else None
        single = len(ranges) == 1
        if single:
            r, count = ranges[0], counts[0]
            if not encoder:
                return None, False  # a canvas sees its whole prefix and itself
            if r.start == r.lo and (window is None or count <= window):
                return None, count > 1  # no prefix: plain causal attention
            return encoder_mask(positions, r.lo, r.start + count, None, window), False
        # several rows: keys of row i sit at [0, start_i - lo_i + count_i), padded to the longest
        lengths = [r.start - r.lo + c for r, c in zip(ranges, counts)]
        span = max(lengths)
        idx = torch.arange(span, device=self.device)
        key_pos = self._to_device(torch.tensor([r.lo for r in ranges]))[:, None] + idx  # [n, K]
        valid = idx[None] < self._to_device(torch.tensor(lengths))[:, None]
        allowed = valid[:, None, None, :].expand(-1, 1, width, -1)
        if encoder:
            q = positions[:, None, :, None]
            k = key_pos[:, None, None, :]
            allowed = allowed & (k <= q)
            if window is not None:
                allowed = allowed & (k > q - window)
        return allowed, False

    def plan_encoder(
        self, num_tokens: int, rows: list[SequenceBlocks], new_counts: list[int] | None = None, in_place: bool = False
    ) -> PagedPass:
        """A causal pass appending new_counts[i] (default num_tokens) tokens to each row; the rows'
        block tables must already cover the new positions. `in_place` (the fused network's encode,
        kernels/fused.py): its keys and values are written into the pool by the q|k|v kernel
        (`pool_writes`) and its attention reads them there with the prefix (`attention`), so
        nothing is gathered and no mask is built: the plan is block tables, starts, counts,
        slots and positions, sent to the device in one copy."""
        counts = list(new_counts) if new_counts is not None else [num_tokens] * len(rows)
        for r, c in zip(rows, counts):
            need = -(-(r.length + c) // self.block_size)
            if len(r.tables[GLOBAL]) < need or len(r.tables[SLIDING]) < need:
                raise RuntimeError(f"no blocks allocated for positions up to {r.length + c}")
        if in_place:
            return self._plan_in_place(rows, counts, num_tokens)
        return self._plan(rows, counts, num_tokens, encoder=True)

    def _plan_in_place(self, rows: list[SequenceBlocks], counts: list[int], width: int) -> PagedPass:
        """`plan_encoder(in_place=True)`'s pass: its device tensors are views of one int32 buffer,
        built on the host and copied without waiting (one copy a pass, not one a tensor)."""
        b = self.block_size
        starts = [r.length for r in rows]
        wide = max(len(r.tables[kind]) for r in rows for kind in KINDS)
        pos = torch.tensor(starts)[:, None] + torch.arange(width)  # [n, T]
        new = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]  # the rest is padding
        host = [pos, torch.tensor(counts)]
        for kind in KINDS:
            table, lo, start = self.canvas_tables(kind, rows, starts, wide)  # checks the blocks in view
            owner = torch.gather(table.long(), 1, (pos // b).clamp(max=wide - 1))
            host += [table, lo, start, torch.where(new, owner * b + pos % b, -1).reshape(-1)]
        flat = self._to_device(torch.cat([t.reshape(-1).to(torch.int32) for t in host]))
        views, at = [], 0
        for t in host:
            views.append(flat[at : at + t.numel()].view(t.shape))
            at += t.numel()
        tables = {kind: tuple(views[2 + 4 * i : 5 + 4 * i]) for i, kind in enumerate(KINDS)}
        slots = {kind: views[5 + 4 * i] for i, kind in enumerate(KINDS)}
        return PagedPass(
            self, list(rows), counts, views[0], True, {}, {}, {}, tables=tables, slots=slots, new_counts=views[1]
        )

    def plan_decoder(self, canvas_length: int, rows: list[SequenceBlocks]) -> PagedPass:
        """A bidirectional pass over a canvas placed right after each row's prefix."""
        return self._plan(rows, [canvas_length] * len(rows), canvas_length, encoder=False)

    def plan_canvas(self, canvas_length: int, rows: list[SequenceBlocks], out: PagedPass | None = None) -> PagedPass:
        """A decoder pass like `plan_decoder`'s whose attention reads the rows' blocks in place:
        block tables, key ranges and positions as device tensors, so the same tensors serve any
        prefix length. With `out` (a pass planned before, e.g. the static inputs of a captured
        CUDA graph) its tensors are overwritten instead: rows beyond `rows` get an empty prefix,
        and tables are as wide as `out`'s."""
        n = len(rows) if out is None else out.positions.shape[0]
        starts = [r.length for r in rows] + [0] * (n - len(rows))
        if out is None:
            width = max([1] + [len(r.tables[kind]) for r in rows for kind in KINDS])
        else:
            width = out.tables[GLOBAL][0].shape[1]
        positions = torch.tensor(starts)[:, None] + torch.arange(canvas_length)
        tables = {kind: self.canvas_tables(kind, rows, starts, width) for kind in KINDS}
        if out is None:
            moved = {kind: tuple(self._to_device(t) for t in parts) for kind, parts in tables.items()}
            return PagedPass(
                self, list(rows), [canvas_length] * n, self._to_device(positions), False, {}, {}, {}, moved
            )
        for kind in KINDS:
            for dest, src in zip(out.tables[kind], tables[kind]):
                dest.copy_(src, non_blocking=True)
        out.positions.copy_(positions, non_blocking=True)
        out.rows = list(rows)
        return out

    def canvas_tables(self, kind: str, rows: list[SequenceBlocks], starts: list[int], width: int):
        """A canvas pass's (block tables int32 [n, width], lo int32 [n], start int32 [n]) of one
        layer kind, on the host: rows past `rows` (n = len(starts)) have an empty prefix.
        RuntimeError if a table is wider than `width` or a block in view was released."""
        n = len(starts)
        table = torch.full((n, width), -1, dtype=torch.int32)
        lo = torch.tensor([self._lo(kind, start) for start in starts], dtype=torch.int32)
        for i, r in enumerate(rows):
            ids = r.tables[kind]
            if len(ids) > width:
                raise RuntimeError(f"{kind} block table of {len(ids)} blocks is wider than the planned {width}")
            if any(ids[j] < 0 for j in range(int(lo[i]) // self.block_size, -(-starts[i] // self.block_size))):
                raise RuntimeError(f"{kind} block released while still in view (positions {int(lo[i])}..{starts[i]})")
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return table, lo, torch.tensor(starts, dtype=torch.int32)

    def canvas_buffers(self, rows: int, canvas_length: int, width: int) -> PagedPass:
        """A `plan_canvas` pass of `rows` empty rows with block tables `width` blocks wide: the
        static inputs a captured decoder step reads (fill them with `plan_canvas(..., out=)`)."""
        empty = [SequenceBlocks() for _ in range(rows)]
        tables = {
            kind: (
                torch.full((rows, width), -1, dtype=torch.int32, device=self.device),
                torch.zeros(rows, dtype=torch.int32, device=self.device),
                torch.zeros(rows, dtype=torch.int32, device=self.device),
            )
            for kind in KINDS
        }
        positions = torch.arange(canvas_length, device=self.device).repeat(rows, 1)
        return PagedPass(self, empty, [canvas_length] * rows, positions, False, {}, {}, {}, tables)

    def commit(self, cache_pass: PagedPass) -> None:
        """Advance each row's computed length after an encoder pass."""
        assert cache_pass.encoder, "only encoder passes commit"
        for r, c in zip(cache_pass.rows, cache_pass.counts):
            r.length += c

    # ---------------------------------------------------------------- the layer call
    def _row_keys(self, pool: torch.Tensor, r: KeyRange, new: torch.Tensor) -> torch.Tensor:
        """[start - lo + len(new), Hkv, D]: the row's cached keys in view, then `new`."""
        prefix = r.start - r.lo
        if prefix == 0:
            return new
        b, nb = self.block_size, r.blocks.numel()
        offset = r.lo - r.first
        end = offset + prefix + new.shape[0]
        buf = torch.empty(max(nb * b, end), *pool.shape[2:], dtype=pool.dtype, device=pool.device)
        torch.index_select(pool, 0, r.blocks, out=buf[: nb * b].view(nb, b, *pool.shape[2:]))
        buf[offset + prefix : end] = new
        return buf[offset:end]

    def attend(self, cache_pass: PagedPass, layer: int, kind: str, k: torch.Tensor, v: torch.Tensor):
        """Store an encoder pass's k/v [n, Hkv, T, D] in the pool; return the keys/values to
        attend over ([n, Hkv, K, D] views), the mask and the causal flag."""
        if cache_pass.slots is not None:  # its keys are the q|k|v kernel's to write, its attention the pool's
            raise RuntimeError("a pass planned in place runs on the fused network (kernels/fused.py), not `attend`")
        keys, values = self.keys[layer], self.values[layer]
        k_rows, v_rows = k.transpose(1, 2), v.transpose(1, 2)  # [n, T, Hkv, D]
        ranges, counts = cache_pass.ranges[kind], cache_pass.counts
        if cache_pass.encoder:
            flat_k, flat_v = keys.view(-1, *keys.shape[2:]), values.view(-1, *values.shape[2:])
            for i, (r, c) in enumerate(zip(ranges, counts)):
                flat_k.index_copy_(0, r.write_slots, k_rows[i, :c].to(keys.dtype))
                flat_v.index_copy_(0, r.write_slots, v_rows[i, :c].to(values.dtype))
        rows_k = [self._row_keys(keys, r, k_rows[i, :c]) for i, (r, c) in enumerate(zip(ranges, counts))]
        rows_v = [self._row_keys(values, r, v_rows[i, :c]) for i, (r, c) in enumerate(zip(ranges, counts))]
        if len(rows_k) == 1:
            return (
                rows_k[0].transpose(0, 1)[None],
                rows_v[0].transpose(0, 1)[None],
                cache_pass.masks[kind],
                cache_pass.causal[kind],
            )
        span = max(x.shape[0] for x in rows_k)
        all_k = k_rows.new_zeros(len(rows_k), span, *k_rows.shape[2:])
        all_v = v_rows.new_zeros(len(rows_v), span, *v_rows.shape[2:])
        for i, (rk, rv) in enumerate(zip(rows_k, rows_v)):
            all_k[i, : rk.shape[0]] = rk
            all_v[i, : rv.shape[0]] = rv
        return all_k.transpose(1, 2), all_v.transpose(1, 2), cache_pass.masks[kind], cache_pass.causal[kind]


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> dict[str, int]:
    """K and V bytes one position takes in every layer of each kind."""
    out = {kind: 0 for kind in KINDS}
    for spec in config.layers:
        out[spec.kind] += 2 * spec.num_kv_heads * spec.head_dim * dtype_bytes
    return out


def sliding_blocks_held(window: int, span: int, block_size: int) -> int:
    """Sliding blocks a sequence holds at most while it encodes `span` new positions at once:
    those its window sees behind them, and theirs (either end may fall inside a block)."""
    return (window - 1 + span) // block_size + 2

"""The dense KV cache: one preallocated row per sequence (the reference loop, AR mode, `canvas_logits`, training).

The engine keeps its cache in blocks instead (`engine/kv/paged_cache.py`); this one mirrors the reference's
layout, so that `sampling="reference"` calls SDPA on the same tensors transformers does.

One preallocated K and V buffer per layer, [rows, kv_heads, capacity, head_dim]. Row r's committed
tokens sit at storage indices [0, lengths[r]) and a key's storage index is its position, so
nothing is ever moved or concatenated:

- an encoder pass (prompt prefill, or a committed canvas) writes its keys/values at
  [lengths[r], lengths[r] + n) and then advances lengths[r];
- a decoder pass writes the canvas's keys/values at the same place as scratch, attends over
  prefix + canvas, and leaves lengths unchanged: the cache is read-only to the decoder.

Sliding-window layers keep the full history too; a pass just views the last `window - 1`
committed keys, which is exactly what the reference's sliding cache keeps.

`key_valid` marks padding slots (left-padded batches in reference mode); it is all True otherwise.

For training, `differentiable=True` makes every write out of place (the buffer is cloned first),
so that autograd can backpropagate through keys/values that a later pass overwrites.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import ModelConfig
from ..model.attention import attend_then_sdpa, decoder_mask, encoder_mask, within_images


@dataclass
class KeyPlan:
    """Which cached keys one layer kind attends to in a pass, and how they are masked."""

    lo: int
    hi: int
    mask: torch.Tensor | None
    is_causal: bool


@dataclass
class CachePass:
    """Everything the layers of one forward pass need from the cache."""

    cache: DenseKVCache
    rows: torch.Tensor | None  # subset of cache rows, or None for all rows
    row_slice: slice | None  # the same subset when it is a contiguous range (views instead of gathers)
    positions: torch.Tensor  # [B, T] storage index (= RoPE position) of each new token
    write_start: int | None  # uniform rows: slice start; else None and positions are the scatter index
    sliding: KeyPlan
    full: KeyPlan
    advance: list[int] | None  # tokens to commit per row (encoder), None for the decoder

    def attend(self, layer: int, sliding: bool, k: torch.Tensor, v: torch.Tensor):
        """Store this pass's k/v [B, Hkv, T, D]; return (keys, values, mask, is_causal) to attend over."""
        plan = self.sliding if sliding else self.full
        keys, values = self.cache.store_and_view(layer, k, v, self, plan)
        return keys, values, plan.mask, plan.is_causal

    def attention(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend_then_sdpa(self, layer, sliding, q, k, v)

    def see_within_images(self, groups: torch.Tensor) -> None:
        """Let each image's tokens in this encoder pass attend to each other (attention.within_images)."""
        starts = self.positions[:, 0].tolist()  # each row's first new storage index
        for name in ("sliding", "full"):
            plan = getattr(self, name)
            offsets = [s - plan.lo for s in starts]
            mask = within_images(plan.mask, plan.is_causal, groups, offsets, plan.hi - plan.lo)
            setattr(self, name, replace(plan, mask=mask, is_causal=False))


@dataclass
class _Placement:
    """A pass's new positions in the cache: its rows (None: all), their lengths before it, the
    positions [B, T], the end `hi` of the keys it sees and whether any key before `hi` is padding."""

    cache: DenseKVCache
    rows: torch.Tensor | None
    row_ids: list[int]
    lens: list[int]
    positions: torch.Tensor
    hi: int
    padded: bool

    @property
    def sliding_lo(self) -> int:
        """The first key a sliding layer may see (the window before the shortest row's new tokens)."""
        return max(0, min(self.lens) - (self.cache.window - 1))

    def cache_pass(self, uniform: bool, sliding: KeyPlan, full: KeyPlan, advance: list[int] | None) -> CachePass:
        """The pass, written as one slice per row where every row starts at the same length (`uniform`)."""
        return CachePass(
            cache=self.cache,
            rows=self.rows,
            row_slice=None if self.rows is None else self.cache._as_slice(self.row_ids),
            positions=self.positions,
            write_start=self.lens[0] if uniform else None,
            sliding=sliding,
            full=full,
            advance=advance,
        )


class DenseKVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        capacity: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        differentiable: bool = False,
    ):
        self.config = config
        self.differentiable = differentiable
        self.capacity = capacity
        self.window = config.sliding_window
        self.keys = []
        self.values = []
        for spec in config.layers:
            shape = (batch_size, spec.num_kv_heads, capacity, spec.head_dim)
            self.keys.append(torch.zeros(shape, device=device, dtype=dtype))
            self.values.append(torch.zeros(shape, device=device, dtype=dtype))
        self.lengths = [0] * batch_size
        self.key_valid = torch.ones(batch_size, capacity, dtype=torch.bool, device=device)
        self.has_padding = False
        self.device = torch.device(device)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def reset_row(self, row: int) -> None:
        self.lengths[row] = 0
        self.key_valid[row] = True
        self.has_padding = bool((~self.key_valid).any())

    def mark_padding(self, valid: torch.Tensor) -> None:
        """Mark storage slots [0, valid.shape[1]) of each row as real (True) or padding (False)."""
        self.key_valid[:, : valid.shape[1]] = valid.to(self.device)
        self.has_padding = bool((~self.key_valid).any())

    def _check_room(self, rows: list[int], n: int) -> None:
        worst = max(self.lengths[r] for r in rows) + n
        if worst > self.capacity:
            raise RuntimeError(f"KV cache overflow: {worst} tokens needed, capacity {self.capacity}")

    def _row_list(self, rows: torch.Tensor | None) -> list[int]:
        return list(range(self.batch_size)) if rows is None else rows.tolist()

    def _as_rows(self, rows) -> torch.Tensor | None:
        """Rows as the plans take them: None for all rows, else an index tensor."""
        if rows is None or isinstance(rows, torch.Tensor):
            return rows
        rows = [int(r) for r in rows]
        return None if rows == list(range(self.batch_size)) else torch.tensor(rows, device=self.device)

    def length(self, row: int) -> int:
        return self.lengths[row]

    @staticmethod
    def _as_slice(row_ids: list[int]) -> slice | None:
        if row_ids == list(range(row_ids[0], row_ids[0] + len(row_ids))):
            return slice(row_ids[0], row_ids[0] + len(row_ids))
        return None

    def _positions(self, lens: list[int], n: int) -> torch.Tensor:
        start = torch.tensor(lens, device=self.device)[:, None]
        return start + torch.arange(n, device=self.device)

    def _key_valid(self, rows: torch.Tensor | None) -> torch.Tensor:
        return self.key_valid if rows is None else self.key_valid[rows]

    def _placed(self, rows, tokens: int) -> _Placement:
        """Where `tokens` new positions go in `rows` (checked to fit): both plans start here."""
        rows = self._as_rows(rows)
        row_ids = self._row_list(rows)
        self._check_room(row_ids, tokens)
        lens = [self.lengths[r] for r in row_ids]
        hi = max(lens) + tokens
        padded = self.has_padding and bool((~self._key_valid(rows)[:, :hi]).any())
        return _Placement(self, rows, row_ids, lens, self._positions(lens, tokens), hi, padded)

    def plan_encoder(
        self, num_tokens: int, rows: torch.Tensor | None = None, new_counts: list[int] | None = None
    ) -> CachePass:
        """Plan a causal pass appending `num_tokens` per row (of which new_counts[r] are real)."""
        at = self._placed(rows, num_tokens)
        rows, lens, positions, hi, padded = at.rows, at.lens, at.positions, at.hi, at.padded
        counts = new_counts if new_counts is not None else [num_tokens] * len(lens)
        uniform = len(set(lens)) == 1 and all(c == num_tokens for c in counts)

        def plan(lo: int, window: int | None) -> KeyPlan:
            kv_len = hi - lo
            # Mirror the reference: SDPA's own causal flag whenever no explicit mask is needed.
            needs_mask = (
                not uniform
                or padded
                or (window is not None and kv_len >= window)
                or (num_tokens > 1 and kv_len != num_tokens)
            )
            if not needs_mask:
                return KeyPlan(lo, hi, None, num_tokens > 1)
            valid = self._key_valid(rows).clone()
            if not uniform:
                bound = torch.tensor([length + c for length, c in zip(lens, counts)], device=self.device)
                valid &= torch.arange(self.capacity, device=self.device) < bound[:, None]
            return KeyPlan(lo, hi, encoder_mask(positions, lo, hi, valid, window), False)

        return at.cache_pass(uniform, plan(at.sliding_lo, self.window), plan(0, None), counts)

    def plan_decoder(self, canvas_length: int, rows: torch.Tensor | None = None) -> CachePass:
        """Plan a bidirectional pass over a canvas placed right after each row's prefix."""
        at = self._placed(rows, canvas_length)
        rows, lens, hi, padded = at.rows, at.lens, at.hi, at.padded
        uniform = len(set(lens)) == 1
        w = self.window - 1

        def plan(lo: int, sliding: bool) -> KeyPlan:
            if uniform and not padded:
                return KeyPlan(lo, hi, None, False)
            idx = torch.arange(self.capacity, device=self.device)
            end = torch.tensor(lens, device=self.device)[:, None] + canvas_length
            valid = self._key_valid(rows) & (idx < end)
            if sliding:
                valid &= idx >= (end - canvas_length - w)
            return KeyPlan(lo, hi, decoder_mask(lo, hi, valid, canvas_length), False)

        return at.cache_pass(uniform, plan(at.sliding_lo, True), plan(0, False), None)

    def store_and_view(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, cache_pass: CachePass, plan: KeyPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's keys/values [B, Hkv, T, D] and return the keys/values to attend over."""
        kb, vb = self.keys[layer], self.values[layer]
        if self.differentiable:
            kb, vb = kb.clone(), vb.clone()
            if cache_pass.advance is not None:  # encoder passes keep what they wrote
                self.keys[layer], self.values[layer] = kb, vb
        rows = cache_pass.rows
        if rows is not None and cache_pass.row_slice is not None:  # contiguous rows: work on a view
            kb, vb, rows = kb[cache_pass.row_slice], vb[cache_pass.row_slice], None
        if cache_pass.write_start is not None and rows is None:
            s, n = cache_pass.write_start, k.shape[2]
            kb[:, :, s : s + n] = k
            vb[:, :, s : s + n] = v
            return kb[:, :, plan.lo : plan.hi], vb[:, :, plan.lo : plan.hi]
        row_idx = (rows if rows is not None else torch.arange(kb.shape[0], device=self.device))[:, None]
        kb[row_idx, :, cache_pass.positions] = k.transpose(1, 2).to(kb.dtype)  # (autocast may hand in bf16)
        vb[row_idx, :, cache_pass.positions] = v.transpose(1, 2).to(vb.dtype)
        if rows is None:
            return kb[:, :, plan.lo : plan.hi], vb[:, :, plan.lo : plan.hi]
        return kb[rows, :, plan.lo : plan.hi], vb[rows, :, plan.lo : plan.hi]

    def set_lengths(self, lengths: list[int]) -> None:
        """Declare how much of each row is committed prefix (training: the decoder's block start)."""
        if len(lengths) != self.batch_size or any(not 0 <= n <= self.capacity for n in lengths):
            raise ValueError(f"lengths must be {self.batch_size} values in [0, {self.capacity}]")
        self.lengths = [int(n) for n in lengths]

    def commit(self, cache_pass: CachePass) -> None:
        """Advance row lengths after an encoder pass."""
        assert cache_pass.advance is not None, "only encoder passes commit"
        for r, c in zip(self._row_list(cache_pass.rows), cache_pass.advance):
            self.lengths[r] += c

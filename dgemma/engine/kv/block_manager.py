"""Block ids, reference counts, reservations and the prefix cache (the scheduler's side of the KV pool).

`BlockPool` tracks the ids of one layer kind's pool: free ids, a reference count per id, and the
prefix-cache index (block hash -> id). A full block of committed tokens is keyed by a hash chain
(the hash of its tokens and of the previous block's key), so one key names a whole prefix. A
block whose count drops to zero stays in the index, "evictable", until an allocation needs its
memory: least recently released first.

`BlockManager` owns the two pools (sliding, global) and does what the scheduler asks per request:
- `admit`: find the longest cached prefix of the prompt that both kinds still hold (the sliding
  pool only needs the blocks the window sees at the end of the prefix), attach those blocks, and
  reserve the private blocks the request may need, so that a running request never runs out;
- `allocate`: give the request blocks for positions it is about to encode;
- `release_behind_window`: return sliding blocks the window no longer sees;
- `register`: put the request's newly completed full blocks into the prefix cache;
- `free`: return everything when the request ends.

Invariant: for each pool, reserved <= free + evictable, so an allocation within a reservation
always succeeds (from the free list, else by evicting the least recently used cached block).
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from ...config import GLOBAL, SLIDING
from .paged_cache import KINDS, SequenceBlocks, sliding_blocks_held


def block_hash(parent: bytes | None, tokens: list[int], extra: bytes = b"") -> bytes:
    """Key of a full block: its tokens, the key of the block before it (so a key names the whole
    prefix) and `extra` (content the tokens do not show, e.g. an image's hash)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


def extend_hashes(
    keys: list[bytes],
    tokens: list[int],
    block_size: int,
    media: list[tuple[int, int, bytes]] = (),
    root: bytes | None = None,
) -> list[bytes]:
    """Append the keys of `tokens`' full blocks past the len(keys) already known. `media`:
    (start, end, content key) of each image; a block holding any of an image's tokens has that
    image's key in its own, since its tokens (all the same placeholder id) do not tell images apart.
    `root`: where the chain starts, a LoRA adapter's content hash (an adapter changes every
    layer's keys and values, so its blocks are never another adapter's, nor the base's)."""
    b = block_size
    while len(keys) < len(tokens) // b:
        j = len(keys)
        extra = b"".join(key for start, end, key in media if start < (j + 1) * b and end > j * b)
        keys.append(block_hash(keys[-1] if keys else root, tokens[j * b : (j + 1) * b], extra))
    return keys


class BlockPool:
    """Ids of one pool: free list (lowest id first), reference counts, the prefix-cache index."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))  # a heap: low ids first keeps a sequence's blocks close
        self.refs = [0] * num_blocks
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.by_key: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.reserved = 0  # blocks promised to running requests, not yet allocated
        self.evictions = 0  # cached blocks reused for new content

    @property
    def available(self) -> int:
        """Blocks a new reservation may claim."""
        return len(self.free) + len(self.evictable) - self.reserved

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free) - len(self.evictable)

    def allocate(self) -> int:
        if self.free:
            block = heapq.heappop(self.free)
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.by_key[self.key_of[block]]
            self.key_of[block] = None
            self.evictions += 1
        self.refs[block] = 1
        return block

    def retain(self, block: int) -> None:
        if self.refs[block] == 0:
            self.evictable.pop(block)
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.key_of[block] is not None:
                self.evictable[block] = None  # most recently released last
            else:
                heapq.heappush(self.free, block)

    def register(self, block: int, key: bytes) -> None:
        if key not in self.by_key and self.key_of[block] is None:
            self.by_key[key] = block
            self.key_of[block] = key

    def lookup(self, key: bytes) -> int | None:
        return self.by_key.get(key)

    def forget(self, key: bytes) -> None:
        """Take `key`'s block out of the prefix cache: free now if no request holds it, else
        when the last one releases it."""
        block = self.by_key.pop(key, None)
        if block is None:
            return
        self.key_of[block] = None
        if self.refs[block] == 0:
            self.evictable.pop(block, None)
            heapq.heappush(self.free, block)


@dataclass
class Reservation:
    """A running request's claim on each pool: `limit` private blocks at most at once, `held` now."""

    limit: dict[str, int]
    held: dict[str, int]


class BlockManager:
    def __init__(
        self, num_blocks: dict[str, int], block_size: int, window: int, max_span: int, prefix_cache: bool = True
    ):
        self.pools = {kind: BlockPool(num_blocks[kind]) for kind in KINDS}
        self.block_size = block_size
        self.window = window
        self.max_span = max_span  # most positions a request encodes in one engine step
        self.prefix_cache = prefix_cache
        self.reservations: dict[int, Reservation] = {}
        self.owned: dict[int, dict[str, set[int]]] = {}  # request id -> its private blocks
        self.rooted: dict[bytes, set[bytes]] = {}  # an adapter's content hash -> the keys cached under it

    # ---------------------------------------------------------------- sizing
    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def sliding_peak(self, total_blocks: int) -> int:
        """Sliding blocks a request holds at most at once: those its window sees behind a step's
        encoder span, and the span's own."""
        return min(total_blocks, sliding_blocks_held(self.window, self.max_span, self.block_size))

    def needs(self, max_length: int, matched_blocks: int = 0) -> dict[str, int]:
        total = self.blocks_for(max_length)
        return {GLOBAL: total - matched_blocks, SLIDING: self.sliding_peak(total - matched_blocks)}

    def fits_at_all(self, max_length: int) -> tuple[bool, dict[str, int]]:
        """Whether an empty pool could hold such a request."""
        need = self.needs(max_length)
        return all(need[k] <= self.pools[k].num_blocks for k in KINDS), need

    # ---------------------------------------------------------------- prefix matching
    def prompt_hashes(
        self, prompt: list[int], media: list[tuple[int, int, bytes]] = (), root: bytes | None = None
    ) -> list[bytes]:
        return extend_hashes([], prompt, self.block_size, media, root)

    def _window_blocks(self, end_block: int) -> range:
        """Sliding blocks the window needs to continue after `end_block` full blocks."""
        end = end_block * self.block_size
        return range(max(0, end - (self.window - 1)) // self.block_size, end_block)

    def match(self, keys: list[bytes], split_ends: set[int] = frozenset()) -> tuple[int, dict[str, list[int | None]]]:
        """Longest cached prefix (in blocks) that both pools can continue from, and its block ids.
        A prefix of m blocks with m in `split_ends` would end inside an image: never matched, so a
        warm run's passes fall where a cold run's do (see prefill)."""
        if not self.prefix_cache:
            return 0, {}
        full = []
        for key in keys:
            block = self.pools[GLOBAL].lookup(key)
            if block is None:
                break
            full.append(block)
        sliding = self.pools[SLIDING]
        for m in range(len(full), 0, -1):
            if m in split_ends:
                continue
            window = {j: sliding.lookup(keys[j]) for j in self._window_blocks(m)}
            if all(b is not None for b in window.values()):
                tables = {GLOBAL: full[:m], SLIDING: [window.get(j, -1) for j in range(m)]}
                return m, tables
        return 0, {}

    # ---------------------------------------------------------------- per request
    def admit(
        self,
        request_id: int,
        kv: SequenceBlocks,
        keys: list[bytes],
        max_length: int,
        split_ends: set[int] = frozenset(),
    ) -> int | None:
        """Attach the cached prefix and reserve the rest; returns the cached token count, or None
        if the pools cannot take the request now (nothing is changed then)."""
        m, tables = self.match(keys, split_ends)
        need = self.needs(max_length, m)
        for kind in KINDS:
            pool = self.pools[kind]
            revived = sum(1 for blk in tables.get(kind, []) if blk is not None and blk >= 0 and pool.refs[blk] == 0)
            if need[kind] + revived > pool.available:
                return None
        for kind in KINDS:
            pool = self.pools[kind]
            kv.tables[kind] = list(tables.get(kind, []))
            for blk in kv.tables[kind]:
                if blk >= 0:
                    pool.retain(blk)
            pool.reserved += need[kind]
        kv.length = m * self.block_size
        self.reservations[request_id] = Reservation(dict(need), {kind: 0 for kind in KINDS})
        self.owned[request_id] = {kind: set() for kind in KINDS}
        return kv.length

    def allocate(self, request_id: int, kv: SequenceBlocks, end: int) -> None:
        """Blocks for every position below `end`, from the request's reservation."""
        res, owned = self.reservations[request_id], self.owned[request_id]
        for kind in KINDS:
            table, pool = kv.tables[kind], self.pools[kind]
            while len(table) < self.blocks_for(end):
                if res.held[kind] >= res.limit[kind]:
                    raise RuntimeError(f"request {request_id} exceeded its {kind} block reservation")
                block = pool.allocate()
                pool.reserved -= 1
                res.held[kind] += 1
                owned[kind].add(block)
                table.append(block)

    def _drop(self, request_id: int, kind: str, block: int) -> None:
        pool = self.pools[kind]
        owned = self.owned[request_id][kind]
        if block in owned:  # a private block goes back to the request's reservation
            owned.discard(block)
            res = self.reservations[request_id]
            res.held[kind] -= 1
            pool.reserved += 1
        pool.release(block)

    def release_behind_window(self, request_id: int, kv: SequenceBlocks, keep_from: int) -> None:
        """Release sliding blocks that hold only positions below `keep_from`."""
        table = kv.tables[SLIDING]
        for j in range(min(len(table), max(0, keep_from) // self.block_size)):
            if table[j] >= 0:
                self._drop(request_id, SLIDING, table[j])
                table[j] = -1

    def register(self, kv: SequenceBlocks, keys: list[bytes], start_block: int, root: bytes | None = None) -> None:
        """Index the full blocks [start_block, len(keys)) of a sequence in the prefix cache (`root`:
        the adapter whose hash chain they are on, for `forget`)."""
        if not self.prefix_cache:
            return
        for j in range(start_block, len(keys)):
            for kind in KINDS:
                table = kv.tables[kind]
                if j < len(table) and table[j] >= 0:
                    self.pools[kind].register(table[j], keys[j])
            if root is not None:
                self.rooted.setdefault(root, set()).add(keys[j])
        if root is not None and len(self.rooted[root]) > 2 * sum(p.num_blocks for p in self.pools.values()):
            # keys of blocks evicted since: keep the ones still cached (bounded by the pools' sizes)
            self.rooted[root] = {k for k in self.rooted[root] if any(k in p.by_key for p in self.pools.values())}

    def forget(self, root: bytes) -> int:
        """Drop every cached block on the hash chains that start at `root` (an unloaded adapter's):
        nothing can match them again. Returns how many keys were dropped."""
        keys = self.rooted.pop(root, set())
        for key in keys:
            for pool in self.pools.values():
                pool.forget(key)
        return len(keys)

    def free(self, request_id: int, kv: SequenceBlocks) -> None:
        """Return every block of an ended request and what is left of its reservation."""
        res = self.reservations.pop(request_id, None)
        if res is None:
            return
        for kind in KINDS:
            pool = self.pools[kind]
            pool.reserved -= res.limit[kind] - res.held[kind]
            for block in kv.tables[kind]:
                if block >= 0:
                    pool.release(block)
            kv.tables[kind] = []
        del self.owned[request_id]

    # ---------------------------------------------------------------- reporting
    def usage(self) -> dict[str, dict[str, int]]:
        return {
            kind: {"used": p.used, "cached": len(p.evictable), "free": len(p.free), "total": p.num_blocks}
            for kind, p in self.pools.items()
        }

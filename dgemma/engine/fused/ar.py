"""Autoregressive decoding on the engine's GPU path: the fused network, the paged KV pool, one
captured graph a token, the tokens read back in batches.

dense/ar.py decodes a token by a fresh eager prefill on the plain modules and reads each token on
the host (thousands of launches a token on a GPU). Here every step's inputs live on the device:

    tokens, positions     [n] each row's last token and where it goes; the step advances them
    tables                per layer kind [n, W]: the rows' block tables (allocated a read-back
                          batch ahead, sliding blocks behind the window released)
    lo, start, slots      per layer kind [n]: the keys a row sees and the pool slot its own go to

and a step (`ar_step`) is: `triton_ar.token_slots` (lo, start and slots from the positions), the
fused layers over one token a row (the q|k|v kernel also writes the token's keys and values into
the pool; attention reads the row's blocks in place), the LM head, the next token (greedy: the
argmax of the softcapped logits in one kernel; sampled: the statistics and a draw from the
request's Philox stream) and `triton_ar.ar_advance` (the token into the output, end of answer
noted, positions forward). No host sync: a CUDA graph captures it once and replays it; the host
reads the tokens every `read_every` steps (one read a batch), cuts each row at its end of answer and
allocates the blocks the next batch needs.

Greedy tokens are dense/ar.py's (tests/engine/test_device_ar.py); sampled ones come from each request's
Philox stream (dense/ar.py draws from a torch generator), so a row does not depend on the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...kernels import triton_ar, triton_step
from ..events import Block, GenerationOutput
from ..kv.paged_cache import KINDS, PagedKVCache, PagedPass, SequenceBlocks
from ..prefill import prefill
from .graphs import cuda_capture, eager_capture

READ_EVERY = 16  # tokens a row decodes between two reads of the device


@dataclass
class ARState:
    """A batch of rows' device state (see the module)."""

    tokens: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int32
    tables: list[torch.Tensor]  # per kind (KINDS order) [n, W] int32
    lo: list[torch.Tensor]  # per kind [n] int32
    start: list[torch.Tensor]  # per kind [n] int32
    slots: list[torch.Tensor]  # per kind [n] int64
    out: torch.Tensor  # [n, read_every] int64
    step: torch.Tensor  # [1] int32: the step within the read-back batch
    done: torch.Tensor  # [n] bool
    eos: torch.Tensor  # [k] int64
    seeds: torch.Tensor  # [n] int64: each request's Philox key (sampling)
    temperature: torch.Tensor  # [n] float32

    @classmethod
    def empty(cls, n: int, width: int, read_every: int, device: torch.device) -> ARState:
        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            zeros(n, dtype=torch.long),
            zeros(n),
            [zeros(n, width) - 1 for _ in KINDS],
            [zeros(n) for _ in KINDS],
            [zeros(n) for _ in KINDS],
            [zeros(n, dtype=torch.long) for _ in KINDS],
            zeros(n, read_every, dtype=torch.long),
            zeros(1),
            zeros(n, dtype=torch.bool),
            zeros(1, dtype=torch.long),
            zeros(n, dtype=torch.long),
            zeros(n, dtype=torch.float32),
        )

    def token_pass(self, cache: PagedKVCache) -> PagedPass:
        """The cache pass of one token a row: its keys and values written into the pool by the
        q|k|v kernel (`PagedPass.pool_writes`, at `slots`), its attention the canvas kernel's over
        the rows' blocks in place, the token its one canvas key (a prefix split across programs:
        one token a row is too few queries for the encoder's causal kernel to fill a GPU)."""
        tables = {kind: (self.tables[i], self.lo[i], self.start[i]) for i, kind in enumerate(KINDS)}
        n = self.tokens.shape[0]
        slots = dict(zip(KINDS, self.slots))
        return PagedPass(cache, [], [1] * n, self.positions[:, None], False, {}, {}, {}, tables, slots=slots)


def choose(runner, raw: torch.Tensor, state: ARState, greedy: bool) -> torch.Tensor:
    """The next token of each row from its raw LM-head output [n, V]: the softcapped argmax, or a
    draw at the row's temperature from its Philox stream (offset: the position it goes to)."""
    cap = runner.config.final_logit_softcapping or 0.0
    if greedy:
        return triton_ar.softcapped_argmax(raw, cap)
    _, _, _, probs = triton_step.step_statistics(raw, state.temperature, cap, None, torch.float32, normalize=True)
    return triton_step.sample_drawn(probs, state.seeds, state.positions.to(torch.int64), 1)


def ar_step(runner, state: ARState, greedy: bool) -> None:
    """One token a row, all on the device (what a graph captures): see the module."""
    cache = runner.cache
    triton_ar.token_slots(
        state.positions, state.tables, state.lo, state.start, state.slots, cache.block_size, cache.window
    )
    hidden = runner.net.encode(state.tokens[:, None], state.token_pass(cache)).view(state.tokens.shape[0], -1)
    chosen = choose(runner, runner.net.lm_head(hidden), state, greedy)
    triton_ar.ar_advance(chosen, state.tokens, state.positions, state.out, state.step, state.done, state.eos)


class _Pool:
    """What `cuda_capture` keeps between captures (its memory pool) where the runner has no graphs."""

    pool = None


@torch.no_grad()
def device_ar_events(
    engine,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    seeds: list[int],
    eos_token_ids: tuple[int, ...],
    read_every: int = READ_EVERY,
    capture=None,
) -> Iterator[Block]:
    """dense/ar.py's `ar_events` on the engine's device path: one `Block` of one token per row per
    step (yielded a read-back batch at a time); returns a GenerationOutput. The rows' blocks come
    from the engine's pool and go back at the end. `capture`: how the step is captured (default a
    CUDA graph on CUDA, replayed eagerly elsewhere)."""
    if max_new_tokens <= 0:
        raise ValueError("max_new_tokens must be positive")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    if not engine.runner.triton:
        raise ValueError("device AR decoding runs on the Triton path (EngineOptions(triton=True))")
    blocks = engine.scheduler.blocks
    rows, owners = [], []
    try:
        for p in prompts:
            kv, owner = SequenceBlocks(), next(engine._prefix_owners)
            if blocks.admit(owner, kv, [], len(p) + max_new_tokens) is None:
                raise RuntimeError(f"no room for a {len(p) + max_new_tokens}-token sequence in the KV cache")
            rows.append(kv)
            owners.append(owner)
        return (
            yield from _generate(
                engine, rows, owners, prompts, max_new_tokens, temperature, seeds, eos_token_ids, read_every, capture
            )
        )
    finally:
        for owner, kv in zip(owners, rows):
            blocks.free(owner, kv)


def _ensure_blocks(engine, rows: list[SequenceBlocks], owners: list[int], ends: list[int]) -> None:
    """Blocks for every position below ends[i] of row i; sliding blocks the window no longer sees
    released (as the scheduler does)."""
    window = engine.runner.cache.window
    for kv, owner, end in zip(rows, owners, ends):
        engine.scheduler.blocks.release_behind_window(owner, kv, kv.length - (window - 1))
        engine.scheduler.blocks.allocate(owner, kv, end)


def _upload_tables(state: ARState, rows: list[SequenceBlocks]) -> None:
    """The rows' block tables (host lists) into the state's device tables (-1 past a row's own)."""
    for i, kind in enumerate(KINDS):
        table = torch.full(tuple(state.tables[i].shape), -1, dtype=torch.int32)
        for r, kv in enumerate(rows):
            table[r, : len(kv.tables[kind])] = torch.tensor(kv.tables[kind], dtype=torch.int32)
        state.tables[i].copy_(table.to(state.tables[i].device, non_blocking=True))


def _generate(engine, rows, owners, prompts, max_new_tokens, temperature, seeds, eos_token_ids, read_every, capture):
    runner = engine.runner
    cache, device, n = runner.cache, runner.net.device, len(prompts)
    chunk = engine.options.prefill_chunk
    last = []
    for kv, owner, p in zip(rows, owners, prompts):  # each prompt a chunk at a time, as the scheduler encodes it
        for start in range(0, len(p), chunk):
            end = min(len(p), start + chunk)
            _ensure_blocks(engine, [kv], [owner], [end])
            hidden = prefill(runner.net, cache, [kv], [p[start:end]], runner.pass_tokens)
        last.append(hidden)
    width = max(-(-(len(p) + max_new_tokens) // cache.block_size) for p in prompts)
    state = ARState.empty(n, width, read_every, device)
    state.positions.copy_(torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int32))  # the first draw's offset
    state.seeds.copy_(torch.tensor([triton_step.seed_bits(s) for s in seeds], dtype=torch.int64))
    state.temperature.fill_(float(temperature))
    state.eos = torch.tensor(list(eos_token_ids) or [-1], dtype=torch.int64).to(device)
    greedy = temperature == 0
    first = choose(runner, runner.net.lm_head(torch.cat(last)), state, greedy)
    state.tokens.copy_(first)
    state.positions.copy_(torch.tensor([len(p) for p in prompts], dtype=torch.int32))

    eos = set(eos_token_ids)
    outputs: list[list[int]] = [[] for _ in prompts]
    finished = [False] * n

    def emit(r: int, token: int):
        outputs[r].append(token)
        finished[r] = token in eos or len(outputs[r]) == max_new_tokens
        return Block(r, len(outputs[r]) - 1, [token], finished[r], 1)

    for r, token in enumerate(first.tolist()):  # the prompt's next token: the first read
        yield emit(r, token)
    step = None
    while not all(finished):
        batch = min(read_every, max_new_tokens - max(len(o) for o in outputs))
        _ensure_blocks(engine, rows, owners, [kv.length + batch for kv in rows])
        _upload_tables(state, rows)
        state.step.zero_()
        if step is None:  # a capture runs the step once (its warm-up): the state it advances is put back
            how = capture or (cuda_capture if device.type == "cuda" else eager_capture)
            saved = [t.clone() for t in (state.tokens, state.positions, state.step, state.done)]
            step, _ = how(lambda: (ar_step(runner, state, greedy), state.out)[1:], runner.graphs or _Pool())
            for dest, src in zip((state.tokens, state.positions, state.step, state.done), saved):
                dest.copy_(src)
        for _ in range(batch):
            step()
        for kv in rows:
            kv.length += batch  # the pool now holds the keys of every token the batch read in
        for r, tokens in enumerate(state.out[:, :batch].tolist()):  # the batch's one read of the device
            for token in tokens:
                if finished[r]:
                    break
                yield emit(r, token)
    return GenerationOutput(sequences=outputs, tokens_per_forward=[1.0] * n, decoder_passes=[len(o) for o in outputs])

"""Turbo denoising: positions that have converged stop being recomputed (opt-in, approximate).

A canvas position whose argmax has been accepted with the same value for `freeze_passes`
passes in a row, at an entropy at most `freeze_entropy`, is *frozen*: its token is that argmax
(what its block would commit), it stops being a query, and the positions still denoising read
the keys and values of its last computation from the request's canvas K/V buffer (refreshed by
a pass over every position each `refresh_every` passes, or never). Positions after a frozen end
of answer freeze with it (they are cut from the answer anyway). With a grammar only a contiguous
prefix from the left may freeze: a grammar walks the canvas from the left.

A position still noise (re-noised last pass) whose entropy is above `dormant_entropy` *rests*
every other pass: it is not computed, keys and values of its last computation (of an earlier
noise token) stand in for the fresh noise token an exact pass would feed, and it cannot be
accepted that pass. Such a position is far from being accepted (acceptance takes the lowest
entropies first), so on dgemma-tiny this is where the work past the freeze rule's ceiling is.
None rests on a canvas's first pass, on refresh passes, on a block's last allowed pass, with a
grammar (its walk reads every row), or when every position not frozen would; a block does not
stop on a pass where one rests (docs/performance.md, "Turbo denoising", has the measurements).

What is kept from an exact pass: frozen positions keep their last entropy in the acceptance rule
and the stopping rule; every pass draws the same random numbers (C uniforms, C noise tokens), so
turbo and exact runs differ only by the approximation; a frozen position's log probabilities are
those of the pass that froze it. The block commits when every position is frozen or the usual
stopping rule holds. Turbo off changes nothing (the runner's exact path is untouched).

The freeze and rest rules are pure functions (`freeze`, `dormant`); the state one canvas carries
is `TurboState`; `TurboPass` is the cache pass of a decoder pass over the active rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import ModelConfig, TurboSettings
from ..model.attention import sdpa
from .events import TokenLogprob


@dataclass
class TurboState:
    """One canvas's turbo state (reset with each canvas; the K/V buffer is kept across blocks).

    `frozen` [C] bool; `streak` [C] passes in a row accepted with an unchanged argmax; `tokens`
    [C] the last argmax (a frozen position's token); `entropy` [C] the last entropy (kept for
    frozen positions); `keys` / `values` per layer [C, Hkv, D] of each position's last
    computation; `passes` since the last pass over every position; `logprobs` of frozen
    positions, stored when they froze; `rested` [C] the positions that rested last pass."""

    frozen: torch.Tensor
    streak: torch.Tensor
    tokens: torch.Tensor
    entropy: torch.Tensor
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    passes: int = 0
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    rested: torch.Tensor | None = None
    slot: int | None = None  # on the device path: its canvas K/V slot (engine/fused/turbo.py)
    active: tuple[int, int] | None = None  # ... and the next pass's computed positions, resting allowed and not

    @classmethod
    def fresh(cls, canvas_length: int, device: torch.device, buffers: TurboState | None = None) -> TurboState:
        """A new canvas's state; `buffers`: the last canvas's state, whose K/V buffer is reused."""
        state = cls(
            frozen=torch.zeros(canvas_length, dtype=torch.bool, device=device),
            streak=torch.zeros(canvas_length, dtype=torch.long, device=device),
            tokens=torch.full((canvas_length,), -1, dtype=torch.long, device=device),
            entropy=torch.zeros(canvas_length, dtype=torch.float32, device=device),
        )
        if buffers is not None:
            state.keys, state.values, state.slot = buffers.keys, buffers.values, buffers.slot
        return state

    def full_pass(self, settings: TurboSettings) -> bool:
        """Whether this pass computes every position: a canvas's first pass, or a refresh."""
        return self.passes == 0 or bool(settings.refresh_every and self.passes % settings.refresh_every == 0)

    def all_frozen(self) -> bool:
        return bool(self.frozen.all())

    def query_rows(self, settings: TurboSettings, may_rest: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(canvas positions this pass computes, long [A]; positions resting, bool [C]): every
        position on a canvas's first pass and on refresh passes, else those neither frozen nor
        resting (`may_rest`: False where none may rest, e.g. a grammar's canvas)."""
        if not self.keys or self.full_pass(settings):
            return torch.arange(self.frozen.numel(), device=self.frozen.device), torch.zeros_like(self.frozen)
        threshold = settings.dormant_entropy if may_rest else 0.0
        resting = dormant(self.frozen, self.streak, self.entropy, self.rested, threshold)
        return (~self.frozen & ~resting).nonzero().squeeze(-1), resting

    def ensure_buffers(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        """The canvas K/V buffer: per layer [C, Hkv, D] keys and values (allocated once per request)."""
        if self.keys:
            return
        c = config.canvas_length
        for spec in config.layers:
            self.keys.append(torch.zeros(c, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device))
            self.values.append(torch.zeros(c, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device))


def may_rest(r) -> bool:
    """Whether positions of request `r`'s canvas may rest this pass: not with a grammar (its walk
    reads every row) nor on the block's last allowed pass (what commits is computed)."""
    return not r.refines and not r.block_ends(False)


def canvas_kv_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """The canvas K/V buffer of one turbo request: keys and values of every canvas position in
    every layer (~55 MB at the released size in bf16)."""
    return sum(2 * config.canvas_length * s.num_kv_heads * s.head_dim * dtype_bytes for s in config.layers)


def freeze(
    frozen: torch.Tensor,
    streak: torch.Tensor,
    previous: torch.Tensor,
    argmax: torch.Tensor,
    accepted: torch.Tensor,
    entropy: torch.Tensor,
    settings: TurboSettings,
    *,
    prefix_only: bool = False,
    eos_ids: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(frozen [C], streak [C]) after one pass (pure; every argument [C]).

    A position not frozen extends its streak when it was accepted with the argmax it had last
    pass, restarts at 1 when accepted with another, and drops to 0 when re-noised; it freezes at
    `freeze_passes` with entropy <= `freeze_entropy`. `prefix_only` (a grammar): only a
    contiguous run from the left is frozen. `eos_ids`: every position after a frozen end of
    answer freezes too (it is cut from the answer; never with `prefix_only`)."""
    same = accepted & (argmax == previous)
    streak = torch.where(same, streak + 1, accepted.long())
    ready = frozen | ((streak >= settings.freeze_passes) & (entropy <= settings.freeze_entropy))
    if prefix_only:
        ready = torch.cumprod(ready.long(), dim=0).bool()
    elif eos_ids:
        eos = ready & torch.isin(argmax, torch.tensor(eos_ids, device=argmax.device))
        if bool(eos.any()):
            first = int(eos.nonzero()[0, 0])
            ready = ready.clone()
            ready[first:] = True
    return ready, streak


def dormant(
    frozen: torch.Tensor, streak: torch.Tensor, entropy: torch.Tensor, rested: torch.Tensor | None, threshold: float
) -> torch.Tensor:
    """The positions that rest this pass ([C] bool; pure): still noise (neither frozen nor
    accepted last pass: streak 0) at a last entropy above `threshold` (0: none rests), and not
    resting last pass (none rests twice in a row). None rests when every position not frozen
    would: a pass computes something."""
    resting = ~frozen & (streak == 0) & (entropy > threshold) if threshold > 0 else torch.zeros_like(frozen)
    if rested is not None:
        resting &= ~rested
    if not bool((~frozen & ~resting).any()):
        return torch.zeros_like(frozen)
    return resting


class TurboPass:
    """The cache pass of a decoder pass over the active rows of n canvases.

    Wraps the full-canvas pass `inner` (prefix ranges, masks, tables: n rows, C canvas keys each):
    each request's active rows' keys/values are written into its canvas K/V buffer, then the
    active queries attend over their prefix and all C canvas positions. `rows` [n, A]: the canvas
    positions computed per request (RoPE positions are theirs)."""

    def __init__(self, inner, rows: torch.Tensor, states: list[TurboState]):
        self.inner, self.rows, self.states = inner, rows, states
        self.positions = inner.positions.gather(1, rows.to(inner.positions.device))

    def attention(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q/k/v [n, H(kv), A, D] of the active rows -> [n, A, H, D]."""
        for i, state in enumerate(self.states):
            state.keys[layer].index_copy_(0, self.rows[i], k[i].transpose(0, 1).to(state.keys[layer].dtype))
            state.values[layer].index_copy_(0, self.rows[i], v[i].transpose(0, 1).to(state.values[layer].dtype))
        full_k = torch.stack([s.keys[layer] for s in self.states]).transpose(1, 2).to(k.dtype)
        full_v = torch.stack([s.values[layer] for s in self.states]).transpose(1, 2).to(v.dtype)
        if self.inner.tables is not None:  # the Triton kernel takes A query rows against C canvas keys
            return self.inner.attention(layer, sliding, q, full_k, full_v)
        k_all, v_all, mask, is_causal = self.inner.attend(layer, sliding, full_k, full_v)
        if mask is not None:  # every query of a canvas sees the same keys: the first A rows' mask serves
            mask = mask[:, :, : q.shape[2]]
        return sdpa(q, k_all, v_all, mask, is_causal)

"""Canvas constraints: fixed tokens and allowed-token masks, per canvas position.

The one API that seeded canvases (infill, editing) and grammars (structured output) build on.

- An *initial* token is where the canvas starts at that position instead of a random token (a
  warm start: the reference's `decoder_input_ids`); it denoises like any other afterwards.
- A *fixed* position holds a given token: it is written into the canvas when it starts, never
  re-noised, excluded from entropy-bound acceptance and from the stopping statistics (mean
  entropy, and it cannot make the canvas unstable), and committed as given. The other positions
  denoise as usual and see the fixed ones on both sides (the decoder is bidirectional).
- An *allowed-token mask* bans tokens at a position: their logits become -inf after the softcap,
  before any statistic, so they are never the argmax, never sampled, and weigh nothing in the
  entropy or the self-conditioning input. It is kept packed (bit t % 32 of word t // 32 set =
  token t allowed, llguidance's layout), which every statistics path reads directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..sampler import pack_token_mask, unpack_token_mask


@dataclass(frozen=True)
class CanvasConstraints:
    fixed: torch.Tensor | None = None  # [C] long: the token at fixed positions, -1 elsewhere
    allowed: torch.Tensor | None = None  # [C, ceil(V / 32)] int32 packed mask, or None: all allowed
    initial: torch.Tensor | None = None  # [C] long: the canvas's first tokens, -1 where random

    @staticmethod
    def build(
        canvas_length: int,
        vocab_size: int,
        fixed: Mapping[int, int] | None = None,
        allowed: torch.Tensor | Mapping[int, Iterable[int]] | None = None,
        initial: Mapping[int, int] | None = None,
    ) -> CanvasConstraints:
        """Validated constraints from friendly forms.

        `fixed`, `initial`: {position: token}. `allowed`: a bool tensor [canvas_length, vocab_size],
        or {position: allowed token ids} (positions not named allow everything).
        """
        fixed_tokens = _positions(fixed, canvas_length, vocab_size, "fixed")
        initial_tokens = _positions(initial, canvas_length, vocab_size, "initial")
        mask = None
        if allowed is not None:
            if isinstance(allowed, torch.Tensor):
                if allowed.shape != (canvas_length, vocab_size) or allowed.dtype != torch.bool:
                    raise ValueError(
                        f"allowed must be a bool tensor [{canvas_length}, {vocab_size}], got "
                        f"{allowed.dtype} {tuple(allowed.shape)}"
                    )
                dense = allowed.cpu()
            else:
                dense = torch.ones(canvas_length, vocab_size, dtype=torch.bool)
                for pos, toks in allowed.items():
                    _check_position(pos, canvas_length, "allowed")
                    ids = torch.as_tensor(list(toks), dtype=torch.long)
                    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
                        raise ValueError(f"allowed[{pos}] holds ids outside [0, {vocab_size})")
                    dense[pos] = False
                    dense[pos, ids] = True
            empty = (~dense.any(dim=-1)).nonzero().flatten().tolist()
            if empty:
                raise ValueError(f"allowed bans every token at canvas position(s) {empty}")
            if fixed_tokens is not None:
                at = (fixed_tokens >= 0).nonzero().flatten()
                bad = [int(p) for p in at if not dense[p, fixed_tokens[p]]]
                if bad:
                    raise ValueError(f"fixed token(s) at position(s) {bad} are not allowed there")
            mask = None if bool(dense.all()) else pack_token_mask(dense)
        return CanvasConstraints(fixed_tokens, mask, initial_tokens)

    @property
    def free(self) -> torch.Tensor | None:
        """[C] bool: positions that denoise (not fixed), or None when nothing is fixed."""
        return None if self.fixed is None else self.fixed < 0

    def apply_fixed(self, canvas: torch.Tensor) -> torch.Tensor:
        """`canvas` with the fixed tokens written in (on its device)."""
        if self.fixed is None:
            return canvas
        fixed = self.fixed.to(canvas.device)
        return torch.where(fixed >= 0, fixed, canvas)

    def seed_canvas(self, canvas: torch.Tensor) -> torch.Tensor:
        """A fresh `canvas` with the initial tokens, then the fixed ones, written in."""
        if self.initial is not None:
            initial = self.initial.to(canvas.device)
            canvas = torch.where(initial >= 0, initial, canvas)
        return self.apply_fixed(canvas)

    def allowed_dense(self, vocab_size: int) -> torch.Tensor | None:
        """The mask unpacked to bool [C, vocab] (tests and debugging)."""
        return None if self.allowed is None else unpack_token_mask(self.allowed, vocab_size)


class CanvasError(ValueError):
    """A canvas given by a caller that is not one: `param` names the field or entry at fault."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def canvas_row(
    row: Any, canvas_length: int, vocab_size: int, what: str = "canvas", nulls: bool = False
) -> list[int | None]:
    """One canvas given by a caller (the API's warm start, the server's fixed `canvas` field), checked
    the one way: `canvas_length` token ids in [0, vocab_size) (or, with `nulls`, None for a free
    position). A tensor row is taken as its list."""
    if isinstance(row, torch.Tensor):
        row = row.tolist()
    entries = "a token id, or null" if nulls else "token ids"
    if not isinstance(row, (list, tuple)) or len(row) != canvas_length:
        size = f"of length {len(row)}" if isinstance(row, (list, tuple)) else ""
        raise CanvasError(
            what,
            f"{what} must be a list of {canvas_length} entries ({entries}); got {type(row).__name__} {size}".rstrip(),
        )
    for i, t in enumerate(row):
        if t is None and nulls:
            continue
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            either = " or null" if nulls else ""
            raise CanvasError(
                f"{what}[{i}]", f"{what}[{i}] must be a token id in [0, {vocab_size}){either} (got {t!r})"
            )
    return list(row)


def _positions(tokens: Mapping[int, int] | None, canvas_length: int, vocab_size: int, what: str) -> torch.Tensor | None:
    """{position: token} as [C] long, -1 at positions not named; None for none."""
    if not tokens:
        return None
    out = torch.full((canvas_length,), -1, dtype=torch.long)
    for pos, tok in tokens.items():
        _check_position(pos, canvas_length, what)
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise ValueError(f"{what}[{pos}] = {tok!r} is not a token id in [0, {vocab_size})")
        out[pos] = tok
    return out


def _check_position(pos, canvas_length: int, what: str) -> None:
    if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < canvas_length:
        raise ValueError(f"{what}: position {pos!r} is outside the canvas [0, {canvas_length})")


@dataclass(frozen=True)
class FirstCanvas:
    """A constraint source that constrains a request's first canvas only (a warm start, an
    infill or an edit); the canvases after it denoise freely."""

    constraints: CanvasConstraints

    def __call__(self, request) -> CanvasConstraints | None:
        return self.constraints if request.block == 0 else None

"""Committed tokens -> text deltas for a client: multi-byte characters and stop strings handled on decoded text."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..engine.events import cut_block


class TextStream:
    """Committed tokens -> text deltas, cut at the first stop string.

    Decodes all tokens so far and emits the new suffix, holding back what may still change: a
    trailing U+FFFD (a multi-byte character split across blocks) and a tail that could be the
    start of a stop string completed by the next block.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str], eos: Sequence[int], max_tokens: int):
        self.decode, self.stops, self.eos, self.max_tokens = decode, list(stops), tuple(eos), max_tokens
        self.tokens: list[int] = []
        self.text = ""  # all text sent so far
        self.stopped = False  # a stop string was found

    def add(self, tokens: list[int], last: bool = False) -> str:
        """Text to send after a committed block; with `last`, everything that is left."""
        if self.stopped:
            return ""
        self.tokens += tokens
        full = self.decode(self.tokens)
        cut = min((i for i in (full.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            end = max(cut, len(self.text))
        elif last:
            end = len(full)
        else:
            end = len(full)
            while end > len(self.text) and full[end - 1] == "\ufffd":
                end -= 1
            end -= self._stop_prefix(full[:end])
            end = max(end, len(self.text))
        if not full.startswith(self.text):  # the decoder rewrote sent text; send nothing more of it
            return ""
        delta = full[len(self.text) : end]
        self.text += delta
        return delta

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def draft(self, canvas: list[int]) -> str:
        """Text that would follow the text sent so far if the canvas committed now (cut at EOS and max_tokens)."""
        room = self.max_tokens - len(self.tokens)
        kept, _, _ = cut_block(canvas, self.eos, max(room, 0))
        full = self.decode(self.tokens + kept)
        return full[len(self.text) :] if full.startswith(self.text) else self.decode(kept)

    def completion_tokens(self) -> int:
        """Tokens generated up to the end of the text sent (the stop string's token, when one was hit)."""
        if not self.stopped:
            return len(self.tokens)
        lo, hi = 0, len(self.tokens)
        while lo < hi:  # fewest tokens whose text covers the sent text plus the stop string
            mid = (lo + hi) // 2
            part = self.decode(self.tokens[:mid])
            if any(s in part for s in self.stops):
                hi = mid
            else:
                lo = mid + 1
        return lo

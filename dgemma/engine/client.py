"""Synchronous callers of one shared engine: `Model.generate` and `Model.stream`.

Each caller submits its requests and reads only their events; whoever needs an event steps the
engine (under a lock), and events of other callers' requests wait in their mailboxes. So two
streams read in turn from one thread, or calls from several threads, share one engine, its
continuous batching and its prefix cache. A caller that stops reading (a closed stream)
cancels its requests.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator

from .engine import Engine
from .events import Finished
from .request import Request


class EngineClient:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._mail: dict[int, deque] = {}

    def run(self, requests: list[Request]) -> Iterator:
        """Submit `requests` and yield their events (each request's `Finished` last) as the engine
        produces them."""
        with self._lock:
            ids = []
            try:
                for r in requests:
                    ids.append(self.engine.add(r))
                    self._mail[ids[-1]] = deque()
            except Exception:
                for i in ids:
                    self.engine.cancel(i)
                raise
        pending = set(ids)
        try:
            while pending:
                ready = self._take(ids)
                if not ready:
                    self._step()
                    continue
                for ev in ready:
                    if isinstance(ev, Finished):
                        pending.discard(ev.row)
                    yield ev
        finally:
            with self._lock:
                for i in pending:
                    self.engine.cancel(i)
                for i in ids:
                    self._mail.pop(i, None)

    def _take(self, ids: list[int]) -> list:
        with self._lock:
            out = []
            for i in ids:
                box = self._mail.get(i)
                while box:
                    out.append(box.popleft())
            return out

    def _step(self) -> None:
        with self._lock:
            for ev in self.engine.step():
                box = self._mail.get(ev.row)
                if box is not None:
                    box.append(ev)

    def finish(self, requests: list[Request]) -> list[Finished]:
        """Run `requests` to their end; their `Finished` events, in order."""
        done = {ev.row: ev for ev in self.run(requests) if isinstance(ev, Finished)}
        return [done[r.request_id] for r in requests]

"""Threads with a big native stack, for the code that may recurse deeply in native code.

llguidance compiles grammars (and computes token masks) with recursive Rust code; a thread's
stack is what bounds how deep a grammar it survives, and overflowing it is a segfault that takes
the whole server down. The main thread and the default thread pool get the platform's default
(8 MiB on Linux); the engine thread and the grammar compile thread are started here with
`STACK_BYTES`, and serve/structured/limits.py refuses grammars above a quarter of what crashes at
that size (scripts/grammar_limits.py measures it).

`threading.stack_size` is process-global: it is set, the thread started, and the old value put
back, under one lock, so that no other thread is started with the wrong size by this module.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

STACK_BYTES = 64 << 20  # 64 MiB: address space only; pages are touched as the stack grows

_stack_lock = threading.Lock()


def start_with_stack(thread: threading.Thread, stack_bytes: int = STACK_BYTES) -> threading.Thread:
    """Start a (not yet started) thread with a native stack of `stack_bytes`."""
    with _stack_lock:
        old = threading.stack_size(stack_bytes)
        try:
            thread.start()
        finally:
            threading.stack_size(old)
    return thread


def start_thread(
    target: Callable[[], Any], name: str, stack_bytes: int = STACK_BYTES, daemon: bool = True
) -> threading.Thread:
    """A new thread running `target` with a native stack of `stack_bytes`, started."""
    return start_with_stack(threading.Thread(target=target, name=name, daemon=daemon), stack_bytes)


class CompileWorker:
    """One long-lived daemon thread with a big stack that runs submitted callables in order.

    Grammar validation, compilation and the tool-call grammar writer run here: off the event
    loop, and never on a thread whose stack a deep grammar could overflow. `submit` returns a
    `concurrent.futures.Future` (await it with `asyncio.wrap_future`); whatever the callable
    raises is set on its future, and the thread goes on with the next one."""

    def __init__(self, name: str = "dgemma-compile", stack_bytes: int = STACK_BYTES):
        self.name, self.stack_bytes = name, stack_bytes
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on the worker thread (started on first use); its future."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            if self._thread is None:
                self._thread = start_thread(self._run, self.name, self.stack_bytes)
            self._jobs.put((future, fn, args))
        return future

    def close(self) -> None:
        """Let the thread end after the callables already submitted."""
        with self._lock:
            self._closed = True
            if self._thread is not None:
                self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - a Rust panic is a BaseException: the caller gets it
                future.set_exception(e)

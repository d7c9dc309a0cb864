"""The bridge between HTTP handlers (asyncio) and the engine (one thread): continuous batching.

The engine is not thread-safe, so one background thread owns it (`EngineThread`). Handlers talk
to that thread through an inbox (submit, cancel) and get events back on a per-request asyncio
queue. Each turn of the thread drains the inbox, runs one `Engine.step()` (prefill chunks and
committed blocks, one decoder pass per denoising canvas) and routes the step's events to their
requests. Requests therefore join and leave at step boundaries. `Generation` is one request's
life on the HTTP side.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..adapters import Adapter, AdapterBank, AdapterError, AdapterWeights
from ..config import GenerationConfig
from ..engine.engine import Engine, Request
from ..engine.events import Block, Draft, Finished, TokenLogprob
from ..inputs.model_inputs import ImagePatches
from .metrics import Metrics
from .text import TextStream
from .threads import start_with_stack

log = logging.getLogger("dgemma.serve")


class QueueFull(RuntimeError):
    """Every canvas slot is busy and the waiting queue is at its limit."""


class UnknownAdapter(LookupError):
    """A request names a LoRA adapter that is not loaded (or is being unloaded)."""


class EngineFailure(RuntimeError):
    """The engine raised while running this request (a server fault, reported as 500)."""


@dataclass
class Job:
    """A request as the HTTP side sees it: what to run, and the queue its events arrive on."""

    prompt: list[int]
    config: GenerationConfig
    seed: int
    drafts: bool
    loop: asyncio.AbstractEventLoop
    images: list[ImagePatches] = field(default_factory=list)  # in the order of their placeholders in prompt
    constraints: Any = None  # the request's constraint source (a grammar's state: engine/constraints/grammar.py)
    top_logprobs: int | None = None  # log probabilities of the committed tokens, with this many alternatives
    adapter: str | None = None  # the LoRA adapter it runs (None: the base)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int | None = None  # the engine's id, once added
    deadline: float | None = None  # time.monotonic() past which the request ends ("timeout")
    cancelled: bool = False
    timed_out: bool = False
    finished: bool = False
    submitted: float = field(default_factory=time.perf_counter)

    def deliver(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop closed (server shutting down)
            pass


class EngineThread:
    """Owns the engine on one thread; `submit` and `cancel` may be called from the event loop."""

    def __init__(
        self,
        new_engine: Callable[[], Engine],
        max_active: int,
        max_queue: int,
        metrics: Metrics,
        adapters: AdapterBank | None = None,
    ):
        self.new_engine = new_engine
        # the LoRA adapters requests may name: resolved on this thread, installed and removed between steps
        self.adapters = adapters
        self._adapter_jobs: Counter[str] = Counter()  # adapter -> its jobs submitted and not finished
        self._draining: set[str] = set()  # adapters being unloaded: no new requests
        self.max_active, self.max_queue = max_active, max_queue
        self.metrics = metrics
        self.engine = new_engine()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._jobs: dict[int, Job] = {}  # engine request id -> job (engine thread only)
        self._lock = threading.Lock()
        self._in_flight = 0  # submitted and not yet finished
        self._vision_seen = (0, 0)  # this engine's vision encodes and cache hits already counted
        self._thread = threading.Thread(target=self._run, name="dgemma-engine", daemon=True)

    # ---------------------------------------------------------------- event-loop side
    def start(self) -> None:
        start_with_stack(self._thread)  # a big native stack: grammar masks are computed on it (threads.py)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def submit(
        self,
        prompt: list[int],
        config: GenerationConfig,
        seed: int,
        drafts: bool = False,
        images: list[ImagePatches] = (),
        constraints: Any = None,
        top_logprobs: int | None = None,
        deadline: float | None = None,
        adapter: str | None = None,
    ) -> Job:
        """Queue a request (with the patches of the images its prompt holds placeholders for;
        with `top_logprobs`, its blocks carry log probabilities; past `deadline`, a
        time.monotonic() value, it ends with reason "timeout", queued or running; `adapter`: the
        loaded LoRA adapter it runs); raises QueueFull when every slot and every queue place is
        taken, UnknownAdapter when `adapter` is not loaded or is being unloaded."""
        with self._lock:
            if adapter is not None and (
                adapter in self._draining or self.adapters is None or self.adapters.get(adapter) is None
            ):
                raise UnknownAdapter(adapter)
            if self._in_flight >= self.max_active + self.max_queue:
                raise QueueFull(
                    f"server busy: {self.max_active} canvases active and {self.max_queue} requests queued; retry later"
                )
            self._in_flight += 1
            if adapter is not None:
                self._adapter_jobs[adapter] += 1
        job = Job(
            prompt,
            config,
            seed,
            drafts,
            asyncio.get_running_loop(),
            list(images),
            constraints,
            top_logprobs,
            adapter=adapter,
            deadline=deadline,
        )
        self._inbox.put(("add", job))
        self._wake.set()
        return job

    # ---------------------------------------------------------------- adapters at run time (event-loop side)
    async def install_adapter(self, adapter: AdapterWeights) -> Adapter:
        """Put a read and checked adapter into a free slot, between two engine steps (the copy of a
        few MB; the reading and checking happened before, off this thread). AdapterError when its
        name is taken or every slot is."""
        if self.adapters is None:
            raise AdapterError("this server serves no adapters")
        with self._lock:
            if adapter.name in self._draining:
                raise AdapterError(f"adapter {adapter.name!r} is being unloaded; load it again once it is")
        return await self._on_engine_thread("install", adapter)

    async def remove_adapter(self, name: str, poll: float = 0.02) -> Adapter:
        """Unload adapter `name`: new requests naming it are refused at once; this waits for the
        requests that run it to end, then empties its slot and drops its prefix-cache blocks."""
        with self._lock:
            if self.adapters is None or self.adapters.get(name) is None or name in self._draining:
                raise UnknownAdapter(name)
            self._draining.add(name)
        try:
            while True:
                with self._lock:
                    if self._adapter_jobs[name] == 0:
                        break
                await asyncio.sleep(poll)
            return await self._on_engine_thread("remove", name)
        finally:
            with self._lock:
                self._draining.discard(name)

    async def _on_engine_thread(self, op: str, payload: Any) -> Any:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((op, (payload, done)))
        self._wake.set()
        return await asyncio.wrap_future(done)

    def draining(self, name: str) -> bool:
        """Whether adapter `name` is being unloaded (new requests naming it are refused)."""
        with self._lock:
            return name in self._draining

    def adapter_jobs(self, name: str) -> int:
        """Requests submitted on adapter `name` and not yet finished."""
        with self._lock:
            return self._adapter_jobs[name]

    def cancel(self, job: Job) -> None:
        """Stop a request; it leaves the engine (and frees its slot) at the next step boundary."""
        if job.finished or job.cancelled:
            return
        job.cancelled = True
        self._inbox.put(("cancel", job))
        self._wake.set()

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._drain_inbox()
            self._end_late_jobs()
            if not self.engine.has_work:
                self._publish_gauges()
                self._wake.wait(timeout=1.0)
                continue
            start, passes = time.perf_counter(), self.engine.stats.decoder_passes
            try:
                events = self.engine.step()
            except Exception as e:  # a bug or out-of-memory: fail what is running, keep serving
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            elapsed = time.perf_counter() - start
            with self.metrics.lock:
                self.metrics.step_seconds.observe(elapsed)
                if self.engine.stats.decoder_passes > passes:
                    self.metrics.step_canvases.observe(self.engine.stats.decoder_passes - passes)
                self.metrics.steps.inc()
                self._publish_vision()  # before the events: a client that has its answer sees the counts
            self._route(events)
            self._publish_gauges()
        self._fail_all(EngineFailure("server shutting down"))

    def _take_inbox(self) -> list[tuple[str, Job]]:
        ops = []
        while True:
            try:
                ops.append(self._inbox.get_nowait())
            except queue.Empty:
                return ops

    def _drain_inbox(self) -> None:
        for op, job in self._take_inbox():
            if op in ("install", "remove"):
                self._adapter_op(op, *job)
            elif op == "add":
                if job.cancelled or _late(job, time.monotonic()):
                    self._done(job, Finished(-1, "timeout" if job.timed_out else "cancelled", [], 0, 0.0))
                    continue
                try:
                    request = Request(
                        job.prompt,
                        job.config,
                        job.seed,
                        drafts=job.drafts,
                        images=job.images,
                        constraints=job.constraints,
                        top_logprobs=job.top_logprobs,
                        adapter=None if job.adapter is None else self.adapters.get(job.adapter).ref,
                    )
                    job.request_id = self.engine.add(request)
                except Exception as e:  # validated by the server first; reported, never raised here
                    self._done(job, EngineFailure(f"the engine refused the request: {e}"))
                    continue
                self._jobs[job.request_id] = job
                with self.metrics.lock:
                    self.metrics.prompt_tokens.inc(len(job.prompt))
            elif op == "cancel" and job.request_id is not None:
                self.engine.cancel(job.request_id)

    def _adapter_op(self, op: str, payload: Any, done: concurrent.futures.Future) -> None:
        """An adapter installed into a free slot, or one whose requests have all ended removed
        (its prefix-cache blocks dropped, unless another loaded adapter has the same weights)."""
        try:
            if op == "install":
                done.set_result(self.adapters.install(payload))
                return
            entry = self.adapters.get(payload)
            if entry is None:
                raise UnknownAdapter(payload)
            if self.engine.uses_adapter(entry.slot):  # (never: the caller waited for its jobs)
                raise AdapterError(f"adapter {payload!r} is still in use")
            self.adapters.remove(payload)
            if not self.adapters.shares_key(entry.key):
                self.engine.forget_adapter(entry.key)
            done.set_result(entry)
        except Exception as e:  # noqa: BLE001 - handed to the waiting route, which answers it
            done.set_exception(e)

    def _route(self, events: list) -> None:
        for ev in events:
            job = self._jobs.get(ev.row)
            if isinstance(ev, Finished):
                self._jobs.pop(ev.row, None)
                with self.metrics.lock:
                    self.metrics.cached_tokens.inc(ev.cached_tokens)
                    self.metrics.generation_tokens.inc(len(ev.tokens))
                    self.metrics.decoder_passes.inc(ev.decoder_passes)
                    self.metrics.decoder_positions.inc(ev.decoder_positions)
                    if ev.decoder_passes:
                        self.metrics.tokens_per_forward.observe(ev.tokens_per_forward)
            if job is None:
                continue
            if isinstance(ev, Finished):
                self._done(job, replace(ev, reason="timeout") if job.timed_out else ev)
            elif not job.cancelled:
                job.deliver(ev)

    def _end_late_jobs(self) -> None:
        """Cancel the running requests whose deadline has passed (they finish as "timeout" at
        the next step boundary, with what they committed so far)."""
        now = time.monotonic()
        for job in self._jobs.values():
            if not job.cancelled and _late(job, now):
                job.cancelled = True
                self.engine.cancel(job.request_id)

    def _done(self, job: Job, final) -> None:
        job.finished = True
        with self._lock:
            self._in_flight -= 1
            if job.adapter is not None:
                self._adapter_jobs[job.adapter] -= 1
        job.deliver(final)

    def _fail_all(self, error: Exception) -> None:
        if getattr(self.engine, "leads_ranks", False) and not self._stop.is_set():
            # a model split across ranks: a failed step is a failed rank (or a collective that timed
            # out); the ranks' engines no longer agree, so the server ends (the launcher stops the rest)
            import os
            import sys

            sys.stderr.write(
                f"dgemma: error: a step across the tensor-parallel ranks failed ({error}); the server stops\n"
            )
            sys.stderr.flush()
            os._exit(1)
        for job in list(self._jobs.values()):
            self._done(job, EngineFailure(str(error) or type(error).__name__))
        self._jobs.clear()
        for op, job in self._take_inbox():
            if op == "add":
                self._done(job, EngineFailure(str(error) or type(error).__name__))
            elif op in ("install", "remove"):
                self._adapter_op(op, *job)
        if not self._stop.is_set():
            with self.metrics.lock:
                self._publish_vision()  # what the failed engine did, before its counts are gone
            self.engine = self.new_engine()
            self._vision_seen = (0, 0)

    def _publish_gauges(self) -> None:
        scheduler, usage = self.engine.scheduler, self.engine.kv_usage()
        with self.metrics.lock:
            self.metrics.active.set(len(scheduler.running))
            self.metrics.queue_depth.set(len(scheduler.waiting) + self._inbox.qsize())
            for kind, counts in usage.items():
                for state in ("used", "cached", "free"):
                    self.metrics.kv_blocks.set(counts[state], kind=kind, state=state)
            self.metrics.prefix_hit_rate.set(self.engine.stats.prefix_hit_rate)

    def _publish_vision(self) -> None:
        """Add the engine's vision encodes and cache hits since the last look to the counters
        (the engine's own counts start again at 0 when a fresh engine takes over). The caller holds metrics.lock."""
        stats = self.engine.stats
        now = (stats.vision_encodes, stats.vision_cache_hits)
        self.metrics.vision_encodes.inc(now[0] - self._vision_seen[0])
        self.metrics.vision_cache_hits.inc(now[1] - self._vision_seen[1])
        self._vision_seen = now


def _late(job: Job, now: float) -> bool:
    """Whether `job` has passed its deadline (and marks it timed out)."""
    if job.deadline is not None and now > job.deadline:
        job.timed_out = True
    return job.timed_out


# ------------------------------------------------------------------------------------ one request
@dataclass
class Update:
    """Something to send a client: committed text ("block") or a draft of the canvas ("draft")."""

    kind: str
    text: str
    block: int
    step: int = 0
    draft: Draft | None = None  # the engine's draft (kind "draft"): the canvas position by position


class Generation:
    """One request's life on the HTTP side: job events in, `Update`s out, finish reason and usage at the end."""

    def __init__(self, engine_thread: EngineThread, job: Job, text: TextStream):
        self.engine_thread, self.job, self.text = engine_thread, job, text
        self.finish_reason: str | None = None
        self.first_block_at: float | None = None
        self.finished: Finished | None = None  # the engine's account: passes, tokens per forward, cached tokens
        self.logprobs: list[TokenLogprob] = []  # of every committed token received, when the job asked

    @property
    def completion_tokens(self) -> int:
        return self.text.completion_tokens()

    @property
    def decoder_passes(self) -> int:
        return self.finished.decoder_passes if self.finished else 0

    @property
    def decoder_positions(self) -> int:
        """Canvas positions the decoder computed for it (passes x canvas_length, fewer with turbo)."""
        return self.finished.decoder_positions if self.finished else 0

    @property
    def tokens_per_forward(self) -> float:
        return self.finished.tokens_per_forward if self.finished else 0.0

    @property
    def cached_tokens(self) -> int:
        return self.finished.cached_tokens if self.finished else 0

    async def updates(self) -> AsyncIterator[Update]:
        """Yield updates until the request ends; sets `finish_reason` ("stop" or "length").

        After a stop string the request is cancelled and nothing more is sent, but the updates
        end only with the engine's `Finished` (a step later), whose counts the usage reports."""
        while True:
            ev = await self.job.events.get()
            if isinstance(ev, Exception):
                raise ev
            if isinstance(ev, Finished):
                self.finished = ev
                if self.finish_reason is None:
                    # "eos" when the block held an EOS beyond max_tokens is a length stop to the client
                    hit_eos = bool(self.text.tokens) and self.text.tokens[-1] in self.text.eos
                    self.finish_reason = ("stop" if hit_eos else "length") if ev.reason == "eos" else ev.reason
                return
            if self.finish_reason is not None:
                continue  # stopped: drain until Finished
            if isinstance(ev, Draft):
                if self.job.events.empty():  # a slow reader gets the latest draft only
                    yield Update("draft", self.text.draft(ev.canvas), ev.block, ev.step, ev)
            elif isinstance(ev, Block):
                if self.first_block_at is None:
                    self.first_block_at = time.perf_counter()
                self.logprobs += ev.logprobs or []
                delta = self.text.add(ev.tokens, last=ev.done)
                if self.text.stopped:
                    self.finish_reason = "stop"
                    self.engine_thread.cancel(self.job)
                yield Update("block", delta, ev.block)

    def cancel(self) -> None:
        self.engine_thread.cancel(self.job)

    def stop(self) -> None:
        """End the request as a stop ("stop"), as a stop string does: the caller has the whole
        answer (a tool call, when parallel calls are off). Nothing more is yielded; the updates
        end with the engine's `Finished`, a step later."""
        if self.finish_reason is None:
            self.finish_reason = "stop"
        self.engine_thread.cancel(self.job)

"""One scheduler's decisions on every rank: rank 0 says what enters the engine, the others replay it.

Every rank runs the same engine (scheduler, block manager, runner over its shard of the model
and of the KV pool). Rank 0 owns the outside world (the server, a chat's input) and publishes,
before each step, what entered and left since the last one: requests added (in order, so each
rank's scheduler gives them the same ids) and cancels (clients that left, deadlines passed). The
other ranks apply the same operations and run the same step. Their schedulers then make the same
decisions: every decision depends only on those operations and on step results, which the sharded
model makes identical on every rank (argmax, entropy and sampled tokens come out of the ranks'
reductions, the same on each). This is why no step plan is broadcast: a plan names requests whose
state (canvas, self-conditioning input, random stream, grammar state) every rank holds anyway.

Operations travel through the process group's key-value store (a TCP store), not a collective,
so an idle server's workers wait on the store, not inside a collective, and wake when rank 0
publishes a step. The step's collectives then pair up on every rank. A rank that dies breaks the
next collective (gloo: a closed connection; NCCL: the group's timeout) and the launcher
(parallel/launch.py) ends the whole group with a message.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..engine.constraints.grammar import CanvasGrammar, Grammar
from ..engine.engine import Engine, Request
from .group import ShardGroup

STOP = "stop"
PREFIX = "dgemma/lockstep/"


@dataclass
class Admission:
    """A request as rank 0 added it, in a form every rank can rebuild (a grammar's state is
    rebuilt from its source on each rank: llguidance's matcher does not pickle)."""

    prompt: list[int]
    config: Any
    seed: int
    drafts: bool
    images: list
    top_logprobs: int | None
    constraints: Any = None
    grammar: tuple[str, str] | None = None  # (kind, llguidance source) of a CanvasGrammar

    @classmethod
    def of(cls, r: Request) -> Admission:
        grammar, constraints = None, r.constraints
        if isinstance(constraints, CanvasGrammar):
            grammar, constraints = (constraints.grammar.kind, constraints.grammar.source), None
        return cls(list(r.prompt), r.config, r.seed, r.drafts, list(r.images), r.top_logprobs, constraints, grammar)

    def request(self, model) -> Request:
        constraints = self.constraints
        if self.grammar is not None:
            constraints = model.grammars.canvas(Grammar(*self.grammar), model.config.canvas_length)
        return Request(
            self.prompt,
            self.config,
            self.seed,
            drafts=self.drafts,
            images=self.images,
            constraints=constraints,
            top_logprobs=self.top_logprobs,
        )


@dataclass
class Operations:
    """What entered and left the engine since the last step, in order: ("add", Admission) and
    ("cancel", request id)."""

    ops: list[tuple[str, Any]] = field(default_factory=list)


def _store(channel: str = ""):
    """The process group's key-value store, under dgemma's prefix (and a channel's: one per
    engine of ranks a process leads, parallel/leader.py)."""
    return dist.PrefixStore(PREFIX + channel, dist.distributed_c10d._get_default_store())


def _wait(store, key: str, poll_s: float) -> bytes:
    """`key`'s value once rank 0 has set it, waiting on the store (not in a collective)."""
    while True:
        try:
            store.wait([key], timedelta(seconds=poll_s))
            return store.get(key)
        except RuntimeError as e:  # a wait that timed out: poll again; anything else (rank 0 gone) ends the wait
            if "timeout" not in str(e).lower():
                raise


class LeaderEngine:
    """Rank 0's engine: an `Engine` whose adds and cancels are published to the other ranks
    before the step they take effect in. The server's engine thread uses it as an Engine."""

    leads_ranks = True  # the server's engine thread cannot replace it after a failure (the ranks would disagree)

    def __init__(self, engine: Engine, group: ShardGroup, channel: str = ""):
        self.engine, self.group = engine, group
        self._pending = Operations()
        self._sequence = 0
        self._store = _store(channel)

    def __getattr__(self, name: str):  # scheduler, runner, stats, options, kv_usage, has_work ...
        return getattr(self.engine, name)

    def add(self, request: Request) -> int:
        admission = Admission.of(request)  # before the engine starts its state
        request_id = self.engine.add(request)
        self._pending.ops.append(("add", admission))
        return request_id

    def cancel(self, request_id: int) -> None:
        self.engine.cancel(request_id)
        self._pending.ops.append(("cancel", request_id))

    def step(self) -> list:
        self._publish(self._pending)
        self._pending = Operations()
        return self.engine.step()

    def stop(self) -> None:
        """Tell the other ranks to leave their loops."""
        self._publish(STOP)

    def _publish(self, what) -> None:
        self._sequence += 1
        self._store.set(f"step/{self._sequence}", pickle.dumps(what))
        if self._sequence > 2:  # every rank read it before it finished the step after it
            self._store.delete_key(f"step/{self._sequence - 2}")


def follow(engine: Engine, model, poll_s: float = 30.0, channel: str = "") -> None:
    """A worker rank's loop: wait for rank 0's next step (on the store, not in a collective),
    apply its operations to this rank's engine, run the step; until rank 0 says stop. Events are
    rank 0's to deliver: here they are dropped."""
    store, sequence = _store(channel), 0
    while True:
        sequence += 1
        what = pickle.loads(_wait(store, f"step/{sequence}", poll_s))
        if what == STOP:
            return
        for op, arg in what.ops:
            if op == "add":
                engine.add(arg.request(model))
            else:
                engine.cancel(arg)
        engine.step()


ENGINES = "engines/"  # the channel where rank 0 of ranks it leads announces each engine it makes


def announce_engine(number: int, options: Any) -> str:
    """Rank 0 of ranks it leads (parallel/leader.py): engine `number` is made now on every rank,
    with these EngineOptions (its collectives pair up with the others'), or STOP: the ranks end.
    Returns the channel of that engine's steps."""
    _store(ENGINES).set(str(number), pickle.dumps(options))
    return f"{number}/"


def follow_engines(model, poll_s: float = 30.0) -> None:
    """A rank that rank 0 leads: make each engine rank 0 announces and follow its steps, until
    rank 0 says stop (`announce_engine`)."""
    store, number = _store(ENGINES), 0
    while True:
        number += 1
        options = pickle.loads(_wait(store, str(number), poll_s))
        if options == STOP:
            return
        follow(Engine(model.engine_net, options), model, poll_s, channel=f"{number}/")

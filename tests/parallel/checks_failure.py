"""A rank that hangs: a collective on a group with a short timeout raises on the rank that waits,
within the timeout, instead of hanging (the engine's collectives run on the group
`from_environment` makes, with DGEMMA_COLLECTIVE_TIMEOUT; the server then exits: engine_thread.py)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dgemma.parallel.group import ShardGroup


def check_a_rank_that_hangs_makes_the_collective_raise(group: ShardGroup) -> None:
    short = ShardGroup(group.rank, group.size, dist.new_group(backend="gloo", timeout=timedelta(seconds=2)))
    if group.rank == 1:
        time.sleep(3.0)  # "hangs" past the timeout
        return
    start = time.monotonic()
    try:
        short.all_reduce(torch.ones(1))
    except RuntimeError as e:
        assert time.monotonic() - start < 2.9, time.monotonic() - start
        assert "timed out" in str(e).lower() or "timeout" in str(e).lower(), e
    else:
        raise AssertionError("the all-reduce did not wait for the hung rank")

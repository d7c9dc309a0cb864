"""The ranks one model is split across, and the few collectives the sharded model issues.

`ShardGroup` wraps a torch.distributed process group (gloo on CPUs, NCCL on GPUs): a tensor-
parallel model calls only `all_reduce`, `all_gather` and `broadcast`, always from the engine
thread, in the same order on every rank. `ShardGroup.single()` is one process: every collective
is the identity, so the unsharded model and a one-rank group run the same code.

`from_environment` joins the group `torchrun` (or dgemma's own launcher) describes with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a collective that waits longer than `timeout_s` raises
instead of hanging (a rank that died or hangs ends the group).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ShardGroup:
    rank: int
    size: int
    group: object | None = None  # the torch.distributed ProcessGroup; None: one process

    @classmethod
    def single(cls) -> ShardGroup:
        return cls(rank=0, size=1)

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`t` reduced over the ranks, in place (and returned). op: "sum" or "max"."""
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (same shape on each), stacked: [size, *t.shape], in rank order."""
        if self.size == 1:
            return t[None]
        out = t.new_empty(self.size, *t.shape)
        dist.all_gather_into_tensor(
            out, t.contiguous(), group=self.group
        ) if t.device.type == "cuda" else dist.all_gather(list(out.unbind(0)), t.contiguous(), group=self.group)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `t` on every rank, in place (and returned)."""
        if self.size > 1:
            dist.broadcast(t, src=src, group=self.group)
        return t

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Rank `src`'s picklable `obj` on every rank (step plans, requests; not for tensors on the hot path)."""
        if self.size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


TIMEOUT_ENV = "DGEMMA_COLLECTIVE_TIMEOUT"  # seconds a collective may wait for a rank (default 120)


def from_environment(device: torch.device | str = "cpu", timeout_s: float | None = None) -> ShardGroup:
    """Join the process group torchrun (or dgemma's launcher) describes in the environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT); one process when WORLD_SIZE is unset or 1. gloo on a
    CPU, NCCL on a GPU; a collective that waits longer than `timeout_s` (default: the
    DGEMMA_COLLECTIVE_TIMEOUT variable, else 120 s) for a rank that hangs raises."""
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, "120"))
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return ShardGroup.single()
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={size} but {', '.join(missing)} not set: start the ranks with torchrun or dgemma's launcher"
        )
    if not dist.is_initialized():
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return ShardGroup(rank=dist.get_rank(), size=dist.get_world_size(), group=dist.group.WORLD)


def join_ranks(size: int, device: torch.device) -> tuple[ShardGroup, torch.device]:
    """This process's place in a group of `size` ranks (`dgemma.load(tensor_parallel_size=size)`),
    and its device: cuda:LOCAL_RANK for a rank on a GPU. A process that was not started as one of
    `size` ranks is told how to start it."""
    found = int(os.environ.get("WORLD_SIZE", "1"))
    if found != size:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} processes started together (torchrun --nproc-per-node {size}, "
            f"or dgemma's --tensor-parallel-size flag); this one is one of {found}"
        )
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return from_environment(device), device

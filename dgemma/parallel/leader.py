"""`dgemma.load(..., tensor_parallel_size=N)` in a plain Python process (a script, a notebook): the
process becomes rank 0 and starts ranks 1..N-1 itself, as `dgemma --tensor-parallel-size N` does
(launch.py) and vLLM's `LLM(model, tensor_parallel_size=N)` does.

Each other rank is a fresh interpreter (never a fork: the caller's threads and CUDA state stay
its own) with torchrun's environment, that loads the same checkpoint (its share of each tensor)
and then replays rank 0's engine (lockstep.py): the caller's generate / stream calls run on
rank 0, which publishes what enters and leaves its engine; each engine rank 0 makes is announced
first, so that the ranks make theirs together. `LedRanks.close` (`Model.close`, and at the
process's exit) ends the ranks; a rank also ends when rank 0's process dies (its store goes, and
on Linux the kernel's parent-death signal). Several hosts: torchrun, with the same calls on every
rank (docs/parallel.md).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .group import TIMEOUT_ENV, ShardGroup
from .launch import free_port, rank_environment, wait_or_kill
from .lockstep import STOP, LeaderEngine, announce_engine

LEADER_VARIABLE = "DGEMMA_LED_BY"  # in a led rank's environment: rank 0's process id
RANK_CODE = (
    "import sys, dgemma; from dgemma.parallel.leader import rank_main; sys.exit(rank_main(dgemma.load, sys.argv[1]))"
)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding `dgemma` (the ranks import it)
CLOSE_GRACE_S = 30.0  # how long the ranks have to leave before they are killed


class LedRanks:
    """Ranks 1..N-1 that this process (rank 0) started, and the group they share with it."""

    def __init__(
        self,
        size: int,
        processes: list[subprocess.Popen],
        logs: list,
        group: ShardGroup,
        device: torch.device,
        threads: int,
    ):
        self.size, self.processes, self.logs, self.group, self.device = size, processes, logs, group, device
        self._threads = threads  # the caller's torch threads, given back at close
        self._engines = 0
        self._leader: LeaderEngine | None = None
        self._closed = False

    @classmethod
    def start(cls, size: int, load_args: dict, device: torch.device) -> LedRanks:
        """Start ranks 1..size-1, each running `dgemma.load(**load_args)` as a rank of `size`, and
        join their group as rank 0 (gloo on a CPU, NCCL on a GPU: rank r on cuda:r)."""
        port = free_port()
        base = {
            **os.environ,
            LEADER_VARIABLE: str(os.getpid()),
            "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        }
        # the kernel's parent-death signal follows the thread that started a process: asked for only
        # when that is the main thread (one that ends early would take the ranks with it)
        spec = json.dumps(
            {"load": load_args, "parent_death_signal": threading.current_thread() is threading.main_thread()}
        )
        processes, logs = [], []
        for rank in range(1, size):
            log = tempfile.TemporaryFile()
            logs.append(log)
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", RANK_CODE, spec],
                    env=rank_environment(rank, size, port, base),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            )
        threads = torch.get_num_threads()
        torch.set_num_threads(int(rank_environment(0, size, port)["OMP_NUM_THREADS"]))  # each rank's share of the cores
        if device.type == "cuda":
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        try:
            timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "120")))
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=size,
                timeout=timeout,
            )
        except Exception as e:
            wait_or_kill(processes, 0.0)
            torch.set_num_threads(threads)
            raise RuntimeError(
                f"tensor_parallel_size={size}: the ranks this process started did not join it ({e})"
                f"{_tails(processes, logs)}"
            ) from None
        ranks = cls(size, processes, logs, ShardGroup(rank=0, size=size, group=dist.group.WORLD), device, threads)
        atexit.register(ranks.close)
        return ranks

    def engine(self, net, options) -> LeaderEngine:
        """A new engine over `net` on every rank (the last one's followers leave it first)."""
        from ..engine.engine import Engine

        if self._closed:
            raise RuntimeError("the model's ranks have been closed (Model.close): load it again")
        if self._leader is not None:
            self._leader.stop()
        self._engines += 1
        channel = announce_engine(self._engines, options)
        self._leader = LeaderEngine(Engine(net, options), self.group, channel)
        return self._leader

    def close(self) -> None:
        """End the ranks: tell them to stop, wait CLOSE_GRACE_S at most, then kill what is left;
        leave the group and give back the caller's threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            if self._leader is not None:
                self._leader.stop()
            announce_engine(self._engines + 1, STOP)
        except Exception:  # noqa: BLE001 - a group already broken (a rank died): the ranks are ended below
            pass
        wait_or_kill(self.processes, CLOSE_GRACE_S)
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads)
        for log in self.logs:
            log.close()


def _tails(processes: list[subprocess.Popen], logs: list) -> str:
    """The last lines of what the ranks that failed wrote."""
    out = []
    for rank, (p, log) in enumerate(zip(processes, logs), start=1):
        log.seek(0)
        lines = log.read().decode(errors="replace").strip().splitlines()[-8:]
        if lines and p.returncode not in (None, 0):
            out += [f"[rank {rank}] {line}" for line in lines]
    return "".join("\n" + line for line in out)


def _end_with_leader(leader: int) -> None:
    """This rank ends when its rank 0's process does, however it ends (Linux: the kernel sends
    SIGTERM when the parent dies; elsewhere rank 0's store going away ends the rank,
    lockstep._wait); started after rank 0 died: at once."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != leader:
        os._exit(1)


def rank_main(load: Callable, spec: str) -> int:
    """A rank that rank 0 started: `load` (dgemma.load) the checkpoint as rank RANK of WORLD_SIZE,
    follow rank 0's engines until it says stop."""
    from .lockstep import follow_engines

    fields = json.loads(spec)
    if fields["parent_death_signal"]:
        _end_with_leader(int(os.environ[LEADER_VARIABLE]))
    model = load(**fields["load"])
    follow_engines(model)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown (tests/train/fsdp_worker.py says why)

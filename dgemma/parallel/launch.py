"""`dgemma <command> --tensor-parallel-size N`: start N ranks of the same command on this host.

Each rank is `python -m dgemma <the same arguments>` with torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), as vLLM's multiprocessing
executor starts its workers: a fresh interpreter per rank, never a fork or spawn that would
re-import the user's `__main__`. Rank 0 talks to the user (its stdin, stdout, stderr); the others
are silent unless they fail first. Several hosts: start the ranks with `torchrun` instead
(docs/parallel.md), which sets the same environment.

The launcher watches its ranks: when one ends with an error or a signal, the others are stopped
and the launcher exits with that rank's status and a line saying which rank ended and how, so a
rank that dies never leaves the rest waiting. Ctrl-C / SIGTERM reach every rank.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, size: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """torchrun's variables for rank `rank` of `size` on this host; each rank gets an equal share
    of the CPU's threads unless OMP_NUM_THREADS says otherwise."""
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // size)))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # not c10d's warning for every idle wait on the store
    return env


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def wait_or_kill(processes: list[subprocess.Popen], grace_s: float) -> None:
    """Wait `grace_s` (in all) for the processes to end, then kill the rest."""
    deadline = time.monotonic() + grace_s
    for p in processes:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(argv: list[str], size: int, poll_s: float = 0.2) -> int:
    """Run `python -m dgemma *argv` as `size` ranks; returns rank 0's exit status, or the status of
    the first rank that failed (after stopping the others)."""
    port = free_port()
    logs = [None] + [tempfile.TemporaryFile() for _ in range(1, size)]
    ranks = []
    for rank in range(size):
        quiet = rank > 0
        ranks.append(
            subprocess.Popen(
                [sys.executable, "-m", "dgemma", *argv],
                env=rank_environment(rank, size, port),
                stdin=subprocess.DEVNULL if quiet else None,
                stdout=subprocess.DEVNULL if quiet else None,
                stderr=logs[rank] if quiet else None,
            )
        )

    def stop_all(sig: int = signal.SIGTERM, grace_s: float = 5.0) -> None:
        for p in ranks:
            if p.poll() is None:
                p.send_signal(sig)
        wait_or_kill(ranks, grace_s)

    def forward(signum, frame) -> None:
        for p in ranks:
            if p.poll() is None:
                p.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            for rank, p in enumerate(ranks):
                code = p.poll()
                if code is None or (code == 0 and rank > 0):
                    continue
                if code == 0:  # rank 0 finished its work: the others have nothing left to do
                    stop_all(grace_s=10.0)
                    return 0
                if rank > 0:  # a failure every rank meets (a bad flag, a size that cannot split): rank 0 says it
                    try:
                        if ranks[0].wait(2.0) != 0:
                            stop_all()
                            return ranks[0].returncode if ranks[0].returncode > 0 else 128 - ranks[0].returncode
                    except subprocess.TimeoutExpired:
                        pass
                others = [r for r, q in enumerate(ranks) if r != rank and q.poll() is None]
                stop_all()
                if rank > 0:
                    logs[rank].seek(0)
                    tail = logs[rank].read().decode(errors="replace").strip().splitlines()[-12:]
                    if tail:
                        sys.stderr.write("\n".join(f"[rank {rank}] {line}" for line in tail) + "\n")
                if others or rank > 0:
                    sys.stderr.write(
                        f"dgemma: error: rank {rank} of {size} ended with {describe(code)}; stopped the other ranks\n"
                    )
                return code if code > 0 else 128 - code
            time.sleep(poll_s)
    except KeyboardInterrupt:
        stop_all(signal.SIGINT)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        for f in logs[1:]:
            f.close()

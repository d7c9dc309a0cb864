"""Tensor and expert parallelism on two gloo ranks (OMP_NUM_THREADS=1 each): one torchrun group
runs every check of tests/parallel/checks_*.py (worker.py), and each check is one test here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from checks import all_checks  # noqa: E402

NAMES = [name for name, _ in all_checks()]
pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel") / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "worker.py"), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks(group_results, name):
    assert name in group_results, f"{name} did not run"
    assert group_results[name] == "ok", group_results[name]


def test_load_outside_a_group_says_how_to_start_one():
    import dgemma

    with pytest.raises(ValueError) as e:
        dgemma.load(tensor_parallel_size=2)
    assert str(e.value).startswith("tensor_parallel_size=2 needs 2 processes started together (torchrun --nproc-per-node 2")


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of rank `rank` among the launcher's children (its RANK variable)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    raise LookupError(f"no rank {rank} among {children}")


def test_serve_tensor_parallel_answers_like_one_process_and_ends_when_a_rank_dies():
    """`dgemma serve --tensor-parallel-size 2`: the official openai client gets the answers one
    process gives (plain and streamed, same seeds); killing the worker rank ends the server
    with a line naming it, within seconds."""
    from hostile.serve_process import ServeProcess
    from servers import openai_client

    def answers(url: str) -> tuple[str, str]:
        client = openai_client(url)
        plain = client.completions.create(model="dgemma-tiny", prompt="def add(a, b):", max_tokens=24, seed=1)
        stream = client.chat.completions.create(model="dgemma-tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=24, seed=2, stream=True)  # fmt: skip
        return plain.choices[0].text, "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ServeProcess([]) as one:
        want = answers(one.url)
    with ServeProcess(["--tensor-parallel-size", "2"]) as two:
        assert answers(two.url) == want and all(want)
        import os
        import signal
        import time

        os.kill(_rank_pid(two.proc.pid, 1), signal.SIGKILL)
        start = time.monotonic()
        two.proc.wait(30)
        assert time.monotonic() - start < 15 and two.proc.returncode != 0
        assert "rank 1 of 2 ended with signal SIGKILL; stopped the other ranks" in two.output


def test_serve_tensor_parallel_ends_when_a_rank_hangs():
    """A worker rank that stops responding (SIGSTOP) makes the next step's collective time out
    (DGEMMA_COLLECTIVE_TIMEOUT), and the server exits with a message instead of hanging."""
    import os
    import signal
    import time

    import httpx
    from hostile.serve_process import ServeProcess

    with ServeProcess(["--tensor-parallel-size", "2"], env={"DGEMMA_COLLECTIVE_TIMEOUT": "4"}) as two:
        worker = _rank_pid(two.proc.pid, 1)
        os.kill(worker, signal.SIGSTOP)
        try:
            start = time.monotonic()
            try:
                httpx.post(two.url + "/v1/completions", json={"model": "dgemma-tiny", "prompt": "hi", "max_tokens": 8},
                           timeout=60)  # fmt: skip
            except httpx.HTTPError:
                pass  # the server went away mid-answer
            two.proc.wait(60)
            assert time.monotonic() - start < 40 and two.proc.returncode != 0
            assert "a step across the tensor-parallel ranks failed" in two.output, two.output[-2000:]
        finally:
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass

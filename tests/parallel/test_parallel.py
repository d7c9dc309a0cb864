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
    import os
    import signal
    import time

    import torch

    import dgemma
    from serve_process import ServeProcess
    from servers import openai_client

    # float32 on both sides: in bf16 the two ranks' partial sums round differently from one
    # process's on some CPUs (an AMX Xeon), enough to flip a token (the worker's checks measure
    # their decisions' margins; this end-to-end check compares text)
    one = dgemma.load(dtype="float32")
    torch.set_num_threads(1)  # as the server's --threads 1
    prompts = {1: "def add(a, b):", 2: "import os\n\n"}
    want = {seed: one.tokenizer.decode(one.generate([one.tokenizer.encode(p)], max_new_tokens=24, seed=seed).sequences[0])
            for seed, p in prompts.items()}  # fmt: skip
    with ServeProcess(["--tensor-parallel-size", "2", "--dtype", "float32"]) as two:
        client = openai_client(two.url)
        plain = client.completions.create(model="dgemma-tiny", prompt=prompts[1], max_tokens=24, seed=1)
        stream = client.completions.create(model="dgemma-tiny", prompt=prompts[2], max_tokens=24, seed=2, stream=True)
        assert plain.choices[0].text == want[1] and "".join(c.choices[0].text for c in stream) == want[2]

        os.kill(_rank_pid(two.proc.pid, 1), signal.SIGKILL)
        start = time.monotonic()
        two.proc.wait(30)
        assert time.monotonic() - start < 15 and two.proc.returncode != 0
        assert "rank 1 of 2 ended with signal SIGKILL; stopped the other ranks" in two.output


def test_sizes_the_host_cannot_run_are_refused_before_any_rank_starts(capsys):
    """A bad --tensor-parallel-size is one line and starts nothing: below 1, more ranks than this
    host's CPU cores (or GPUs), --expert-parallel alone."""
    import os

    from dgemma.cli import main

    for flags, said in ((["-tp", "0"], "--tensor-parallel-size must be at least 1, got 0"),
                        (["-tp", "100000"], f"--tensor-parallel-size 100000: this host has {os.cpu_count()} CPU cores"),
                        (["--expert-parallel"], "--expert-parallel needs --tensor-parallel-size 2 or more")):  # fmt: skip
        assert main(["run", "hello", *flags]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err

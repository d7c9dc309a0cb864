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

from processes import processes_with  # noqa: E402

NAMES = [name for name, _ in all_checks()]
pytestmark = [pytest.mark.slow, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel") / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(HERE / "worker.py"),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks(group_results, name):
    assert name in group_results, f"{name} did not run"
    assert group_results[name] == "ok", group_results[name]


# a plain Python process (python -c, as a script or a notebook): dgemma.load starts rank 1 itself
LED = """
import json, sys
from pathlib import Path
import dgemma, torch
one = dgemma.load(dtype="float32")  # float32: bf16 partial sums round differently from one process's (test below)
torch.set_num_threads(1)
prompts = [one.tokenizer.encode(p) for p in ("def add(a, b):", "import os\\n\\n")]
want = one.generate(prompts, max_new_tokens=24, seed=[1, 2]).sequences
two = dgemma.load(dtype="float32", tensor_parallel_size=2)
ranks = [p.pid for p in two.ranks.processes]
report = {"ranks": ranks, "equal": two.generate(prompts, max_new_tokens=24, seed=[1, 2]).sequences == want}
two.configure_engine(max_active=1)  # a new engine, on both ranks
report["streamed"] = [t for ev in two.stream(prompts[0], max_new_tokens=24, seed=1) for t in ev.tokens] == want[0]
try:
    two.generate(prompts[:1], max_new_tokens=8, seed=1, sampling="reference")
except ValueError as e:
    report["reference"] = str(e)
if sys.argv[1] == "close":
    two.close()
    report["left"] = [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
print(json.dumps(report))
"""


@pytest.mark.parametrize("ending", ["close", "exit"])
def test_load_in_a_plain_process_starts_and_ends_its_ranks(ending):
    """`dgemma.load(..., tensor_parallel_size=2)` outside torchrun: this process is rank 0 and
    starts rank 1 (gloo); the tokens are one process's (whole and streamed, across a second
    engine); work outside the engine is refused in one line; the rank ends at `close()`, or when
    the process exits without it: no process is left behind."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LED, ending],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert len(report["ranks"]) == 1 and report["equal"] and report["streamed"]
    assert report["reference"].startswith("sampling='reference' runs the network outside the engine")
    if ending == "close":
        assert report["left"] == []
    assert processes_with("DGEMMA_LED_BY", str(proc.pid)) == []


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
    want = {
        seed: one.tokenizer.decode(one.generate([one.tokenizer.encode(p)], max_new_tokens=24, seed=seed).sequences[0])
        for seed, p in prompts.items()
    }
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

    for flags, said in (
        (["-tp", "0"], "--tensor-parallel-size must be at least 1, got 0"),
        (["-tp", "100000"], f"--tensor-parallel-size 100000: this host has {os.cpu_count()} CPU cores"),
        (["--expert-parallel"], "--expert-parallel needs --tensor-parallel-size 2 or more"),
    ):
        assert main(["run", "hello", *flags]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err

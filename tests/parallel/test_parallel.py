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

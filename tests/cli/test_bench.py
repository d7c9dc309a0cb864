"""`dgemma bench`: a quick check that says what it will do, shows progress and ends within a minute."""

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.subprocess
def test_bench_quick_prints_its_plan_first_and_finishes_within_a_minute():
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "dgemma.cli", "bench", "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=180, check=False)  # fmt: skip
    took = time.monotonic() - start
    assert run.returncode == 0, run.stderr[-3000:]
    err, out = run.stderr, run.stdout
    assert err.index("dgemma bench --quick: --size tiny") < err.index("building random weights") < err.index("warm-up: dgemma")
    assert "4 fixed steps" in err and "estimate ~" in err and "round 1/1: dgemma" in err  # plan, estimate, progress
    assert "dgemma-ar" in out and "ms_per_step" in out and "tokens [" not in out  # the table alone on stdout
    assert took < 60, f"bench --quick took {took:.0f} s"


def test_bench_flags_say_their_defaults_and_explicit_flags_beat_the_preset():
    from dgemma.cli.bench import add_cli, resolve_settings

    parser = argparse.ArgumentParser()
    add_cli(subparsers := parser.add_subparsers())
    for action in subparsers.choices["bench"]._actions:
        if action.dest != "help":
            assert action.help and "default" in action.help, action.option_strings
    args = parser.parse_args(["bench", "--size", "mid"])
    resolve_settings(args, 256)  # canvas 256: the commands in docs/performance.md keep 512 + 768 tokens
    assert (args.prompt_len, args.new_tokens, args.steps, args.runs) == (512, 768, 16, 3)
    assert args.peers == ["default", "ar", "reference"]
    args = parser.parse_args(["bench", "--quick", "--steps", "8", "--peers", "default"])
    resolve_settings(args, 32)
    assert (args.prompt_len, args.new_tokens, args.steps, args.runs, args.peers) == (32, 64, 8, 1, ["default"])

"""Compiling Triton kernels for sm90 without a GPU (to a cubin with triton's bundled ptxas), in a
subprocess without TRITON_INTERPRET: the check that a kernel the interpreter accepts also builds
for a Hopper GPU. The script prints "compiled" and exits 0, or exits 3 with a reason to skip."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def compile_for_sm90(script: str, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]

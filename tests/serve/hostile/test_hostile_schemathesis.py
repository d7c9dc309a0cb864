"""schemathesis over the server's own /openapi.json (a subprocess server, small budgets so that
generated requests that pass validation finish quickly): no 5xx from any generated request,
bounded in examples and time, and the server healthy afterwards."""

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from serve_process import ServeProcess

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]  # `dgemma serve` and `st` in subprocesses, ~50 s

KEY = "fuzz-key"


def test_no_server_errors_from_generated_requests(tmp_path):
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        pytest.skip("schemathesis is not installed (it is in the test extras: pip install -e '.[test]')")
    flags = [
        "--served-model-name",
        "dgemma-tiny",
        "--max-context",
        "256",
        "--max-denoising-steps",
        "4",
        "--request-timeout",
        "10",
        "--api-key",
        KEY,
        "--max-active",
        "4",
        "--max-queue",
        "16",
    ]
    with ServeProcess(flags) as server:
        start = server.rss()
        run = subprocess.run(
            [
                st,
                "run",
                server.url + "/openapi.json",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "8",
                "--max-time",
                "45",
                "--seed",
                "1",
                "--generation-database",
                "none",
                "--workers",
                "2",
                "--no-color",
                "--request-timeout",
                "30",
                "-H",
                f"Authorization: Bearer {KEY}",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert " passed" in run.stdout and "failed" not in run.stdout.split("Test cases:")[-1]
        assert server.alive and server.healthy()
        answer = httpx.post(
            server.url + "/v1/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": "dgemma-tiny", "prompt": "x = ", "max_tokens": 4},
            timeout=60,
        )
        assert answer.status_code == 200
        assert server.peak_rss() < start + 300 * 2**20
        assert "Traceback" not in server.output, server.output[-3000:]

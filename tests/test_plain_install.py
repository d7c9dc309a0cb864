"""A plain install (`pip install -e .`, the README's quickstart) has none of the test extras:
PyTorch's CPU wheel brings no triton, and transformers, pytest, openai... are not there. Every
module under dgemma/ must import there, and the quickstart's command and `dgemma serve`'s first
request must run on the torch path (issue 52: `dgemma run` crashed importing a name that
triton_step defined only when triton was installed).

Each check runs in a subprocess with those packages hidden (`sys.modules[name] = None`: their
import raises ImportError, as where they are not installed). `.ci/run` also runs the quickstart
verbatim in a virtualenv without extras (.ci/quickstart); these tests catch the same mistakes
inside the suite, in seconds.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import tomllib

from serve_process import ServeProcess, cli_command, wait_until

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
ENV.pop("TRITON_INTERPRET", None)  # a user's environment: conftest.py sets it for the interpreter tests


def _distribution(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def extras_only_modules() -> tuple[str, ...]:
    """The top-level modules of the test extras that a plain install lacks (pyproject.toml's
    `test` extra less the runtime dependencies), triton always among them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_distribution(r) for r in project["dependencies"]}
    extras = {_distribution(r) for r in project["optional-dependencies"]["test"]} - runtime
    modules = {"triton"}
    for module, dists in importlib.metadata.packages_distributions().items():
        if any(d.lower().replace("_", "-") in extras for d in dists) and module.isidentifier():
            modules.add(module)
    return tuple(sorted(modules))


HIDDEN = extras_only_modules()


def test_the_hidden_set_is_the_test_extras():
    """The list the checks below hide is read from pyproject.toml: it must name the extras a plain
    install lacks (a mistake in reading it would hide nothing and prove nothing)."""
    for name in ("triton", "transformers", "pytest", "openai", "compressed_tensors", "xdist"):
        assert name in HIDDEN, HIDDEN
    for name in ("torch", "fastapi", "httpx", "safetensors", "dgemma"):
        assert name not in HIDDEN, HIDDEN


def _run_hidden(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    prelude = f"import sys; sys.modules.update(dict.fromkeys({list(HIDDEN)!r}))\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT
    )


@pytest.mark.subprocess
def test_every_module_imports_without_the_test_extras():
    done = _run_hidden(
        "import importlib, pkgutil, dgemma\n"
        "bad = []\n"
        "for m in pkgutil.walk_packages(dgemma.__path__, 'dgemma.'):\n"
        "    if m.name.rsplit('.', 1)[-1] == '__main__':\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{m.name}: {type(e).__name__}: {e}')\n"
        "print('imported', len(list(pkgutil.walk_packages(dgemma.__path__, 'dgemma.'))))\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert int(done.stdout.split()[1]) > 100  # the walk found the package's modules


@pytest.mark.subprocess
def test_the_quickstart_runs_without_the_test_extras():
    """The README's first command, as a plain install runs it: the shipped model, the torch path."""
    done = subprocess.run(
        [*cli_command(HIDDEN), "run", "def fibonacci(n):"], capture_output=True, text=True, timeout=300, env=ENV
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "Traceback" not in done.stderr
    assert re.search(r"dgemma: \d+ tokens in", done.stderr), done.stderr


@pytest.mark.subprocess
def test_serve_answers_its_first_request_without_the_test_extras():
    with ServeProcess(["--max-active", "2"], hidden=HIDDEN) as server:
        name = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        reply = httpx.post(
            server.url + "/v1/completions",
            json={"model": name, "prompt": "def fibonacci(n):", "max_tokens": 16, "seed": 1},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"]
        assert server.alive and "Traceback" not in server.output
        tokens = reply.json()["usage"]["completion_tokens"]
        # the server's line a request (serve/http/request_log.py), on by default
        assert wait_until(
            lambda: re.search(rf"127\.0\.0\.1 POST /v1/completions 200 {tokens} tokens [\d.]+ s", server.output)
        )

"""`dgemma serve` in a subprocess, for the hostile-input tests: a request that could crash the
process (a segfault in a native library, a stack overflow) takes this process down, not pytest.

`ServeProcess(args)` starts `dgemma serve --port 0 ARGS`, waits for its startup line, and keeps
reading its output (so the pipe never fills). `rss()` / `peak_rss()` read /proc of the server.
`hidden` names top-level packages the server runs without (tests/test_plain_install.py: a plain
install has no triton and no test extras).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

STARTED = re.compile(r"serving '.*' on (http://\S+?) ")


def cli_command(hidden: tuple[str, ...] = ()) -> list[str]:
    """`dgemma` as this interpreter runs it, with the packages in `hidden` made unimportable
    (sys.modules[name] = None: their import raises ImportError, as where they are not installed)."""
    hide = f"sys.modules.update(dict.fromkeys({list(hidden)!r})); " if hidden else ""
    return [sys.executable, "-c", f"import sys; {hide}from dgemma.cli import main; sys.exit(main())"]


class ServeProcess:
    """One `dgemma serve` subprocess on a free port of 127.0.0.1."""

    def __init__(
        self, args: list[str], env: dict | None = None, startup_timeout: float = 180.0, hidden: tuple[str, ...] = ()
    ):
        environ = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **(env or {})}
        if "--threads" not in args:  # beside `-n 2` test processes a second intra-op thread waits on a busy
            args = [
                *args,
                "--threads",
                "1",
            ]  # core at every op: the tiny model's passes ran 10-30x slower (conftest.py)
        self.proc = subprocess.Popen(
            [*cli_command(hidden), "serve", "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environ,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self._started = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._started.wait(startup_timeout) or self.url is None or not wait_until(self.healthy, 60):
            self.stop()
            raise RuntimeError("dgemma serve did not start:\n" + self.output)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = STARTED.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._started.set()
        self._started.set()  # the process ended

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _status(self, key: str) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    def rss(self) -> int:
        """Resident bytes now."""
        return self._status("VmRSS")

    def peak_rss(self) -> int:
        """The most resident bytes the process has had."""
        return self._status("VmHWM")

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_until(check, timeout: float = 30.0, every: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every)
    return False

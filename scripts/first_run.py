"""The newcomer's first run: `dgemma run "def fibonacci(n):"` (the README's command, the shipped
model) on empty caches (a fresh HOME and TORCH_EXTENSIONS_DIR), timed as a user sees it.

Reports the time to the first text of the completion on stdout, the longest silence (no byte on
stdout or stderr: from the start to the first line, between lines, from the last line to the
exit), the whole run, and when each stderr line came (the build lines among them). The aim
(issue 48): first text within 30 s on 2 cores, never silent for more than 20 s.

A background build of the native kernels outlives the run (so that the next run has them):
`--wait-build` waits for it and then times a second run on the built kernels; otherwise the
build is stopped. Either way nothing is left behind: processes that still carry this run's
TORCH_EXTENSIONS_DIR are ended before its temporary directory is removed.

    python scripts/first_run.py                      # one first run
    python scripts/first_run.py --wait-build         # ... then the build's end and a second run
    python scripts/first_run.py --threads 2 -- --max-new-tokens 64   # flags for `dgemma run` after --
"""

from __future__ import annotations

import argparse
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "def fibonacci(n):"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def timed_run(argv: list[str], env: dict[str, str], timeout: float) -> dict:
    """Run `argv`; every chunk of its stdout and stderr timestamped (seconds from the start)."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    selector = selectors.DefaultSelector()
    for stream, name in ((process.stdout, "stdout"), (process.stderr, "stderr")):
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ, name)
    events: list[tuple[float, str, bytes]] = []
    open_streams = 2
    while open_streams:
        if time.perf_counter() - started > timeout:
            process.kill()
            raise SystemExit(f"first_run: `{' '.join(argv)}` ran past {timeout:.0f} s")
        for key, _ in selector.select(timeout=1.0):
            chunk = key.fileobj.read1(65536) if hasattr(key.fileobj, "read1") else key.fileobj.read()
            if not chunk:
                selector.unregister(key.fileobj)
                open_streams -= 1
                continue
            events.append((time.perf_counter() - started, key.data, chunk))
    code = process.wait()
    ended = time.perf_counter() - started
    times = [0.0, *(t for t, _, _ in events), ended]
    first_text = next((t for t, name, chunk in events if name == "stdout" and chunk.strip()), None)
    lines: list[tuple[float, str]] = []
    pending = b""
    for t, name, chunk in events:
        if name == "stderr":
            pending += chunk
            *done, pending = pending.split(b"\n")
            lines += [(t, line.decode(errors="replace")) for line in done if line.strip()]
    return {
        "code": code,
        "first_text": first_text,
        "longest_silence": max(b - a for a, b in zip(times, times[1:])),
        "total": ended,
        "stderr_lines": lines,
        "stdout": b"".join(c for _, n, c in events if n == "stdout").decode(errors="replace"),
    }


def processes_with(variable: str, value: str) -> list[int]:
    """This user's processes whose environment sets `variable` to `value` (a run's builders)."""
    wanted = f"{variable}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def end_processes(pids: list[int]) -> None:
    """SIGTERM to each process's group (a builder leads its own: its compilers go with it)."""
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass


def report(title: str, result: dict, first_text_aim: float, silence_aim: float) -> bool:
    ok = result["code"] == 0 and result["first_text"] is not None and result["first_text"] <= first_text_aim
    ok = ok and result["longest_silence"] <= silence_aim
    first = "none" if result["first_text"] is None else f"{result['first_text']:.1f} s"
    print(
        f"{title}: first text {first} (aim {first_text_aim:.0f} s), longest silence {result['longest_silence']:.1f} s "
        f"(aim {silence_aim:.0f} s), whole run {result['total']:.1f} s, exit {result['code']}: {'PASS' if ok else 'FAIL'}"
    )
    for t, line in result["stderr_lines"]:
        print(f"  {t:6.1f} s  {line[:160]}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt", default=PROMPT, help=f"the prompt (default: {PROMPT!r}, the README's)")
    parser.add_argument(
        "--wait-build", action="store_true", help="wait for the background build, then time a second run"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take at most (default: 900)")
    parser.add_argument("--first-text-aim", type=float, default=30.0)
    parser.add_argument("--silence-aim", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=None, help="dgemma run --threads (default: dgemma's choice)")
    parser.add_argument("run_flags", nargs="*", help="more flags for `dgemma run` (after --)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="dgemma-first-run-"))
    extensions = root / "torch_extensions"
    env = {**os.environ, "HOME": str(root / "home"), "TORCH_EXTENSIONS_DIR": str(extensions)}
    for variable in ("XDG_CACHE_HOME", "HF_HOME", "DGEMMA_REBUILD_NATIVE", "DGEMMA_NATIVE", "DGEMMA_CPU_ISA"):
        env.pop(variable, None)
    (root / "home").mkdir()
    argv = [sys.executable, "-m", "dgemma", "run", args.prompt]
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    argv += args.run_flags
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}; caches empty: {root}")
    print(f"command: {' '.join(argv[2:])}")
    try:
        ok = report("first run", timed_run(argv, env, args.timeout), args.first_text_aim, args.silence_aim)
        if args.wait_build:
            waited = time.perf_counter()
            while processes_with("TORCH_EXTENSIONS_DIR", str(extensions)):
                time.sleep(0.5)
            print(f"the background build ended {time.perf_counter() - waited:.1f} s after the first run")
            report(
                "second run (built kernels)", timed_run(argv, env, args.timeout), args.first_text_aim, args.silence_aim
            )
    finally:
        end_processes(processes_with("TORCH_EXTENSIONS_DIR", str(extensions)))
        time.sleep(0.5)
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The native kernels' build cache (`native.build`): one build per sources and toolchain wherever
the checkout or venv lives, one line for every build, rebuild or wait, safe under concurrent
processes. A tiny C++ module of the tests' own goes through the same `build` (seconds, any CPU)."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import get_cxx_compiler

import dgemma
from dgemma.kernels import native

pytestmark = [
    pytest.mark.skipif(shutil.which(get_cxx_compiler()) is None, reason=f"no C++ compiler ({get_cxx_compiler()})"),
    pytest.mark.native,
]

NAME = "dgemma_tiny"
TINY_CPP = """#include <Python.h>
#include "tiny.h"

static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(ANSWER); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "dgemma_tiny", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_dgemma_tiny() { return PyModule_Create(&module_def); }
"""
# what a process reports: its dgemma, its torch, the module's answer and file
BUILD = f"""
import sys, dgemma, torch
from pathlib import Path
from dgemma.kernels import native
module = native.build({NAME!r}, [Path(dgemma.__file__).parent / "tiny" / "tiny.cpp"], ["-O1"], "tiny test kernels", "seconds")
print(dgemma.__file__, torch.__file__, module.answer(), module.__file__)
"""
LINES = ("building dgemma's", "rebuilding dgemma's", "waiting for another process's build")


def _checkout(root: Path, answer: int = 42) -> Path:
    """A copy of the dgemma package (without its model assets) with the tiny module's sources."""
    shutil.copytree(
        Path(dgemma.__file__).parent, root / "dgemma", ignore=shutil.ignore_patterns("assets", "__pycache__")
    )
    (root / "dgemma" / "tiny").mkdir()
    (root / "dgemma" / "tiny" / "tiny.cpp").write_text(TINY_CPP)
    (root / "dgemma" / "tiny" / "tiny.h").write_text(f"#define ANSWER {answer}\n")
    return root


def _other_venv(root: Path) -> Path:
    """A site directory whose torch is the same torch under another path (as another venv's is):
    torch's build files would name its include paths."""
    root.mkdir()
    (root / "torch").symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    return root


def _environment(**env: str) -> dict[str, str]:
    """This process's environment, less a rebuild asked for outside the tests, plus `env`."""
    return {**{k: v for k, v in os.environ.items() if k != native.REBUILD_VARIABLE}, **env}


def _start(checkout: Path, extensions: Path, site: Path | None = None, **env: str) -> subprocess.Popen:
    path = os.pathsep.join([*([str(site)] if site else []), str(checkout)])
    env = _environment(TORCH_EXTENSIONS_DIR=str(extensions), PYTHONPATH=path, **env)
    return subprocess.Popen(
        [sys.executable, "-c", BUILD], cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(process: subprocess.Popen) -> tuple[list[str], list[str]]:
    """(the process's report, its build/rebuild/wait lines)."""
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return out.split(), [line for line in err.splitlines() if line.startswith(LINES)]


def _run(checkout: Path, extensions: Path, site: Path | None = None, **env: str) -> tuple[list[str], list[str]]:
    return _finish(_start(checkout, extensions, site, **env))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """One checkout's tiny module, built: (the extensions directory, its build directory)."""
    root = tmp_path_factory.mktemp("built")
    extensions = root / "extensions"
    report, lines = _run(_checkout(root / "a"), extensions)
    assert report[0].startswith(str(root / "a")) and report[2] == "42"
    assert len(lines) == 1 and lines[0].startswith(
        "building dgemma's tiny test kernels (seconds; cached afterwards) in"
    )
    (directory,) = extensions.iterdir()
    assert report[3] == str(directory / "build" / f"{NAME}.so")  # the building process imports torch's output
    return extensions, directory


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_second_checkout_and_venv_load_the_build_silently(built, tmp_path):
    """Another checkout of the same sources, importing the same torch from another path, builds
    nothing: it imports the finished library (torch's build files name no path of a checkout)."""
    extensions, directory = built
    site = _other_venv(tmp_path / "venv")
    report, lines = _run(_checkout(tmp_path / "b"), extensions, site)
    assert report[0].startswith(str(tmp_path / "b")) and report[1].startswith(str(site))
    assert lines == [] and report[2:] == ["42", str(directory / f"{NAME}.so")]
    assert [p.name for p in extensions.iterdir()] == [directory.name]
    ninja = (directory / "build" / "build.ninja").read_text()
    assert str(directory / "src" / "tiny.cpp") in ninja and "dgemma/tiny" not in ninja  # the copies, not a checkout's


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_forced_or_corrupt_rebuild_says_so(built, tmp_path):
    extensions, directory = built
    checkout = _checkout(tmp_path / "c")
    report, lines = _run(checkout, extensions, **{native.REBUILD_VARIABLE: "1"})
    assert report[2] == "42" and len(lines) == 1
    assert lines[0].startswith("rebuilding dgemma's tiny test kernels (seconds) in") and lines[0].endswith(
        f"{native.REBUILD_VARIABLE}=1"
    )
    (directory / f"{NAME}.so").write_bytes(b"not a library")
    report, lines = _run(checkout, extensions)
    assert (
        report[2] == "42" and len(lines) == 1 and lines[0].startswith("rebuilding dgemma's tiny test kernels (seconds)")
    )
    assert f"{NAME}.so there does not load" in lines[0]
    assert _run(checkout, extensions)[1] == []  # rebuilt: silent again


def _first_line(process: subprocess.Popen) -> str:
    """The process's first build/rebuild/wait line ('' if it ends without one)."""
    for line in process.stderr:
        if line.startswith(LINES):
            return line.strip()
    return ""


@pytest.mark.slow
@pytest.mark.subprocess
def test_concurrent_processes_wait_and_build_once(tmp_path, monkeypatch):
    """Two processes that find the build lock held say so and wait; then one builds and the other
    imports its library. Other sources (another answer) build in a directory of their own."""
    extensions = tmp_path / "extensions"
    first, second = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    sources = [first / "dgemma" / "tiny" / "tiny.cpp"]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    directory = native.build_directory(NAME, sources, ["-O1"])
    monkeypatch.undo()
    directory.mkdir(parents=True)
    with open(directory / "build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        processes = [_start(first, extensions), _start(second, extensions)]
        waiting = f"waiting for another process's build of dgemma's tiny test kernels: {directory / 'build.lock'}"
        assert [_first_line(p) for p in processes] == [waiting, waiting]
        fcntl.flock(lock, fcntl.LOCK_UN)
    results = [_finish(p) for p in processes]
    assert sorted(len(lines) for _, lines in results) == [0, 1]  # the wait lines were read above
    assert all(report[2] == "42" for report, _ in results)
    other = _checkout(tmp_path / "other", answer=7)
    report, lines = _run(other, extensions)
    assert (
        report[2] == "7"
        and len(lines) == 1
        and lines[0].startswith("building dgemma's")
        and len(list(extensions.iterdir())) == 2
    )


def test_build_directory_names_no_path(monkeypatch):
    """The same sources anywhere, one directory; another compiler, another one."""
    import tempfile

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        copies = []
        for root in (Path(a), Path(b)):
            for path in native._inputs(native.SOURCES):
                shutil.copyfile(path, root / path.name)
            copies.append([root / s.name for s in native.SOURCES])
        here = native.build_directory("dgemma_native", native.SOURCES, native.CFLAGS)
        assert native.build_directory("dgemma_native", copies[0], native.CFLAGS) == here
        assert native.build_directory("dgemma_native", copies[1], native.CFLAGS) == here
        (Path(b) / "scales.h").write_text("// another header\n")
        assert native.build_directory("dgemma_native", copies[1], native.CFLAGS) != here
    monkeypatch.setenv("CXX", "a-compiler-that-is-not-there")
    assert native.build_directory("dgemma_native", native.SOURCES, native.CFLAGS) != here


@pytest.mark.slow
@pytest.mark.subprocess
def test_test_subprocesses_import_the_session_build(tmp_path):
    """What `.ci/run` relies on: conftest's session fixture built the kernels, so a test's
    subprocess (dgemma chat, serve, a script) imports them without a build or a wait."""
    from dgemma.kernels import avx2

    if avx2.extension() is None and native.extension() is None:
        pytest.skip("no native kernels here (no AVX2/FMA/F16C and no AVX-512 BF16, no compiler, or DGEMMA_NATIVE=0)")
    code = (
        "from dgemma.kernels import avx2, native; print(avx2.extension() is not None, native.extension() is not None)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=_environment(PYTHONPATH=str(Path(dgemma.__file__).parents[1])),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(avx2.extension() is not None), str(native.extension() is not None)]
    assert [line for line in done.stderr.splitlines() if line.startswith(LINES)] == []


# ------------------------------------------------------------------------------------ builds in the background
def _on_demand(tmp_path: Path, monkeypatch, source: str = TINY_CPP) -> native.OnDemand:
    """The tiny module as an OnDemand extension, built in the background, in a fresh directory."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cpp").write_text(source)
    (src / "tiny.h").write_text("#define ANSWER 42\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv(native.POLICY_VARIABLE, "background")
    monkeypatch.delenv(native.REBUILD_VARIABLE, raising=False)
    return native.OnDemand(
        NAME, [src / "tiny.cpp"], ["-O1"], "tiny test kernels", "seconds", frozenset(), "in use from now on"
    )


def _asked_until_settled(kernels: native.OnDemand, timeout_s: float = 240.0):
    """Ask as a generation does (every linear) until the builder is done; the answer then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        module = kernels.module()
        if not kernels.building():
            return module
        assert module is None  # torch's kernels meanwhile
        time.sleep(0.05)
    raise AssertionError(f"the background build took over {timeout_s} s")


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_background_build_lets_the_caller_go_on_then_switches(tmp_path, monkeypatch, caplog, two_threads):
    """What `dgemma run` and `chat` do on a fresh machine: the first ask returns None at once (a
    process of its own compiles, on a core the caller's torch threads lend it), a later ask gets
    the kernels, said in one line, and the threads come back; the builder is gone. A process that
    finds the library built imports it, silently."""
    kernels = _on_demand(tmp_path, monkeypatch)
    with caplog.at_level("WARNING", logger="dgemma"):
        assert kernels.module() is None and kernels.building()  # not compiled here: the caller goes on
        builder = kernels._builder
        assert torch.get_num_threads() == 1  # one of the two lent to the compiler
        module = _asked_until_settled(kernels)
    assert module is not None and module.answer() == 42
    assert builder.poll() == 0 and torch.get_num_threads() == 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        "building dgemma's tiny test kernels in the background on one core (seconds, once; cached in "
    )
    assert lines[0].endswith("torch's kernels on 1 thread meanwhile")
    assert lines[1].startswith("dgemma's tiny test kernels are built (") and lines[1].endswith("s): in use from now on")
    caplog.clear()
    with caplog.at_level("DEBUG", logger="dgemma"):
        again = dataclasses.replace(kernels)
        assert again.module() is not None and not again.building() and not caplog.records


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_failed_background_build_says_why_in_one_line(tmp_path, monkeypatch, caplog):
    kernels = _on_demand(tmp_path, monkeypatch, TINY_CPP.replace("PyLong_FromLong(ANSWER)", "PyLong_FromLong(ANSWER"))
    with caplog.at_level("WARNING", logger="dgemma"):
        assert kernels.module() is None
        assert _asked_until_settled(kernels) is None
    last = caplog.records[-1].getMessage()
    assert last.startswith("dgemma's tiny test kernels are off: the build failed (") and "error" in last
    assert "background.log" in last and len(caplog.records) == 2


@pytest.mark.slow
@pytest.mark.subprocess
def test_wait_takes_over_a_background_build(tmp_path, monkeypatch, caplog):
    """A caller that needs the kernels now (a benchmark; `wait=True`) waits for the builder that
    runs, rather than building a second time."""
    kernels = _on_demand(tmp_path, monkeypatch)
    with caplog.at_level("WARNING", logger="dgemma"):
        assert kernels.module() is None
        module = kernels.module(wait=True)
    assert module is not None and module.answer() == 42 and not kernels.building()
    assert any(
        r.getMessage().startswith("waiting for the background build of dgemma's tiny test kernels")
        for r in caplog.records
    )

"""Native CPU kernels (C++ in `csrc/`, built on first use with torch's extension builder).

- `csrc/amx_gemm.cpp`: bf16 GEMMs on Intel AMX: one layer's MoE block (routing, both GEMMs,
  activation, weighting and the top-k sum in one call), the dense gated MLP, plain linears;
- `csrc/rms_norm.cpp`: RMSNorm in one pass per row;
- `csrc/step_statistics.cpp`: softcap, argmax, entropy and the exp weights of a step's logits in
  one pass per row;
- `csrc/dequant_avx512.cpp`: quantised weights dequantised into bf16 (`avx2.py` picks them
  over its AVX2 kernels for a bf16 output).

All are optional. Where the CPU lacks AVX-512 (BF16) or AMX, no C++ compiler is found, or the
build fails, `extension()` / `amx()` return None and the engine keeps its torch / oneDNN path
(a failed build says why in one line). `DGEMMA_NATIVE=0` keeps them off. The build (once) is
cached under `~/.cache/torch_extensions` (or `TORCH_EXTENSIONS_DIR`), in a directory named by a
hash of what the library depends on (`build_directory`: the sources' content, flags, compiler,
torch and Python), never by where the checkout or venv lives, so that every checkout and venv
of the same code loads one build. `build` says so in one line whenever it builds, rebuilds or
waits for another process's build; `DGEMMA_REBUILD_NATIVE=1` forces a rebuild. The sources
include ATen's tensor header, never torch/extension.h (~45 s of compiler time a file on its own).

An extension is built when a model first needs it (`OnDemand`), in one of two ways
(`build_policy`): in the foreground, the caller waiting (the default: what a benchmark measures
is what runs), or, for `dgemma run` and `dgemma chat` (the first text in seconds on a fresh
machine), by a process of its own in the background while the caller goes on with torch's
kernels: `extension()` is None until the build is done, then the kernels, said in one line.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

log = logging.getLogger("dgemma")
SOURCES = [
    Path(__file__).with_name("csrc") / name
    for name in ("bindings.cpp", "amx_gemm.cpp", "rms_norm.cpp", "step_statistics.cpp", "dequant_avx512.cpp")
]
CFLAGS = [
    "-O3",
    "-fopenmp",
    "-mf16c",
    "-mavx512f",
    "-mavx512dq",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mamx-tile",
    "-mamx-bf16",
]
AVX512_FLAGS = {"f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16"}
AMX_FLAGS = {"amx_tile", "amx_bf16"}


def _cpuinfo(field: str) -> str | None:
    """The value of /proc/cpuinfo's first `field` line (Linux), else None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's name: every speed figure names the CPU it came from."""
    return _cpuinfo("model name") or platform.processor() or "unknown CPU"


def cpu_flags() -> set[str]:
    """The CPU's feature flags. `DGEMMA_CPU_ISA=avx2` hides AVX-512 and AMX, so that dgemma picks
    every kernel as on an AVX2-only CPU (to measure that path on a newer one: scripts/cpu_speed.py)."""
    flags = set((_cpuinfo("flags") or "").split())
    if os.environ.get("DGEMMA_CPU_ISA", "").lower() == "avx2":
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
    return flags


LDFLAGS = ("-fopenmp",)  # at::parallel_for is inlined into the kernels and runs on torch's (same libgomp) threads
REBUILD_VARIABLE = "DGEMMA_REBUILD_NATIVE"


@functools.cache
def _compiler_identity(compiler: str) -> str:
    """What `compiler --version` says: another compiler (or version) builds into another directory."""
    try:
        out = subprocess.run([compiler, "--version"], check=False, capture_output=True, text=True, timeout=60)
        return f"{compiler}\n{out.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        return f"{compiler}: not found"


def _inputs(sources: list[Path]) -> list[Path]:
    """The sources and the headers beside them (what they include), each copied into the build."""
    headers = sorted({h for src in sources for h in src.parent.glob("*.h")} - set(sources))
    return [*sources, *headers]


def build_directory(name: str, sources: list[Path], cflags: list[str]) -> Path:
    """Where `name` is built: one directory per content (and file names) of its sources and the
    headers beside them, its flags, the compiler's identity and the torch and Python versions,
    below torch's extension root (`TORCH_EXTENSIONS_DIR`, as torch itself reads it, else the
    user's cache). No path enters the name: checkouts with other sources never rebuild over each
    other's build, and the same sources in any checkout or venv reuse one build."""
    from torch.utils.cpp_extension import get_cxx_compiler, get_default_build_root

    toolchain = [
        torch.__version__,
        str(torch.version.git_version),
        sys.version,
        platform.machine(),
        _compiler_identity(get_cxx_compiler()),
    ]
    digest = hashlib.sha1("\n".join([*cflags, *LDFLAGS, *toolchain]).encode())
    for path in _inputs(sources):
        digest.update(f"\n{path.name}\n".encode())
        digest.update(path.read_bytes())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root).absolute() / f"{name}-{digest.hexdigest()[:12]}"


def _import(name: str, library: Path) -> ModuleType:
    """The finished library imported as it is (torch is imported already): no torch `load()`,
    whose build.ninja names this venv's include paths and would rebuild for another venv."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    if spec is None:
        raise ImportError(f"no import spec for {library}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@contextmanager
def _build_lock(directory: Path, what: str) -> Iterator[None]:
    """`directory`'s build lock, held exclusively (one build at a time, across processes); said in
    one line when another process holds it. The kernel releases it when its holder dies."""
    import fcntl

    path = directory / "build.lock"
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process's build of dgemma's %s: %s", what, path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(name: str, sources: list[Path], cflags: list[str], what: str, duration: str = "about a minute") -> ModuleType:
    """The extension `name` from `sources`, built once in `build_directory` and then imported
    from there by every process, checkout and venv. A build (or a rebuild: forced by
    `DGEMMA_REBUILD_NATIVE=1`, or because the library there does not load) is said in one line
    first, as is a wait for another process's build; a library that loads is silent.

    The sources are copied into the directory first, so that torch's build files name no path of
    this checkout; the library is published by an atomic rename, so that a reader never imports
    a half-written file."""
    directory = build_directory(name, sources, cflags)
    library = directory / f"{name}.so"
    forced = os.environ.get(REBUILD_VARIABLE, "") not in ("", "0")
    if not forced and library.exists():
        try:
            return _import(name, library)
        except ImportError:
            pass  # rebuilt below, under the lock, unless another process has rebuilt it meanwhile
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory, what):
        why = f"{REBUILD_VARIABLE}={os.environ[REBUILD_VARIABLE]}" if forced else None
        if not forced and library.exists():
            try:
                return _import(name, library)  # built by the process whose build this one waited for
            except ImportError as e:
                why = f"{library.name} there does not load: {(str(e).strip().splitlines() or ['?'])[0]}"
        if why:
            log.warning("rebuilding dgemma's %s (%s) in %s: %s", what, duration, directory, why)
        else:
            log.warning("building dgemma's %s (%s; cached afterwards) in %s", what, duration, directory)
        return _build_and_publish(name, sources, cflags, directory, library)


def _build_and_publish(name: str, sources: list[Path], cflags: list[str], directory: Path, library: Path) -> ModuleType:
    """torch's build of copies of `sources` (from scratch: nothing a dead build left is reused),
    its library then renamed into `library`. Called under the build lock."""
    from torch.utils.cpp_extension import load

    src, work = directory / "src", directory / "build"
    for stale in (src, work):
        shutil.rmtree(stale, ignore_errors=True)
        stale.mkdir()
    for partial in directory.glob(f".{library.name}.*.partial"):  # a copy whose process died
        partial.unlink(missing_ok=True)
    for path in _inputs(sources):
        shutil.copyfile(path, src / path.name)
    # copies: torch appends its own flags (and this venv's library paths) to the lists it is given
    module = load(
        name,
        [str(src / s.name) for s in sources],
        extra_cflags=list(cflags),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(work),
    )
    built = Path(getattr(module, "__file__", None) or work / "none")
    # torch names it `NAME_vN` when this process built `name` before (elsewhere): not importable as `name`
    if built.name == library.name and built.is_file():
        partial = directory / f".{library.name}.{os.getpid()}.partial"
        shutil.copyfile(built, partial)
        os.replace(partial, library)
    return module


POLICY_VARIABLE = "DGEMMA_NATIVE"  # 0: off; wait: foreground builds; background: background builds
POLL_SECONDS = 0.5  # how often a caller on torch's kernels looks whether a background build is done
BUILDER_NICENESS = 19  # the builder yields the CPU to generation (and compiles a file at a time: MAX_JOBS=1)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding `dgemma` (the builder imports it)


def build_policy() -> str:
    """How kernels not built yet come when a process first needs them: "off"
    (`DGEMMA_NATIVE=0`), "background" (`DGEMMA_NATIVE=background`, which `dgemma run` and
    `dgemma chat` set when it is unset) or "wait" (anything else: built in the foreground)."""
    value = os.environ.get(POLICY_VARIABLE, "").strip().lower()
    return "off" if value == "0" else "background" if value == "background" else "wait"


def _first_error(text: str) -> str:
    """The line of a failed build's output that says what failed (else its last line)."""
    lines = text.strip().splitlines() or ["?"]
    return next((line for line in lines if "error" in line), lines[-1]).strip()


@dataclass
class OnDemand:
    """One native extension, built when a model first needs it (`module`) and then imported by
    every later call. Where its library is built already, it is imported at once. Otherwise, by
    `build_policy`: built here, the caller waiting; or built by a process of its own (niced, in
    its own session), while `module` returns None and the caller runs torch's kernels: a look
    every POLL_SECONDS whether the builder is done, then one line and the kernels. The builder
    outlives a run shorter than the build, so that the next run has the kernels.
    `dataclasses.replace(kernels)` is a copy that has not asked yet (the tests')."""

    name: str
    sources: list[Path]
    cflags: list[str]
    what: str  # what the lines call the kernels
    duration: str  # how long a build takes, as the lines say it
    cpu_flags: frozenset[str]  # what the CPU needs for them
    takes_effect: str  # which work uses them once a background build is done
    _module: ModuleType | None = field(default=None, init=False, repr=False)
    _settled: bool = field(default=False, init=False, repr=False)
    _builder: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _started: float = field(default=0.0, init=False, repr=False)
    _next_look: float = field(default=0.0, init=False, repr=False)
    _lent_thread: bool = field(default=False, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def module(self, wait: bool | None = None) -> ModuleType | None:
        """The kernels, or None where they cannot run here (or their build failed), or while they
        build in the background; `wait` (default: `build_policy`) builds or waits here."""
        if self._settled:
            return self._module
        if not wait and self._builder is not None and time.monotonic() < self._next_look:
            return None  # a generation's every linear asks: no lock, no system call
        with self._lock:
            if not self._settled:
                self._advance(build_policy() == "wait" if wait is None else wait)
            return self._module

    def building(self) -> bool:
        """A background build of these kernels runs for this process."""
        return not self._settled and self._builder is not None

    def _settle(self, module: ModuleType | None) -> None:
        if self._builder is not None and self._lent_thread:
            torch.set_num_threads(torch.get_num_threads() + 1)  # the builder's core, back to the caller's work
        self._module, self._settled, self._builder = module, True, None

    def _advance(self, wait: bool) -> None:
        """One step towards the kernels: import a built library, build it here, start or look at
        the background builder. Called under the lock."""
        if self._builder is None:
            missing = self.cpu_flags - cpu_flags()
            if missing:  # (debug: what runs is what is said, cpu.describe; not what does not)
                log.debug("dgemma's %s do not run here: this CPU lacks %s", self.what, ", ".join(sorted(missing)))
            if missing or build_policy() == "off":
                return self._settle(None)
            built = self._built()
            if built is not None:
                return self._settle(built)
            if wait:
                return self._settle(self._build_here())
            return self._start_builder()
        if wait and self._builder.poll() is None:
            log.warning(
                "waiting for the background build of dgemma's %s (started %.0f s ago)",
                self.what,
                time.monotonic() - self._started,
            )
            self._builder.wait()
        if self._builder.poll() is None:
            self._next_look = time.monotonic() + POLL_SECONDS
            return None
        return self._settle(self._builder_result())

    def _directory(self) -> Path:
        return build_directory(self.name, self.sources, self.cflags)

    def _built(self) -> ModuleType | None:
        """The library in its build directory, imported, where it is there and loads (and no
        rebuild is forced): nothing is built."""
        if os.environ.get(REBUILD_VARIABLE, "") not in ("", "0"):
            return None
        library = self._directory() / f"{self.name}.so"
        try:
            return _import(self.name, library) if library.exists() else None
        except ImportError:
            return None  # built again (`build` says why)

    def _build_here(self) -> ModuleType | None:
        try:
            return build(self.name, self.sources, self.cflags, self.what, self.duration)
        except Exception as e:  # noqa: BLE001 - any build failure means: keep the torch path
            log.warning("dgemma's %s are off: the build failed (%s)", self.what, _first_error(str(e)))
            return None

    def _start_builder(self) -> None:
        spec = json.dumps(
            {
                "name": self.name,
                "sources": [str(s) for s in self.sources],
                "cflags": self.cflags,
                "what": self.what,
                "duration": self.duration,
            }
        )
        path = os.pathsep.join(
            [str(PACKAGE_ROOT), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])]
        )
        try:
            directory = self._directory()
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / "background.log", "w") as output:
                self._builder = subprocess.Popen(
                    [sys.executable, "-c", BUILDER, spec],
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env={"MAX_JOBS": "1", **os.environ, "PYTHONPATH": path},
                    start_new_session=True,
                )
        except OSError as e:
            log.warning("dgemma's %s are off: their build could not start (%s)", self.what, e)
            return self._settle(None)
        self._started = time.monotonic()
        self._next_look = self._started + POLL_SECONDS
        atexit.register(self._say_still_building)
        # the compiler's core is lent by the caller's torch threads: on a small CPU two threads waiting
        # on each other's turns with a compiler ran a generation 5-20x slower (docs/performance.md)
        threads = torch.get_num_threads()
        self._lent_thread = threads > 1
        if self._lent_thread:
            torch.set_num_threads(threads - 1)
        log.warning(
            "building dgemma's %s in the background on one core (%s, once; cached in %s); torch's kernels on "
            "%d thread%s meanwhile",
            self.what,
            self.duration,
            directory,
            max(1, threads - 1),
            "s" if threads > 2 else "",
        )

    def _builder_result(self) -> ModuleType | None:
        """The finished builder's kernels (one line: ready, or why not)."""
        took, code = time.monotonic() - self._started, self._builder.returncode
        directory = self._directory()
        if code == 0:
            try:
                module = _import(self.name, directory / f"{self.name}.so")
                log.warning("dgemma's %s are built (%.0f s): %s", self.what, took, self.takes_effect)
                return module
            except ImportError as e:
                reason = _first_error(str(e))
        else:
            try:
                reason = _first_error((directory / "background.log").read_text(errors="replace"))
            except OSError as e:
                reason = f"exit status {code}; no log: {e}"
        log.warning(
            "dgemma's %s are off: the build failed (%s; the log: %s)", self.what, reason, directory / "background.log"
        )
        return None

    def _say_still_building(self) -> None:
        """At exit, a builder still at work (it goes on: the next run has the kernels)."""
        builder = self._builder
        if builder is not None and builder.poll() is None:
            log.warning(
                "dgemma's %s are still building in the background (process %d; %s): the next run uses them",
                self.what,
                builder.pid,
                self._directory() / "background.log",
            )


# the background builder: a fresh interpreter that builds (niced) and exits 0 once the library is in place
BUILDER = "import sys; from dgemma.kernels.native import build_main; sys.exit(build_main(sys.argv[1]))"


def build_main(spec: str) -> int:
    """The background builder's work: `build` from the JSON `spec` (OnDemand's fields), niced,
    its lines and any error on stderr (the log its parent reads). 0 when the library is built."""
    try:
        os.nice(BUILDER_NICENESS)
    except OSError:
        pass
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    fields = json.loads(spec)
    try:
        build(
            fields["name"], [Path(s) for s in fields["sources"]], fields["cflags"], fields["what"], fields["duration"]
        )
    except Exception as e:  # noqa: BLE001 - reported by the parent, from this log
        sys.stderr.write(f"{e}\n")
        return 1
    return 0


KERNELS = OnDemand(
    "dgemma_native",
    SOURCES,
    CFLAGS,
    "native CPU kernels",
    "about a minute of a core",
    frozenset(AVX512_FLAGS),
    "models loaded from now on use them (the next run)",
)


def extension(wait: bool | None = None) -> ModuleType | None:
    """The built kernels, or None where they cannot run here, or while they build in the
    background (`OnDemand`); `wait` builds or waits here."""
    return KERNELS.module(wait)


def amx(wait: bool | None = None) -> ModuleType | None:
    """The kernels if this CPU and kernel also let the process use AMX tiles, else None."""
    module = extension(wait)
    return module if module is not None and amx_runs(module) else None


@functools.cache
def amx_runs(module: ModuleType) -> bool:
    """This CPU has AMX and the OS grants this process its tile state (asked once)."""
    if AMX_FLAGS - cpu_flags():
        return False
    if not module.amx_init():
        log.warning("AMX kernels off: the OS refused AMX tile state to this process")
        return False
    return True


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """[E, 2I, K] (gate rows, then up rows) -> [E][I/16][K/32][gate, up][16][16][2] AMX tiles."""
    e, two_i, k = weight.shape
    tiles = weight.detach().reshape(e, 2, two_i // 32, 16, k // 32, 16, 2)
    return tiles.permute(0, 2, 4, 1, 5, 3, 6).contiguous()


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """[E, N, K] or [N, K] (out x in) -> [E][N/32][K/32][2 column blocks][16][16][2] AMX tiles."""
    w = weight.detach()
    w = w[None] if w.dim() == 2 else w
    e, n, k = w.shape
    tiles = w.reshape(e, n // 32, 2, 16, k // 32, 16, 2)
    return tiles.permute(0, 1, 4, 2, 5, 3, 6).contiguous()


def fits(weight: torch.Tensor) -> bool:
    """A bf16 [.., N, K] weight the AMX kernels take: N and K multiples of 32 (the released
    model's 2816 / 704 / 2112 / 262144 are)."""
    return weight.dtype == torch.bfloat16 and weight.shape[-1] % 32 == 0 and weight.shape[-2] % 32 == 0


class AMXLinear(nn.Module):
    """x @ W.T (no bias) on AMX, W packed once; any leading shape."""

    def __init__(self, weight: torch.Tensor, kernel: ModuleType):
        super().__init__()
        self.kernel, self.out_features = kernel, weight.shape[0]
        self.packed = pack_linear(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel.linear(x.reshape(-1, x.shape[-1]).contiguous(), self.packed)
        return out.view(*x.shape[:-1], self.out_features)


class AMXGatedMLP(nn.Module):
    """down(gelu(gate(x)) * up(x)) in one native call: the dense MLP and the self-conditioning MLP."""

    def __init__(self, mlp: nn.Module, kernel: ModuleType):
        super().__init__()
        self.kernel, self.exact_gelu = kernel, mlp.approximate == "none"
        self.gate_up = pack_gate_up(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])[None])
        self.down = pack_linear(mlp.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel.gated_mlp(x.reshape(-1, x.shape[-1]).contiguous(), self.gate_up, self.down, self.exact_gelu)
        return out.view(*x.shape[:-1], -1)


class AMXExperts(nn.Module):
    """`Experts` (bf16) as one native call per layer; weights repacked once into AMX tile order."""

    def __init__(self, experts: nn.Module, kernel: ModuleType):
        super().__init__()
        self.kernel = kernel
        self.exact_gelu = experts.approximate == "none"
        self.gate_up = pack_gate_up(experts.gate_up_proj)
        self.down = pack_linear(experts.down_proj)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.kernel.moe_forward(
            x.contiguous(), top_k_index, top_k_weights.float(), self.gate_up, self.down, self.exact_gelu
        )

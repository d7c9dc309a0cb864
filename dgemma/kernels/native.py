"""Native CPU kernels (C++ in `csrc/`, built on first use with torch's extension builder).

- `csrc/amx_gemm.cpp`: bf16 GEMMs on Intel AMX: one layer's MoE block (routing, both GEMMs,
  activation, weighting and the top-k sum in one call), the dense gated MLP, plain linears;
- `csrc/rms_norm.cpp`: RMSNorm in one pass per row;
- `csrc/step_statistics.cpp`: softcap, argmax, entropy and the exp weights of a step's logits in
  one pass per row;
- `csrc/dequant_avx512.cpp`: quantised weights dequantised into bf16 (`dequant.py` picks them
  over its AVX2 kernels for a bf16 output).

All are optional. Where the CPU lacks AVX-512 (BF16) or AMX, no C++ compiler is found, or the
build fails, `extension()` / `amx()` return None and the engine keeps its torch / oneDNN path,
with one logged line saying why. `DGEMMA_NATIVE=0` keeps them off. The build (~1 min, once) is
cached under `~/.cache/torch_extensions` (or `TORCH_EXTENSIONS_DIR`), in a directory named by a
hash of the sources (`build_directory`): a changed source builds anew beside the old build.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import time
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

log = logging.getLogger("dgemma")
SOURCES = [
    Path(__file__).with_name("csrc") / name
    for name in ("bindings.cpp", "amx_gemm.cpp", "rms_norm.cpp", "step_statistics.cpp", "dequant_avx512.cpp")
]
CFLAGS = ["-O3", "-fopenmp", "-mf16c", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
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


def _cpu_flags() -> set[str]:
    """The CPU's feature flags. `DGEMMA_CPU_ISA=avx2` hides AVX-512 and AMX, so that dgemma picks
    every kernel as on an AVX2-only CPU (to measure that path on a newer one: scripts/cpu_speed.py)."""
    flags = set((_cpuinfo("flags") or "").split())
    if os.environ.get("DGEMMA_CPU_ISA", "").lower() == "avx2":
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
    return flags


STALE_LOCK_SECONDS = 600  # a build takes about a minute; a lock this old was left by one that died


def build_directory(name: str, sources: list[Path], cflags: list[str]) -> Path:
    """Where `name` is built: one directory per content of its sources, the headers beside them and
    its flags (and torch and Python versions) below torch's extension root
    (`TORCH_EXTENSIONS_DIR`, as torch itself reads it, else the user's cache), so that checkouts
    with other sources never rebuild over each other's build, and the same sources anywhere
    reuse one build."""
    import hashlib
    import sys

    from torch.utils.cpp_extension import get_default_build_root

    digest = hashlib.sha1(" ".join([*cflags, torch.__version__, sys.version]).encode())
    headers = sorted({h for src in sources for h in src.parent.glob("*.h")})  # what the sources include
    for src in [*sources, *headers]:
        digest.update(src.read_bytes())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"{name}-{digest.hexdigest()[:12]}"


def build(name: str, sources: list[Path], cflags: list[str], what: str) -> ModuleType:
    """torch's extension build of `sources` into `build_directory`, said so first when nothing is
    built there yet (a `dgemma run` that builds for a minute does not look hung); a lock left by
    a build that died (torch would wait on it forever) is removed."""
    from torch.utils.cpp_extension import load

    directory = build_directory(name, sources, cflags)
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            log.warning("removing %s, left by a build of dgemma's %s that did not finish", lock, what.split(" (")[0])
            lock.unlink()
    except FileNotFoundError:
        pass
    if not any(directory.glob("*.so")):
        log.warning("building dgemma's %s; cached afterwards) in %s", what, directory)
    # -fopenmp: at::parallel_for is inlined here and runs on torch's (same libgomp) threads
    return load(name, [str(s) for s in sources], extra_cflags=cflags, extra_ldflags=["-fopenmp"], build_directory=str(directory))


@functools.cache
def extension() -> ModuleType | None:
    """The built kernels, or None where they cannot run here (reason logged once)."""
    if os.environ.get("DGEMMA_NATIVE", "1") == "0":
        return None
    missing = AVX512_FLAGS - _cpu_flags()
    if missing:
        log.info("native CPU kernels off: this CPU lacks %s", ", ".join(sorted(missing)))
        return None
    try:
        return build("dgemma_native", SOURCES, CFLAGS, "native CPU kernels (about a minute")
    except Exception as e:  # noqa: BLE001 - any build failure means: keep the torch path
        lines = str(e).strip().splitlines() or ["?"]
        first_error = next((line for line in lines if "error" in line), lines[-1])
        log.warning("native CPU kernels off: the build failed (%s)", first_error.strip())
        return None


@functools.cache
def amx() -> ModuleType | None:
    """The kernels if this CPU and kernel also let the process use AMX tiles, else None."""
    module = extension()
    if module is None:
        return None
    missing = AMX_FLAGS - _cpu_flags()
    if missing:
        log.info("AMX kernels off: this CPU lacks %s", ", ".join(sorted(missing)))
        return None
    if not module.amx_init():
        log.warning("AMX kernels off: the OS refused AMX tile state to this process")
        return None
    return module


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

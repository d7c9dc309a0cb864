"""Native dequantisation of weight tiles (`csrc/dequant.cpp`): quantised or bf16 rows into float32
or bfloat16, so that a CPU matmul on a quantised / bf16 weight spends little time outside the GEMM;
and GEMMs that read such a weight as stored (`csrc/gemm_avx2.cpp`, `linear`): float32 x @ W.T with
W converted inside the microkernel (bf16, int8) or a block at a time (int4, fp8, nvfp4).

A separate extension from `native.py`'s (`dgemma_dequant`), built with AVX2 + FMA + F16C only,
so it runs on AVX2-only CPUs (AMD Zen 2/3) as well as on AVX-512 ones; built when a model first
needs it (native.OnDemand: an unquantised model on a CPU with native bf16 never does). Where the
CPU lacks one of those flags, no compiler is found, the build fails (said in one line),
`DGEMMA_NATIVE=0`, or while it builds in the background, `extension()` is None and
`dequantize_into` / `widen_into` use torch (`formats.dequantize`, `copy_`), with the same
values: the kernel equals `formats.dequantize` bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from ..quant import formats, schemes
from ..quant.formats import QTensor
from . import native

NAME = "dgemma_dequant"
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("dequant.cpp", "gemm_avx2.cpp")]
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
CPU_FLAGS = {"avx2", "fma", "f16c"}
OUT_DTYPES = (torch.float32, torch.bfloat16)


KERNELS = native.OnDemand(
    NAME,
    SOURCES,
    CFLAGS,
    "native AVX2 GEMM and dequantisation kernels",
    "about 40 s of a core",
    frozenset(CPU_FLAGS),
    "in use from now on",
)


def extension(wait: bool | None = None) -> ModuleType | None:
    """The built kernels, or None where they cannot run here, or while they build in the
    background (`native.OnDemand`); `wait` builds or waits here."""
    return KERNELS.module(wait)


def bf16_extension() -> ModuleType | None:
    """The kernels that dequantise into a bf16 `out` here: native.py's AVX-512 ones
    (`csrc/dequant_avx512.cpp`: the same functions, 1.3-2.8x these AVX2 ones) where this CPU has
    AVX-512 BF16 (the CPUs where bf16 activations run; None while they build), else this module's."""
    kernel = native.extension()
    return kernel if kernel is not None or native.KERNELS.building() else extension()


def _native_target(out: torch.Tensor) -> bool:
    return out.device.type == "cpu" and out.dtype in OUT_DTYPES


def _as_read(t: torch.Tensor) -> torch.Tensor:
    """A part as the kernels take it: contiguous, float8 as its bytes."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _kernel_args(q: QTensor, k: int) -> list | None:
    """A 2D weight's arguments to its native functions (`dequant_<cpu>` / `gemm_<cpu>` of the
    scheme's table entry), in csrc's order: the codes, the scales, the group (a scheme whose group
    size the caller chooses: the inputs per scale column, as the reference reads them), the
    global scale (one number); None where the weight has more than one global scale."""
    scheme, p = schemes.get(q.scheme), q.parts
    scale = p["weight_scale"]
    args = [_as_read(p[scheme.main_part]), _as_read(scale)]
    if scheme.group.choosable:
        groups = scale.shape[-1]
        args.append(k // groups if groups and k % groups == 0 else (q.group_size or 0))
    if scheme.global_scale:
        global_scale = p[schemes.GLOBAL_SCALE]
        if global_scale.numel() != 1:
            return None
        args.append(global_scale.item())
    return args


def _dequantize_2d(kernel: ModuleType, q: QTensor, out: torch.Tensor) -> None:
    """One 2D weight into a contiguous `out` (kept lean: a small tile's call is a few us)."""
    args = _kernel_args(q, out.shape[-1])
    if args is None:
        global_scale = q.parts[schemes.GLOBAL_SCALE]
        raise RuntimeError(
            f"dequantize_into: a 2D {q.scheme} weight has one global scale, got {tuple(global_scale.shape)}"
        )
    getattr(kernel, f"dequant_{schemes.get(q.scheme).kernels.cpu}")(*args, out)


def _native_parts(q: QTensor) -> bool:
    """Parts the kernel takes: a scheme it has functions for (the table's `kernels.cpu`), on the
    CPU, scales in a dtype it reads (others: torch's path)."""
    scheme = schemes.find(q.scheme)
    if scheme is None or scheme.kernels.cpu is None:
        return False
    main, scale = q.parts.get(scheme.main_part), q.parts.get("weight_scale")
    return (
        main is not None
        and scale is not None
        and main.device.type == "cpu"
        and scale.dtype in scheme.kernels.cpu_scale_dtypes
    )


def dequantize_into(q: QTensor, out: torch.Tensor) -> torch.Tensor:
    """Write the weight `q` stands for ([N, K], any scheme) into `out` (float32 or bfloat16; its
    dtype chooses) and return `out`: `formats.dequantize(q, out.dtype)`, natively where it can.
    A QTensor with leading dims ([E, N, K]) is done one 2D weight at a time."""
    if out.shape != q.shape:
        raise RuntimeError(f"dequantize_into: out has shape {tuple(out.shape)}, the weight {tuple(q.shape)}")
    kernel = bf16_extension() if out.dtype == torch.bfloat16 else extension()
    if kernel is None or not _native_target(out) or out.dim() < 2 or not _native_parts(q):
        return out.copy_(formats.dequantize(q, out.dtype))
    if out.dim() > 2:
        for i in range(q.shape[0]):
            dequantize_into(q.select(i), out[i])
        return out
    if out.is_contiguous():
        _dequantize_2d(kernel, q, out)
    else:
        target = torch.empty(out.shape, dtype=out.dtype)
        _dequantize_2d(kernel, q, target)
        out.copy_(target)
    return out


def widen_into(w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy a bf16 weight into `out` (float32: widened exactly, or bfloat16) and return `out`."""
    kernel = extension()
    if (
        kernel is None
        or w.dtype != torch.bfloat16
        or not _native_target(out)
        or w.device.type != "cpu"
        or w.shape != out.shape
        or w.dim() == 0
        or not out.is_contiguous()
    ):
        return out.copy_(w)
    k = w.shape[-1]
    kernel.widen_bf16(w.contiguous().view(-1, k), out.view(-1, k))
    return out


def fused_bf16_extension() -> ModuleType | None:
    """The kernels whose GEMMs dequantise inside for bf16 x: native.py's, on a CPU with AVX-512
    BF16 but no AMX. With AMX, oneDNN's bf16 GEMM runs on AMX tiles, far above VDPBF16PS's
    rate, so the weight is dequantised whole for it instead (measured: forcing these on an AMX
    Xeon made the mid model's int4 / int8 step 1.16x / 1.23x slower; docs/quantization.md)."""
    return native.extension() if native.amx() is None else None


# bf16 x up to this many rows goes to the AVX-512 GEMM that dequantises inside; more rows to the
# weight dequantised whole and oneDNN's GEMM (whose blocking wins there). int4 [M, 1024] @ [2048,
# 1024]^T, AMD EPYC Zen 4: M = 32: 0.27 vs 0.36 ms; 64: 0.97 vs 1.16; 128: 1.90 vs 2.04-2.18; 256:
# 3.64 vs 3.39-3.43. An MoE expert's rows (16-32 a step at the released and mid sizes) stay below.
FUSED_BF16_ROWS = 128


def linear(x: torch.Tensor, weight: torch.Tensor | QTensor) -> torch.Tensor | None:
    """x [..., K] @ W.T -> [..., N] with W [N, K] as stored, read in place by a native GEMM that
    converts it inside (accumulation in float32: `x @ formats.dequantize(W).T` up to float32
    rounding, not bit for bit):

    - x float32, W a bf16 tensor or a 2D QTensor (any scheme): `csrc/gemm_avx2.cpp`, float32 out;
    - x bf16 of at most FUSED_BF16_ROWS rows, W a 2D QTensor, on a CPU with AVX-512 BF16 and no
      AMX (`fused_bf16_extension`): `csrc/dequant_avx512.cpp`'s GEMM, which dequantises four
      weight rows at a time into L1 and multiplies them by VDPBF16PS; bf16 out.

    None where no native GEMM applies (no extension, a tensor off the CPU, another dtype, W of
    another kind, scales in a dtype the kernels do not read): the caller falls back."""
    if x.device.type != "cpu" or x.dim() == 0:
        return None
    if x.dtype == torch.float32:
        kernel = extension()
    elif x.dtype == torch.bfloat16 and isinstance(weight, QTensor) and x.numel() <= FUSED_BF16_ROWS * x.shape[-1]:
        kernel = fused_bf16_extension()
    else:
        return None
    if kernel is None:
        return None
    k = x.shape[-1]
    if isinstance(weight, QTensor):
        if len(weight.shape) != 2 or weight.shape[-1] != k or not _native_parts(weight):
            return None
    elif not (
        isinstance(weight, torch.Tensor)
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[-1] == k
    ):
        return None
    n = weight.shape[0]
    flat = x.reshape(-1, k).contiguous()
    out = torch.empty(flat.shape[0], n, dtype=x.dtype)
    if isinstance(weight, torch.Tensor):
        kernel.gemm_bf16(flat, weight.contiguous(), out)
        return out.view(*x.shape[:-1], n)
    args = _kernel_args(weight, k)
    if args is None:
        return None
    getattr(kernel, f"gemm_{schemes.get(weight.scheme).kernels.cpu}")(flat, *args, out)
    return out.view(*x.shape[:-1], n)


def matmul_nn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [..., K] (float32) @ w [K, N] (bf16, as stored: row k holds input k's N values) -> [..., N]
    float32, by the native GEMM (`gemm_bf16_nn`, csrc/gemm_avx2.cpp; float32 accumulation): the
    soft embedding probs @ E with the bf16 embedding table read in place.

    None where it does not apply (no extension, a tensor off the CPU, x not float32, w not a 2D
    bf16 [K, N]): the caller falls back."""
    kernel = extension()
    if kernel is None or not isinstance(w, torch.Tensor) or not isinstance(x, torch.Tensor):
        return None
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() == 0:
        return None
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 2 or w.shape[0] != x.shape[-1]:
        return None
    k, n = w.shape
    flat = x.reshape(-1, k).contiguous()
    out = torch.empty(flat.shape[0], n, dtype=torch.float32)
    kernel.gemm_bf16_nn(flat, w.contiguous(), out)
    return out.view(*x.shape[:-1], n)

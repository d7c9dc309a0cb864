"""What every Triton kernel module asks (and imports from here: `triton`, `tl`, None without
triton): is triton there, were its kernels built for Triton's
interpreter (TRITON_INTERPRET=1 when the module was imported: then they run on CPU tensors too),
and can they run on a device."""

from __future__ import annotations

import torch

try:  # optional: absent on macOS / Windows wheels, and then every module's `available()` is False
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is not installed
    triton = None
    tl = None

HAVE_TRITON = triton is not None

if HAVE_TRITON:

    @triton.jit
    def round_bf16(v):
        """float32 -> the nearest bf16 value (ties to even), still as float32: the cast that
        follows is then exact, whether the backend truncates (the interpreter) or rounds; what
        torch's bf16 chain rounds after each op, where the kernels must round as it does."""
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))  # NaN stays NaN

    @triton.jit
    def round_if(v, ROUND: tl.constexpr):
        """`round_bf16(v)` when ROUND (a bf16 model), else v."""
        if ROUND:
            v = round_bf16(v)
        return v

else:  # pragma: no cover - exercised only where triton is not installed
    round_bf16 = round_if = None


def interpreted(kernel) -> bool:
    """Whether a @triton.jit kernel was built for the interpreter."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - a triton without the interpreter
        return False
    return isinstance(kernel, InterpretedFunction)


def runs_on(device: torch.device | str, interpreted_kernels: bool) -> bool:
    """triton is importable and the device is CUDA (ROCm builds report "cuda" too), or the
    kernels were built for the interpreter."""
    return HAVE_TRITON and (interpreted_kernels or torch.device(device).type == "cuda")

"""Proving on a CPU that GPU code never makes the host wait: the device is torch's "meta" device
(shapes, dtypes and devices, no data: any device but the CPU takes dgemma's GPU paths) and a
dispatch mode fails on every operation that would synchronise the host with a real device or copy
from the host. (FakeTensorMode with a fake "cuda" device would be closer, but a CPU-only build of
torch refuses plain indexing of such tensors.)

On a real GPU these are the operations that stall the host until the device has caught up
(reading a value: `.item()`, `.tolist()`, `bool(t)`, a copy to the CPU; output sizes that depend on
data: `nonzero`, `bincount`, `unique`, `masked_select`, boolean indexing), and the copies from the
CPU that are illegal while a CUDA graph captures. `no_host_sync(copies="none")` refuses all of
them (the captured decoder step); `copies="non_blocking"` lets non-blocking host-to-device copies
through (a step's preparation: block tables, token ids) and still refuses blocking ones, which
wait for everything queued before them.

The Triton kernels cannot run on meta tensors: `stub_triton_launches` replaces every kernel launch
by a check that its tensor arguments live on the device (the wrappers around the launches, which
size grids and allocate outputs, still run).
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DEVICE = torch.device("meta")

# operations that read device data on the host, or whose output size depends on it
SYNC_OPS = {
    "_local_scalar_dense",
    "item",
    "is_nonzero",
    "equal",
    "nonzero",
    "nonzero_static",
    "bincount",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "masked_select",
    "allclose",
}
COPY_OPS = {"_to_copy", "copy_", "copy", "_copy_from", "_copy_from_and_resize"}


class HostSync(AssertionError):
    """An operation that would make the host wait for the device (or copy from the host)."""


def _where() -> str:
    """The innermost frames of dgemma's own code (where the offending call was written)."""
    frames = [f for f in traceback.extract_stack() if "/dgemma/" in f.filename]
    return " <- ".join(f"{f.filename.split('/dgemma/')[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))


def _refuse(what: str):
    raise HostSync(f"{what} at {_where()}")


class _Guard(TorchDispatchMode):
    def __init__(self, copies: str):
        super().__init__()
        self.copies = copies
        self.h2d_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name in SYNC_OPS and any(t.device.type != "cpu" for t in tensors):
            _refuse(f"host sync: aten.{name}")
        if name in COPY_OPS:
            src = args[1] if name == "copy_" else args[0]
            dest = args[0].device if name == "copy_" else torch.device(kwargs.get("device") or src.device)
            if src.device.type != "cpu" and dest.type == "cpu":
                _refuse(f"host sync: a copy from the device to the host (aten.{name})")
            if src.device.type == "cpu" and dest.type != "cpu":
                blocking = not (kwargs.get("non_blocking") or (name == "copy_" and len(args) > 2 and args[2]))
                if self.copies == "none" or blocking:
                    _refuse(
                        f"a {'blocking ' if blocking else ''}copy from the host to the device (aten.{name}, {list(src.shape)})"
                    )
                self.h2d_copies += 1
        else:
            devices = {t.device.type for t in tensors if t.dim() > 0 or t.device.type != "cpu"}
            if "cpu" in devices and len(devices) > 1:
                _refuse(f"a host tensor in a device operation (aten.{name}: an implicit copy)")
        return func(*args, **kwargs)


class _MethodGuard(TorchFunctionMode):
    """What may not reach the dispatcher as an aten op: `tolist`, `numpy`, `bool` of a device tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if (
            name in ("tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__")
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].device.type != "cpu"
        ):
            _refuse(f"host sync: Tensor.{name}()")
        return func(*args, **(kwargs or {}))


def to_device(module: torch.nn.Module) -> torch.nn.Module:
    """`module` (built on the CPU) with every parameter and buffer replaced, in place, by a tensor
    of its shape and dtype on the meta `DEVICE`."""
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in store.items():
                if t is not None:
                    moved = torch.empty(t.shape, dtype=t.dtype, device=DEVICE)
                    store[name] = (
                        torch.nn.Parameter(moved, requires_grad=False) if isinstance(t, torch.nn.Parameter) else moved
                    )
    return module


@contextlib.contextmanager
def no_host_sync(copies: str = "none"):
    """Inside, any host sync or (per `copies`) host-to-device copy raises `HostSync`, naming the
    operation and where dgemma's code called it."""
    assert copies in ("none", "non_blocking")
    guard = _Guard(copies)
    with guard, _MethodGuard():
        yield guard


@contextlib.contextmanager
def stub_triton_launches():
    """Every Triton kernel launch (compiled or interpreted) checks that its tensor arguments are
    on the device and returns without running (meta tensors hold no data)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def launch(self, *args, grid=None, warmup=False, **kwargs):
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor) and a.device.type == "cpu":
                raise HostSync(f"a host tensor {list(a.shape)} passed to a Triton kernel at {_where()}")

    saved = [(cls, cls.run) for cls in (JITFunction, InterpretedFunction)]
    try:
        for cls, _ in saved:
            cls.run = launch
        yield
    finally:
        for cls, run in saved:
            cls.run = run


class _ReadCounter(TorchFunctionMode):
    """Counts the host's reads of device values, answering each with zeros of the right shape (the
    meta device holds no values), so a whole step runs and its reads can be budgeted."""

    READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            self.count += 1
            self.where.append(_where())
            zeros = torch.zeros(args[0].shape, dtype=args[0].dtype)
            if name == "cpu":
                return zeros
            if name == "numpy":
                return zeros.numpy()
            return getattr(zeros, name)()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_reads():
    """Inside, every read of a device value by the host counts (`.count`, `.where`) and gives zeros."""
    counter = _ReadCounter()
    with counter:
        yield counter

"""The one place that decides which kernels run, per device and dtype, once when an engine is built.

Everything else asks it: `EngineOptions.resolve` (Triton or not), `engine_net` (which copy of the
network runs: packed weights, bf16 weights widened on a CPU without native bf16, the network
itself), the runner (`KernelPlan`: step statistics, canvas attention, CUDA graphs, sampling),
quantised modules (`gpu_kernels_run`: the Triton kernels or the CPU's) and benchmark reports
(`kernels.cpu.describe`). The reference-exact paths never ask: they run the network as loaded.

The choices, and why:
- CPU network: oneDNN linears packed once (or the AMX kernels where they run); for a bf16
  model on a CPU without AVX-512 BF16 / AMX the widened path (bf16 weights multiplied in float32
  a tile at a time), since torch's bf16 GEMM is ~27x slower there (kernels/widened.py).
- Step statistics: dgemma's native kernel on a CPU with AVX-512 (vocabularies a multiple of 16),
  the Triton kernels on a GPU, torch elsewhere.
- Canvas attention: with Triton a kernel reading the paged pool in place; else gathered keys
  and SDPA.
- CUDA graphs: for the decoder step on a GPU with Triton (attention reads block tables on the
  device, so one graph replays for any prefix length).
- Sampling: on a GPU every position is sampled (no host sync); on a CPU only the accepted ones.
- fp8 activations (W8A8) for the fused network's dense linears (attention projections, dense MLP):
  where the scheme's table entry names a compute capability with fp8 tensor cores (fp8: 89) and the
  GPU has it (`fp8_activations`, asked once when the fused network is built), and under Triton's
  interpreter, which runs the kernel's float32 emulation of the fp8 rounding. An sm80 GPU keeps the
  weight-only fp8 GEMM; the experts, the LM head and self-conditioning stay weight-only / bf16.
- A model cut across ranks (dgemma/parallel): statistics over its vocabulary shard with the
  ranks' reductions ("sharded"; the native and Triton statistics read whole rows), attention
  gathered, no CUDA graphs (eager: the sharded step has not been captured and measured yet).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import native

if TYPE_CHECKING:
    from ..model.diffusion_gemma import DiffusionGemma


@dataclass(frozen=True)
class KernelPlan:
    """Which kernels one engine runs (decided by `plan_kernels`)."""

    network: str  # "packed", "widened", "plain" (CPU) or "triton" / "plain" (GPU): see `engine_net`
    statistics: str  # "native", "triton", "sharded" (tensor parallel) or "torch"
    attention: str  # "paged" (Triton, the pool read in place) or "gathered" (SDPA)
    cuda_graphs: bool
    sample_all_positions: bool  # GPU: no host sync to find the accepted positions
    reuse_buffers: bool  # CPU: step buffers kept between passes (no allocator traffic)

    @property
    def triton(self) -> bool:
        return self.statistics == "triton"


def native_bf16() -> bool:
    """This CPU multiplies bf16 natively (AVX-512 BF16 or AMX). `DGEMMA_CPU_BF16=0` says it does
    not, to run (and measure) the widened path on a machine that has it."""
    if os.environ.get("DGEMMA_CPU_BF16", "1") == "0":
        return False
    return bool({"avx512_bf16", "amx_bf16"} & native.cpu_flags())


def cpu_network(dtype: torch.dtype) -> str:
    """The CPU copy of a network of this dtype: widened, packed, or the network itself."""
    from .cpu import supported

    if dtype == torch.bfloat16 and not native_bf16():
        return "widened"
    return "packed" if supported(dtype) else "plain"


def triton_runs(device: torch.device, requested: bool | None) -> bool:
    """Whether an engine on `device` runs the Triton step kernels: by default on CUDA where
    they run; asked for where they cannot run, a ValueError naming the device."""
    from . import triton_step

    if requested is None:
        return device.type == "cuda" and triton_step.available(device)
    if requested and not triton_step.available(device):
        raise ValueError(f"triton: the Triton step kernels need a CUDA device or TRITON_INTERPRET=1 (device {device})")
    return bool(requested)


def gpu_kernels_run(device: torch.device) -> bool:
    """Quantised weights on `device` use the GPU kernels (kernels/triton_quant.py): a device that is
    not the CPU (CUDA, which ROCm reports too; the meta device of the host-sync tests) with triton."""
    if device.type == "cpu":
        return False
    from . import triton_quant

    return triton_quant.available(device)


def fp8_activations(scheme: str | None, device: torch.device) -> bool:
    """Whether a dense linear with weights of `scheme` on `device` runs W8A8 on the fused path:
    activations quantised per token by the kernel that produced them, e4m3 x e4m3 on the tensor
    cores (kernels/triton_quant.py). From the scheme's `kernels.cuda_fp8_activations` (quant/
    schemes.py) and the device's compute capability (the meta device: an H200's, as the launch
    counts and the roofline model it); under the interpreter, its emulation."""
    from ..quant import schemes

    entry = schemes.find(scheme)
    first = entry.kernels.cuda_fp8_activations if entry is not None else None
    if first is None:
        return False
    from . import triton_quant

    if not triton_quant.available(device):
        return False
    return triton_quant.INTERPRETED or triton_quant.arch(device) >= first


def engine_net(net: DiffusionGemma) -> DiffusionGemma:
    """The network the engine and AR mode run: on CPU a copy (every tensor shared) with packed or
    widened weights (faster, equal to `net` at float32 rounding; modules with hooks, e.g. LoRA
    adapters, stay as they are), elsewhere `net` itself. The runner adds the Triton modules."""
    if net.device.type != "cpu":
        return net
    from .cpu import packed_copy, widened_copy

    kind = cpu_network(net.dtype)
    if kind == "widened":
        return widened_copy(net)
    return packed_copy(net) if kind == "packed" else net


def plan_kernels(net: DiffusionGemma, triton: bool, cuda_graphs: bool) -> KernelPlan:
    """The kernels an engine over `net` (already `engine_net`'s copy) runs, with the resolved
    EngineOptions' `triton` and `cuda_graphs`."""
    cpu = net.device.type == "cpu"
    if getattr(net, "shards", None) is not None and net.shards.size > 1:
        if triton:
            raise ValueError(
                "triton: the Triton step kernels do not run on a model cut across ranks yet (tensor parallelism runs eagerly)"
            )
        statistics = "sharded"
    elif triton:
        statistics = "triton"
    elif cpu and net.config.vocab_size % 16 == 0 and native.extension() is not None:
        statistics = "native"
    else:
        statistics = "torch"
    return KernelPlan(
        network="triton" if triton else (cpu_network(net.dtype) if cpu else "plain"),
        statistics=statistics,
        attention="paged" if triton else "gathered",
        cuda_graphs=bool(cuda_graphs) and triton and not cpu,
        sample_all_positions=not cpu,
        reuse_buffers=cpu,
    )

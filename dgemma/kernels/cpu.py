"""CPU: linear layers on weights packed once (oneDNN, or the AMX kernels of `native` where they run).

A plain `F.linear` repacks its weight into the GEMM kernel's blocked layout on every call; for
the decoder's small per-expert batches (~32 rows) that repacking costs as much as the
arithmetic. Packing each weight once at load (`mkldnn._reorder_linear_weight`) and calling
`mkldnn._linear_pointwise` measured 1.2x (256 x 2048 x 1024) to 1.8x (32 x 1024 x 1024) faster
here. Results differ from `F.linear` at float32 rounding (~2e-6), so the reference-exact path
never uses these; the engine and AR mode do.

`packed_copy(net)` returns a second module tree that shares every tensor with `net` except the
packed weights, so one loaded model serves both paths.
"""

from __future__ import annotations

import copy
import ctypes
import logging

import torch
from torch import nn

from ..model.diffusion_gemma import DenseMLP, DiffusionGemma, Experts, SelfConditioning, grouped_matmul
from ..model.layers import RMSNorm
from . import native, widened

log = logging.getLogger("dgemma")
BATCH_HINT = 256  # rows the packed layout is tuned for; any row count works


def supported(dtype: torch.dtype) -> bool:
    """oneDNN packed linears exist in this torch build and take this dtype."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4, dtype=dtype), 4)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4, dtype=dtype), w, None, "none", [], "")
        return True
    except (RuntimeError, AttributeError):
        return False


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


def packed_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x @ W.T for a W packed once (a fused MLP's `gate` and `up`): what kernels/lora.py runs when
    an adapter's delta must go in between the GEMM and its fused post-op."""
    return _packed_matmul(x, packed)


class PackedLinear(nn.Module):
    """x @ W.T with W packed once (no bias: the model has none)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.packed = _pack(weight)  # a plain attribute: not part of any state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_matmul(x, self.packed)


class PackedExperts(nn.Module):
    """`Experts` with one packed weight pair per expert, run over tokens sorted by expert."""

    def __init__(self, experts: Experts):
        super().__init__()
        self.num_experts = experts.num_experts
        self.approximate = experts.approximate
        self.gate_up = [_pack(experts.gate_up_proj[e]) for e in range(self.num_experts)]
        self.down = [_pack(experts.down_proj[e]) for e in range(self.num_experts)]

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        # Few, large ops around the per-expert GEMMs (each torch op costs ~20-50 us here): one
        # gather, one concatenation per projection, one gelu * up, one scatter-add back to tokens.
        return widened.sorted_experts(
            x,
            top_k_index,
            top_k_weights,
            self.num_experts,
            self.approximate,
            lambda e, rows: _packed_matmul(rows, self.gate_up[e]),
            lambda e, rows: _packed_matmul(rows, self.down[e]),
        )


class LeanRMSNorm(nn.Module):
    """`RMSNorm` in one native pass per row where the kernels run here, else in fewer torch passes
    (sum of squares without a squared copy, scale applied in place)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.eps, self.weight = norm.eps, norm.weight  # shared with the model, as every packed module's tensors
        self.weight_f32 = None if norm.weight is None else norm.weight.detach().float().contiguous()
        self.kernel = native.extension()  # used for float32 / bfloat16 inputs
        self.no_weight = torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype in (torch.float32, torch.bfloat16):
            return self.kernel.rms_norm(x, self.no_weight if self.weight_f32 is None else self.weight_f32, self.eps)
        xf = x.float()
        sum_sq = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_()
        out = xf * sum_sq.div_(x.shape[-1]).add_(self.eps).pow_(-0.5)
        if self.weight_f32 is not None:
            out.mul_(self.weight_f32)
        return out.to(x.dtype)


class LeanDenseMLP(nn.Module):
    """`DenseMLP` / self-conditioning MLP with gelu and `* up` fused into the GEMMs as oneDNN post-ops.

    gelu(x @ Wg) comes out of the gate GEMM, (x @ Wu) * that out of the up GEMM: no separate
    gelu or multiply pass (gelu-tanh alone is ~0.55 ms per [256, 2048] here). The activation is
    applied to the float32 accumulator before rounding, so bf16 results differ from the model's
    by bf16 rounding (closer to a float64 oracle); float32 ones by ~1e-7.
    """

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.approximate = mlp.approximate
        self.gate, self.up, self.down_proj = (
            _pack(mlp.gate_proj.weight),
            _pack(mlp.up_proj.weight),
            PackedLinear(mlp.down_proj.weight),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        act = torch.ops.mkldnn._linear_pointwise(x, self.gate, None, "gelu", [], self.approximate)
        return self.down_proj(torch.ops.mkldnn._linear_pointwise(x, act, self.up, None, "mul"))


class LeanSelfConditioning(SelfConditioning):
    """`SelfConditioning` (its forward) with lean norms and the fused MLP."""

    def __init__(self, module: SelfConditioning):
        nn.Module.__init__(self)
        self.pre_norm, self.post_norm, self.body = (
            LeanRMSNorm(module.pre_norm),
            LeanRMSNorm(module.post_norm),
            _gated_mlp(module),
        )

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def keep_freed_memory(mmap_threshold: int = 64 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Ask glibc malloc to serve tensors up to 64 MB from its heap and to keep up to 1 GB freed.

    By default glibc maps big blocks fresh from the kernel and unmaps them on free, so a decoder
    step's dozens of 0.5-30 MB temporaries are page-faulted in again on every step: measured here
    ~8 ms per 32 MB and up to 12 ms for one 2 MB gather. Process-wide, like
    `torch.set_num_threads`, so the CLI calls it once at start; returns False where it does not
    apply (not glibc).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, mmap_threshold)) and bool(
            libc.mallopt(m_trim_threshold, trim_threshold)
        )
    except (OSError, AttributeError):
        return False


def release_freed_memory() -> bool:
    """Give the pages of freed heap chunks back to the kernel (glibc `malloc_trim(0)`), keeping the
    address space. Quantising a model at load leaves its temporaries' chunks free between the
    quantised weights, where the heap cannot shrink: on the released size's int4 build, RSS fell
    from 15.86 to 13.92 GiB when trimmed (13.60 GiB of weights). Called after each quantised layer,
    so that free memory never piles up; a few ms. False where it does not apply (not glibc)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def tree_copy(module: nn.Module) -> nn.Module:
    """A copy of the module tree that shares every parameter and buffer with the original."""
    clone = copy.copy(module)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = {name: tree_copy(child) for name, child in module._modules.items()}
    return clone


def _amx_kernel(*weights: torch.Tensor):
    """The AMX kernels if they run here and take every one of these weights, else None."""
    return native.amx() if all(native.fits(w) for w in weights) else None


def _linear(weight: torch.Tensor) -> nn.Module:
    """x @ weight.T: on AMX where the kernels run here and take the weight, else oneDNN packed."""
    kernel = _amx_kernel(weight)
    return native.AMXLinear(weight, kernel) if kernel is not None else PackedLinear(weight)


def _gated_mlp(mlp: nn.Module) -> nn.Module:
    kernel = _amx_kernel(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    return native.AMXGatedMLP(mlp, kernel) if kernel is not None else LeanDenseMLP(mlp)


def _fast_module(module: nn.Module) -> nn.Module | None:
    """The engine's replacement for a module, or None to keep it (and look inside it)."""
    if isinstance(module, DenseMLP):  # (quantised projections stay as they are: look inside)
        return _gated_mlp(module) if isinstance(module.gate_proj, nn.Linear) else None
    if isinstance(module, SelfConditioning):
        return LeanSelfConditioning(module)
    if isinstance(module, nn.Linear):
        return _linear(module.weight)
    if isinstance(module, Experts):
        kernel = _amx_kernel(module.gate_up_proj, module.down_proj)
        return native.AMXExperts(module, kernel) if kernel is not None else PackedExperts(module)
    if isinstance(module, RMSNorm):
        return LeanRMSNorm(module)
    return None


def has_hooks(module: nn.Module) -> bool:
    """Something (a LoRA adapter, a user's hook) acts on this module's calls: keep it as it is."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def swap_in(module: nn.Module, replacement=_fast_module) -> None:
    """Replace children in place by `replacement(child)` where it gives one; a replaced module's
    own children are not visited (nor packed twice)."""
    for name, child in module._modules.items():
        fast = None if has_hooks(child) else replacement(child)
        if fast is None:
            swap_in(child, replacement)
        else:
            module._modules[name] = fast


@torch.no_grad()
def packed_modules(module: nn.Module) -> nn.Module:
    """A copy of a module tree with packed linears, MLPs, experts and norms (sharing the weights)."""
    fast = tree_copy(module)
    swap_in(fast)
    return fast


def _widened_module(module: nn.Module) -> nn.Module | None:
    """The widened path's replacement for a module of a bf16 model, or None to look inside it
    (dense and self-conditioning MLPs get widened linears inside; quantised modules stay: they
    dequantise to the activations' dtype, float32 here)."""
    if isinstance(module, nn.Linear):
        return widened.WidenedLinear(module.weight)
    if isinstance(module, Experts):
        return widened.WidenedExperts(module)
    if isinstance(module, RMSNorm):
        return LeanRMSNorm(module)
    return None


def widened_copy(net: DiffusionGemma) -> DiffusionGemma:
    """A bf16 model run in float32 with its weights left in bf16 (kernels/widened.py): what a CPU
    without native bf16 runs instead of torch's slow bf16 GEMMs or a float32 copy of the model."""
    fast = tree_copy(net)
    swap_in(fast, _widened_module)
    fast.embed_tokens = widened.WidenedEmbedding(net.embed_tokens)
    fast.lm_head_kernel = widened.WidenedLinear(net.embed_tokens.weight)
    fast.soft_embed_kernel = widened.WidenedSoftEmbed(net.embed_tokens.weight)
    fast.compute_dtype = torch.float32
    return fast


def describe(net: nn.Module) -> str:
    """What an engine net runs on, as what runs (a benchmark's ratio means little without it;
    `dgemma serve` says it when it starts). Asks only for the kernels this net runs, so that
    asking builds nothing else; kernels building in the background are named as such."""
    if net.device.type != "cpu":
        return f"torch ({net.device.type})"
    from . import avx2

    modules = list(net.modules())
    quant = getattr(net, "quantization", None)
    widened_net = net.dtype == torch.float32 and any(isinstance(m, widened.WidenedLinear) for m in modules)
    # (float32 activations on bf16 or quantised weights: quant/modules, widened.py)
    native_gemm = (widened_net or bool(quant) and net.dtype == torch.float32) and avx2.extension() is not None
    parts = []
    if quant and net.dtype == torch.bfloat16 and avx2.fused_bf16_extension() is not None:
        # (quant/modules.cpu_quant_linear; avx2.linear says where the row limit comes from)
        parts.append(
            f"{quant[0]} weights decoded inside the native AVX-512 BF16 GEMM (up to {avx2.FUSED_BF16_ROWS} "
            f"rows; more: dequantised per weight (native) + oneDNN)"
        )
    elif quant:
        # (bf16 activations without the AVX-512 kernels: each weight dequantised whole for its
        # GEMM; float32 without the native GEMM: a tile at a time)
        unit = "weight" if net.dtype == torch.bfloat16 else "tile"
        kernel = avx2.bf16_extension() if net.dtype == torch.bfloat16 else avx2.extension()
        tiles = "native" if kernel is not None else "torch"
        parts.append(
            f"{quant[0]} weights decoded inside the native AVX2 GEMM"
            if native_gemm
            else f"{quant[0]} weights dequantised per {unit} ({tiles})"
        )
    if widened_net:
        how = "inside the native AVX2 GEMMs" if native_gemm else "a tile at a time for torch's GEMMs"
        parts.append(f"bf16 weights widened to float32 {how} (this CPU has no native bf16)")
    if any(isinstance(m, (native.AMXExperts, native.AMXGatedMLP, native.AMXLinear)) for m in modules):
        parts.append("AMX GEMMs")
    if any(isinstance(m, (PackedLinear, PackedExperts, LeanDenseMLP)) for m in modules):
        parts.append("oneDNN GEMMs")
    norms = "native" if any(isinstance(m, LeanRMSNorm) and m.kernel is not None for m in modules) else "torch"
    statistics = "native" if native.extension() is not None else "torch"
    rest = f"{statistics} statistics + RMSNorm" if statistics == norms else f"{statistics} statistics + {norms} RMSNorm"
    text = " + ".join(parts or ["torch GEMMs"]) + ", " + rest
    building = [kernels.what for kernels in (avx2.KERNELS, native.KERNELS) if kernels.building()]
    return text + (f" (building in the background: dgemma's {' and '.join(building)})" if building else "")


def packed_copy(net: DiffusionGemma) -> DiffusionGemma:
    """A CPU copy of the model (every tensor shared): packed linears, experts, LM head and
    self-conditioning matmul. Which copy the engine runs is kernels/choice.py's `engine_net`."""
    if net.device.type != "cpu" or not supported(net.dtype):
        return net
    fast = packed_modules(net)
    if getattr(net, "quantization", None):  # quantised to save memory: no packed copies of the embeddings
        return fast
    embed = net.embed_tokens.weight
    # hidden @ E.T stays on oneDNN, whose cache blocking suits the wide [256, vocab] output better
    # (10.2 vs 14.5 ms for [256x1024] @ [32768x1024]^T, hot); probs @ E, with K = vocab, goes to
    # AMX where it runs (11.2 vs 15.5 ms)
    fast.lm_head_kernel = PackedLinear(embed)
    fast.soft_embed_kernel = _linear(embed.t())
    return fast


__all__ = [
    "describe",
    "keep_freed_memory",
    "packed_copy",
    "packed_matmul",
    "packed_modules",
    "release_freed_memory",
    "supported",
    "widened_copy",
    "PackedLinear",
    "PackedExperts",
    "grouped_matmul",
]

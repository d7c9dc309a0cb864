"""Modules that compute with quantised weights, and the one function that puts them in a model.

A quantised weight's parts live as buffers named as on disk (`formats.py`). A matmul dequantises
one tile of output channels at a time into the activations' dtype and multiplies it, so no
full-precision copy of a weight outlives its tile; an expert is one tile. What is quantised:
attention q/k/v/o, the dense MLP, the MoE experts (most of the bytes). Embeddings (the tied LM
head), routers, norms, the self-conditioning MLP and the vision tower stay in the model dtype.

Do not `.to(dtype)` a model holding these modules: fp8 parts are floating point and would be cast.

Training (QLoRA, dgemma/train/): the weights stay frozen, but gradients must flow through them to
the adapters of earlier layers. Where autograd records (grad enabled and the input needs a
gradient) a quantised matmul runs as `QuantMatmul`: the same forward GEMM, and a backward
grad_in = grad_out @ W that dequantises a tile of W's rows at a time (`quant_grad_input`), so no
full-precision weight outlives its tile in the backward either. The experts then take a
differentiable path (gather, a QuantMatmul per expert, gelu * up, the routing weights, a
scatter) through which dx and the router's weights' gradients flow. Under no_grad (inference)
nothing changes: the same kernels, the same code path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import avx2
from ..kernels.choice import gpu_kernels_run
from ..kernels.cpu import release_freed_memory
from ..kernels.widened import buffered_rows, sorted_experts, tiled_linear
from .formats import QTensor, quantize


class QuantWeight(nn.Module):
    """A quantised weight [..., out, in]: its parts as buffers, and how to read them back."""

    def __init__(self, q: QTensor):
        super().__init__()
        self.scheme, self.shape, self.group_size = q.scheme, tuple(q.shape), q.group_size
        for name, tensor in q.parts.items():
            self.register_buffer(name, tensor)

    @property
    def qtensor(self) -> QTensor:
        return QTensor(self.scheme, self.shape, dict(self.named_buffers(recurse=False)), self.group_size)

    @property
    def nbytes(self) -> int:
        return self.qtensor.nbytes

    def extra_repr(self) -> str:
        return f"{self.scheme}, shape={self.shape}, group_size={self.group_size}"


def dequantized_rows(q: QTensor, dtype: torch.dtype):
    """`weight_tile` for a quantised 2D weight: rows dequantised into one buffer (natively where
    the kernel runs: kernels/avx2.py)."""
    return buffered_rows(q.shape, dtype, lambda start, end, into: avx2.dequantize_into(q.rows(start, end), into))


# bf16 activations (a CPU with native bf16): a weight of up to this many elements (16 MB in bf16:
# the released model's experts and dense MLP; its attention projections go in two tiles) is
# dequantised whole, just for the call, and multiplied by one oneDNN GEMM. The float32 path's 1 MB
# tiles, each a GEMM on transposed operands, measured 1.6-2.1x slower per matmul here (AMD EPYC,
# AVX-512 BF16: 0.66 vs 0.31 ms for an int4 [32, 1024] @ [1024, 1024]^T; the dequantisation
# itself is 0.07 ms of that). The transient buffer is at most 16 MB.
WHOLE_WEIGHT_ELEMENTS = 1 << 23


def cpu_quant_linear(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """x @ dequantize(q).T on the CPU: a native GEMM that decodes the weight inside
    (`kernels/avx2.linear`: AVX2 for float32 activations, AVX-512 BF16 for bf16 ones) where it
    runs; else bf16 activations: the weight dequantised whole for one oneDNN GEMM; float32: a
    dequantised tile at a time."""
    out = avx2.linear(x, q)
    if out is not None:
        return out
    tile_elements = WHOLE_WEIGHT_ELEMENTS if x.dtype == torch.bfloat16 else None
    return tiled_linear(x, q.shape[0], dequantized_rows(q, x.dtype), tile_elements)


# The backward GEMM's tile of dequantised weight rows: 16 MB in float32 (an expert's whole gate_up
# at the released size is 4M elements). Larger than the forward's 1 MB tile: each tile's addmm
# re-reads the whole [tokens, in] gradient, so fewer, larger tiles do less traffic.
BACKWARD_TILE_ELEMENTS = 1 << 22


def _records(*tensors: torch.Tensor) -> bool:
    """Whether autograd records through a quantised weight here: grad enabled and some input needs
    a gradient (training). Inference (no_grad, inference_mode, or inputs without grad) never does."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def quant_grad_input(grad_out: torch.Tensor, q: QTensor, tile_elements: int | None = None) -> torch.Tensor:
    """grad_out [..., out] @ W [out, in] -> [..., in] for a quantised 2D W: the backward GEMM of
    x @ W.T. W is dequantised a tile of output rows at a time into grad_out's dtype and device
    (natively on the CPU: kernels/avx2.dequantize_into; formats.dequantize elsewhere), each tile's
    product added into the result, so no full-precision copy of W exists at once."""
    from ..kernels.widened import tile_rows

    out_features, in_features = q.shape
    flat = grad_out.reshape(-1, out_features)
    rows = min(out_features, tile_rows(in_features, tile_elements or BACKWARD_TILE_ELEMENTS))
    buffer = torch.empty(rows, in_features, dtype=flat.dtype, device=flat.device)
    result = flat.new_zeros(flat.shape[0], in_features)
    for start in range(0, out_features, rows):
        end = min(out_features, start + rows)
        tile = avx2.dequantize_into(q.rows(start, end), buffer[: end - start])
        result.addmm_(flat[:, start:end], tile)
    return result.view(*grad_out.shape[:-1], in_features)


class QuantMatmul(torch.autograd.Function):
    """y = product(x, q) = x @ W.T for a frozen quantised W, differentiable in x: the forward is
    whatever GEMM inference runs (`product`), the backward `quant_grad_input` (tile by tile). W
    gets no gradient (a quantised base is frozen; adapters learn beside it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: QTensor, product: Callable[[torch.Tensor, QTensor], torch.Tensor]):
        ctx.q = q  # the parts are buffers of the module: referenced, not copied
        return product(x, q)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return quant_grad_input(grad_out, ctx.q), None, None


def dequantized_linear(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """x @ dequantize(q).T for one expert's weight off the CPU (a GPU training step): the expert is
    the tile, dequantised in x's dtype for the call (the grouped MoE kernels have no backward)."""
    from .formats import dequantize

    return F.linear(x, dequantize(q, x.dtype))


# ---------------------------------------------------------------- fp8 activations (W8A8), in torch
FP8_MAX = 448.0  # e4m3fn's largest finite value
AMAX_FLOOR = 1e-30  # a token's amax is at least this (an all-zero row: codes 0, no division by zero)


def fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 codes [..., K] float8_e4m3fn, float32 scales [..., 1]), one scale a token:
    the torch copy of the GPU's per-token quantisation (kernels/triton_decode.py's `fp8_rows`, which
    the tests hold to it byte for byte): amax / 448 the scale; x times 448 / amax, clamped to +-448,
    rounded to the nearest e4m3 (ties to even)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR)
    full = torch.full_like(amax, FP8_MAX)  # tensor by tensor: torch multiplies by a scalar's reciprocal
    codes = (xf * (full / amax)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, amax / full


def w8a8_reference(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """x @ W.T as the W8A8 GEMM computes it, for fp8 weights, in float32 on any device: x quantised
    per token (`fp8_per_token`), the weight's e4m3 codes, products and sums in float32, then the
    token's scale and the channel's, rounded once to x's dtype. The float32 emulation of the fp8
    rounding that the GPU kernel (kernels/triton_quant.py, A8) is checked against, and what
    scripts/quant_quality.py measures (`QuantLinear.fp8_activations`)."""
    codes, scales = fp8_per_token(x)
    acc = codes.float() @ q.parts["weight"].float().transpose(-1, -2)
    return (acc * scales * q.parts["weight_scale"].float().reshape(1, -1)).to(x.dtype)


def _on_gpu(x: torch.Tensor) -> bool:
    """x's device runs the GPU kernels (kernels/triton_quant.py): kernels/choice.py decides."""
    return gpu_kernels_run(x.device)


def gpu_weight(module: nn.Module, q: QTensor):
    """The GPU GEMM's view of a quantised weight (kernels/triton_quant.gemm_weight: scale rows
    padded to whole K-tiles), made once per module and remade if its parts are replaced."""
    from ..kernels.triton_quant import gemm_weight

    key = tuple(t.data_ptr() for t in q.parts.values())
    cached = module.__dict__.get("_gpu_weight")
    if cached is None or cached[0] != key:
        cached = module.__dict__["_gpu_weight"] = (key, gemm_weight(q))
    return cached[1]


class QuantLinear(QuantWeight):
    """x @ W.T for a quantised W [out, in]: on a GPU the Triton GEMM (kernels/triton_quant.py), on
    a CPU the native AVX2 GEMM (float32), which dequantise inside the GEMM; elsewhere a tile of
    output channels at a time (kernels/widened.tiled_linear). `fp8_activations` (fp8 weights; set
    on a module by scripts/quant_quality.py): off the GPU, the W8A8 GEMM's emulation instead
    (`w8a8_reference`), to measure what the fused GPU path's fp8 activations cost."""

    fp8_activations = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.qtensor
        if _records(x):  # training: the same GEMM, with a backward (QuantMatmul)
            return QuantMatmul.apply(x, q, self._product)
        return self._product(x, q)

    def _product(self, x: torch.Tensor, q: QTensor) -> torch.Tensor:
        if _on_gpu(x):
            from ..kernels.triton_quant import quant_linear

            return quant_linear(x, gpu_weight(self, q))
        if self.fp8_activations:
            return w8a8_reference(x, q)
        return cpu_quant_linear(x, q)

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def out_features(self) -> int:
        return self.shape[-2]


class QuantExperts(nn.Module):
    """The MoE experts with quantised gate_up [E, 2I, H] and down [E, H, I]: on a GPU the MoE
    kernels (one launch per projection, rows gathered in place), elsewhere tokens sorted by expert
    and each expert's weights dequantised tile by tile for all of its tokens. `fp8_activations`
    (fp8 weights; scripts/quant_quality.py): off the GPU, gate|up as the fused path's W8A8 GEMM
    computes it (`w8a8_reference`; down stays weight-only there too)."""

    fp8_activations = False

    def __init__(self, gate_up: QTensor, down: QTensor, approximate: str):
        super().__init__()
        self.num_experts = gate_up.shape[0]
        self.approximate = approximate
        self.gate_up_proj = QuantWeight(gate_up)
        self.down_proj = QuantWeight(down)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj.qtensor, self.down_proj.qtensor
        if _records(x, top_k_weights):
            return self._differentiable(x, top_k_index, top_k_weights, gate_up, down)
        if _on_gpu(x):
            return self._grouped(x, top_k_index, top_k_weights, gate_up, down)
        return sorted_experts(
            x,
            top_k_index,
            top_k_weights,
            self.num_experts,
            self.approximate,
            lambda e, rows: (w8a8_reference if self.fp8_activations else cpu_quant_linear)(rows, gate_up.select(e)),
            lambda e, rows: cpu_quant_linear(rows, down.select(e)),
        )

    def _differentiable(
        self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: QTensor, down: QTensor
    ) -> torch.Tensor:
        """`sorted_experts` written out of place, each expert's GEMM a QuantMatmul (training): the
        gradient reaches x through the gather and both projections, and the router through the
        routing weights. The same forward GEMMs as inference on the CPU; on a GPU each expert's
        weight is dequantised for its call (`dequantized_linear`)."""
        product = cpu_quant_linear if x.device.type == "cpu" else dequantized_linear
        num_tokens, top_k = top_k_index.shape
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        token = perm // top_k
        routed = x.index_select(0, token)
        counts = torch.bincount(expert_ids, minlength=self.num_experts).tolist()
        spans, start = [], 0
        for e, n in enumerate(counts):
            if n:
                spans.append((e, start, start + n))
            start += n
        projected = torch.cat([QuantMatmul.apply(routed[a:b], gate_up.select(e), product) for e, a, b in spans])
        gate, up = projected.chunk(2, dim=-1)
        act = F.gelu(gate, approximate=self.approximate) * up
        out = torch.cat([QuantMatmul.apply(act[a:b], down.select(e), product) for e, a, b in spans])
        out = out * top_k_weights.reshape(-1)[perm].to(out.dtype)[:, None]
        return torch.zeros_like(x).index_add(0, token, out)

    def _grouped(self, x, top_k_index, top_k_weights, gate_up: QTensor, down: QTensor) -> torch.Tensor:
        """The GPU path: the MoE kernels (align, gate|up with gelu * up, down: kernels/triton_moe.py),
        then Experts.forward's weighted sum (bf16 rows times float32 weights, summed in float32)."""
        from ..kernels.triton_moe import moe

        num_tokens, top_k = top_k_index.shape
        gu, dn = gpu_weight(self.gate_up_proj, gate_up), gpu_weight(self.down_proj, down)
        y = moe(x, top_k_index.to(torch.int32), gu, dn, self.approximate).view(num_tokens, top_k, -1)
        return (y * top_k_weights[..., None]).sum(dim=1).to(x.dtype)


LINEAR_TARGETS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def quantize_layer(layer: nn.Module, scheme: str, group_size: int | None) -> None:
    """Replace one text layer's linears and experts by quantised ones, in place (each weight is
    quantised and its full-precision tensor dropped before the next)."""
    dtype = layer.input_layernorm.weight.dtype
    for path in LINEAR_TARGETS:
        parent_name, _, child = path.rpartition(".")
        parent = layer.get_submodule(parent_name)
        linear = getattr(parent, child)
        if isinstance(linear, nn.Linear):
            parent._modules[child] = QuantLinear(quantize(linear.weight.detach(), scheme, group_size, dtype))
    experts = layer.experts
    if not isinstance(experts, QuantExperts):
        gate_up = quantize_stacked(
            lambda e: experts.gate_up_proj[e].detach(), experts.num_experts, scheme, group_size, dtype
        )
        down = quantize_stacked(lambda e: experts.down_proj[e].detach(), experts.num_experts, scheme, group_size, dtype)
        layer._modules["experts"] = QuantExperts(gate_up, down, experts.approximate)
    release_freed_memory()  # the quantisation's temporaries: no pile of free, resident heap


def quantize_model(net: nn.Module, scheme: str, group_size: int | None) -> nn.Module:
    """Quantise every text layer of a DiffusionGemma in place, layer by layer; returns it."""
    for layer in net.layers:
        quantize_layer(layer, scheme, group_size)
    net.quantization = (scheme, group_size)
    return net


def weight_bytes(net: nn.Module) -> dict[str, int]:
    """Resident bytes of the model's weights by part: experts, attention, dense MLP, embeddings, other."""
    out = {"experts": 0, "attention": 0, "dense": 0, "embeddings": 0, "other": 0}
    for name, tensor in list(net.named_parameters()) + list(net.named_buffers()):
        size = tensor.numel() * tensor.element_size()
        kind = (
            "experts"
            if ".experts." in name
            else "attention"
            if ".self_attn." in name
            else "dense"
            if ".mlp." in name
            else "embeddings"
            if name.startswith("embed_tokens")
            else "other"
        )
        out[kind] += size
    return out


def quantize_stacked(
    matrix,
    count: int,
    scheme: str,
    group_size: int | None,
    scale_dtype: torch.dtype = torch.float32,
    amax: torch.Tensor | None = None,
) -> QTensor:
    """Quantise `count` matrices (`matrix(i)`, e.g. one expert each) into one QTensor with a leading
    dim, written into tensors allocated once: one full-precision matrix exists at a time, and no
    list of parts is stacked (which would hold the quantised experts twice). `amax` [count, ...]:
    each matrix's `formats.scale_amax` where it is a slice of a larger one (tensor parallelism)."""

    def one(i: int) -> QTensor:
        return quantize(matrix(i), scheme, group_size, scale_dtype, None if amax is None else amax[i])

    first = one(0)
    parts = {k: v.new_empty((count, *v.shape)) for k, v in first.parts.items() if k != "weight_shape"}
    meta = next(iter(parts.values())).device.type == "meta"  # no values to write: one quantisation gives every shape
    for i in range(0 if meta else count):
        q = first if i == 0 else one(i)
        for k, dest in parts.items():
            dest[i] = q.parts[k]
    if "weight_shape" in first.parts:
        parts["weight_shape"] = first.parts["weight_shape"]
    return QTensor(scheme, (count, *first.shape), parts, first.group_size)


@torch.no_grad()
def random_quantized_model(
    config, scheme: str, group_size: int | None, dtype: torch.dtype, seed: int = 0, std: float = 0.02, device="cpu"
):
    """A DiffusionGemma with random weights built directly quantised: each matrix (each expert) is
    drawn, quantised and dropped before the next, so memory holds the quantised model plus one
    matrix; the parts that stay unquantised are drawn in `dtype` (benchmarks of the real size).
    Built on `device` (a GPU draws and quantises the released size in seconds; the meta device,
    which holds no values, takes no generator)."""
    from ..model.diffusion_gemma import DiffusionGemma

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed) if device.type != "meta" else None

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * std

    with torch.device("meta"):
        net = DiffusionGemma(config)
    for name, p in list(net.named_parameters()):
        if name.startswith("layers.") and (".experts." in name or any(f".{t}." in name for t in LINEAR_TARGETS)):
            continue  # drawn quantised below
        value = (draw(*p.shape) if p.dim() >= 2 else torch.ones(p.shape, device=device)).to(dtype)
        module_name, _, attr = name.rpartition(".")
        net.get_submodule(module_name)._parameters[attr] = nn.Parameter(value, requires_grad=False)
    for name, b in list(net.named_buffers()):
        module_name, _, attr = name.rpartition(".")
        net.get_submodule(module_name)._buffers[attr] = torch.ones(b.shape, dtype=dtype, device=device)
    for layer in net.layers:
        for path in LINEAR_TARGETS:
            parent_name, _, child = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, child)
            if linear is not None:
                parent._modules[child] = QuantLinear(quantize(draw(*linear.weight.shape), scheme, group_size, dtype))
        e, two_i, h = layer.experts.gate_up_proj.shape
        gate_up = quantize_stacked(lambda _, two_i=two_i, h=h: draw(two_i, h), e, scheme, group_size, dtype)
        down = quantize_stacked(lambda _, two_i=two_i, h=h: draw(h, two_i // 2), e, scheme, group_size, dtype)
        layer._modules["experts"] = QuantExperts(gate_up, down, layer.experts.approximate)
        release_freed_memory()
    net.quantization = (scheme, group_size)
    return net.eval()

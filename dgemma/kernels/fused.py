"""The engine's copy of the model for the Triton path (`EngineOptions.triton`, chosen by the runner).

A decoder layer of the torch model launches ~110 GPU kernels (the norms alone ~70); the copy made
here runs each layer in 14 launches (15 where the attention splits its keys), the same
arithmetic rounded at the same points:

    launch                                  kernel
    x @ [Wq | Wk | Wv]                      one GEMM (cuBLAS for bf16 weights, else triton_quant.gemm)
    q, k, v norms and RoPE                  triton_layer.qkv_norm_rope (V = K's projection on global layers)
    attention (+ its split combine)         the cache pass's: the paged canvas kernel (a decoder step), the
                                            paged causal kernel (an encoder pass, K/V already in the pool)
    o_proj                                  one GEMM
    residual + 4 norms                      triton_norms.post_attention -> h, dense, MoE and router inputs
    dense [Wgate | Wup], gelu * up, down    two GEMMs and triton_layer.gelu_mul (up to SMALL_M rows, e.g.
                                            AR's one token a row: gelu * up in the first GEMM's epilogue)
    router logits, softmax, top-k           triton_moe.router_topk
    experts: align, gate|up (gelu * up), down   triton_moe.moe: 3 launches, rows gathered and scattered in place
    MoE sum + 3 norms + residual + scalar   triton_norms.combine, with the next layer's input norm
                                            (the final norm after the last layer)

Outside the layers: the embedding (+ self-conditioning's pre-norm, gate|up, gelu * up, down on a
decoder pass) and layer 0's input norm in `triton_norms.embed_norm`, and the RoPE tables of every
layer kind once per pass (`triton_layer.rope_tables`, 3 launches).

fp8 weights on a GPU with fp8 tensor cores run the four dense GEMMs W8A8 (`FusedLayer`'s `a8`):
activations quantised per token where they are made (`embed_norm`, `post_attention`, `combine`)
or by one `triton_norms.quantize_rows` launch (o_proj's and down's inputs, over SMALL_M rows: 15
launches a layer, 16 with the split; gelu * up then runs in gate|up's epilogue).

Weights: q|k|v, the dense MLP's and self-conditioning's gate|up become one tensor each, and the
modules' own weights views of it (`fuse_rows`: no copy stays behind; the model's other paths
read the same values); quantised weights are read in their stored layout (triton_quant.gemm_weight).
A network with modules that carry hooks (LoRA adapters being trained) keeps the torch layers with
two Triton swaps (`TritonAttention`, `TritonExperts`). Served LoRA adapters (kernels/lora.py's
slots) add a shrink and an expand launch after each of the four GEMMs, for passes whose rows carry
adapter slots (kernels/triton_lora.py): 22 launches a layer then, the 14 without. The
reference-exact paths never see this copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model.diffusion_gemma import Attention, DiffusionGemma, Experts, Layer
from . import triton_layer, triton_lora, triton_moe, triton_norms, triton_quant
from .choice import fp8_activations
from .cpu import has_hooks, swap_in, tree_copy
from .lora import AdapterRows, LoraSlots


# ------------------------------------------------------------------- the unfused swaps (LoRA)
class TritonAttention(nn.Module):
    """Attention with q, k and v's RMSNorm and RoPE in one pass each (`norm_rope`)."""

    def __init__(self, attn: Attention):
        super().__init__()
        self.attn = attn
        self.spec = attn.spec  # what the stack reads of its layers' attention (the RoPE table per kind)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, cache_pass) -> torch.Tensor:
        a = self.attn
        b, t, _ = x.shape
        d = a.spec.head_dim
        cos, sin = cos.reshape(b * t, d), sin.reshape(b * t, d)
        flat = x.reshape(b * t, -1)
        q = triton_layer.norm_rope(a.q_proj(flat).view(b * t, -1, d), a.q_norm.weight, cos, sin, a.q_norm.eps)
        k_raw = a.k_proj(flat).view(b * t, -1, d)
        v_raw = a.v_proj(flat).view(b * t, -1, d) if a.v_proj is not None else k_raw
        k = triton_layer.norm_rope(k_raw, a.k_norm.weight, cos, sin, a.k_norm.eps)
        v = triton_layer.norm_rope(v_raw, None, None, None, a.v_norm.eps)

        def heads(y: torch.Tensor) -> torch.Tensor:  # [B*T, heads, D] -> [B, heads, T, D]
            return y.view(b, t, -1, d).transpose(1, 2)

        out = cache_pass.attention(layer, a.spec.is_sliding, heads(q), heads(k), heads(v))
        return a.o_proj(out.reshape(b, t, -1))


class TritonExperts(nn.Module):
    def __init__(self, experts: Experts):
        super().__init__()
        self.experts = experts

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return triton_layer.moe_experts(self.experts, x, top_k_index, top_k_weights)


def _triton_module(module: nn.Module) -> nn.Module | None:
    if isinstance(module, Attention):
        return TritonAttention(module)
    if type(module) is Experts:
        return TritonExperts(module)
    return None


# ------------------------------------------------------------------------- fused weights
def _same_base(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor these are consecutive row blocks of (a fusion done before), or None."""
    base = tensors[0]._base
    if base is None or any(t._base is not base for t in tensors):
        return None
    offset = 0
    for t in tensors:
        if t.storage_offset() - base.storage_offset() != offset or not t.is_contiguous():
            return None
        offset += t.numel()
    return base if offset == base.numel() else None


def fuse_rows(owners: list[tuple[nn.Module, str]]) -> torch.Tensor:
    """One tensor of the row blocks `getattr(module, name)` (weights [N_i, K], or their quantised
    parts), each module's own then a view of its block: no copy outlives the call (and a second
    call finds the fusion already made)."""
    tensors = [getattr(m, name) for m, name in owners]
    fused = _same_base(tensors)
    if fused is not None:
        return fused
    fused = torch.cat([t.detach() for t in tensors])
    start = 0
    for (module, name), t in zip(owners, tensors):
        view = fused[start : start + t.shape[0]]
        start += t.shape[0]
        if isinstance(t, nn.Parameter):
            module._parameters[name] = nn.Parameter(view, requires_grad=t.requires_grad)
        else:
            module._buffers[name] = view
    return fused


def fused_linear(modules: list[nn.Module]) -> torch.Tensor | triton_quant.GemmWeight:
    """The weight of `modules` (nn.Linear, or quant.modules.QuantLinear, one kind) stacked along
    the output dim: a tensor [N, K] (a cuBLAS GEMM) or the GEMM kernel's view of quantised rows."""
    if all(type(m) is nn.Linear for m in modules):
        return fuse_rows([(m, "weight") for m in modules]) if len(modules) > 1 else modules[0].weight
    from ..quant.modules import QuantLinear

    if not all(type(m) is QuantLinear for m in modules) or len({m.scheme for m in modules}) > 1:
        raise TypeError("fused_linear takes nn.Linear or QuantLinear modules of one scheme")
    if len(modules) == 1:
        return triton_quant.gemm_weight(modules[0].qtensor)
    first = modules[0].qtensor
    parts = {
        name: fuse_rows([(m, name) for m in modules])
        for name in first.parts
        if name in ("weight", "weight_packed", "weight_scale")
    }
    if "weight_global_scale" in first.parts:  # nvfp4: a global scale per module, one per output channel when fused
        weights = [triton_quant.gemm_weight(m.qtensor) for m in modules]
        fused = triton_quant.gemm_weight(
            type(first)(
                first.scheme,
                (sum(m.shape[0] for m in modules), first.shape[1]),
                dict(parts, weight_global_scale=first.parts["weight_global_scale"]),
                first.group_size,
            )
        )
        fused.channel = torch.cat([w.channel for w in weights])
        return fused
    return triton_quant.gemm_weight(
        type(first)(first.scheme, (sum(m.shape[0] for m in modules), first.shape[1]), parts, first.group_size)
    )


def _experts(module: nn.Module) -> tuple[triton_quant.GemmWeight, triton_quant.GemmWeight]:
    if type(module) is Experts:
        return triton_quant.gemm_weight(module.gate_up_proj), triton_quant.gemm_weight(module.down_proj)
    return triton_quant.gemm_weight(module.gate_up_proj.qtensor), triton_quant.gemm_weight(module.down_proj.qtensor)


def linear(x: torch.Tensor, weight: torch.Tensor | triton_quant.GemmWeight) -> torch.Tensor:
    """x [T, K] @ W.T: cuBLAS for a full-precision weight, else the GEMM kernel."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight)
    return triton_quant.gemm(x, weight)


def fusable(net: DiffusionGemma) -> bool:
    """Whether every layer can run fused: plain or quantised linears and experts, no hooks."""
    from ..model.diffusion_gemma import DenseMLP, SelfConditioning
    from ..quant.modules import QuantExperts, QuantLinear

    kinds = (nn.Linear, QuantLinear)
    for layer in net.layers:
        if type(layer) is not Layer or any(has_hooks(m) for m in layer.modules()):
            return False
        a, mlp = layer.self_attn, layer.mlp
        if type(a) is not Attention or type(mlp) is not DenseMLP or type(layer.experts) not in (Experts, QuantExperts):
            return False  # e.g. a CPU copy's packed modules
        linears = [a.q_proj, a.k_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj] + (
            [a.v_proj] if a.v_proj is not None else []
        )
        if not all(type(m) in kinds for m in linears):
            return False
    sc = net.self_conditioning
    return (
        not has_hooks(net)
        and type(sc) is SelfConditioning
        and all(type(m) is nn.Linear for m in (sc.gate_proj, sc.up_proj, sc.down_proj))
    )


# ------------------------------------------------------------------------- the fused network
SMALL_M = 64  # rows up to which the dense MLP's gate|up GEMM computes gelu * up in its epilogue


class LayerAdapters:
    """A fused layer's LoRA slots (kernels/lora.py), as its four GEMMs hold their linears side by
    side: (A list, B list) for q|k|v, o, gate|up and down (kernels/triton_lora.py's `add_lora`)."""

    def __init__(self, slots: LoraSlots, index: int, has_v: bool):
        def parts(*sites: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            names = [f"layers.{index}.{site}" for site in sites]
            return [slots.a[n] for n in names], [slots.b[n] for n in names]

        qkv = ("self_attn.q_proj", "self_attn.k_proj") + (("self_attn.v_proj",) if has_v else ())
        self.qkv, self.o = parts(*qkv), parts("self_attn.o_proj")
        self.gate_up, self.down = parts("mlp.gate_proj", "mlp.up_proj"), parts("mlp.down_proj")


class FusedLayer(nn.Module):
    """One layer of the fused network (see the module): (h, x) -> (h', x'), x = the layer's input
    norm of h, x' the next one's (`next_norm`). With `adapters` (served LoRA slots), each GEMM's
    output gets its rows' adapters' deltas when the pass has per-row slots (`lora` in forward):
    a shrink and an expand launch each (kernels/triton_lora.py), 8 a layer.

    W8A8 (`a8`: fp8 weights on a GPU with fp8 tensor cores, kernels/choice.py's `fp8_activations`,
    decided here once): the four dense GEMMs take activations quantised per token
    (triton_quant.Fp8Rows). q|k|v's come from the kernel that made x (the previous layer's
    `combine`, or `embed_norm`: `quant_next`), gate|up's from `post_attention`, o_proj's and down's
    from one `quantize_rows` launch each (+1 a layer: gelu * up moves into gate|up's epilogue, which
    frees gelu_mul's launch). The experts' gate|up likewise (`experts_a8`: its input quantised by
    `post_attention`, gathered by token; their down stays weight-only: gelu * up's rows are spread
    over the dual GEMM's column tiles, so quantising them would take a launch more). Only for passes
    of more than SMALL_M rows (a decoder step, a prompt chunk): a GEMV's rows (AR tokens, turbo's
    short passes) stay weight-only, bound by the weights' bytes, and the wgmma that W8A8 needs takes
    64 rows at least."""

    def __init__(self, layer: Layer, next_norm: torch.Tensor, adapters: LayerAdapters | None = None):
        super().__init__()
        self.layer = layer
        self.adapters = adapters
        a, mlp = layer.self_attn, layer.mlp
        self.spec = a.spec
        self.qkv = fused_linear([a.q_proj, a.k_proj] + ([a.v_proj] if a.v_proj is not None else []))
        self.o = fused_linear([a.o_proj])
        self.gate_up = fused_linear([mlp.gate_proj, mlp.up_proj])
        self.gate_up_gemm = (
            self.gate_up
            if isinstance(self.gate_up, triton_quant.GemmWeight)
            else triton_quant.gemm_weight(self.gate_up)
        )
        self.down = fused_linear([mlp.down_proj])
        self.experts_gate_up, self.experts_down = _experts(layer.experts)
        self.next_norm = next_norm
        self.heads = (a.num_heads, a.spec.num_kv_heads)
        dense = (self.qkv, self.o, self.gate_up, self.down)
        self.a8 = all(
            isinstance(w, triton_quant.GemmWeight) and fp8_activations(w.scheme, w.data.device) for w in dense
        )
        self.experts_a8 = fp8_activations(self.experts_gate_up.scheme, self.experts_gate_up.data.device)
        self.quant_next = False  # the next layer runs W8A8: combine writes its x quantised too (fused_network)

    def forward(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        tables,
        cache_pass,
        index: int,
        encoder: bool,
        shape,
        lora: torch.Tensor | None = None,
        xq: triton_quant.Fp8Rows | None = None,
    ) -> tuple:
        """`lora`: each token row's adapter slot ([B T] int32, -1: none), or None: no adapter launches.
        `xq`: x quantised per token (a W8A8 layer's q|k|v input). Returns (h', x', x' quantised or None)."""
        layer, a = self.layer, self.layer.self_attn
        spec, eps = self.spec, layer.input_layernorm.eps
        cos, sin, rope_col = tables
        adapted = lora is not None and self.adapters is not None
        many = x.shape[0] > SMALL_M  # W8A8 needs them (a GEMV's rows stay weight-only)
        a8 = self.a8 and many

        def gemm(inputs: torch.Tensor, weight, parts, rows: triton_quant.Fp8Rows | None = None) -> torch.Tensor:
            out = linear(rows if rows is not None else inputs, weight)  # rows: W8A8
            return triton_lora.add_lora(inputs, out, *parts, lora) if adapted else out

        # a pass whose keys and values the q|k|v kernel writes into the pool (an encoder pass, an AR token)
        pools = cache_pass.pool_writes(index, spec.kind) if hasattr(cache_pass, "pool_writes") else None
        q, k, v = triton_layer.qkv_norm_rope(
            gemm(x, self.qkv, self.adapters.qkv if adapted else None, xq if a8 else None),
            self.heads,
            spec.head_dim,
            a.v_proj is not None,
            a.q_norm.weight,
            a.k_norm.weight,
            a.q_norm.eps,
            cos,
            sin,
            rope_col[spec.kind],
            pools=pools,
        )
        b, t = shape

        def heads(y: torch.Tensor) -> torch.Tensor:  # [B*T, heads, D] -> [B, heads, T, D]
            return y.view(b, t, -1, spec.head_dim).transpose(1, 2)

        attn = cache_pass.attention(index, spec.is_sliding, heads(q), heads(k), heads(v)).reshape(b * t, -1)
        router = layer.router
        attn_q = triton_norms.quantize_rows(attn) if a8 else None
        moe_a8 = self.experts_a8 and many
        h, dense_in, moe_in, router_in, *fp8_in = triton_norms.post_attention(
            h,
            gemm(attn, self.o, self.adapters.o if adapted else None, attn_q),
            layer.post_attention_layernorm.weight,
            layer.pre_feedforward_layernorm.weight,
            layer.pre_feedforward_layernorm_2.weight,
            router.scale,
            router.root_size,
            eps,
            quant=a8,
            quant_moe=moe_a8,
        )
        dense_q, moe_q = fp8_in if fp8_in else (None, None)
        if adapted:  # gate|up's deltas go in before gelu * up: never in the GEMM's epilogue
            gate_up = gemm(dense_in, self.gate_up, self.adapters.gate_up, dense_q)
            dense = gemm(triton_layer.gelu_mul(gate_up, layer.mlp.approximate), self.down, self.adapters.down)
        elif a8:  # W8A8: gelu * up in gate|up's epilogue, then its rows quantised for down
            act = triton_quant.gemm(dense_q, self.gate_up_gemm, dual=layer.mlp.approximate)
            dense = linear(triton_norms.quantize_rows(act), self.down)
        elif dense_in.shape[0] <= SMALL_M:  # gelu * up in the GEMM's epilogue: one launch fewer (a GEMV's rows)
            dense = linear(triton_quant.gemm(dense_in, self.gate_up_gemm, dual=layer.mlp.approximate), self.down)
        else:
            dense = linear(triton_layer.gelu_mul(linear(dense_in, self.gate_up), layer.mlp.approximate), self.down)
        top_w, top_i = triton_moe.router_topk(router_in, router.proj.weight, router.per_expert_scale, router.top_k)
        y = triton_moe.moe(moe_q or moe_in, top_i, self.experts_gate_up, self.experts_down, layer.experts.approximate)
        scalar = layer.encoder_layer_scalar if encoder else layer.layer_scalar
        h, x, *xq = triton_norms.combine(
            h,
            dense,
            y,
            top_w,
            layer.post_feedforward_layernorm_1.weight,
            layer.post_feedforward_layernorm_2.weight,
            layer.post_feedforward_layernorm.weight,
            scalar,
            self.next_norm,
            eps,
            quant=self.quant_next and many,
        )
        return h, x, (xq[0] if xq else None)


class FusedGemma(DiffusionGemma):
    """The fused network: `fused_network`'s copy of a DiffusionGemma (every tensor shared) whose
    encode / decode run `FusedLayer`s; lm_head, logits and soft_embed are the model's own."""

    def _passes(self, h: torch.Tensor, x: torch.Tensor, cache_pass, encoder: bool, shape, xq=None) -> torch.Tensor:
        """The layers over (h, x); `xq`: x quantised per token (layer 0 runs W8A8: `embed_norm` wrote it)."""
        freqs, cols = self._rope(h.device)
        cos, sin = triton_layer.rope_tables(cache_pass.positions, freqs, h.dtype)
        rows = getattr(self, "lora_rows", None)
        lora = None  # each token row's adapter slot: the pass's rows' slots, a row's canvas (or chunk) long
        if rows is not None and rows.row_slots is not None:
            lora = rows.row_slots[:, None].expand(shape[0], shape[1]).reshape(-1)
        for i, layer in enumerate(self.fused_layers):
            h, x, xq = layer(h, x, (cos, sin, cols), cache_pass, i, encoder, shape, lora, xq)
        return x.view(*shape, -1)

    def _rope(self, device: torch.device) -> tuple[torch.Tensor, dict[str, int]]:
        """Every layer kind's RoPE frequencies side by side on `device` (made once) and each
        kind's first column in them."""
        found = self._rope_side_by_side.get(device)
        if found is None:
            freqs = self.rope_frequencies(device)
            cols, col = {}, 0
            for kind, f in freqs.items():
                cols[kind] = col
                col += f.numel()
            found = self._rope_side_by_side[device] = (torch.cat(list(freqs.values())), cols)
        return found

    def _scale(self) -> float:
        """The embedding scale as the model's dtype holds it (embed's multiplier)."""
        return float(torch.tensor(self.config.embed_scale, dtype=torch.float32).to(self.dtype))

    def encode(self, ids: torch.Tensor, cache_pass, embeds: torch.Tensor | None = None) -> torch.Tensor:
        first, quant = self.layers[0].input_layernorm, self.fused_layers[0].a8 and ids.numel() > SMALL_M
        if embeds is None:
            h, x, *xq = triton_norms.embed_norm(
                self.embed_tokens.weight, self._scale(), first.weight, first.eps, ids=ids, quant=quant
            )
        else:
            h, x, *xq = triton_norms.embed_norm(
                self.embed_tokens.weight, self._scale(), first.weight, first.eps, embeds=embeds, quant=quant
            )
        return self._passes(h, x, cache_pass, True, tuple(ids.shape), *xq)

    def decode(self, canvas: torch.Tensor, cache_pass, soft_embeds: torch.Tensor | None) -> torch.Tensor:
        sc_out = None
        if soft_embeds is not None:
            sc = self.self_conditioning
            pre = triton_norms.rms_norm(soft_embeds, sc.pre_norm.weight, sc.pre_norm.eps).reshape(
                -1, soft_embeds.shape[-1]
            )
            sc_out = F.linear(
                triton_layer.gelu_mul(F.linear(pre, self.sc_gate_up), sc.approximate), sc.down_proj.weight
            )
        first = self.layers[0].input_layernorm
        h, x, *xq = triton_norms.embed_norm(
            self.embed_tokens.weight,
            self._scale(),
            first.weight,
            first.eps,
            ids=canvas,
            decoder=True,
            self_conditioning=sc_out,
            quant=self.fused_layers[0].a8 and canvas.numel() > SMALL_M,
        )
        return self._passes(h, x, cache_pass, False, tuple(canvas.shape), *xq)


@torch.no_grad()
def fused_network(net: DiffusionGemma, adapters: LoraSlots | None = None) -> FusedGemma:
    """The fused copy of `net` (sharing every tensor; q|k|v and gate|up fused in place); with
    `adapters`, its layers add the rows' LoRA deltas (`lora_rows`: kernels/lora.py's selection,
    per-row slots on the device)."""
    fast = tree_copy(net)
    fast.__class__ = FusedGemma  # the same module tree, the fused encode / decode
    fast._rope_side_by_side = {}
    norms = [layer.input_layernorm.weight for layer in net.layers[1:]] + [net.norm.weight]
    parts = [
        None if adapters is None else LayerAdapters(adapters, i, layer.self_attn.v_proj is not None)
        for i, layer in enumerate(net.layers)
    ]
    fast.fused_layers = [FusedLayer(layer, norm, p) for layer, norm, p in zip(net.layers, norms, parts)]
    for this, following in zip(fast.fused_layers, fast.fused_layers[1:]):
        this.quant_next = following.a8  # W8A8 q|k|v: its input quantised by the kernel that makes it
    if adapters is not None:
        fast.lora_rows = AdapterRows(adapters, on_device=True)
    sc = net.self_conditioning
    fast.sc_gate_up = fuse_rows([(sc.gate_proj, "weight"), (sc.up_proj, "weight")])
    return fast


@torch.no_grad()
def triton_modules(net: DiffusionGemma, adapters: LoraSlots | None = None) -> DiffusionGemma:
    """The engine's network on the Triton path: the fused network where every layer can run it
    (with served LoRA `adapters`: their kernels beside its GEMMs), else a copy (sharing every
    tensor) whose attention and experts run the Triton kernels (the runner adds served adapters
    to it as kernels/lora.py's modules); modules with hooks (adapters being trained) stay as they are."""
    if fusable(net):
        return fused_network(net, adapters)
    fast = tree_copy(net)
    for layer in fast.layers:
        swap_in(layer, _triton_module)
    return fast

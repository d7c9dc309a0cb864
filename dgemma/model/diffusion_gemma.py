"""The DiffusionGemma text stack: one set of weights, run two ways.

- `encode`: causal pass over prompt tokens or a committed canvas; writes the KV cache.
- `decode`: bidirectional pass over a canvas that attends to the cached prefix plus the whole
  canvas; reads the cache only. Its input embeddings are mixed with a self-conditioning signal
  built from the previous step's predictions.

Both take a *cache pass* (`dgemma.dense.kv_cache.CachePass` for the dense cache, `PagedPass`
for the engine's block pool): the positions of the pass's tokens, and `attend(layer, sliding, k,
v)`, which stores this pass's keys/values where the cache keeps them and returns the keys/values
to attend over with their mask. The model does not know how a cache is laid out.

Module and parameter names follow the checkpoint (`model.decoder.*`), so loading is a rename.
Arithmetic follows the `transformers` reference operation for operation (RMSNorm via pow(-0.5),
fp32 router softmax, grouped expert matmuls, fp32 softcapped logits) so float32 results agree to
rounding, and to the bit where the reference's own kernels are used.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LayerSpec, ModelConfig
from . import rope
from .layers import RMSNorm, gated_mlp


def no_reduce(t: torch.Tensor) -> torch.Tensor:
    """The reduce points' default: one process holds every partial sum already."""
    return t


def table_lookup(table: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The embedding lookup's default: the table's rows at `ids`."""
    return table(ids)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        h, hd = config.hidden_size, spec.head_dim
        self.num_heads = config.num_heads
        self.q_proj = nn.Linear(h, config.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * hd, bias=False) if spec.has_v_proj else None
        self.o_proj = nn.Linear(config.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.v_norm = RMSNorm(hd, config.rms_norm_eps, with_scale=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, D], k/v [B, Hkv, T, D]. Global layers have V = K's projection (own norm, no RoPE)."""
        shape = (*x.shape[:-1], -1, self.spec.head_dim)
        q = rope.apply_rope(self.q_norm(self.q_proj(x).view(shape)), cos, sin).transpose(1, 2)
        k_raw = self.k_proj(x).view(shape)
        v_raw = self.v_proj(x).view(shape) if self.v_proj is not None else k_raw
        k = rope.apply_rope(self.k_norm(k_raw), cos, sin).transpose(1, 2)
        v = self.v_norm(v_raw).transpose(1, 2)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, cache_pass) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = cache_pass.attention(layer, self.spec.is_sliding, q, k, v)  # the pass knows how its cache is read
        return self.o_proj(out.reshape(*x.shape[:-1], -1))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self, x)


class Router(nn.Module):
    """Scale-free RMSNorm -> x scale x hidden^-0.5 -> linear -> fp32 softmax -> top-k -> renormalise."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.top_k_experts
        self.root_size = config.hidden_size**-0.5
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (router probabilities [N, E], top-k weights [N, K], top-k expert ids [N, K])."""
        x = self.norm(x) * self.scale * self.root_size
        probs = F.softmax(self.proj(x), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights * self.per_expert_scale[index], index


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, in] sorted by expert, weight [E, in, out], offsets = cumulative rows per expert -> [S, out]."""
    x = x.to(weight.dtype)
    try:
        return F.grouped_mm(x, weight, offs=offsets)
    except (RuntimeError, NotImplementedError, AttributeError):
        out = x.new_zeros(x.shape[0], weight.shape[2])
        start = 0
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                torch.mm(x[start:end], weight[e], out=out[start:end])
            start = end
        return out


class Experts(nn.Module):
    """Fused expert weights, run as two grouped matmuls over tokens sorted by expert (no per-token loop)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = e
        self.approximate = config.gelu_approximate
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        routed = x[perm // top_k]
        weights = top_k_weights.reshape(-1)[perm]
        counts = torch.histc(
            expert_ids.float() if x.device.type in ("cpu", "mps") else expert_ids.int(),
            bins=self.num_experts,
            min=0,
            max=self.num_experts - 1,
        )
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = grouped_matmul(routed, self.gate_up_proj.transpose(-2, -1), offsets).chunk(2, dim=-1)
        out = grouped_matmul(F.gelu(gate, approximate=self.approximate) * up, self.down_proj.transpose(-2, -1), offsets)
        out = out * weights.unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        return out[inverse].view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


class Layer(nn.Module):
    """Attention, then a dense MLP and an MoE side by side, each with its own norms."""

    def __init__(self, config: ModelConfig, spec: LayerSpec):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, spec)
        self.mlp = DenseMLP(h, config.intermediate_size, config.gelu_approximate)
        self.router = Router(config)
        self.experts = Experts(config)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
        self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
        # The decoder's layer_scalar is stored with the layer; the encoder's separately.
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))
        # Tensor parallelism (parallel/shard.py): the all-reduce where a rank's partial sums meet,
        # after the attention's o_proj, the dense MLP and the MoE. Here, not in those modules, so
        # that the kernels' replacements of them (kernels/cpu.py, gpu.py) keep it.
        self.reduce = no_reduce

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        dense = self.post_feedforward_layernorm_1(self.reduce(self.mlp(self.pre_feedforward_layernorm(h))))
        flat = h.reshape(-1, h.shape[-1])
        _, weights, index = self.router(flat)
        moe = self.reduce(self.experts(self.pre_feedforward_layernorm_2(flat), index, weights)).reshape(h.shape)
        return self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(moe))

    def forward(self, h, cos, sin, layer, cache_pass, encoder: bool) -> torch.Tensor:
        attn = self.reduce(self.self_attn(self.input_layernorm(h), cos, sin, layer, cache_pass))
        h = h + self.post_attention_layernorm(attn)
        h = h + self.feed_forward(h)
        return h * (self.encoder_layer_scalar if encoder else self.layer_scalar)


class SelfConditioning(nn.Module):
    """Gated MLP over the previous step's soft embeddings, added to the canvas embeddings."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.hidden_size
        self.pre_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_norm = RMSNorm(h, config.rms_norm_eps, with_scale=False)
        self.approximate = config.gelu_approximate
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)

    def forward(self, embeds: torch.Tensor, soft_embeds: torch.Tensor | None, reduce=no_reduce) -> torch.Tensor:
        """`reduce`: the model's (tensor parallelism sums the MLP's intermediate shards before the add)."""
        if soft_embeds is None:  # first step: the signal is exactly zero
            return self.post_norm(embeds)
        return self.post_norm(embeds + reduce(self.mlp(self.pre_norm(soft_embeds))))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self, x)


def token_embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """nn.Embedding's own init (normal) except on the meta device, where checkpoints are loaded
    into the model: there torch's normal_ imports torch._dynamo, 2 s of every process's start."""
    weight = torch.empty(vocab_size, hidden_size)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(vocab_size, hidden_size, _weight=weight)


class DiffusionGemma(nn.Module):
    def __init__(self, config: ModelConfig, vision: bool = False):
        super().__init__()
        self.config = config
        self.embed_tokens = token_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config, spec) for spec in config.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_conditioning = SelfConditioning(config)
        # Optional replacements for the two vocab-sized matmuls (see kernels/cpu.py); None: plain torch.
        self.lm_head_kernel = None
        self.soft_embed_kernel = None
        # float32 where the engine's copy multiplies bf16 weights in float32 (kernels/widened.py)
        self.compute_dtype: torch.dtype | None = None
        # One spec per layer kind, for RoPE tables. Frequencies are kept in float32 per device
        # (`rope_frequencies`), not as buffers that a dtype cast would round.
        self.rope_specs = {spec.kind: spec for spec in config.layers}
        self._rope_frequencies: dict[torch.device, dict[str, torch.Tensor]] = {}
        # Tensor parallelism (parallel/shard.py): the ranks' ShardGroup and ShardPlan once the model
        # is cut to one rank's share; `reduce` sums the vocabulary and self-conditioning shards'
        # partial results and `lookup` reads a vocabulary shard's rows (identity / the table here).
        self.shards = None
        self.shard_plan = None
        self.reduce = no_reduce
        self.lookup = table_lookup
        # ... and `gather_vocab` assembles whole logits rows from the ranks' columns, `own_vocab`
        # cuts a whole row to this rank's columns (both the identity here)
        self.gather_vocab = no_reduce
        self.own_vocab = no_reduce
        # The vision tower (model.encoder.vision_tower / embed_vision), when the checkpoint holds it.
        self.quantization: tuple[str, int | None] | None = None  # (scheme, group size) once quantised
        self.vision = None
        if vision:
            if config.vision is None:
                raise ValueError("a vision tower needs a vision_config")
            from .vision import Vision

            self.vision = Vision(config.vision, config.hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the weights' unless a kernel choice computes wider (`compute_dtype`)."""
        return self.compute_dtype or self.embed_tokens.weight.dtype

    @property
    def kv_config(self) -> ModelConfig:
        """The config of the keys and values this network computes: its rank's KV heads (replicas
        included) when cut across ranks (parallel/shard.py), with the whole vocabulary; else `config`."""
        if self.shards is None or self.shards.size == 1:
            return self.config
        return replace(self.shard_plan.rank_config(self.shards.rank), vocab_size=self.config.vocab_size)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.config.embed_scale, dtype=torch.float32).to(self.dtype)
        return self.lookup(self.embed_tokens, ids) * scale

    def soft_embed(self, probs: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
        """Expected embedding under `probs` [.., vocab]: probs @ E x sqrt(hidden).

        With `total`, `probs` are unnormalised weights and the result is divided by it, which saves
        normalising the full-vocab tensor.
        Sharded by vocabulary, `probs` are this rank's columns [.., Vs] and `total` the full sum.
        """
        w = self.embed_tokens.weight
        scale = torch.tensor(self.config.embed_scale, dtype=torch.float32).to(self.dtype)
        kernel = self.soft_embed_kernel
        soft = kernel(probs.to(self.dtype)) if kernel is not None else torch.matmul(probs.to(w.dtype), w)
        soft = self.reduce(soft)
        if total is not None:
            soft = soft / total.to(soft.dtype)[..., None]
        return soft * scale

    def soft_embed_from_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The reference's self-conditioning input: softmax(logits) @ E x sqrt(hidden)."""
        return self.soft_embed(self.own_vocab(logits.softmax(dim=-1, dtype=torch.float32)))

    def rope_frequencies(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Each layer kind's RoPE inverse frequencies (float32) on `device`: computed on the CPU as
        the reference does, copied to a device once. A copy per pass would make the host wait on a
        GPU, and is illegal inside a captured CUDA graph."""
        freqs = self._rope_frequencies.get(device)
        if freqs is None:
            freqs = {kind: rope.inv_freq(spec).to(device, non_blocking=True) for kind, spec in self.rope_specs.items()}
            self._rope_frequencies[device] = freqs
        return freqs

    def _run_layers(self, h: torch.Tensor, cache_pass, encoder: bool) -> torch.Tensor:
        freqs = self.rope_frequencies(h.device)
        tables = {kind: rope.cos_sin(cache_pass.positions, freqs[kind], h.dtype) for kind in self.rope_specs}
        for i, layer in enumerate(self.layers):
            cos, sin = tables[layer.self_attn.spec.kind]
            h = layer(h, cos, sin, i, cache_pass, encoder)
        return self.norm(h)

    def encode(self, ids: torch.Tensor, cache_pass, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Causal pass over ids [B, T]; writes the cache (commit it afterwards). Returns final hidden states.

        `embeds` [B, T, H] replaces `embed(ids)` (prefill passes it with image soft tokens written in)."""
        return self._run_layers(self.embed(ids) if embeds is None else embeds, cache_pass, encoder=True)

    def decode(self, canvas: torch.Tensor, cache_pass, soft_embeds: torch.Tensor | None) -> torch.Tensor:
        """Bidirectional pass over canvas [B, C] given self-conditioning soft embeddings [B, C, H] (or None)."""
        h = self.self_conditioning(self.embed(canvas), soft_embeds, self.reduce)
        return self._run_layers(h, cache_pass, encoder=False)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden @ E.T in the model's dtype: the logits before softcapping."""
        kernel = self.lm_head_kernel
        return kernel(hidden) if kernel is not None else F.linear(hidden, self.embed_tokens.weight)

    def whole_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`logits` over the whole vocabulary: on a model cut across ranks, every rank's columns
        gathered (the reference sampler, AR mode, `canvas_logits`); else `logits` itself."""
        return self.gather_vocab(self.logits(hidden))

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tied LM head, then float32 tanh softcapping.

        `out` [tokens, vocab] float32 receives a bf16/fp16 head's conversion; a float32 head's own
        output is softcapped where it is (in place outside autograd) and `out` is left unused.
        """
        cap = self.config.final_logit_softcapping
        logits = self.lm_head(hidden)
        if out is not None and logits.dtype != torch.float32:
            logits = out.view(logits.shape).copy_(logits)
        logits = logits.to(torch.float32)
        if logits.requires_grad:
            return torch.tanh(logits / cap) * cap
        return logits.div_(cap).tanh_().mul_(cap)  # same ops in place: no [tokens, vocab] temporaries

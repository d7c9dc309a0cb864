"""The training objective of DiffusionGemma (as published for SFT).

For each sequence, one block of `canvas_length` supervised positions is chosen. A noise level
t ~ U(eps, 1) is drawn and each canvas position is replaced by a uniform random vocabulary token
with probability t (there is no [MASK] token: a canvas at inference starts as uniform noise).
The decoder denoises the block given the clean prefix in the KV cache; its loss is the mean
cross-entropy over the supervised canvas positions (no 1/t weighting). The encoder's causal pass
over the clean sequence adds an autoregressive cross-entropy, weighted by `ar_weight` (1.0).

Self-conditioning is trained with two passes: a no-grad decoder pass without the signal, whose
logits feed the second pass for a random half of the examples (`sc_prob`); only the second pass
has a loss. That matches inference, where step 1 has no signal and later steps have one.

Every random draw comes from a per-example generator seeded from (seed, step, example index),
so a batch's noise does not depend on how it is split across micro-batches or ranks: gradient
accumulation and data parallelism see exactly the examples and noise a single process would, and
a resumed run redraws exactly what the interrupted one would have.

Memory (the released size on one card, QLoRA): `checkpoint_layers` keeps only each layer's input
from the forward and recomputes the layer in the backward, in the decoder passes and in the
encoder pass; the encoder layer writes the (differentiable) KV cache, so it runs checkpointed
with its K/V buffers as explicit inputs and outputs (`_encoder_layer`), never as a side effect
the recomputation would repeat. `chunk_rows` computes both cross-entropies and the
self-conditioning input over the vocabulary a chunk of rows at a time (chunked.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..dense.kv_cache import DenseKVCache
from ..model import rope
from ..model.diffusion_gemma import DiffusionGemma
from .chunked import chunked_cross_entropy, chunked_soft_embeds

EPS = 1e-3
_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def example_seed(seed: int, step: int, index: int, salt: int = 0) -> int:
    """A 63-bit seed for one example's draws at one step (a fixed integer mix, stable across runs)."""
    x = (seed * _MIX[0] + step * _MIX[1] + index * _MIX[2] + salt) % (1 << 64)
    x ^= x >> 31
    x = (x * _MIX[1]) % (1 << 64)
    x ^= x >> 29
    return x & ((1 << 63) - 1)


def example_generator(seed: int, step: int, index: int, salt: int = 0) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(example_seed(seed, step, index, salt))
    return g


@dataclass
class Example:
    """A tokenised training sequence: ids, which ids are supervised targets, and whether it is complete.

    `complete` means the sequence ends where the document ends (its last id is EOS), so a canvas
    that runs past the end is supervised to produce pad, which is what generation emits after EOS.
    """

    ids: list[int]
    mask: list[bool]
    complete: bool = True


@dataclass
class Batch:
    """A collated micro-batch: right-padded ids and the chosen canvas block of each row."""

    ids: torch.Tensor  # [B, L] long, right-padded with pad
    lengths: list[int]  # real tokens per row
    ar_mask: torch.Tensor  # [B, L] bool: ids[:, i] is a supervised target of the encoder
    block_start: list[int]  # [B * k] canvas position 0 sits here (prefix = ids[:start]); k blocks per row
    target: torch.Tensor  # [B * k, C] long: clean block (pad past the end of a complete sequence)
    canvas_mask: torch.Tensor  # [B * k, C] bool: supervised canvas positions

    @property
    def blocks(self) -> int:
        return len(self.block_start) // self.ids.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.ids.to(device),
            self.lengths,
            self.ar_mask.to(device),
            self.block_start,
            self.target.to(device),
            self.canvas_mask.to(device),
        )


@dataclass
class Noise:
    """The diffusion draws for a batch: noise level, corrupted positions, replacement tokens, self-conditioning."""

    t: torch.Tensor  # [B] float in [eps, 1)
    corrupt: torch.Tensor  # [B, C] bool
    tokens: torch.Tensor  # [B, C] long, uniform over the vocabulary
    self_cond: torch.Tensor  # [B] bool: the second pass sees the first pass's predictions

    def to(self, device: torch.device | str) -> Noise:
        return Noise(self.t.to(device), self.corrupt.to(device), self.tokens.to(device), self.self_cond.to(device))


def choose_block(example: Example, canvas_length: int, gen: torch.Generator) -> tuple[int, list[int], list[bool]]:
    """Pick the block start among supervised positions; return (start, target ids, target mask).

    Positions past the end of a complete sequence are pad and supervised; past the end of a
    truncated one they are unknown, so such blocks are avoided when the sequence allows it.
    """
    n = len(example.ids)
    candidates = [i for i in range(1, n) if example.mask[i]]
    if not example.complete:
        inside = [i for i in candidates if i + canvas_length <= n]
        candidates = inside or candidates
    if not candidates:  # nothing supervised: an unsupervised block after the end (contributes no loss)
        return max(1, n), [0] * canvas_length, [False] * canvas_length
    start = candidates[int(torch.randint(len(candidates), (1,), generator=gen))]
    target = example.ids[start : start + canvas_length]
    mask = example.mask[start : start + canvas_length]
    pad = canvas_length - len(target)
    return start, target + [0] * pad, mask + [example.complete] * pad


def collate(
    examples: list[Example],
    canvas_length: int,
    generators: list[torch.Generator],
    blocks: int = 1,
    pad_id: int = 0,
) -> Batch:
    """Right-pad a list of examples and choose `blocks` canvas blocks per example with its generator."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    ar_mask = torch.zeros(len(examples), width, dtype=torch.bool)
    starts, targets, masks = [], [], []
    for r, (e, g) in enumerate(zip(examples, generators)):
        ids[r, : len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
        ar_mask[r, : len(e.ids)] = torch.tensor(e.mask, dtype=torch.bool)
        for _ in range(blocks):
            start, target, mask = choose_block(e, canvas_length, g)
            starts.append(start)
            targets.append(target)
            masks.append(mask)
    return Batch(
        ids=ids,
        lengths=[len(e.ids) for e in examples],
        ar_mask=ar_mask,
        block_start=starts,
        target=torch.tensor(targets, dtype=torch.long),
        canvas_mask=torch.tensor(masks, dtype=torch.bool),
    )


def draw_noise(
    generators: list[torch.Generator],
    canvas_length: int,
    vocab_size: int,
    sc_prob: float = 0.5,
    eps: float = EPS,
    blocks: int = 1,
) -> Noise:
    """Diffusion draws for each of an example's `blocks` canvases, from that example's generator."""
    ts, corrupt, tokens, sc = [], [], [], []
    for g in (g for g in generators for _ in range(blocks)):
        t = eps + (1.0 - eps) * torch.rand((), generator=g)
        ts.append(t)
        corrupt.append(torch.rand(canvas_length, generator=g) < t)
        tokens.append(torch.randint(vocab_size, (canvas_length,), generator=g))
        sc.append(torch.rand((), generator=g) < sc_prob)
    return Noise(torch.stack(ts), torch.stack(corrupt), torch.stack(tokens), torch.stack(sc))


def corrupt_canvas(target: torch.Tensor, noise: Noise) -> torch.Tensor:
    """The noisy canvas x_t: each corrupted position holds its uniform random token."""
    return torch.where(noise.corrupt, noise.tokens, target)


def masked_cross_entropy(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the True positions of `mask` (0 when there are none); logits [..., V]."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="none")
    m = mask.reshape(-1).to(ce.dtype)
    return (ce * m).sum() / m.sum().clamp(min=1.0)


def ar_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, ar_mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of the encoder: logits[:, i] predicts ids[:, i + 1] where supervised."""
    return masked_cross_entropy(logits[:, :-1], ids[:, 1:], ar_mask[:, 1:])


def expand_rows(cache: DenseKVCache, k: int) -> None:
    """Repeat every cache row k times (differentiably), so that k canvases share one encoder pass.

    Each repeated row is another sample of the same objective (another block and noise level of
    the same sequence), which buys k times the diffusion signal for one encoder pass.
    """
    cache.keys = [t.repeat_interleave(k, 0) for t in cache.keys]
    cache.values = [t.repeat_interleave(k, 0) for t in cache.values]
    cache.key_valid = cache.key_valid.repeat_interleave(k, 0)
    cache.lengths = [n for n in cache.lengths for _ in range(k)]


@dataclass
class Losses:
    total: torch.Tensor
    diffusion: torch.Tensor
    ar: torch.Tensor


def _encoder_layer(layer: torch.nn.Module, index: int, h: torch.Tensor, cos, sin, cache_pass) -> torch.Tensor:
    """One encoder layer under activation checkpointing. The layer writes its keys and values into
    the differentiable cache (a new buffer, `DenseKVCache.store_and_view`); here the buffer it
    starts from goes in and the one it writes comes out as explicit outputs, and the cache is left
    as it was inside the checkpointed function. So the recomputation in the backward repeats no
    side effect, and the decoder's gradient reaches these K/V through the outputs' graph."""
    cache = cache_pass.cache

    def run(h: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        before = cache.keys[index], cache.values[index]
        cache.keys[index], cache.values[index] = keys, values
        try:
            out = layer(h, cos, sin, index, cache_pass, True)
            return out, cache.keys[index], cache.values[index]
        finally:
            cache.keys[index], cache.values[index] = before

    out, cache.keys[index], cache.values[index] = checkpoint(
        run, h, cache.keys[index], cache.values[index], use_reentrant=False
    )
    return out


def run_layers(
    net: DiffusionGemma, h: torch.Tensor, cache_pass, encoder: bool, checkpoint_layers: bool
) -> torch.Tensor:
    """`net._run_layers` (every layer, then the final norm), each layer checkpointed where autograd
    records and `checkpoint_layers` asks: its activations are recomputed in the backward from its
    input, so a pass keeps one hidden state per layer instead of every intermediate."""
    if not (checkpoint_layers and torch.is_grad_enabled()):
        return net._run_layers(h, cache_pass, encoder)
    if encoder and not cache_pass.cache.differentiable:
        raise ValueError("checkpointed encoder layers need a differentiable cache (they return its K/V)")
    freqs = net.rope_frequencies(h.device)
    tables = {kind: rope.cos_sin(cache_pass.positions, freqs[kind], h.dtype) for kind in net.rope_specs}
    for i, layer in enumerate(net.layers):
        cos, sin = tables[layer.self_attn.spec.kind]
        if encoder:
            h = _encoder_layer(layer, i, h, cos, sin, cache_pass)
        else:  # the decoder reads the cache (a copy of each buffer): nothing to hand back
            h = checkpoint(layer, h, cos, sin, i, cache_pass, False, use_reentrant=False)
    return net.norm(h)


def _loss(net: DiffusionGemma, hidden: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, rows: int | None):
    """Mean cross-entropy of the model's logits over `mask`: whole (`masked_cross_entropy`) or a
    chunk of `rows` rows at a time, the logits recomputed in the backward (chunked.py)."""
    if rows is None:
        return masked_cross_entropy(net.logits(hidden), target, mask)
    weight = net.embed_tokens.weight
    return chunked_cross_entropy(hidden, weight, target, mask, net.config.final_logit_softcapping, rows)


def training_losses(
    net: DiffusionGemma,
    batch: Batch,
    noise: Noise,
    ar_weight: float = 1.0,
    two_pass: bool = True,
    checkpoint_layers: bool = False,
    chunk_rows: int | None = None,
) -> Losses:
    """Encoder pass over the clean sequence (AR loss, KV cache), then the two-pass decoder on the noisy blocks.

    The decoder of block r sees only the encoder's keys at positions < block_start[r] and places the
    canvas at positions block_start[r] + [0, C), exactly where generation would place it. With
    `two_pass` the no-grad first pass always runs (rows whose `self_cond` is False get a zero
    signal), so every data-parallel rank makes the same module calls whatever its draws; without
    it no row gets the signal. `checkpoint_layers` and `chunk_rows` (None: the whole logits at
    once) trade compute for memory and give the same losses and gradients to float32 rounding.
    """
    bsz, width = batch.ids.shape
    c = batch.target.shape[1]
    cache = DenseKVCache(net.config, bsz, width + c, device=batch.ids.device, dtype=net.dtype, differentiable=True)
    ragged = any(n != width for n in batch.lengths)
    plan = cache.plan_encoder(width, new_counts=batch.lengths if ragged else None)
    hidden = run_layers(net, net.embed(batch.ids), plan, True, checkpoint_layers)
    cache.commit(plan)
    if chunk_rows is None:
        ar = ar_cross_entropy(net.logits(hidden), batch.ids, batch.ar_mask)
    else:  # logits[:, i] predicts ids[:, i + 1], as ar_cross_entropy
        ar = _loss(net, hidden[:, :-1], batch.ids[:, 1:], batch.ar_mask[:, 1:], chunk_rows)
    del hidden

    if batch.blocks > 1:
        expand_rows(cache, batch.blocks)
    cache.set_lengths(batch.block_start)
    canvas = corrupt_canvas(batch.target, noise)
    dec_plan = cache.plan_decoder(c)

    def decode(soft: torch.Tensor | None) -> torch.Tensor:
        h = net.self_conditioning(net.embed(canvas), soft, net.reduce)
        return run_layers(net, h, dec_plan, False, checkpoint_layers)

    soft = None
    if two_pass:
        with torch.no_grad():
            first = decode(None)
            if chunk_rows is None:
                soft = net.soft_embed_from_logits(net.logits(first))
            else:
                soft = chunked_soft_embeds(net, first, chunk_rows)
        soft = soft * noise.self_cond.to(net.dtype)[:, None, None]
    diffusion = _loss(net, decode(soft), batch.target, batch.canvas_mask, chunk_rows)
    return Losses(diffusion + ar_weight * ar, diffusion, ar)


class TrainingModule(torch.nn.Module):
    """The objective as a module whose forward is the loss, so FSDP2's hooks see one forward per step."""

    def __init__(
        self,
        net: DiffusionGemma,
        ar_weight: float = 1.0,
        self_conditioning: bool = True,
        checkpoint_layers: bool = False,
        chunk_rows: int | None = None,
    ):
        super().__init__()
        self.net = net
        self.ar_weight = ar_weight
        self.self_conditioning = self_conditioning
        self.checkpoint_layers = checkpoint_layers
        self.chunk_rows = chunk_rows

    def forward(self, batch: Batch, noise: Noise) -> Losses:
        return training_losses(
            self.net,
            batch,
            noise,
            self.ar_weight,
            self.self_conditioning,
            self.checkpoint_layers,
            self.chunk_rows,
        )

"""The reference sampler: transformers' `DiffusionGemmaForBlockDiffusion.generate`, step for step.

Outer loop over blocks: a canvas of `canvas_length` random tokens is denoised by repeated decoder
passes (inner loop), its argmax is committed, and the committed block is run through the encoder
to extend the KV cache before the next canvas starts. Every random number comes from torch's
global RNG in the reference's order, so that after the same `torch.manual_seed` the tokens are
identical (CPU, float32). Ragged prompts are left-padded with an attention mask, as one calls
the reference; the prompt is encoded in one pass, as the reference does, in a dense cache.

The default sampler (each request its own generator, continuous batching, the paged cache and
prefix caching) is the engine's (`engine.py`). Both emit the same events (`events.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig
from ..engine import sampler
from ..engine.events import Block, Draft, GenerationOutput, cut_block, shown_entropy
from ..engine.prefill import PlacedImage, prefill
from ..engine.request import validate_prompts
from ..model.diffusion_gemma import DiffusionGemma
from .kv_cache import DenseKVCache


@dataclass
class _RowResult:
    tokens: list[int] = field(default_factory=list)
    passes: int = 0
    tokens_per_forward: float = 0.0
    counted: int = 0  # non-pad tokens generated (the reference's count), for tokens_per_forward
    done: bool = False


def _finish(results: list[_RowResult]) -> GenerationOutput:
    return GenerationOutput(
        sequences=[r.tokens for r in results],
        tokens_per_forward=[r.tokens_per_forward for r in results],
        decoder_passes=[r.passes for r in results],
    )


@torch.no_grad()
def reference_events(
    net: DiffusionGemma,
    prompts: list[list[int]],
    gen: GenerationConfig,
    drafts: bool = False,
    images: list[list[PlacedImage]] | None = None,
    initial_canvas: torch.Tensor | None = None,
) -> Iterator[Draft | Block]:
    """The reference sampler, random numbers from the global RNG in the reference's order.
    `images[r]`: prompt r's image soft tokens placed in it (see prefill). `initial_canvas`
    [B, C]: the first canvas (transformers' `decoder_input_ids`); the random one is drawn all
    the same, as the reference draws it before it looks for decoder_input_ids."""
    cfg = net.config
    validate_prompts(prompts, cfg.vocab_size)
    device, batch, canvas_len, vocab = net.device, len(prompts), cfg.canvas_length, cfg.vocab_size
    max_len = max(len(p) for p in prompts)
    num_blocks = math.ceil(gen.max_new_tokens / canvas_len)
    cache = DenseKVCache(net.kv_config, batch, max_len + num_blocks * canvas_len, device, net.dtype)

    ids = torch.full((batch, max_len), gen.pad_token_id, dtype=torch.long)
    valid = torch.zeros(batch, max_len, dtype=torch.bool)
    for r, p in enumerate(prompts):  # left padding, as the reference is called with an attention mask
        ids[r, max_len - len(p) :] = torch.tensor(p)
        valid[r, max_len - len(p) :] = True
    if not valid.all():
        cache.mark_padding(valid)

    eos = torch.tensor(gen.eos_token_ids, dtype=torch.long, device=device) if gen.eos_token_ids else None
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    passes = torch.zeros(batch, dtype=torch.long, device=device)
    results = [_RowResult() for _ in range(batch)]
    block_input = ids
    rows = list(range(batch))
    # left padding shifts each prompt's images as it shifts its tokens
    placed = [[(s + max_len - len(p), f) for s, f in row] for p, row in zip(prompts, images)] if images else None
    for block in range(num_blocks):
        prefill(net, cache, rows, block_input.tolist(), images=placed if block == 0 else None)  # one pass per block

        decode_pass = cache.plan_decoder(canvas_len)
        canvas = torch.randint(0, vocab, (batch, canvas_len), device=device)
        if block == 0 and initial_canvas is not None:
            canvas = initial_canvas.to(device)
        argmax_canvas = canvas
        sc_logits = None
        history = None
        finished_denoising = torch.zeros(batch, dtype=torch.bool, device=device)
        block_passes = torch.zeros(batch, dtype=torch.long, device=device)
        for steps_remaining in reversed(range(1, gen.max_denoising_steps + 1)):
            block_passes += ~(finished_denoising | finished)
            soft = net.soft_embed_from_logits(sc_logits) if sc_logits is not None else None
            logits = net.whole_logits(net.decode(canvas, decode_pass, soft))
            processed = logits / sampler.temperature(steps_remaining, gen.max_denoising_steps, gen.t_min, gen.t_max)
            probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
            denoised = torch.multinomial(probs.view(-1, vocab), num_samples=1).view(batch, canvas_len)
            new_argmax = torch.argmax(processed, dim=-1)
            entropy = sampler.reference_entropy(processed)
            accepted = sampler.entropy_bound_accept(entropy, gen.entropy_bound)
            accepted_canvas = torch.where(accepted, denoised, canvas)
            noise = torch.randint(0, vocab, (batch, canvas_len), device=device)
            new_canvas = torch.where(~accepted, noise, accepted_canvas)
            if finished_denoising.any():  # converged rows keep their canvas and logits
                new_argmax = torch.where(finished_denoising[:, None], argmax_canvas, new_argmax)
                new_canvas = torch.where(finished_denoising[:, None], canvas, new_canvas)
                processed = torch.where(finished_denoising[:, None, None], sc_logits, processed)
                entropy = sampler.reference_entropy(processed)
            stop, history = sampler.stable_and_confident(
                history, new_argmax, entropy, gen.stability_threshold, gen.confidence_threshold
            )
            converged = finished_denoising.clone()  # rows that kept their canvas this step
            finished_denoising |= stop
            sc_logits = processed.to(net.dtype)
            canvas, argmax_canvas = new_canvas, new_argmax
            if drafts:
                step = gen.max_denoising_steps - steps_remaining + 1
                for r in range(batch):
                    if not results[r].done:
                        kept = (accepted[r] | converged[r]).tolist()
                        yield Draft(r, block, step, argmax_canvas[r].tolist(), kept, shown_entropy(entropy[r].tolist()))
            if bool(finished_denoising.all()):
                break
        passes += block_passes

        # Commit: rows finished earlier get pad; rows hitting EOS now get pad after their first EOS.
        committed = argmax_canvas.clone()
        committed[finished] = gen.pad_token_id
        hit = torch.isin(committed, eos).any(dim=-1) if eos is not None else torch.zeros_like(finished)
        new_finished = hit & ~finished
        if eos is not None and new_finished.any():
            is_eos = torch.isin(committed, eos)
            count = is_eos.cumsum(dim=-1)
            after_eos = (count > 0) & ~((count == 1) & is_eos)
            committed[after_eos & new_finished[:, None]] = gen.pad_token_id
        out_of_room = (block + 1) * canvas_len >= gen.max_new_tokens
        for r in range(batch):
            res = results[r]
            if res.done:
                continue
            row = committed[r].tolist()
            tokens, hit_eos, _ = cut_block(row, gen.eos_token_ids, gen.max_new_tokens - len(res.tokens))
            res.tokens += tokens
            res.counted += sum(1 for t in row if t != gen.pad_token_id)
            res.passes = int(passes[r])
            res.done = hit_eos or out_of_room or len(res.tokens) >= gen.max_new_tokens
            yield Block(r, block, tokens, res.done, int(block_passes[r]))
        finished |= hit
        if bool(finished.all()) or out_of_room:
            break
        block_input = committed
    for r, res in enumerate(results):
        res.passes = int(passes[r])
        res.tokens_per_forward = res.counted / res.passes if res.passes else 0.0
    return _finish(results)

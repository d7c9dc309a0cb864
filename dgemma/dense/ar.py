"""Autoregressive decoding with the same weights.

The encoder pass is a causal LM trained with an autoregressive loss: its final hidden state
through the tied head (softcapped) gives next-token logits. Greedy (temperature 0) or sampled
decoding with it is the honest baseline for diffusion's tokens per forward.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..engine.events import Block, GenerationOutput
from ..engine.prefill import prefill
from ..engine.sampler import sample_from_weights
from ..model.diffusion_gemma import DiffusionGemma
from .kv_cache import DenseKVCache


@torch.no_grad()
def ar_events(
    net: DiffusionGemma,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    seeds: list[int],
    eos_token_ids: tuple[int, ...],
) -> Iterator[Block]:
    """One `Block` event of one token per row per step; returns a GenerationOutput."""
    if max_new_tokens <= 0:
        raise ValueError("max_new_tokens must be positive")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    device, batch = net.device, len(prompts)
    lengths = [len(p) for p in prompts]
    cache = DenseKVCache(net.kv_config, batch, max(lengths) + max_new_tokens, device, net.dtype)
    generators = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
    last = prefill(net, cache, list(range(batch)), prompts)

    outputs: list[list[int]] = [[] for _ in prompts]
    live = list(range(batch))
    eos = set(eos_token_ids)
    for step in range(max_new_tokens):
        logits = net.whole_logits(last)  # [live, vocab]
        if temperature == 0:
            next_ids = logits.argmax(dim=-1)
        else:
            z = logits / temperature
            weights = torch.exp(z - z.max(dim=-1, keepdim=True).values)
            u = torch.stack([torch.rand((), generator=generators[r]) for r in live]).to(device)
            next_ids = sample_from_weights(weights, u)
        still = []
        for j, r in enumerate(live):
            t = int(next_ids[j])
            outputs[r].append(t)
            done = t in eos or step == max_new_tokens - 1
            yield Block(r, step, [t], done, 1)
            if not done:
                still.append(j)
        if not still:
            break
        live = [live[j] for j in still]
        last = prefill(net, cache, live, [[int(next_ids[j])] for j in still])
    passes = [len(o) for o in outputs]
    return GenerationOutput(sequences=outputs, tokens_per_forward=[1.0] * batch, decoder_passes=passes)


def ar_stream(
    model, prompt_ids: list[int], max_new_tokens: int | None = None, temperature: float = 0.0, seed: int | None = None
):
    """AR events for one prompt, with the checkpoint's max_new_tokens and EOS list by default
    (`Model.ar_events`: the device loop on a GPU, this module's elsewhere)."""
    gen = model.generation_config
    return model.ar_events(
        [list(prompt_ids)],
        max_new_tokens or gen.max_new_tokens,
        temperature,
        [seed if seed is not None else 0],
        gen.eos_token_ids,
    )

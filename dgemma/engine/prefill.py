"""The one prefill function: every way to generate encodes prompts (and committed blocks) here.

The engine, the reference loop, AR mode, `canvas_logits` and the scripts all call `prefill`; it
works on either cache (the dense rows of `kv_cache.py`, the block tables of `kv/paged_cache.py`),
which both plan passes from each row's current length. The fused network (kernels/fused.py, the
engine's GPU path) on the paged cache plans its passes in place: its q|k|v kernel writes the keys
and values into the pool and its attention reads them there (`PagedKVCache.plan_encoder`'s
`in_place`), where the others gather the prefix. Image soft tokens (computed by the vision tower
beforehand) replace their placeholders' embeddings here, and a pass never splits an image.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..inputs.model_inputs import image_safe_end
from ..kernels import lora
from ..kernels.fused import FusedGemma
from ..model.diffusion_gemma import DiffusionGemma
from .kv.paged_cache import PagedKVCache

# Soft tokens of one image placed in a token list: (index of its first placeholder, features [n, hidden]).
PlacedImage = tuple[int, torch.Tensor]


@torch.no_grad()
def prefill(
    net: DiffusionGemma,
    cache,
    rows: Sequence,
    token_lists: Sequence[Sequence[int]],
    pass_tokens: int | None = None,
    images: Sequence[Sequence[PlacedImage]] | None = None,
    adapters: Sequence[int] | None = None,
) -> torch.Tensor:
    """Encode token_lists[i] after what cache row rows[i] already holds; returns the final hidden
    state of each row's last new token [len(rows), hidden].

    `pass_tokens=None` runs one pass (rows of different lengths are padded on the right);
    otherwise each pass of a row ends at the next multiple of `pass_tokens` (absolute positions),
    so a sequence is always cut into the same passes whatever was encoded before: a prefix-cache
    hit then only skips passes, and the rest rounds exactly as a cold run (CPU GEMMs round
    differently with the number of rows they see). `images[i]` places image features in row i;
    `adapters[i]` is row i's LoRA slot (-1: none) on a network with adapters (kernels/lora.py).
    """
    images = images or [[] for _ in rows]
    spans = [[(s, s + f.shape[0]) for s, f in placed] for placed in images]
    done = [0] * len(rows)
    last: list[torch.Tensor | None] = [None] * len(rows)
    pad = net.config.pad_token_id
    in_place = isinstance(net, FusedGemma) and isinstance(cache, PagedKVCache)
    while True:
        active = [i for i in range(len(rows)) if done[i] < len(token_lists[i])]
        if not active:
            break
        counts = []
        for i in active:
            count = len(token_lists[i]) - done[i]
            if pass_tokens is not None:
                start = cache.length(rows[i])
                count = min(count, (start // pass_tokens + 1) * pass_tokens - start)
            counts.append(image_safe_end(done[i], done[i] + count, spans[i]) - done[i])
        ids = torch.full((len(active), max(counts)), pad, dtype=torch.long)
        for j, (i, count) in enumerate(zip(active, counts)):
            ids[j, :count] = torch.tensor(token_lists[i][done[i] : done[i] + count])
        now = [rows[i] for i in active]
        plan = (
            cache.plan_encoder(max(counts), now, counts, in_place=True)
            if in_place
            else cache.plan_encoder(max(counts), now, counts)
        )
        ids = ids.to(net.device, non_blocking=True)  # no wait for the passes queued before it
        embeds = _with_images(net, ids, plan, [images[i] for i in active], [done[i] for i in active])
        with lora.selected(net, None if adapters is None else [adapters[i] for i in active]):
            hidden = net.encode(ids, plan, embeds)
        cache.commit(plan)
        for j, (i, count) in enumerate(zip(active, counts)):
            last[i] = hidden[j, count - 1]
            done[i] += count
    if any(h is None for h in last):
        raise ValueError("prefill needs at least one token per row")
    return torch.stack(last)


def _with_images(net: DiffusionGemma, ids: torch.Tensor, plan, placed: list, offsets: list[int]) -> torch.Tensor | None:
    """The pass's input embeddings with image features written over their placeholders (None
    when the pass holds no image); with bidirectional vision, each image's tokens see each other."""
    inside = [
        [(s - off, f) for s, f in row if s < off + ids.shape[1] and s + f.shape[0] > off]
        for row, off in zip(placed, offsets)
    ]
    if not any(inside):
        return None
    embeds = net.embed(ids)
    groups = torch.full(ids.shape, -1, dtype=torch.long, device=ids.device)
    for j, row in enumerate(inside):
        for g, (s, f) in enumerate(row):  # image_safe_end keeps every image whole within a pass
            embeds[j, s : s + f.shape[0]] = f.to(embeds.dtype)
            groups[j, s : s + f.shape[0]] = g
    if net.config.vision is not None and net.config.vision.bidirectional:
        plan.see_within_images(groups)
    return embeds

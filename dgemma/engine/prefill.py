"""The one prefill function: every way to generate encodes prompts (and committed blocks) here.

The engine, the reference loop, AR mode, `canvas_logits` and the scripts all call `prefill`; it
works on either cache (the dense rows of `kv_cache.py`, the block tables of `paged_cache.py`),
which both plan passes from each row's current length.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..model.diffusion_gemma import DiffusionGemma


@torch.no_grad()
def prefill(
    net: DiffusionGemma, cache, rows: Sequence, token_lists: Sequence[Sequence[int]], pass_tokens: int | None = None
) -> torch.Tensor:
    """Encode token_lists[i] after what cache row rows[i] already holds; returns the final hidden
    state of each row's last new token [len(rows), hidden].

    `pass_tokens=None` runs one pass (rows of different lengths are padded on the right);
    otherwise each pass of a row ends at the next multiple of `pass_tokens` (absolute positions),
    so a sequence is always cut into the same passes whatever was encoded before: a prefix-cache
    hit then only skips passes, and the rest rounds exactly as a cold run (CPU GEMMs round
    differently with the number of rows they see).
    """
    done = [0] * len(rows)
    last: list[torch.Tensor | None] = [None] * len(rows)
    pad = net.config.pad_token_id
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
            counts.append(count)
        ids = torch.full((len(active), max(counts)), pad, dtype=torch.long)
        for j, (i, count) in enumerate(zip(active, counts)):
            ids[j, :count] = torch.tensor(token_lists[i][done[i] : done[i] + count])
        plan = cache.plan_encoder(max(counts), [rows[i] for i in active], counts)
        hidden = net.encode(ids.to(net.device), plan)
        cache.commit(plan)
        for j, (i, count) in enumerate(zip(active, counts)):
            last[i] = hidden[j, count - 1]
            done[i] += count
    if any(h is None for h in last):
        raise ValueError("prefill needs at least one token per row")
    return torch.stack(last)

"""The encode part of scripts/roofline.py (PREDICTED on a CPU, no GPU): a prompt's encode as the
engine runs it, and what its paged prefix attention moves and computes.

Why apart: the encode is the one scenario made of several passes (a prompt longer than the
engine's prefill chunk is encoded a chunk a step, each chunk attending to every position before
it), and its attention kernel (`triton_attention._paged_prefix_kernel`) does work that depends on
where the chunk starts, which the meta device's tensors cannot tell: each pass's launches are
recorded with the chunk's start, and the kernel's work is counted from its grid and that start.
Imported by roofline.py after its `_helpers` put the suite's helpers on the path; needs neither
torch nor triton to import.
"""

from __future__ import annotations

import math


def prompt_encode_launches(net, prompt: int) -> list[tuple[int, object]]:
    """[(chunk start, launches)] of encoding a `prompt`-token prompt as the engine's steps run it
    for a request alone: one prefill chunk a step (EngineOptions.prefill_chunk, 2,048 tokens; one
    pass a chunk on a GPU, where runs are not batch invariant), each counted on its own."""
    import torch

    import launch_count
    from dgemma.config import GenerationConfig
    from dgemma.engine.engine import Request
    from host_sync import count_host_reads

    out = []
    with launch_count.h200():
        engine = launch_count.meta_engine(net)
        gen = GenerationConfig(max_new_tokens=net.config.canvas_length, max_denoising_steps=1)
        engine.add(Request(list(range(10, 10 + prompt)), gen, 0))
        with torch.no_grad(), count_host_reads():
            done = 0
            while done < prompt:
                plan = engine.scheduler.schedule()
                [work] = plan.encode
                assert work.start == done, (work.start, done)
                with launch_count.count_launches(engine.runner.net) as launches:
                    engine.runner._encode(plan.encode)
                out.append((work.start, launches))
                engine.scheduler.update(plan, [])
                done = work.end
    return out


def key_tiles(start: int, tokens: int, group: int, window: int, block_m: int, block_n: int, m_tiles: int) -> int:
    """Key tiles the prefix kernel's programs of one row and KV head visit together: query tile m
    holds packed rows [m * block_m, (m + 1) * block_m) (row r: position start + r // group) and
    walks keys from its first query's window (0 on a global layer) to its last query, as the
    kernel's loop bounds do (a row with no image)."""
    total = 0
    for m in range(m_tiles):
        first = start + min(m * block_m // group, tokens - 1)
        last = start + min(((m + 1) * block_m - 1) // group, tokens - 1)
        lo = max(first - window + 1, 0) if window else 0
        total += math.ceil((last + 1 - lo) / block_n)
    return total


def prefix_attention(rec: dict, start: int) -> dict:
    """bytes, flops, ctas and the variant of one `_paged_prefix_kernel` launch whose rows start at
    position `start`: q and the output once, the keys and values in view once (compulsory DRAM
    traffic: the positions [start - window + 1, start + T) of a sliding layer, [0, start + T) of a
    global one), the block table; tensor FLOPs of the tiles the programs multiply (masked products
    included: they take the tensor cores' time too)."""
    a, grid = rec["args"], rec["grid"]
    q, kp, vp = a["q_ptr"], a["kp_ptr"], a["vp_ptr"]
    n, h, tokens, d = q.shape
    hkv, group, window = a["HKV"], a["G"], a["WINDOW"]
    bm, bn = a["BLOCK_M"], a["BLOCK_N"]
    end = start + tokens
    keys = end - (max(start - window + 1, 0) if window else 0)
    size = q.element_size()
    tiles = key_tiles(start, tokens, group, window, bm, bn, grid[0])
    return dict(
        bytes=2 * n * h * tokens * d * size  # q, out
        + n * hkv * keys * d * (kp.element_size() + vp.element_size())
        + a["table_ptr"].numel() * a["table_ptr"].element_size(),
        flops=4.0 * n * hkv * tiles * bm * bn * d,
        ctas=math.prod(grid),
        variant=f"D={d} {'sliding' if window else 'global'} {bm}x{bn}",
        sliding=bool(window),
    )

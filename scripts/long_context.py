"""A long prompt on this machine: time to first block, peak memory, and a short request served meanwhile.

    python scripts/long_context.py --prompt-tokens 32768

A small random model (its max_position_embeddings raised to fit) gets one long prompt, and a
short request arrives right after it. The engine prefills the long prompt `--prefill-chunk`
tokens per step, between decoder steps of the short one; the script reports the long prompt's
time to first committed block, the process's peak memory and the most KV blocks in use, and
how many blocks the short request committed while the long prompt was still prefilling.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dgemma.config import GLOBAL, SLIDING, GenerationConfig  # noqa: E402
from dgemma.engine.engine import Engine, EngineOptions, Request  # noqa: E402
from dgemma.engine.events import Block, Finished  # noqa: E402
from dgemma.engine.kv.budget import dtype_bytes  # noqa: E402
from dgemma.engine.kv.paged_cache import kv_bytes_per_token  # noqa: E402
from dgemma.kernels.choice import engine_net  # noqa: E402
from dgemma.model.checkpoint import make_config, random_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--canvas", type=int, default=128, help="canvas length (and KV block size)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    c = args.canvas
    config = make_config(
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_kv_heads=1,
        intermediate_size=128,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        sliding_window=512,
        canvas_length=c,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=args.prompt_tokens + 8 * c,
    )
    net = engine_net(random_model(config, seed=0, std=0.05))
    engine = Engine(net, EngineOptions(prefill_chunk=args.prefill_chunk))
    fixed = dict(max_denoising_steps=8, confidence_threshold=1e-30, eos_token_ids=())  # 8 passes per canvas
    g = torch.Generator().manual_seed(0)
    long = Request(
        torch.randint(5, 512, (args.prompt_tokens,), generator=g).tolist(),
        GenerationConfig(max_new_tokens=2 * c, **fixed),
        seed=0,
    )
    short = Request([5, 6, 7, 8, 9], GenerationConfig(max_new_tokens=4 * c, **fixed), seed=1)
    start = time.perf_counter()
    engine.add(long)
    engine.add(short)
    first_block, short_blocks_meanwhile, short_done = None, 0, None
    most_blocks = {SLIDING: 0, GLOBAL: 0}
    while engine.has_work:
        events = engine.step()
        for kind, u in engine.kv_usage().items():
            most_blocks[kind] = max(most_blocks[kind], u["used"])
        prefilling = long.kv.length < len(long.prompt) and long.block == 0
        for ev in events:
            if isinstance(ev, Block) and ev.row == long.request_id and first_block is None:
                first_block = time.perf_counter() - start
            if isinstance(ev, Block) and ev.row == short.request_id and prefilling:
                short_blocks_meanwhile += 1
            if isinstance(ev, Finished) and ev.row == short.request_id:
                short_done = time.perf_counter() - start
    total = time.perf_counter() - start
    per_token = kv_bytes_per_token(config, dtype_bytes(net.dtype))
    kv_mb = sum(most_blocks[k] * c * per_token[k] for k in most_blocks) / 2**20
    dense_mb = args.prompt_tokens * sum(per_token.values()) * 2 / 2**20  # both requests in preallocated rows
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"model: {config.num_parameters() / 1e6:.2f}M parameters, canvas/block {c}, window {config.sliding_window}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"long prompt: {args.prompt_tokens} tokens, time to first block {first_block:.2f} s, all done in {total:.2f} s"
    )
    print(
        f"peak memory (process RSS): {peak_mb:.0f} MB; most KV blocks in use: sliding {most_blocks[SLIDING]}, "
        f"global {most_blocks[GLOBAL]} = {kv_mb:.1f} MB (two preallocated rows of the prompt's length: {dense_mb:.1f} MB)"
    )
    steps = -(-args.prompt_tokens // engine.options.prefill_chunk)
    print(
        f"short request: {short_blocks_meanwhile} of {len(short.tokens) // c} blocks committed while the long prompt "
        f"prefilled ({steps} engine steps of prefill; a block takes {fixed['max_denoising_steps']}); "
        f"done after {short_done:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

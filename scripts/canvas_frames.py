"""The canvas frames of one generation as plain text: what `dgemma chat` and `dgemma run
--show-canvas` draw live, one frame per denoising step (accepted positions as their tokens,
re-noised ones as ░), for the README's frame sequence.

    python scripts/canvas_frames.py [--prompt TEXT] [--seed N] [--blocks N] [--model DIR]
"""

from __future__ import annotations

import argparse

import dgemma
from dgemma.cli.chat import plain_frame, token_pieces
from dgemma.engine.events import Block, Draft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped dgemma-tiny)")
    p.add_argument("--prompt", default="def fibonacci(n):\n")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", type=int, default=1, help="canvases to show")
    args = p.parse_args()
    model = dgemma.load(args.model) if args.model else dgemma.load()
    tok, c = model.tokenizer, model.config.canvas_length
    print(f"prompt: {args.prompt!r} (seed {args.seed}, canvas {c})")
    committed = ""
    for ev in model.stream(args.prompt, drafts=True, seed=args.seed, max_new_tokens=args.blocks * c):
        if isinstance(ev, Draft):
            end = next((i + 1 for i, t in enumerate(ev.canvas) if t in model.generation_config.eos_token_ids), c)
            pieces = token_pieces(tok, ev.canvas[:end])  # no pad after EOS
            print(
                f"--- block {ev.block + 1}, step {ev.step:2d}: {sum(ev.accepted):2d}/{c} accepted, "
                f"mean entropy {sum(ev.entropy) / c:.2f}"
            )
            print(committed + plain_frame(pieces, ev.accepted))
        elif isinstance(ev, Block):
            committed += tok.decode(ev.tokens)
            print(f"=== block {ev.block + 1} committed after {ev.decoder_passes} passes")
    print(committed)


if __name__ == "__main__":
    main()

"""Figures for a trained checkpoint's model card: held-out losses, tokens per forward, samples.

    python scripts/model_card_stats.py dgemma/assets/dgemma-tiny --data stdlib --batches 32

Held-out losses use the trainer's own eval (the published objective: one block per sequence,
self-conditioning with probability 0.5, fixed noise) on the files `--eval-fraction` holds out by
name, which are the files the training run never saw. Tokens per forward and the samples use the
checkpoint's generation_config.json (the defaults `dgemma run` uses).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict

import torch

import dgemma
from dgemma.train.trainer import TrainArgs, Trainer

PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:\n",
    "def is_prime(n):\n    ",
    "for i in range(10):\n",
    "    def __repr__(self):\n",
    "with open(path) as f:\n",
    "# Copyright",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--data", nargs="+", default=["stdlib"])
    p.add_argument("--eval-fraction", type=float, default=0.02)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batches", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            TrainArgs(
                out=tmp,
                data=args.data,
                model=args.model,
                eval_fraction=args.eval_fraction,
                seq_len=args.seq_len,
                batch_size=8,
                eval_batches=args.batches,
                blocks=1,
            )
        )
        held_out = trainer.evaluate()
        n_eval = len(trainer.eval_set)
    print(f"held-out ({n_eval} sequences, {args.batches * 8} evaluated): {held_out}")

    model = dgemma.load(args.model)
    tok = model.tokenizer
    samples, tokens, passes, seconds = [], 0, 0, 0.0
    for i, prompt in enumerate(PROMPTS):
        t0 = time.perf_counter()
        out = model.generate([tok.encode(prompt)], seed=i)
        seconds += time.perf_counter() - t0
        tokens += len(out.sequences[0])  # new tokens up to and including EOS
        passes += out.decoder_passes[0]
        samples.append(
            {
                "prompt": prompt,
                "completion": tok.decode(out.sequences[0]),
                "seed": i,
                "tokens": len(out.sequences[0]),
                "decoder_passes": out.decoder_passes[0],
                "tokens_per_forward": out.tokens_per_forward[0],
            }
        )
    figures = {
        "held_out": held_out,
        "held_out_sequences": n_eval,
        "tokens_per_forward": tokens / max(passes, 1),
        "tokens": tokens,
        "decoder_passes": passes,
        "tokens_per_second_cpu": tokens / seconds,
        "generation_config": asdict(model.generation_config),
        "samples": samples,
    }
    print(
        f"tokens per forward at default settings: {figures['tokens_per_forward']:.2f} "
        f"({tokens} tokens / {passes} decoder passes over {len(PROMPTS)} prompts)"
    )
    for s in samples:
        print("=" * 60 + f"\n{s['prompt']}\033[1m{s['completion']}\033[0m")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2, default=str)


if __name__ == "__main__":
    main()

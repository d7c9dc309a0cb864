"""What quantisation costs a trained model: held-out losses, tokens per forward, greedy AR agreement.

    python scripts/quant_quality.py dgemma/assets/dgemma-tiny --batches 16 [--schemes fp8 int8 int4 nvfp4]

For the unquantised checkpoint and each scheme (quantised at load, as `--quantization` does):
the trainer's held-out encoder and diffusion losses (the published objective, fixed noise, files
held out by name), tokens per forward at the checkpoint's default settings over the model card's
prompts, and the share of greedy AR tokens (64 per prompt) equal to the unquantised model's,
position by position.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from model_card_stats import PROMPTS

import dgemma
from dgemma.quant.modules import quantize_model
from dgemma.train.trainer import TrainArgs, Trainer


def held_out(model_dir: str, scheme: str | None, group_size: int, batches: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            TrainArgs(
                out=tmp,
                data=["stdlib"],
                model=model_dir,
                eval_fraction=0.02,
                seq_len=256,
                batch_size=8,
                eval_batches=batches,
                blocks=1,
            )
        )
        if scheme is not None:
            quantize_model(trainer.net, scheme, group_size)
        return trainer.evaluate()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--schemes", nargs="+", default=["fp8", "int8", "int4", "nvfp4"])
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--ar-tokens", type=int, default=64)
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args()
    torch.set_num_threads(2)
    rows, baseline_ar = [], None
    for scheme in [None, *args.schemes]:
        model = dgemma.load(args.model, quantization=scheme, group_size=args.group_size)
        prompts = [model.tokenizer.encode(text) for text in PROMPTS]
        out = model.generate(prompts, seed=list(range(len(prompts))))
        tpf = sum(len(s) for s in out.sequences) / max(sum(out.decoder_passes), 1)
        ar = model.generate(prompts, mode="ar", max_new_tokens=args.ar_tokens, eos_token_ids=[]).sequences
        baseline_ar = baseline_ar or ar
        same = sum(a == b for x, y in zip(ar, baseline_ar) for a, b in zip(x, y))
        total = sum(len(y) for y in baseline_ar)
        row = {
            "scheme": scheme or "none (float32)",
            **held_out(args.model, scheme, args.group_size, args.batches),
            "tokens_per_forward": tpf,
            "ar_agreement": same / total,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

"""What quantisation costs a trained model: held-out losses, tokens per forward, greedy AR agreement.

    python scripts/quant_quality.py dgemma/assets/dgemma-tiny --batches 16 [--schemes fp8 int8 int4 nvfp4]
    python scripts/quant_quality.py dgemma/assets/dgemma-tiny --schemes fp8 fp8+a8 fp8+a8+head   # W8A8

For the unquantised checkpoint and each scheme (quantised at load, as `--quantization` does):
the trainer's held-out encoder and diffusion losses (the published objective, fixed noise, files
held out by name), tokens per forward at the checkpoint's default settings over the model card's
prompts, and the share of greedy AR tokens (64 per prompt) equal to the unquantised model's,
position by position.

fp8's W8A8 (the fused GPU path on fp8 tensor cores, kernels/fused.py: activations quantised per
token for the attention projections, the dense MLP and the experts' gate|up) runs on a GPU only, so
here it is emulated on the CPU in float32 (quant/modules.py's `w8a8_reference`: per-token e4m3
activations, e4m3 weights, float32 accumulation): `fp8+a8`. `fp8+a8+head` adds the GEMMs that stay
in the model's dtype on the GPU, the LM head (hidden @ E.T, E in e4m3 per vocabulary row) and
self-conditioning's probs @ E (probabilities per token, E in e4m3 per hidden column), to say
whether fp8 there would cost no more than in the rest.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from model_card_stats import PROMPTS

import dgemma
from dgemma.quant import schemes
from dgemma.quant.formats import quantize
from dgemma.quant.modules import QuantExperts, QuantLinear, quantize_model, w8a8_reference
from dgemma.train.trainer import TrainArgs, Trainer

# script labels -> (the scheme quantised at load, W8A8 emulated, the LM head and probs @ E in fp8 too)
VARIANTS = {"fp8+a8": ("fp8", True, False), "fp8+a8+head": ("fp8", True, True)}


def variant(label: str | None) -> tuple[str | None, bool, bool]:
    return VARIANTS.get(label, (label, False, False))


def emulate_w8a8(net, head: bool) -> None:
    """The fused GPU path's W8A8, emulated on `net` (and every copy made of it after): quantised
    linears and the experts' gate|up of a scheme with fp8 activations (its table entry's
    `kernels.cuda_fp8_activations`); `head`: the LM head and probs @ E as W8A8 GEMMs too."""
    for m in net.modules():
        if isinstance(m, (QuantLinear, QuantExperts)):
            scheme = m.scheme if isinstance(m, QuantLinear) else m.gate_up_proj.scheme
            if schemes.get(scheme).kernels.cuda_fp8_activations is not None:
                m.fp8_activations = True
    if head:
        table = net.embed_tokens.weight.detach().float()
        rows, cols = quantize(table, "fp8"), quantize(table.t().contiguous(), "fp8")  # per vocab row / hidden column
        net.lm_head_kernel = lambda hidden: w8a8_reference(hidden, rows)
        net.soft_embed_kernel = lambda probs: w8a8_reference(probs, cols)


def held_out(model_dir: str, label: str | None, group_size: int, batches: int) -> dict:
    scheme, a8, head = variant(label)
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
                loss_chunk_rows=0,  # whole logits: through the model's LM head (its W8A8 emulation)
            )
        )
        if scheme is not None:
            quantize_model(trainer.net, scheme, group_size)
        if a8:
            emulate_w8a8(trainer.net, head)
        return trainer.evaluate()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument(
        "--schemes", nargs="+", default=["fp8", "int8", "int4", "nvfp4"], help=f"schemes, or {list(VARIANTS)}"
    )
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--ar-tokens", type=int, default=64)
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args()
    torch.set_num_threads(2)
    rows, baseline_ar = [], None
    for label in [None, *args.schemes]:
        scheme, a8, head = variant(label)
        model = dgemma.load(args.model, quantization=scheme, group_size=args.group_size)
        if a8:
            emulate_w8a8(model.net, head)
            emulate_w8a8(model.engine_net, head)  # the engine's copy (its own LM head kernels)
        prompts = [model.tokenizer.encode(text) for text in PROMPTS]
        out = model.generate(prompts, seed=list(range(len(prompts))))
        tpf = sum(len(s) for s in out.sequences) / max(sum(out.decoder_passes), 1)
        ar = model.generate(prompts, mode="ar", max_new_tokens=args.ar_tokens, eos_token_ids=[]).sequences
        baseline_ar = baseline_ar or ar
        same = sum(a == b for x, y in zip(ar, baseline_ar) for a, b in zip(x, y))
        total = sum(len(y) for y in baseline_ar)
        row = {
            "scheme": label or "none (float32)",
            **held_out(args.model, label, args.group_size, args.batches),
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

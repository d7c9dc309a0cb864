"""`dgemma train` (a model from a config), `dgemma finetune` (a checkpoint, full, LoRA, or LoRA
on a quantised base: QLoRA) and `dgemma merge-lora` (adapters folded into a checkpoint); the loop
is dgemma/train/trainer.py.

`dgemma finetune --model OWNER/NAME` checks the run's memory plan from the hub's config.json
before the weights are downloaded, as `dgemma run` does; a local checkpoint is checked by the
trainer before it is read."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..model.presets import PRESETS
from .common import (
    MODEL_HELP,
    CliError,
    add_hub_flags,
    device_memory_override,
    resolve_model,
    say,
    scheme_choices,
)


def add_cli(sub) -> None:
    """The `train`, `finetune` and `merge-lora` subcommands."""
    t = sub.add_parser("train", help="train a model from scratch, given a config")
    t.add_argument("--config", required=True, help=f"a preset ({', '.join(PRESETS)}) or a JSON file of model sizes")
    _common_flags(t, lr=3e-4)
    t.set_defaults(func=cmd_train)

    f = sub.add_parser("finetune", help="fine-tune a checkpoint (full or LoRA)")
    f.add_argument(
        "--model", "-m", help=f"the checkpoint to start from: {MODEL_HELP} (default: the shipped dgemma-tiny)"
    )
    add_hub_flags(f)
    f.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (omitted: full fine-tuning)")
    f.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    f.add_argument("--lora-targets", default="attention,mlp", help="attention, mlp and/or module-name suffixes")
    f.add_argument("--no-merge", dest="merge", action="store_false", help="LoRA: write the adapters only")
    f.add_argument(
        "--quantization",
        default=None,
        choices=scheme_choices(),
        help="QLoRA: keep the frozen base quantised in this scheme (quantised while loading; needs --lora-rank)",
    )
    f.add_argument("--group-size", type=int, default=None, help="with --quantization int4: its group size (default 64)")
    f.add_argument("--adapter", default=None, help="start from these LoRA adapters (PEFT's format or dgemma's)")
    f.add_argument(
        "--checkpoint-layers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="activation checkpointing per layer (default: on with --quantization)",
    )
    f.add_argument(
        "--loss-chunk-rows",
        type=int,
        default=None,
        help="rows per chunk of the vocabulary-sized loss (default: about 64 MiB of logits; 0: all at once)",
    )
    _common_flags(f, lr=1e-4)
    f.set_defaults(func=cmd_train)

    m = sub.add_parser("merge-lora", help="fold LoRA adapters into a full checkpoint")
    m.add_argument("--model", "-m", help=f"the base checkpoint: {MODEL_HELP} (default: the shipped dgemma-tiny)")
    add_hub_flags(m)
    m.add_argument("--adapter", required=True, help="directory with adapter_config.json and adapter_model.safetensors")
    m.add_argument("--out", required=True, help="directory to write the merged checkpoint to")
    m.add_argument(
        "--quantization",
        default=None,
        choices=scheme_choices(),
        help="adapters trained on a quantised base (QLoRA): fold them into the base as the run held it and write "
        "the merged checkpoint quantised in this scheme, a tensor at a time (docs/training.md)",
    )
    m.add_argument("--group-size", type=int, default=None, help="int4's group size, as the run used (default: 64)")
    m.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="with --quantization: skip comparing the merged checkpoint's logits with the unmerged run's",
    )
    m.set_defaults(func=cmd_merge_lora)


def _common_flags(p: argparse.ArgumentParser, lr: float) -> None:
    """The flags train and finetune share; their defaults are TrainArgs's."""
    from ..train.trainer import TrainArgs

    d = TrainArgs(out="", data=[])
    p.add_argument("--data", nargs="+", required=True, help="text files, directories, .jsonl files, or 'stdlib'")
    p.add_argument("--out", "-o", required=True, help="output directory (checkpoints, final model, log)")
    p.add_argument("--tokenizer", help="tokenizer.json or checkpoint dir (train: default trains a BPE on --data)")
    p.add_argument("--eval-data", nargs="+", help="held-out data (default: --eval-fraction of --data)")
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=d.eval_fraction,
        help=f"share of --data held out for eval losses, without --eval-data (default: {d.eval_fraction})",
    )
    for flag, kind, default, text in (
        ("--steps", int, d.steps, "optimizer steps"),
        ("--batch-size", int, d.batch_size, "sequences per micro-batch per process"),
        ("--grad-accum", int, d.grad_accum, "micro-batches per optimizer step"),
        ("--seq-len", int, d.seq_len, "tokens per training sequence"),
        ("--blocks", int, d.blocks, "canvas blocks drawn per sequence (1 = the published objective)"),
        ("--lr", float, lr, "peak learning rate"),
        ("--min-lr-ratio", float, d.min_lr_ratio, "final lr as a fraction of the peak"),
        ("--warmup", int, d.warmup, "linear warmup steps"),
        ("--weight-decay", float, d.weight_decay, "AdamW weight decay (matrices only)"),
        ("--clip", float, d.clip, "gradient-norm clipping (0 = off)"),
        ("--ar-weight", float, d.ar_weight, "weight of the encoder's autoregressive loss"),
        ("--sc-prob", float, d.sc_prob, "probability of the self-conditioning second pass"),
        ("--eval-every", int, d.eval_every, "steps between eval losses"),
        ("--eval-batches", int, d.eval_batches, "batches per eval"),
        ("--save-every", int, d.save_every, "steps between checkpoints"),
        ("--save-minutes", float, d.save_minutes, "also checkpoint when this many minutes passed"),
        ("--keep", int, d.keep, "checkpoints to keep"),
        ("--seed", int, d.seed, "seed for init, data order and noise"),
        ("--threads", int, None, "torch CPU threads"),
        ("--log-every", int, d.log_every, "steps between log lines"),
    ):
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (bf16 autocast)")
    p.add_argument(
        "--save-dtype", choices=["float32", "bfloat16"], default="float32", help="dtype of the final weights"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--fresh", action="store_true", help="ignore checkpoints in --out and start over")


def cmd_train(args) -> int:
    from ..train.trainer import TrainArgs, train

    if args.command == "finetune":
        if args.lora_rank is not None and args.lora_rank <= 0:
            raise CliError(f"--lora-rank must be positive (got {args.lora_rank}); omit it for full fine-tuning")
        args.lora_rank = args.lora_rank or 0
        args.device_memory = device_memory_override()  # DGEMMA_DEVICE_MEMORY, as `dgemma run` reads it
        # a hub id fetched into the cache (its plan checked before the download), a directory as it
        # is (the trainer checks its plan); none: dgemma-tiny
        args.model = str(_finetune_checkpoint(args, TrainArgs).path)
    fields_ = TrainArgs.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields_}
    result = train(TrainArgs(**values))
    return 130 if result.interrupted else 0


def _finetune_checkpoint(args, train_args):
    """The base of `dgemma finetune`: a local directory as it is; a hub id's config.json first, the
    fine-tuning plan checked against the device (the trainer's own check, on a run that reads
    nothing), then its weights downloaded. Offline or unreachable: the cache, as `resolve_model`."""
    from pathlib import Path

    from ..hub import is_hub_id

    ref = args.model
    if ref is None or Path(ref).expanduser().exists() or not is_hub_id(ref):
        return resolve_model(args, fit=False)
    from huggingface_hub import is_offline_mode

    from ..hub.fetch import Unreachable, fetch_snapshot, locate
    from ..train.trainer import plan_check

    if is_offline_mode():
        return resolve_model(args, fit=False)
    try:
        snapshot = locate(ref, getattr(args, "revision", None))  # config files only
    except Unreachable:
        return resolve_model(args, fit=False)
    fields_ = train_args.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields_}
    plan_check(train_args(**{**values, "model": str(snapshot.path)}))
    return fetch_snapshot(snapshot, None, getattr(args, "force", False), say)


def cmd_merge_lora(args) -> int:
    import dgemma

    from ..inputs.tokenizer import DEFAULT_CHAT_TEMPLATE
    from ..model.checkpoint import save_checkpoint
    from ..train import lora

    base = resolve_model(args, fit=False).path
    if args.quantization is not None:
        return merge_quantized_cli(base, args)
    model = dgemma.load(base)
    lora.load_adapters(model.net, args.adapter)
    lora.merge_lora(model.net)
    tok = model.tokenizer
    template = (tok.chat_template if tok else None) or DEFAULT_CHAT_TEMPLATE
    save_checkpoint(model.net, args.out, generation=model.generation_config, tokenizer=tok, chat_template=template)
    print(f"wrote the merged checkpoint to {args.out}")
    return 0


def merge_quantized_cli(base, args) -> int:
    """`merge-lora --quantization`: train/merge.py's merge, then (unless --no-check) how far the
    merged checkpoint's logits are from the unmerged run's."""
    from ..quant.write import check_output_dir
    from ..train.merge import merge_quantized
    from .quantize import ProgressLine

    check_output_dir(Path(args.out))
    what = f"dgemma: merging {args.adapter} into {base}, quantised to {args.quantization}, into {args.out}"
    out = merge_quantized(base, args.adapter, args.out, args.quantization, args.group_size, ProgressLine(what))
    print(f"wrote the merged checkpoint, quantised to {args.quantization}, to {out}")
    if args.check:
        rel, top = closeness(base, args.adapter, out, args.quantization, args.group_size)
        print(f"merged vs unmerged logits (float32, one canvas): relative L2 {rel:.2e}, max |difference| {top:.2e}")
    return 0


def closeness(
    base: str | Path, adapter_dir: str | Path, merged: str | Path, scheme: str, group_size: int | None = None
) -> tuple[float, float]:
    """(relative L2, max |difference|) of the merged checkpoint's logits against the unmerged
    QLoRA model's (the base quantised as loading does, the adapters attached), float32, one
    canvas after a short prompt."""
    import torch

    import dgemma

    from ..train.lora import load_adapters

    unmerged = dgemma.load(base, dtype="float32", quantization=scheme, group_size=group_size)
    load_adapters(unmerged.net, adapter_dir)
    config = unmerged.config
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, config.vocab_size, (1, 16), generator=gen).tolist()
    canvas = torch.randint(3, config.vocab_size, (1, config.canvas_length), generator=gen)
    want = unmerged.canvas_logits(prompt, canvas)
    del unmerged
    got = dgemma.load(merged, dtype="float32").canvas_logits(prompt, canvas)
    diff = got - want
    return float(diff.norm() / want.norm()), float(diff.abs().max())

"""`dgemma quantize`: write a quantised copy of a checkpoint in the compressed-tensors format."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..model.presets import PRESETS
from ..quant import schemes
from ..quant.formats import DEFAULT_GROUP_SIZE, QuantError
from .common import MODEL_HELP, add_hub_flags, parse_size, resolve_model, scheme_choices

DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}


def cmd_quantize(args) -> int:
    import torch

    from ..hub import is_hub_id
    from ..quant.quant_config import check_group_size
    from ..quant.write import check_output_dir, write_quantized

    check_group_size(args.scheme, args.group_size)  # the arguments first, then the directories
    if args.dtype is not None and args.dtype not in DTYPES:
        raise QuantError(f"--dtype must be one of {', '.join(DTYPES)} (got {args.dtype!r})")
    try:
        shard_bytes = parse_size(args.shard_size)
    except argparse.ArgumentTypeError as e:
        raise QuantError(f"--shard-size: {e}") from None
    if args.model is not None and args.size is not None:
        raise QuantError("give --model (a checkpoint) or --size NAME (random weights of a named size), not both")
    if args.model is not None and not Path(args.model).is_dir() and not is_hub_id(args.model):
        raise QuantError(f"--model {args.model}: no such directory (nor a hub id owner/name)")
    check_output_dir(Path(args.out))
    if args.size is None:  # --model, or the shipped dgemma-tiny as `run` takes it; a hub id fetched into the cache
        args.model = str(resolve_model(args, fit=False).path)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    source = args.model if args.size is None else f"random weights of size {args.size}"
    progress = ProgressLine(f"dgemma: quantising {source} to {args.scheme} into {args.out}")
    options = dict(dtype=dtype, quantize_embeddings=args.quantize_embeddings, shard_bytes=shard_bytes)
    if args.size is None:
        out = write_quantized(args.model, args.out, args.scheme, args.group_size, progress=progress, **options)
    else:
        out = write_random_quantized(args.size, args.out, args.scheme, args.group_size, progress=progress, **options)
    print(f"wrote a checkpoint quantised to {args.scheme} (compressed-tensors) to {out}")
    return 0


class ProgressLine:
    """What a long write is doing, on stderr: its first line when the first tensor is about to be
    read (after the checks, whose errors stay one line), then, on a terminal, the count of tensors
    written, redrawn in place."""

    def __init__(self, what: str):
        self.what, self.tty, self.started = what, sys.stderr.isatty(), False

    def __call__(self, done: int, total: int) -> None:
        if not self.started:
            self.started = True
            sys.stderr.write(self.what + ("" if self.tty else "\n"))
        if self.tty:
            end = "\n" if done == total else ""
            sys.stderr.write(f"\r{self.what}: {done}/{total} tensors ({100 * done // max(total, 1)}%){end}")
        sys.stderr.flush()


def write_random_quantized(size: str, out: str, scheme: str, group_size: int | None, dtype=None, **options) -> Path:
    """Random weights of a named size (bf16 unless `dtype`), drawn tensor by tensor and quantised
    as they stream to disk: the released model's size is written without its weights."""
    import torch

    from ..model.checkpoint import byte_tokenizer, config_json, make_config, save_side_files
    from ..quant.tensor_sources import RandomTensors
    from ..quant.write import write_quantized_from

    config = make_config(**PRESETS[size])
    dtype = dtype or torch.bfloat16
    config_dict = dict(config_json(config), dtype=str(dtype).removeprefix("torch."))

    return write_quantized_from(
        RandomTensors(config, dtype),
        config_dict,
        out,
        scheme,
        group_size,
        dtype=dtype,
        side_files=lambda d: save_side_files(d, config, tokenizer=byte_tokenizer()),
        **options,
    )


def add_cli(sub) -> None:
    """The `quantize` subcommand."""
    p = sub.add_parser(
        "quantize", help="write a quantised checkpoint (compressed-tensors format; docs/quantization.md)"
    )
    p.add_argument(
        "--model",
        "-m",
        default=None,
        help=f"the full-precision checkpoint: {MODEL_HELP} (default: the shipped dgemma-tiny)",
    )
    add_hub_flags(p)
    p.add_argument(
        "--size",
        choices=sorted(PRESETS),
        default=None,
        help="instead of --model: random weights of a named size (bf16), drawn as they are written "
        "(`--size real` writes the released model's size without its weights; docs/quantization.md)",
    )
    p.add_argument(
        "--quantization",
        "--scheme",
        dest="scheme",
        required=True,
        help=f"the scheme, as `run` and `serve` name it: one of {', '.join(scheme_choices())} (--scheme: the same)",
    )
    p.add_argument("--out", "-o", required=True, help="output directory (new or empty)")
    p.add_argument(
        "--group-size", type=int, default=None, help=f"inputs per int4 scale (default: {DEFAULT_GROUP_SIZE})"
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="dtype of the tensors kept in full precision: bf16, fp16, fp32 (default: as stored)",
    )
    p.add_argument(
        "--quantize-embeddings",
        choices=list(schemes.embedding_names()),
        default=None,
        help="quantise the tied embedding table per row too (dgemma reads it; vLLM does not)",
    )
    p.add_argument("--shard-size", default="5GB", help="largest output file (default: 5GB)")
    p.set_defaults(func=cmd_quantize)

"""`dgemma quantize`: write a quantised copy of a checkpoint in the compressed-tensors format."""

from __future__ import annotations

import argparse
from pathlib import Path

from .formats import DEFAULT_GROUP_SIZE, SCHEMES, QuantError

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}  # fmt: skip


def cmd_quantize(args) -> int:
    import torch

    from ..cli import parse_size
    from .checkpoint import check_group_size, check_output_dir, write_quantized

    check_group_size(args.scheme, args.group_size)  # the arguments first, then the directories
    if args.dtype is not None and args.dtype not in DTYPES:
        raise QuantError(f"--dtype must be one of {', '.join(DTYPES)} (got {args.dtype!r})")
    try:
        shard_bytes = parse_size(args.shard_size)
    except argparse.ArgumentTypeError as e:
        raise QuantError(f"--shard-size: {e}") from None
    if not Path(args.model).is_dir():
        raise QuantError(f"--model {args.model}: no such directory")
    check_output_dir(Path(args.out))
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    out = write_quantized(args.model, args.out, args.scheme, args.group_size, dtype=dtype,
                          quantize_embeddings=args.quantize_embeddings, shard_bytes=shard_bytes)  # fmt: skip
    print(f"wrote a {args.scheme} checkpoint (compressed-tensors) to {out}")
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser("quantize", help="write a quantised checkpoint (compressed-tensors format; docs/quantization.md)")
    p.add_argument("--model", "-m", required=True, help="full-precision checkpoint directory")
    p.add_argument("--scheme", required=True, help=f"one of {', '.join(SCHEMES)}")
    p.add_argument("--out", "-o", required=True, help="output directory (new or empty)")
    p.add_argument("--group-size", type=int, default=None, help=f"inputs per int4 scale (default: {DEFAULT_GROUP_SIZE})")
    p.add_argument("--dtype", default=None, help="dtype of the tensors kept in full precision: bf16, fp16, fp32 "
                   "(default: as stored)")  # fmt: skip
    p.add_argument("--quantize-embeddings", choices=["int8", "fp8"], default=None,
                   help="quantise the tied embedding table per row too (dgemma reads it; vLLM does not)")  # fmt: skip
    p.add_argument("--shard-size", default="5GB", help="largest output file (default: 5GB)")
    p.set_defaults(func=cmd_quantize)

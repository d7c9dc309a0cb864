"""`dgemma make-tiny DIR`: a tiny random checkpoint, for trying the tools without a download."""

from __future__ import annotations

from pathlib import Path


def cmd_make_tiny(args) -> int:
    from ..model.checkpoint import make_tiny_random

    path = make_tiny_random(args.out, seed=args.seed)
    print(f"wrote a tiny random DiffusionGemma checkpoint to {path}")
    return 0


def add_cli(sub) -> None:
    """The `make-tiny` subcommand."""
    tiny = sub.add_parser("make-tiny", help="write a tiny random checkpoint (for trying the tools)")
    tiny.add_argument("out", type=Path, help="directory to write the checkpoint to")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    tiny.set_defaults(func=cmd_make_tiny)

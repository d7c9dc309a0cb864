"""`dgemma pull ID`: a checkpoint from the Hugging Face hub into its cache, without loading it: the
memory plan checked for --device first (from config.json and the shards' headers), then exactly
the files dgemma reads, then a verification (every shard there, its size the hub's, its header
readable). `dgemma run --model ID` does the same on first use; pull does it ahead of time."""

from __future__ import annotations

import argparse

from .common import (
    CliError,
    add_device_flags,
    add_hub_flags,
    add_quantization_flags,
    fit_request,
    say,
)


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Register `dgemma pull`."""
    from ..hub.fit import SINGLE_REQUEST_CONTEXT

    p = sub.add_parser(
        "pull",
        help="download a checkpoint from the Hugging Face hub (only what dgemma reads), "
        "after checking it fits this device, and verify it",
    )
    p.add_argument("repo_id", metavar="ID", help="a Hugging Face hub id, owner/name")
    add_hub_flags(p)
    add_device_flags(p)
    add_quantization_flags(
        p, "plan for this scheme, as run and serve would quantise while loading (auto: the best that fits)"
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=SINGLE_REQUEST_CONTEXT,
        help=f"plan for requests of this many positions (default: {SINGLE_REQUEST_CONTEXT}, as run and chat "
        "plan; serve plans the model's whole context)",
    )
    p.add_argument(
        "--max-active", type=int, default=1, help="plan for this many requests at once (default: 1; serve: 8)"
    )
    p.set_defaults(func=cmd_pull)


def cmd_pull(args: argparse.Namespace) -> int:
    from ..devices import resolve_device
    from ..hub import is_hub_id
    from ..hub.fetch import pull_checkpoint

    if not is_hub_id(args.repo_id):
        raise CliError(f"{args.repo_id!r} is not a hub id (owner/name)")
    for flag, value in (("--max-context", args.max_context), ("--max-active", args.max_active)):
        if value < 1:
            raise CliError(f"{flag} must be at least 1 (got {value})")
    request = fit_request(args, resolve_device(args.device))
    checkpoint, verified = pull_checkpoint(args.repo_id, args.revision, request, args.force, say)
    if checkpoint.fit is not None and checkpoint.fit.fits and not checkpoint.fetched:  # else said before the download
        say(f"{checkpoint.name} {checkpoint.fit.describe()}")
    if args.quantization == "auto":
        say(f"--quantization auto: {checkpoint.quantization or 'unquantised'}")
    say(f"verified: {verified}")
    print(f"{checkpoint.name} (commit {checkpoint.commit[:7]}) is in {checkpoint.path}")
    return 0

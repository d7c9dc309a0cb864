"""`dgemma list` (the DiffusionGemma checkpoints in the Hugging Face cache: revision, size on disk,
scheme, whether each fits this device) and `dgemma rm ID` (removes one from the cache with the
cache's own deletion API). The cache is huggingface_hub's, under HF_HOME (hub/cache.py)."""

from __future__ import annotations

import argparse

from .common import add_device_flags, device_memory_override, say


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Register `dgemma list` and `dgemma rm`."""
    ls = sub.add_parser("list", help="the DiffusionGemma checkpoints in the Hugging Face cache, and whether each fits")
    add_device_flags(ls)
    ls.set_defaults(func=cmd_list)
    rm = sub.add_parser("rm", help="remove a checkpoint from the Hugging Face cache")
    rm.add_argument("repo_id", metavar="ID", help="a hub id, owner/name, as `dgemma list` shows it")
    rm.add_argument(
        "--revision",
        default=None,
        help="only this revision: a branch, a tag or a commit (its first characters will do); "
        "default: every cached revision",
    )
    rm.set_defaults(func=cmd_rm)


def fits_here(entry, request) -> str:
    """The list's fit column: yes, the scheme --quantization auto would pick, or no."""
    from ..hub import FitError
    from ..hub.fit import check_fit, local_facts

    if not entry.complete:
        return "incomplete (dgemma pull)"
    try:
        fit = check_fit(local_facts(entry.path, entry.repo_id), request)
    except FitError:
        return "no"
    except ValueError as e:  # a config or header dgemma cannot read
        return f"unreadable ({str(e)[:40]})"
    return f"with --quantization {fit.scheme}" if fit.scheme else "yes"


def cmd_list(args: argparse.Namespace) -> int:
    from functools import partial

    from ..devices import resolve_device, resolve_dtype
    from ..hub import FitRequest
    from ..hub.cache import cached_checkpoints
    from ..hub.errors import cache_dir
    from ..hub.fetch import size_text
    from ..hub.fit import GIB, device_memory

    entries = cached_checkpoints()
    if not entries:
        say(f"no DiffusionGemma checkpoints in the cache ({cache_dir()}); `dgemma pull owner/name` fetches one")
        return 0
    device = resolve_device(args.device)
    request = FitRequest(
        device,
        partial(resolve_dtype, args.dtype, device),
        "auto",
        memory=device_memory_override(),
        flags=("--quantization",),
    )
    memory, where = device_memory(device, request.memory)
    here = f"FITS {device} ({memory / GIB:.1f} GiB {where})" if memory else f"FITS {device}"
    rows = [("MODEL", "REVISION", "SIZE", "SCHEME", here)]
    for entry in entries:
        rows.append((entry.repo_id, entry.label, size_text(entry.size), entry.scheme, fits_here(entry, request)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from ..hub.cache import remove
    from ..hub.fetch import size_text

    removed, freed = remove(args.repo_id, args.revision)
    print(f"removed {args.repo_id} ({'; '.join(removed)}): {size_text(freed)} freed")
    return 0

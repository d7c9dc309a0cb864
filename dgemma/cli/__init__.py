"""Command line: `dgemma run | make-tiny | memory | serve | bench | train | finetune | merge-lora |
quantize | chat`.

One module per command, each with `add_cli(subparsers)`; COMMANDS below is the whole list, in the
order `dgemma --help` shows them. A command module imports what its work needs inside its
functions, so that building the parser (and `dgemma --help`) stays cheap. Shared flags live in
common.py. `python -m dgemma.cli.loadtest` (the server's load test) is a script, not a subcommand.
"""

from __future__ import annotations

import argparse
import logging
import sys

from . import bench, chat, make_tiny, memory, quantize, run, serve, train
from .common import CliError, flag_names

COMMANDS = (run, make_tiny, memory, serve, bench, train, quantize, chat)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dgemma", description="Run, serve and fine-tune DiffusionGemma.")
    parser.add_argument("--verbose", "-v", action="store_true", help="log loading details")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from ..config import ConfigError
    from ..kernels.cpu import keep_freed_memory
    from ..model.weights import WeightsError

    keep_freed_memory()  # a long-running process: no page faults for every step's temporaries

    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130
    except ConfigError as e:  # the sampler's checks name its fields: say the flags the user typed
        sys.stderr.write(f"dgemma: error: {flag_names(str(e), args)}\n")
        return 2
    except (CliError, WeightsError, FileNotFoundError, ValueError, TypeError) as e:
        sys.stderr.write(f"dgemma: error: {e}\n")
        return 2

"""Command line: `dgemma run | make-tiny | memory | serve | bench | train | finetune | merge-lora |
quantize | chat | pull | list | rm`.

One module per command, each with `add_cli(subparsers)`; COMMANDS below is the whole list, in the
order `dgemma --help` shows them. A command module imports what its work needs inside its
functions, so that building the parser (and `dgemma --help`) stays cheap. Shared flags live in
common.py. A model is a directory or a Hugging Face hub id (owner/name): `pull` fetches one into the
hub's cache, `list` and `rm` show and remove what the cache holds (dgemma/hub/).
`python -m dgemma.cli.loadtest` (the server's load test) is a script, not a subcommand.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from . import bench, chat, make_tiny, memory, models, pull, quantize, run, serve, train
from .common import CliError, flag_names

COMMANDS = (run, make_tiny, memory, serve, bench, train, quantize, chat, pull, models)
BACKGROUND_BUILDS = ("run", "chat")  # the commands that do not wait for the native kernels' build


class OneLineErrors(argparse.ArgumentParser):
    """A parser (and its subcommands' parsers) whose errors are one line, as every other error of
    `dgemma` is, with where the flags are listed, rather than argparse's usage block first."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="dgemma", description="Run, serve and fine-tune DiffusionGemma.")
    parser.add_argument("--verbose", "-v", action="store_true", help="log loading details")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_cli(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed arguments; a flag the subcommand does not know is that subcommand's error (which
    points to `dgemma SUBCOMMAND --help`, where its flags are), not the top-level parser's."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subcommands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def quiet_broken_pipe() -> int:
    """Standard output's reader closed early (`dgemma run ... | head`): end quietly with status 0,
    as other command-line tools do; what is left to print goes nowhere (no second error at exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0


def _check_ranks_fit_this_host(size: int, device: str) -> None:
    """One rank per GPU (NCCL refuses two on one) or per CPU core at most: a larger size is refused
    before any process starts (several hosts: torchrun, docs/parallel.md)."""
    import torch

    gpu = str(device).startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    have, what = (torch.cuda.device_count(), "GPUs") if gpu else (os.cpu_count() or 1, "CPU cores")
    if size > have:
        raise CliError(
            f"--tensor-parallel-size {size}: this host has {have} {what}, one rank each at most "
            "(ranks on several hosts: torchrun, docs/parallel.md)"
        )


def _launch_ranks(args, argv: list[str] | None) -> int | None:
    """--tensor-parallel-size N > 1 outside a group: start N ranks of this very command
    (parallel/launch.py) and return their status; inside a rank (WORLD_SIZE set): None."""
    size = getattr(args, "tensor_parallel_size", 1)
    if not getattr(args, "launch_ranks", False):
        return None
    if size < 1:
        raise CliError(f"--tensor-parallel-size must be at least 1, got {size}")
    if getattr(args, "expert_parallel", False) and size == 1:
        raise CliError("--expert-parallel needs --tensor-parallel-size 2 or more")
    if size == 1 or "WORLD_SIZE" in os.environ:
        return None
    _check_ranks_fit_this_host(size, getattr(args, "device", "cpu"))
    from ..parallel.launch import launch

    return launch(list(sys.argv[1:] if argv is None else argv), size)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from ..config import ConfigError
    from ..kernels.cpu import keep_freed_memory
    from ..kernels.native import POLICY_VARIABLE
    from ..model.weights import WeightsError

    keep_freed_memory()  # a long-running process: no page faults for every step's temporaries
    # huggingface_hub (imported when a hub id is resolved) reads HF_HUB_VERBOSITY then; at its default it
    # logs each retry of a failed request, where dgemma says what failed in one line (its progress
    # bars stay). A user's HF_HUB_VERBOSITY wins; ours is gone when main returns.
    quiet_hub = "HF_HUB_VERBOSITY" not in os.environ
    if quiet_hub:
        os.environ["HF_HUB_VERBOSITY"] = "info" if args.verbose else "error"
    # `run` and `chat` start on torch's kernels while native ones not built yet build in the
    # background (kernels/native.py, OnDemand): the first text in seconds on a fresh machine; the
    # others build them in the foreground. DGEMMA_NATIVE, where set, wins; unset when main returns.
    background = args.command in BACKGROUND_BUILDS and POLICY_VARIABLE not in os.environ
    if background:
        os.environ[POLICY_VARIABLE] = "background"
    try:
        launched = _launch_ranks(args, argv)
        if launched is not None:
            return launched
        return args.func(args) or 0
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130
    except BrokenPipeError:
        return quiet_broken_pipe()
    except ConfigError as e:  # the sampler's checks name its fields: say the flags the user typed
        sys.stderr.write(f"dgemma: error: {flag_names(str(e), args)}\n")
        return 2
    except (CliError, WeightsError, FileNotFoundError, ValueError, TypeError) as e:
        sys.stderr.write(f"dgemma: error: {e}\n")
        return 2
    finally:
        if quiet_hub:
            os.environ.pop("HF_HUB_VERBOSITY", None)
        if background:
            os.environ.pop(POLICY_VARIABLE, None)

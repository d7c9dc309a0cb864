"""`dgemma bench`: dgemma's diffusion path, its AR mode and the transformers reference, side by side
(and with --turbo, the diffusion path with turbo denoising: same prompts, same seeds).

Peers run interleaved in one process (default, ar, reference, default, ar, ...) on the same
weights and prompt, so that machine noise hits all of them alike; the table reports medians and
the ratios between peers. Fixed steps (the default) turn adaptive stopping off, so every canvas
takes exactly `--steps` decoder passes in every peer. This module is the command (its flags, the
plan, the progress and the table); dgemma/benchmark.py times the runs.

The reference peer needs `transformers` (a test dependency); it is skipped when not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..benchmark import (
    BenchEngine,
    RunResult,
    check_room,
    load_reference,
    memory_figures,
    memory_report,
    random_model,
    run_dgemma,
    run_reference,
    summarize,
    write_checkpoint,
)
from ..model.presets import PRESETS
from .common import (
    MODEL_HELP,
    TURBO_FLAGS,
    add_device_flags,
    add_hub_flags,
    add_parallel_flags,
    add_threads_flag,
    add_turbo_flags,
    apply_threads,
    parallel_load_args,
    resolve_model,
    scheme_choices,
    turbo_knobs,
)


def print_table(rows: list[dict], header: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=header)
    cols = ["peer", "output_tok_s", "decode_tok_s", "ttft_s", "ms_per_step", "tokens_per_forward", "peak_mem_mb"]
    if any("positions_per_token" in r for r in rows):  # decoder positions per committed token: turbo's saving
        cols.insert(-1, "positions_per_token")
    extra = sorted({k for r in rows for k in r if k.startswith("x_vs_")})
    for c in cols + extra:
        table.add_column(c, justify="right" if c != "peer" else "left")
    for r in rows:
        table.add_row(*[f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols + extra])
    Console(width=200).print(table)


# What a run does when a flag is not given: prompt and new tokens in canvases of the model, so the
# mid and real sizes (canvas 256) keep 512 + 768 (docs/performance.md's figures) and tiny (canvas
# 32) runs the same three committed canvases in seconds instead of 24 canvases in minutes.
DEFAULTS = {"prompt_canvases": 2, "new_canvases": 3, "steps": 16, "runs": 3, "peers": "default,ar,reference"}
# --quick: a check that it runs and a first figure, under a minute on tiny; not a measurement.
QUICK = {"prompt_canvases": 1, "new_canvases": 2, "steps": 4, "runs": 1, "peers": "default,ar"}
PEER_NAMES = {"default": "dgemma", "ar": "dgemma-ar", "reference": "transformers", "turbo": "dgemma-turbo"}


def model_config(args):
    """The config of what will be benchmarked, read before anything is built or loaded (for the plan)."""
    from ..config import load_model_config
    from ..model.checkpoint import make_config

    if not args.model:
        return make_config(**PRESETS[args.size])
    if not (Path(args.model) / "config.json").is_file():
        raise FileNotFoundError(f"--model {args.model}: not a checkpoint directory (no config.json in it)")
    return load_model_config(Path(args.model))


def resolve_settings(args, canvas: int) -> None:
    """Fill the flags left unset from --quick's preset or the defaults; explicit flags always win."""
    preset = QUICK if args.quick else DEFAULTS
    if args.prompt_len is None:
        args.prompt_len = preset["prompt_canvases"] * canvas
    if args.new_tokens is None:
        args.new_tokens = preset["new_canvases"] * canvas
    for name in ("steps", "runs", "peers"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    for flag in ("prompt_len", "new_tokens", "steps", "runs", "batch"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})")
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()] if isinstance(args.peers, str) else args.peers
    unknown = sorted(set(args.peers) - set(PEER_NAMES))
    if unknown or not args.peers:
        raise ValueError(
            f"--peers takes a comma list of default, ar, reference, turbo (got {','.join(unknown) or 'none'})"
        )
    if getattr(args, "turbo", None) and "turbo" not in args.peers:  # its row right after dgemma's
        at = args.peers.index("default") + 1 if "default" in args.peers else len(args.peers)
        args.peers = args.peers[:at] + ["turbo"] + args.peers[at:]
    knob = next((k.flag for k in TURBO_FLAGS[1:] if getattr(args, k.name, None) is not None), None)
    if knob is not None and "turbo" not in args.peers:
        raise ValueError(f"{knob} sets the turbo row's freezing: it needs --turbo (or turbo in --peers)")


def busy_cpu_note(args, device) -> str | None:
    """A hint when other work already fills the cores: torch's threads then wait on each other,
    and fewer threads can be several times faster (measured: 10x on 2 busy cores)."""
    if args.threads is not None or torch.device(device).type != "cpu" or not hasattr(os, "getloadavg"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0]
    if load < cores:
        return None
    return f"note: the CPU is busy (load average {load:.1f} on {cores} cores): --threads 1 may be several times faster"


def plan_lines(args, config, device) -> list[str]:
    canvas = config.canvas_length
    model = args.model or f"--size {args.size} (random weights)"
    n = config.num_parameters()
    params = f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
    quant = f" {args.quantization}" if args.quantization else ""
    steps = "adaptive steps" if args.adaptive else f"{args.steps} fixed steps per canvas"
    canvases = -(-args.new_tokens // canvas)
    peers = ", ".join(PEER_NAMES[p] for p in args.peers)
    rounds = f"{'1 warm-up round + ' if args.warmup else ''}{args.runs} timed round{'s' * (args.runs > 1)}"
    total = (args.runs + args.warmup) * len(args.peers)
    threads = torch.get_num_threads()
    lines = [
        (
            f"dgemma bench{' --quick' if args.quick else ''}: {model}, {params} parameters, "
            f"{device} {args.dtype}{quant}, {threads} thread{'s' * (threads > 1)}"
        ),
        (
            f"  each run: batch {args.batch}, {args.prompt_len} prompt + {args.new_tokens} new tokens "
            f"({canvases} canvas{'es' * (canvases > 1)} of {canvas}), {steps}"
        ),
        f"  peers {peers}, interleaved: {rounds} = {total} run{'s' * (total > 1)}",
        "  estimate: the bar's remaining time from the first committed canvas on, and a line after every round",
    ]
    if args.quick:
        lines.append("  --quick: a check, not a measurement; for figures to quote, drop --quick")
    note = busy_cpu_note(args, device)
    return lines + ([note] if note else [])


def bench_model(args, device, dtype, peers: list[str], tmp: Path, say):
    """The model the peers run and the checkpoint a peer reads (None when no peer reads one).
    --model: loaded as ever. Random --size weights: built directly on --device in --dtype (or
    quantised with --quantization), and written to `tmp` only for the transformers reference;
    the ranks of a tensor-parallel run each read their share from a file, built on the CPU."""
    from ..loading import load

    if args.model:
        say(f"loading {args.model}")  # its plan was checked once already, by resolve_model (at --batch)
        return load(
            args.model,
            device=device,
            dtype=dtype,
            quantization=args.quantization,
            group_size=args.group_size,
            force=True,
            **parallel_load_args(args),
        ), Path(args.model)
    if args.tensor_parallel_size > 1:
        if not args.force:
            check_room(args.size, "cpu", dtype)
        say(f"building random weights of --size {args.size} on the cpu, written for the ranks")
        path = write_checkpoint(random_model(args.size, "cpu", dtype), tmp, dtype)
        return load(
            path,
            device=device,
            dtype=dtype,
            quantization=args.quantization,
            group_size=args.group_size,
            force=args.force,
            **parallel_load_args(args),
        ), path
    if not args.force:
        check_room(args.size, device, dtype, args.quantization, args.group_size)
    say(f"building random {args.quantization or args.dtype} weights of --size {args.size} on {device}")
    model = random_model(args.size, device, dtype, args.quantization, args.group_size)
    if "reference" not in peers:
        return model, None
    say("writing them as a checkpoint for the transformers reference")
    return model, write_checkpoint(model, tmp, dtype)


def cmd_bench(args) -> int:
    from tqdm import tqdm

    from ..devices import dtype_name, resolve_device, resolve_dtype
    from ..kernels import cpu as cpu_kernels

    apply_threads(args)
    turbo = {k: v for k, v in turbo_knobs(args).items() if k != "turbo"}  # the turbo row's knobs, checked first
    started = time.perf_counter()

    def say(message: str) -> None:  # stderr, so that stdout holds only the table (or the JSON)
        tqdm.write(f"[{time.perf_counter() - started:5.1f} s] {message}", file=sys.stderr)

    torch.manual_seed(0)
    device = resolve_device(args.device)
    if args.model:  # a hub id fetched (after the memory plan's check at --batch), a directory as it is
        checkpoint = resolve_model(args)
        args.model, args.quantization = str(checkpoint.path), checkpoint.quantization  # auto: its pick
    config = model_config(args)
    dtype = resolve_dtype(args.dtype, device, args.model)  # --model's stored dtype; bf16 for random --size weights
    args.dtype = dtype_name(dtype)  # what the plan and the table say
    resolve_settings(args, config.canvas_length)
    print("\n".join(plan_lines(args, config, device)), file=sys.stderr, flush=True)
    peers = list(args.peers)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tensor_parallel_size > 1 and "reference" in peers:
            say("the transformers reference runs in one process: skipping it with --tensor-parallel-size")
            peers.remove("reference")
        if args.quantization is not None and "reference" in peers:
            say("transformers runs full-precision weights only: skipping the reference peer with --quantization")
            peers.remove("reference")
        if "reference" in peers and importlib.util.find_spec("transformers") is None:
            say("transformers is not installed: skipping the reference peer")
            peers.remove("reference")
        model, path = bench_model(args, device, dtype, peers, Path(tmp), say)
        if "reference" in peers:
            say("loading the transformers reference")
            ref = load_reference(path, device, dtype)
            if ref is None:
                say("transformers is not installed: skipping the reference peer")
                peers.remove("reference")
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
        per_run = args.batch * args.new_tokens
        diffusion = [p for p in peers if p in ("default", "turbo")]
        engine = BenchEngine.build(model, args.batch, args.prompt_len, args.new_tokens) if diffusion else None
        rounds = ["warm-up"] * args.warmup + [f"round {i + 1}/{args.runs}" for i in range(args.runs)]

        say(
            f"running ({'the warm-up round pays for allocation and kernel selection' if args.warmup else 'no warm-up'})"
        )
        bar = tqdm(
            total=len(rounds) * len(peers) * per_run,
            file=sys.stderr,
            smoothing=0,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} tokens [{elapsed}<{remaining}{postfix}]",
        )

        def once(peer: str) -> RunResult:
            credited = 0

            def progress(n: int) -> None:
                nonlocal credited
                n = min(n, per_run - credited)
                credited += n
                bar.update(n)

            if peer == "reference":
                result = run_reference(ref, prompts, args.new_tokens, args.steps, args.adaptive, progress)
            else:
                mode = "ar" if peer == "ar" else "diffusion"
                result = run_dgemma(
                    model,
                    prompts,
                    args.new_tokens,
                    args.steps,
                    args.adaptive,
                    mode,
                    progress,
                    turbo=turbo if peer == "turbo" else None,
                    engine=engine,
                )
            bar.update(per_run - credited)  # a row that ended early (EOS) still counts as its whole run
            return result

        results = []
        with bar:
            for index, name in enumerate(rounds):
                times = {}
                for peer in peers:
                    bar.set_description_str(f"{name} {PEER_NAMES[peer]}")
                    t = time.perf_counter()
                    result = once(peer)
                    times[PEER_NAMES[peer]] = time.perf_counter() - t
                    if name != "warm-up":
                        results.append(result)
                left = len(rounds) - index - 1
                guess = left * sum(
                    times.values()
                )  # the latest round (the warm-up's overestimates: first calls allocate)
                each = ", ".join(f"{k} {v:.1f} s" for k, v in times.items())
                say(
                    f"{name}: {each}"
                    + (f"; estimate ~{guess:.0f} s for the {left} round{'s' * (left > 1)} left" if left else "")
                )
    rows = summarize(results)
    memory = memory_figures(model, engine, results)
    header = (
        f"{args.model or args.size} | {device} {args.dtype} | batch {args.batch} | prompt {args.prompt_len} | "
        f"{args.new_tokens} new | {'adaptive' if args.adaptive else f'{args.steps} fixed'} steps | "
        f"canvas {model.config.canvas_length} | threads {torch.get_num_threads()}"
        f"{f' x {args.tensor_parallel_size} ranks' if args.tensor_parallel_size > 1 else ''}"
        f"{' (expert parallel)' if args.expert_parallel else ''} | "
        f"kernels: {cpu_kernels.describe(model.engine_net)}"
    )
    say(f"done: {args.runs} timed round{'s' * (args.runs > 1)} of {len(peers)} peer{'s' * (len(peers) > 1)}")
    if args.json:
        print(
            json.dumps(
                {
                    "setup": header,
                    "memory": memory_report(memory),
                    "memory_bytes": memory,
                    "rows": rows,
                    "runs": [asdict(r) for r in results],
                },
                indent=2,
            )
        )
    else:
        print(memory_report(memory))
        print_table(rows, header)
    return 0


def add_cli(sub) -> None:
    """The `bench` subcommand."""
    p = sub.add_parser(
        "bench",
        help="time dgemma against its AR mode and the transformers reference",
        description="Runs the peers interleaved on the same weights and prompt and prints medians and "
        "ratios (stdout); the plan, an estimate and the progress go to stderr. "
        "--quick: a check in under a minute on the tiny model.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a preset for a check in under a minute on tiny: 1 canvas of prompt, 2 new, 4 steps, "
        "peers default,ar, 1 warm-up + 1 timed round; flags given explicitly override it (default: off)",
    )
    p.add_argument("--model", "-m", help=f"{MODEL_HELP} (default: random weights of --size)")
    add_hub_flags(p)
    p.add_argument(
        "--size",
        choices=list(PRESETS),
        default="tiny",
        help="model size preset for random weights, dgemma/model/presets.py (default: tiny)",
    )
    add_parallel_flags(p)
    add_device_flags(p)  # random --size weights on CUDA: --dtype auto is bfloat16, the released model's
    p.add_argument(
        "--quantization",
        choices=scheme_choices(),
        default=None,
        help="quantised weights; random --size models are built directly quantised (default: none)",
    )
    p.add_argument("--group-size", type=int, default=None, help="inputs per scale for int4 (default: 64)")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens, random ids (default: 2 canvases of the model: 64 on tiny, 512 on mid; --quick: 1 canvas)",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens to generate per prompt, no EOS stop (default: 3 canvases: 96 on tiny, 768 on mid; "
        "--quick: 2 canvases)",
    )
    p.add_argument("--batch", type=int, default=1, help="prompts generated together (default: 1)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"fixed denoising steps per canvas (default: {DEFAULTS['steps']}; --quick: {QUICK['steps']})",
    )
    p.add_argument("--adaptive", action="store_true", help="adaptive stopping instead of fixed steps (default: fixed)")
    p.add_argument(
        "--peers",
        default=None,
        help=f"comma list of default, ar, reference, turbo (default: {DEFAULTS['peers']}; --quick: {QUICK['peers']})",
    )
    p.add_argument(
        "--turbo",
        action="store_true",
        default=None,
        help="add a dgemma-turbo row: the diffusion peer with turbo denoising, same prompts and seeds; "
        "positions_per_token then shows the decoder positions it computed per committed token "
        "(default: off)",
    )
    add_turbo_flags(p, switch=False)
    p.add_argument(
        "--runs",
        type=int,
        default=None,
        metavar="N",
        help=f"timed runs per peer, interleaved; the table gives medians (default: {DEFAULTS['runs']}; "
        f"--quick: {QUICK['runs']})",
    )
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the untimed warm-up round (default: one warm-up run of each peer first)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table (default: a table)")
    add_threads_flag(p)
    p.set_defaults(func=cmd_bench)

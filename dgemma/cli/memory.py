"""`dgemma memory`: the KV cache bytes of one request (paged against preallocated rows), or with
--card SIZE whether serving fits a device of that size, part by part. With
--tensor-parallel-size N (and --expert-parallel) both are per rank: what each of N devices of
that size holds, the largest rank deciding."""

from __future__ import annotations

from .common import CliError, parse_size, quantization_choices


def print_memory_plan(config, args) -> int:
    """`dgemma memory --card SIZE`: what serving takes on a device of SIZE bytes, by part, and
    whether it fits: the check every load makes (hub/fit.py), for a card of that size."""
    from pathlib import Path

    import torch

    from ..devices import resolve_dtype
    from ..hub import FitError, FitRequest
    from ..hub.fit import CheckpointFacts, check_fit, local_facts

    dtype = resolve_dtype(args.dtype)
    name = args.model or f"--size {args.size}"
    # a checkpoint's facts include a pre-quantised one's headers (its weights as stored)
    facts = local_facts(Path(args.model)) if args.model else CheckpointFacts(name, Path("."), config)
    ranks = args.tensor_parallel_size
    flags = ("--quantization", "--max-context", "--max-active") + (("--tensor-parallel-size",) if ranks > 1 else ())
    request = FitRequest(
        torch.device("cuda"),
        lambda _: dtype,
        args.quantization,
        args.group_size,
        args.max_active,
        args.max_context,
        memory=args.card,
        memory_source="--card",
        flags=flags,
        tensor_parallel_size=ranks,
        expert_parallel=args.expert_parallel,
    )
    try:
        fit = check_fit(facts, request, force=True)
    except (FitError, ValueError) as e:
        raise CliError(str(e)) from None
    if ranks > 1:
        return print_rank_plans(facts, request, fit, name, args)
    plan, gib = fit.plan, 2**30
    print(
        f"serving {name} on a {args.card / gib:.1f} GiB device, {args.dtype}, "
        f"{plan.scheme or 'unquantised'} weights, batch {plan.batch}, context {plan.context}:"
    )
    for part, size in plan.weights.items():
        print(f"  weights: {part:<12} {size / gib:8.2f} GiB")
    for part, size in (("KV cache", plan.kv_cache), ("step buffers", plan.step_buffers), ("reserve", plan.reserve)):
        print(f"  {part:<21} {size / gib:8.2f} GiB")
    print(f"  {'total':<21} {plan.total / gib:8.2f} GiB")
    if not fit.fits:
        print(f"does not fit: {fit.message}")
        return 1
    print("fits")
    return 0


def print_rank_plans(facts, request, fit, name: str, args) -> int:
    """`dgemma memory --card SIZE --tensor-parallel-size N`: every rank's plan, part by part, one
    column per rank, and whether the largest fits a device of SIZE."""
    from ..hub.fit import rank_plans_for

    every = rank_plans_for(facts, request.dtype(facts.config_dir), fit.scheme, request)
    gib, split = 2**30, "expert parallel" if args.expert_parallel else "tensor parallel"
    print(
        f"serving {name} on {len(every)} devices of {args.card / gib:.1f} GiB, {args.dtype}, "
        f"{fit.plan.scheme or 'unquantised'} weights, batch {fit.plan.batch}, context {fit.plan.context}, "
        f"per rank ({len(every)} ranks, {split}), GiB:"
    )
    groups: list[list] = []  # consecutive ranks that hold the same bytes share a column
    for plan in every:
        if groups and groups[-1][-1].weights == plan.weights and groups[-1][-1].total == plan.total:
            groups[-1].append(plan)
        else:
            groups.append([plan])
    labels = [f"rank {g[0].rank}" if len(g) == 1 else f"ranks {g[0].rank}-{g[-1].rank}" for g in groups]
    plans = [g[0] for g in groups]
    print(f"  {'':<21}" + "".join(f"{label:>12}" for label in labels))
    rows = [(f"weights: {part}", [p.weights[part] for p in plans]) for part in plans[0].weights]
    rows += [
        (part, [getattr(p, field) for p in plans])
        for part, field in (
            ("KV cache", "kv_cache"),
            ("step buffers", "step_buffers"),
            ("reserve", "reserve"),
            ("total", "total"),
        )
    ]
    for label, sizes in rows:
        print(f"  {label:<21}" + "".join(f"{size / gib:12.2f}" for size in sizes))
    for note in fit.plan.notes:
        print(f"note: {note}")
    if not fit.fits:
        print(f"does not fit: {fit.message}")
        return 1
    print(f"fits: rank {fit.plan.rank}, the largest, takes {fit.plan.total / gib:.2f} of {args.card / gib:.1f} GiB")
    return 0


def kv_config(config, args):
    """The config whose KV cache one device holds: the whole model's, or with
    --tensor-parallel-size the largest rank's heads (replicated KV heads counted)."""
    if args.tensor_parallel_size == 1:
        return config
    from ..memory_plan import rank_kv_bytes_per_token
    from ..parallel.plan import ShardError, ShardPlan

    try:
        shards = ShardPlan.build(config, args.tensor_parallel_size, args.expert_parallel)
    except ShardError as e:
        raise CliError(str(e)) from None
    rank = max(range(shards.size), key=lambda r: (sum(rank_kv_bytes_per_token(shards, r, 2).values()), -r))
    return shards.rank_config(rank)


def print_finetune_plan(config, args) -> int:
    """`dgemma memory --finetune`: one fine-tuning step's peak memory, part by part (train/plan.py's
    plan_finetune, the figure `dgemma finetune` checks before it loads), and with --card whether it
    fits, or what would."""
    import torch

    from ..quant import schemes
    from ..train import lora
    from ..train.plan import FinetuneWork, finetune_fixes, plan_finetune

    if args.lora_rank < 0:
        raise CliError(f"--lora-rank must be positive, or 0 for full fine-tuning (got {args.lora_rank})")
    if args.seq_len < 2 or args.batch_size < 1:
        raise CliError("--seq-len must be at least 2 and --batch-size positive")
    cpu = args.device == "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype or ("float32" if cpu else "bfloat16")
    ]
    targets = tuple(
        t.split(".", 2)[2] if t.startswith("layers.") else t for t in lora.resolve_targets(args.lora_targets)
    )
    with torch.device("meta"):
        from ..model.diffusion_gemma import DiffusionGemma

        try:
            lora.target_modules(DiffusionGemma(config), targets)
        except ValueError as e:
            raise CliError(str(e)) from None

    def work(scheme):
        return FinetuneWork(
            scheme=scheme,
            group_size=args.group_size,
            lora_rank=args.lora_rank,
            targets=targets,
            seq_len=args.seq_len,
            batch=args.batch_size,
            weight_dtype=dtype,
            act_dtype=dtype,
            checkpointing=not args.no_checkpoint_layers,
            device="cpu" if cpu else "cuda",
        )

    scheme = args.quantization
    if scheme == "auto":  # the first of the unquantised base and auto's schemes whose plan fits the card
        order = [None, *schemes.auto_names()]
        scheme = next(
            (s for s in order if args.card is None or plan_finetune(config, work(s)).total <= args.card), order[-1]
        )
    if scheme is not None and args.lora_rank == 0:
        raise CliError(f"the {scheme} base is frozen: plan LoRA on it with --lora-rank R (e.g. 16)")
    plan, gib = plan_finetune(config, work(scheme)), 2**30
    name = args.model or f"--size {args.size}"
    device = "a CPU (float32 activations)" if cpu else "a GPU"
    what = f"LoRA rank {args.lora_rank}" if args.lora_rank else "full fine-tuning"
    card = f", a {args.card / gib:.1f} GiB device" if args.card else ""
    print(
        f"fine-tuning {name} on {device}{card}: {scheme or 'unquantised'} base, {what} "
        f"({plan.trained_parameters / 1e6:.1f}M trained parameters), {args.batch_size} x {args.seq_len} tokens, "
        f"{str(dtype).removeprefix('torch.')} activations, checkpointing {'off' if args.no_checkpoint_layers else 'on'} "
        "(planned, not measured):"
    )
    for part, size in plan.base.items():
        print(f"  base: {part:<22} {size / gib:8.2f} GiB")
    for part, size in list(plan.parts.items())[1:]:
        print(f"  {part:<28} {size / gib:8.2f} GiB")
    print(f"  {'total':<28} {plan.total / gib:8.2f} GiB")
    if args.card is None:
        return 0
    if plan.total > args.card:
        fixes = finetune_fixes(config, work(scheme), args.card)
        hint = "it would fit with " + " or ".join(fixes) if fixes else "no smaller scheme, sequence or rank fits it"
        print(f"does not fit: {plan.total / gib:.2f} of {args.card / gib:.1f} GiB; {hint}")
        return 1
    print(f"fits: {plan.total / gib:.2f} of {args.card / gib:.1f} GiB")
    return 0


def cmd_memory(args) -> int:
    """KV cache bytes of one request: the paged layout against preallocated rows."""
    from ..config import load_model_config
    from ..devices import resolve_dtype
    from ..memory_plan import kv_report

    if args.model:
        config = load_model_config(args.model)
    else:
        from ..model.checkpoint import make_config
        from ..model.presets import PRESETS

        if args.size not in PRESETS:
            raise CliError(f"--size must be one of {', '.join(PRESETS)} (got {args.size!r})")
        config = make_config(**PRESETS[args.size])
    if args.tokens < 1:
        raise CliError(f"--tokens must be positive (got {args.tokens})")
    if args.tensor_parallel_size < 1:
        raise CliError(f"--tensor-parallel-size must be positive (got {args.tensor_parallel_size})")
    if args.finetune:
        return print_finetune_plan(config, args)
    args.dtype = args.dtype or "bfloat16"
    if args.card is not None:
        return print_memory_plan(config, args)
    full, config = config, kv_config(config, args)
    r = kv_report(config, args.tokens, resolve_dtype(args.dtype), args.block_size)
    unit, scale = ("GiB", 2**30) if r["dense_total"] >= 2**30 else ("MiB", 2**20)
    ranks = f", per rank ({args.tensor_parallel_size} ranks)" if args.tensor_parallel_size > 1 else ""
    print(
        f"KV cache for one request of {r['tokens']} tokens, {args.dtype}, blocks of {r['block_size']} positions "
        f"({args.model or args.size}: window {full.sliding_window}){ranks}"
    )
    print(f"{'layers':<20} {'bytes/token':>12} {'paged ' + unit:>10} {'preallocated rows ' + unit:>22}")
    for kind in r["paged"]:
        n = sum(1 for spec in config.layers if spec.kind == kind)
        print(
            f"{f'{n} {kind}':<20} {r['bytes_per_token'][kind]:>12} {r['paged'][kind] / scale:>10.2f} {r['dense'][kind] / scale:>22.2f}"
        )
    print(
        f"{'total':<20} {sum(r['bytes_per_token'].values()):>12} {r['paged_total'] / scale:>10.2f} {r['dense_total'] / scale:>22.2f}"
    )
    print(
        "paged: sliding layers hold the blocks their window sees, global layers every block; "
        "preallocated rows: every layer holds every position"
    )
    return 0


def add_cli(sub) -> None:
    """The `memory` subcommand."""
    mem = sub.add_parser("memory", help="KV cache bytes of one request of --tokens tokens (paged vs preallocated)")
    mem.add_argument("--model", "-m", help="checkpoint directory (its config.json); default: --size")
    mem.add_argument("--size", default="real", help="a model-size preset (default: real, the released model)")
    mem.add_argument("--tokens", type=int, default=131072, help="tokens of the request (default: 131072)")
    mem.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the KV cache and weights (default: bfloat16; --finetune on a CPU: float32)",
    )
    mem.add_argument("--block-size", type=int, default=None, help="positions per KV block (default: the canvas length)")
    mem.add_argument(
        "--card",
        type=parse_size,
        default=None,
        help="plan serving on a device of this many bytes (e.g. 24GB, 80GiB): weights, KV, step buffers, fit",
    )
    mem.add_argument(
        "--quantization",
        default=None,
        choices=quantization_choices(),
        help="with --card: the scheme (auto: the best that fits)",
    )
    mem.add_argument("--group-size", type=int, default=None, help="with --card: int4's group size (default 64)")
    mem.add_argument("--max-active", type=int, default=8, help="with --card: canvases denoised at once (default 8)")
    mem.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="with --card: positions of the longest request (default: max_position_embeddings)",
    )
    mem.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="plan per rank of a model split across this many devices (default 1)",
    )
    mem.add_argument(
        "--expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size: whole experts per rank instead of each expert split",
    )
    ft = mem.add_argument_group("fine-tuning (--finetune)")
    ft.add_argument(
        "--finetune",
        action="store_true",
        help="plan one step of `dgemma finetune` instead: base, adapters and optimizer, activations, loss chunk",
    )
    ft.add_argument("--lora-rank", type=int, default=16, help="adapters' rank (0: full fine-tuning; default 16)")
    ft.add_argument("--lora-targets", default="attention,mlp", help="attention, mlp and/or module-name suffixes")
    ft.add_argument("--seq-len", type=int, default=2048, help="tokens per training sequence (default 2048)")
    ft.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch (default 1)")
    ft.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where it trains (default cuda)")
    ft.add_argument("--no-checkpoint-layers", action="store_true", help="plan without activation checkpointing")
    mem.set_defaults(func=cmd_memory)

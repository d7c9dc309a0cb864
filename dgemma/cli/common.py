"""What several commands share: the model, device, sampler, engine, thread and chat-template flags,
and the helpers that turn them into a loaded model; the one error type a command raises.

Imports of anything heavy (jinja2, the engine's options, the model) wait inside the functions, so
that building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from ..knobs import KNOBS, Knob


class CliError(Exception):
    """A mistake in what the user typed: `dgemma` prints it as one line and exits with 2."""


# the sampler's flags: the knobs of knobs.py's table that have one, in its order (run and chat take them all);
# the turbo ones (`--turbo` first, a switch: absent is the checkpoint's default, off) serve and bench take on
# their own (add_turbo_flags)
SAMPLER_FLAGS: tuple[Knob, ...] = tuple(k for k in KNOBS if k.flag)
TURBO_FLAGS: tuple[Knob, ...] = tuple(k for k in SAMPLER_FLAGS if k.turbo)

# --device and --dtype of run, chat, serve and bench; `dgemma.devices.resolve_device` and
# `resolve_dtype` decide what they mean (the one place "auto" is resolved)
DEVICE_HELP = "cpu, cuda, cuda:N (the GPU of index N) or auto: cuda when torch sees a GPU (default: cpu)"
DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]
DTYPE_HELP = (
    "the weights' dtype in memory (default: auto = the checkpoint's stored dtype, bfloat16 for the "
    "released model and the shipped dgemma-tiny)"
)


def add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)


MODEL_HELP = "a checkpoint directory or a Hugging Face hub id (owner/name)"


def scheme_choices() -> list[str]:
    """Every quantisation scheme of quant/schemes.py's table, in its order: asked when a parser
    is built, so a scheme registered before then is a choice."""
    from ..quant import schemes

    return list(schemes.names())


def quantization_choices() -> list[str]:
    """--quantization's choices: auto (the best scheme whose plan fits) and every scheme."""
    return ["auto", *scheme_choices()]


def add_hub_flags(p: argparse.ArgumentParser) -> None:
    """--revision and --force of every command that names a model (dgemma/hub/)."""
    p.add_argument("--revision", default=None, help="with a hub id: the branch, tag or commit to use (default: main)")
    p.add_argument(
        "--force",
        action="store_true",
        help="go on when the memory plan does not fit the device, or a download the disk's free space "
        "(default: refuse, saying what would fit)",
    )


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size and --expert-parallel (dgemma/parallel; docs/parallel.md)."""
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model across N ranks: N processes on this host, one per GPU on a GPU host (across "
        "hosts: start the ranks with torchrun, docs/parallel.md) (default: 1)",
    )
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size: whole experts per rank instead of every expert split (default: split)",
    )
    p.set_defaults(launch_ranks=True)  # cli/__init__.py starts the ranks (`dgemma memory` only plans them)


def parallel_load_args(args) -> dict:
    """dgemma.load's tensor_parallel_size / expert_parallel from the flags (none for one process)."""
    size, experts = getattr(args, "tensor_parallel_size", 1), getattr(args, "expert_parallel", False)
    return {"tensor_parallel_size": size, "expert_parallel": experts} if size != 1 or experts else {}


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help=f"{MODEL_HELP} (default: the shipped dgemma-tiny)")
    add_hub_flags(p)
    add_device_flags(p)
    add_parallel_flags(p)
    add_quantization_flags(
        p,
        "quantise the text layers' linears and experts while loading (docs/quantization.md); "
        "auto: the best scheme whose memory plan fits the device (a pre-quantised checkpoint: "
        "its own)",
    )


def add_quantization_flags(p: argparse.ArgumentParser, help_text: str) -> None:
    """--quantization (`help_text` says what it does for the command) and int4's --group-size."""
    p.add_argument("--quantization", choices=quantization_choices(), default=None, help=help_text)
    p.add_argument("--group-size", type=int, default=None, help="inputs per scale for int4 (default: 64)")


SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """A byte count: '4GiB', '512MB', '1.5g', '1073741824'."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in SIZE_UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4GiB, 512MB, 1073741824)")
    return int(float(m.group(1)) * SIZE_UNITS[unit])


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """KV cache and scheduling flags shared by `dgemma run` and `dgemma serve` (see EngineOptions)."""
    p.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        help="memory for the KV cache blocks, e.g. 4GiB (default: half of the free memory on CUDA, a quarter on a CPU, at most "
        "what 8 requests of max_position_embeddings need)",
    )
    p.add_argument("--block-size", type=int, default=None, help="positions per KV block (default: the canvas length)")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=2048,
        help="prompt tokens encoded per engine step, between other requests' decoder steps (default: 2048)",
    )
    p.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="do not reuse the cached keys/values of earlier prompts and committed blocks",
    )
    p.add_argument(
        "--batched-passes",
        action="store_true",
        help="run a step's canvases as one batched pass even on CPU (faster; a seeded request's text "
        "then depends on its batch and on the prefix cache at float-rounding level). "
        "Default: batched on GPU only",
    )


def engine_options(args):
    """The EngineOptions of the flags add_engine_flags added."""
    from ..engine.options import EngineOptions

    return EngineOptions(
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        prefix_cache=args.prefix_cache,
        prefill_chunk=args.prefill_chunk,
        batch_invariant=False if args.batched_passes else None,
    )


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads for the model's matmuls (default: torch's choice, one per core it sees); "
        "on a shared or busy CPU fewer, even 1, can be several times faster",
    )


def apply_threads(args) -> None:
    """--threads, set before any work (torch's intra-op pool)."""
    threads = getattr(args, "threads", None)
    if threads is None:
        return
    if threads < 1:
        raise CliError(f"--threads must be at least 1 (got {threads})")
    import torch

    torch.set_num_threads(threads)


def add_chat_template_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template to use instead of the checkpoint's (tokenizer_config.json or chat_template.jinja)",
    )


def read_chat_template(args) -> str | None:
    """--chat-template FILE's text, checked that Jinja parses it (before minutes of loading)."""
    path = getattr(args, "chat_template", None)
    if path is None:
        return None
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"--chat-template: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise CliError(
            f"--chat-template: {path} is not a valid Jinja template: {e.message} (line {e.lineno})"
        ) from None
    return text


def apply_chat_template_file(model, args, text: str | None = None) -> None:
    """--chat-template FILE (or its `text`, read before loading) set on the model's tokenizer;
    the processor renders through the same tokenizer."""
    text = text if text is not None else read_chat_template(args)
    if text is None:
        return
    if model.tokenizer is None:
        raise CliError(f"--chat-template: {model.path} has no tokenizer.json to render it with")
    model.tokenizer.chat_template = text


def _add_flags(p: argparse.ArgumentParser, table: tuple[Knob, ...]) -> None:
    for k in table:
        if k.kind is bool:  # a switch: absent is None, so the checkpoint's default applies
            p.add_argument(
                k.flag, dest=k.name, action="store_true", default=None, help=f"{k.help} (default: {k.default})"
            )
        else:
            p.add_argument(k.flag, dest=k.name, type=k.kind, default=None, help=f"{k.help} (default: {k.default})")


def add_sampler_flags(p: argparse.ArgumentParser) -> None:
    _add_flags(p, SAMPLER_FLAGS)


def add_turbo_flags(p: argparse.ArgumentParser, switch: bool = True) -> None:
    """--turbo and its knobs alone (serve: the default of requests that do not say); without
    `switch` the knobs only (bench, whose --turbo adds a row)."""
    _add_flags(p, TURBO_FLAGS if switch else TURBO_FLAGS[1:])


def sampler_knobs(args) -> dict:
    """The GenerationConfig overrides the sampler flags give (None: not given), for Model.generate / stream."""
    return {k.name: getattr(args, k.name) for k in SAMPLER_FLAGS}


def turbo_knobs(args) -> dict:
    """The turbo flags the user gave (unset ones left out), checked by the sampler's own rule
    (a ConfigError naming the field, which `dgemma` reports by its flag) before any loading."""
    from ..config import GenerationConfig

    knobs = {k.name: getattr(args, k.name) for k in TURBO_FLAGS if getattr(args, k.name, None) is not None}
    GenerationConfig().with_overrides(**knobs)
    return knobs


def refuse_turbo(args, why: str | None) -> None:
    """--turbo where `why` (a flag the user gave, e.g. --sampling reference) rules it out: one
    line, before loading."""
    if getattr(args, "turbo", None) and why is not None:
        raise CliError(
            f"--turbo does not go with {why}: turbo denoising runs on the engine's sampler only; drop one of them"
        )


def check_turbo_knobs(args, config) -> None:
    """Refuse turbo knobs where turbo is off in `config` (the generation config the flags give):
    they would change nothing."""
    given = [k.flag for k in TURBO_FLAGS[1:] if getattr(args, k.name, None) is not None]
    if given and not config.turbo:
        raise CliError(f"{given[0]} is a knob of turbo denoising: it needs --turbo")


def flag_names(message: str, args) -> str:
    """`message` with the sampler fields the user set by flag named as those flags
    (`max_denoising_steps` -> `--steps`)."""
    for k in SAMPLER_FLAGS:
        if getattr(args, k.name, None) is not None:
            message = re.sub(rf"\b{k.name}\b", k.flag, message)
    return message


def check_seed_flag(args) -> None:
    """--seed in the range the API and the server take (`dgemma.engine.request.check_seed`),
    refused before the model loads."""
    from ..engine.request import check_seed

    if getattr(args, "seed", None) is not None:
        try:
            check_seed(args.seed, "--seed")
        except ValueError as e:
            raise CliError(str(e)) from None


def say(message: str) -> None:
    """A progress or warning line on stderr (stdout holds the command's output)."""
    sys.stderr.write(f"dgemma: {message}\n")
    sys.stderr.flush()


FIT_FLAGS = ("--quantization", "--max-context", "--max-active")


def device_memory_override() -> int | None:
    """DGEMMA_DEVICE_MEMORY as bytes: the memory the memory-plan check takes for the device's, e.g.
    to check on one machine what another will run (and in tests); None when unset."""
    from ..hub.fit import DEVICE_MEMORY_ENV

    text = os.environ.get(DEVICE_MEMORY_ENV)
    if not text:
        return None
    try:
        return parse_size(text)
    except argparse.ArgumentTypeError as e:
        raise CliError(f"{DEVICE_MEMORY_ENV}: {e}") from None


def fit_request(args, device):
    """The memory-plan check's request from a command's flags (`hub.FitRequest`): the device, dtype
    and scheme it loads with, and what it runs: serve its --max-active requests of --max-context
    positions, the others one request (bench: --batch); with --turbo, each of them with its turbo
    canvas K/V buffer."""
    from functools import partial

    from ..devices import resolve_dtype
    from ..hub import FitRequest
    from ..hub.fit import SINGLE_REQUEST_CONTEXT

    flags = tuple(f for f in FIT_FLAGS if hasattr(args, f[2:].replace("-", "_")))
    context = args.max_context if hasattr(args, "max_context") else SINGLE_REQUEST_CONTEXT
    return FitRequest(
        device,
        partial(resolve_dtype, getattr(args, "dtype", "auto"), device),
        getattr(args, "quantization", None),
        getattr(args, "group_size", None),
        max_active=getattr(args, "max_active", None) or getattr(args, "batch", None) or 1,
        max_context=context,
        kv_cache_memory=getattr(args, "kv_cache_memory", None),
        prefill_chunk=getattr(args, "prefill_chunk", 2048),
        turbo=bool(getattr(args, "turbo", None)),
        memory=device_memory_override(),
        flags=flags + ("--force",),
        **parallel_load_args(args),
    )


def resolve_model(args, fit: bool = True):
    """--model (a directory or a hub id, at --revision) as a local checkpoint (`hub.Checkpoint`),
    fetched if need be; with `fit`, its memory plan checked against --device first (--force: a
    warning only). Without --model: the shipped dgemma-tiny."""
    from ..devices import resolve_device
    from ..hub import resolve_checkpoint
    from ..loading import default_model_dir

    revision = getattr(args, "revision", None)
    if args.model is None:
        if revision is not None:
            raise CliError("--revision needs --model owner/name (a hub id)")
        if not (default_model_dir() / "config.json").exists():
            raise CliError("no --model given and the shipped model is missing; create one with `dgemma make-tiny DIR`")
    request = fit_request(args, resolve_device(args.device)) if fit else None
    return resolve_checkpoint(
        args.model or default_model_dir(), revision, fit=request, force=getattr(args, "force", False), say=say
    )


def add_lora_flag(p: argparse.ArgumentParser) -> None:
    """`dgemma run` / `chat --lora PATH`: one adapter beside the base (serve takes several: --lora NAME=PATH)."""
    p.add_argument(
        "--lora",
        metavar="PATH",
        default=None,
        help="run with the LoRA adapter at PATH (a PEFT-format directory, as `dgemma finetune` writes it, or a "
        "hub id owner/name), unmerged beside the base",
    )


def attach_lora(model, args) -> str | None:
    """The --lora adapter read, checked against the model and installed (its name for
    `Model.stream(..., adapter=)`), or None without the flag; CliError of one line otherwise."""
    path = getattr(args, "lora", None)
    if path is None:
        return None
    from ..adapters import AdapterError, read_adapter

    try:
        adapter = read_adapter("lora", path, model.config)
        model.enable_adapters(max_loras=1, max_rank=adapter.rank).install(adapter)
    except (AdapterError, ValueError) as e:
        raise CliError(f"--lora: {e}") from None
    return adapter.name


def load_model(args):
    """The model named by --model/--revision/--device/--dtype/--quantization (the shipped
    dgemma-tiny without --model), after the memory-plan check; `model.name` is the hub id or the
    directory's name."""
    import dgemma

    checkpoint = resolve_model(args)  # force=True below: checked here, with the command's own flags
    model = dgemma.load(
        checkpoint.path,
        device=args.device,
        dtype=args.dtype,
        quantization=checkpoint.quantization,
        group_size=getattr(args, "group_size", None),
        force=True,
        **parallel_load_args(args),
    )
    model.name = checkpoint.name
    return model


def print_growing(text: str, printed: str) -> str:
    """Write to stdout what `text` (the answer decoded so far) adds to `printed` (what is on the
    screen already), or, when decoding the longer answer changed what was printed (tokens that
    merge), the whole text again on a new line. Returns `text`: what is printed now."""
    sys.stdout.write(text[len(printed) :] if text.startswith(printed) else "\n" + text)
    sys.stdout.flush()
    return text

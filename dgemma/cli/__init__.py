"""Command line: `dgemma run | serve | bench | train | finetune | make-tiny`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
import time
from pathlib import Path

SAMPLER_FLAGS = (
    ("--max-new-tokens", "max_new_tokens", int, "tokens to generate at most"),
    ("--steps", "max_denoising_steps", int, "denoising steps per canvas at most"),
    ("--entropy-bound", "entropy_bound", float, "entropy budget for accepting tokens per step"),
    ("--t-min", "t_min", float, "temperature at the last step"),
    ("--t-max", "t_max", float, "temperature at the first step"),
    ("--stability-threshold", "stability_threshold", int, "steps the argmax must hold before stopping"),
    ("--confidence-threshold", "confidence_threshold", float, "mean entropy below which a canvas may stop"),
)


class CliError(Exception):
    pass


DEMO_MODEL_NOTE = ("dgemma: no --model: the shipped demo model dgemma-tiny (10M parameters, trained on Python's "
                   "standard library: expect Python-flavoured text, not working code); --model DIR for a real checkpoint")  # fmt: skip


# --device and --dtype of run, chat, serve and bench; `dgemma.api.resolve_device` and
# `resolve_dtype` decide what they mean (the one place "auto" is resolved)
DEVICE_HELP = "cpu, cuda, cuda:N (the GPU of index N) or auto: cuda when torch sees a GPU (default: cpu)"
DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]
DTYPE_HELP = ("the weights' dtype in memory (default: auto = the checkpoint's dtype on CUDA, bfloat16 for the "
              "released model; float32 on CPU)")  # fmt: skip


def add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help="checkpoint directory (default: the shipped dgemma-tiny)")
    add_device_flags(p)
    p.add_argument("--quantization", choices=["fp8", "int8", "int4", "nvfp4"], default=None,
                   help="quantise the text layers' linears and experts while loading (docs/quantization.md)")
    p.add_argument("--group-size", type=int, default=None, help="inputs per scale for int4 (default: 64)")


SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
              "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """A byte count: '4GiB', '512MB', '1.5g', '1073741824'."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in SIZE_UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4GiB, 512MB, 1073741824)")
    return int(float(m.group(1)) * SIZE_UNITS[unit])


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """KV cache and scheduling flags shared by `dgemma run` and `dgemma serve` (see EngineOptions)."""
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="memory for the KV cache blocks, e.g. 4GiB (default: a quarter of free memory, at most "
                        "what 8 requests of max_position_embeddings need)")  # fmt: skip
    p.add_argument("--block-size", type=int, default=None, help="positions per KV block (default: the canvas length)")
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="prompt tokens encoded per engine step, between other requests' decoder steps (default: 2048)")  # fmt: skip
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not reuse the cached keys/values of earlier prompts and committed blocks")  # fmt: skip
    p.add_argument("--batched-passes", action="store_true",
                   help="run a step's canvases as one batched pass even on CPU (faster; a seeded request's text "
                        "then depends on its batch and on the prefix cache at float-rounding level). "
                        "Default: batched on GPU only")  # fmt: skip


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for the model's matmuls (default: torch's choice, one per core it sees); "
                        "on a shared or busy CPU fewer, even 1, can be several times faster")  # fmt: skip


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
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template to use instead of the checkpoint's (tokenizer_config.json or "
                        "chat_template.jinja)")  # fmt: skip


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
        raise CliError(f"--chat-template: {path} is not a valid Jinja template: {e.message} (line {e.lineno})") from None
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


def engine_options(args):
    from ..engine.options import EngineOptions

    return EngineOptions(
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, prefix_cache=args.prefix_cache,
        prefill_chunk=args.prefill_chunk, batch_invariant=False if args.batched_passes else None,
    )  # fmt: skip


def flag_names(message: str, args) -> str:
    """`message` with the sampler fields the user set by flag named as those flags
    (`max_denoising_steps` -> `--steps`)."""
    import re

    for flag, dest, _, _ in SAMPLER_FLAGS:
        if getattr(args, dest, None) is not None:
            message = re.sub(rf"\b{dest}\b", flag, message)
    return message


def add_sampler_flags(p: argparse.ArgumentParser) -> None:
    for flag, dest, kind, text in SAMPLER_FLAGS:
        p.add_argument(flag, dest=dest, type=kind, default=None, help=f"{text} (default: generation_config.json)")


def sampler_knobs(args) -> dict:
    return {dest: getattr(args, dest) for _, dest, _, _ in SAMPLER_FLAGS}


def load_model(args):
    """The model named by --model/--device/--dtype (the shipped dgemma-tiny without --model)."""
    import dgemma

    if args.model is None and not (dgemma.default_model_dir() / "config.json").exists():
        raise CliError("no --model given and the shipped model is missing; create one with `dgemma make-tiny DIR`")
    quantization, group_size = getattr(args, "quantization", None), getattr(args, "group_size", None)
    return dgemma.load(args.model, device=args.device, dtype=args.dtype, quantization=quantization, group_size=group_size)


def chat_messages(args, content) -> list[dict]:
    """`dgemma run --chat`'s conversation: the --system prompt, then the user's content."""
    return ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": content}]


def media_prompt(model, args):
    """The prompt of `dgemma run --image/--video` as the processor builds it (ModelInputs). With
    --chat the media parts come first in the user turn, in command-line order; without, the prompt
    gets one placeholder per image/video prepended (and a newline), unless it holds placeholders."""
    from ..serve.media_sources import check_soft_tokens

    if args.mode == "ar":
        raise CliError("--image and --video work in diffusion mode only, not with --mode ar")
    if not model.supports_images:
        raise CliError(f"--image/--video: {model.path or 'the model'} has no vision tower (or no processor config)")
    budgets = {name: check_soft_tokens(getattr(args, name), "--" + name.replace("_", "-"))
               for name in ("max_soft_tokens", "video_max_soft_tokens")}  # fmt: skip
    budgets = {k: v for k, v in budgets.items() if v is not None}
    processor = model.processor
    if args.chat:
        content = [{"type": kind, kind: path} for kind, path in args.media] + [{"type": "text", "text": args.prompt}]
        return processor.apply_chat_template(chat_messages(args, content), add_generation_prompt=True, **budgets)
    placeholders = {"image": processor.image_token, "video": processor.video_token}
    text = args.prompt
    if not any(token in text for token in placeholders.values()):
        text = "".join(placeholders[kind] for kind, _ in args.media) + "\n" + text
    images = [path for kind, path in args.media if kind == "image"]
    videos = [path for kind, path in args.media if kind == "video"]
    return processor(text, images=images, videos=videos, **budgets)


def run_grammar(model, args):
    """The Grammar of --json-schema FILE / --regex / --grammar FILE (Lark), or None."""
    from ..engine.constraints.grammar import GrammarError

    given = [(flag, value) for flag, value in (("--json-schema", args.json_schema), ("--regex", args.regex),
                                                ("--grammar", args.grammar)) if value is not None]  # fmt: skip
    if not given:
        return None
    if len(given) > 1:
        raise CliError(f"give one of --json-schema, --regex and --grammar (got {' and '.join(f for f, _ in given)})")
    flag, value = given[0]
    if args.mode == "ar" or args.sampling == "reference":
        raise CliError(f"{flag} works with the engine's sampler only (not with --mode ar or --sampling reference)")
    if flag == "--regex":
        kind, spec = "regex", value
    else:
        try:
            spec = Path(value).read_text(encoding="utf-8")
        except OSError as e:
            raise CliError(f"{flag}: cannot read {value}: {e.strerror or e}") from None
        kind = "json_schema" if flag == "--json-schema" else "lark"
    try:
        return model.compile_grammar(kind, spec)
    except GrammarError as e:
        raise CliError(f"{flag}: {e}") from None


def run_suffix(args) -> str | None:
    """The text of --suffix / --suffix-file, or None; checks what infill cannot go with."""
    if args.suffix is not None and args.suffix_file is not None:
        raise CliError("give --suffix or --suffix-file, not both")
    suffix = args.suffix
    if args.suffix_file is not None:
        try:
            suffix = Path(args.suffix_file).read_text(encoding="utf-8")
        except OSError as e:
            raise CliError(f"--suffix-file: cannot read {args.suffix_file}: {e.strerror or e}") from None
    if suffix is None:
        if args.span_length is not None:
            raise CliError("--span-length needs --suffix or --suffix-file")
        return None
    for flag, bad in (("--chat", args.chat), ("--mode ar", args.mode == "ar"), ("--sampling reference", args.sampling == "reference"),
                      ("--image/--video", bool(args.media)), ("--json-schema/--regex/--grammar",
                      any(v is not None for v in (args.json_schema, args.regex, args.grammar)))):  # fmt: skip
        if bad:
            raise CliError(f"--suffix (infill) does not go with {flag}")
    if args.show_canvas and args.span_length is None:
        raise CliError("--show-canvas with --suffix needs --span-length (a chosen length is found by trying several)")
    return suffix


def cmd_infill(model, args, suffix: str) -> int:
    """`dgemma run PREFIX --suffix TEXT`: print the text between them (see engine/constraints/infill.py)."""
    from ..engine.events import Draft

    knobs = {k: v for k, v in sampler_knobs(args).items() if k != "max_new_tokens"}
    try:
        demo_note(args)
        if not args.show_canvas:
            started = time.perf_counter()
            result = model.infill(args.prompt, suffix, span_length=args.span_length, seed=args.seed, **knobs)
            sys.stdout.write(result.text + "\n")
            sys.stdout.flush()
            if not args.quiet:
                sys.stderr.write(f"dgemma: a span of {result.span_length} tokens (of {len(result.scores)} candidate lengths) "
                                 f"in {time.perf_counter() - started:.2f} s\n")  # fmt: skip
            return 0
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        tok, n = model.tokenizer, args.span_length
        with Live(Text(""), console=Console(), refresh_per_second=20) as live:
            for ev in model.infill_stream(args.prompt, suffix, n, seed=args.seed, **knobs):
                tokens = ev.canvas if isinstance(ev, Draft) else ev.tokens
                view = Text(args.prompt, style="dim")
                view.append(tok.decode(tokens[:n]), style="bold cyan" if isinstance(ev, Draft) else "bold")
                view.append(suffix, style="dim")
                if isinstance(ev, Draft):
                    view.append(f"\n[step {ev.step}]", style="dim")
                live.update(view)
        return 0
    except ValueError as e:
        raise CliError(str(e)) from None


def run_prompt(args) -> str:
    """The prompt of `dgemma run`: the argument, standard input for '-', or --prompt-file; an
    empty one is refused (it would generate from <bos> alone: text about nothing)."""
    if args.prompt_file is not None:
        if args.prompt is not None:
            raise CliError("give the prompt or --prompt-file, not both")
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"--prompt-file: cannot read {args.prompt_file}: {getattr(e, 'strerror', None) or e}") from None
    elif args.prompt == "-":
        text = sys.stdin.read()
    elif args.prompt is None:
        raise CliError("no prompt: give the text to complete, '-' to read it from standard input, or --prompt-file FILE")
    else:
        text = args.prompt
    if not text.strip() and not args.media:
        raise CliError("the prompt is empty (or only white space): give the text to complete (with --chat, the question)")
    return text


def demo_note(args) -> None:
    """Say, before its output, that the shipped demo model writes noise (unless --quiet)."""
    if args.model is None and not args.quiet:
        sys.stderr.write(DEMO_MODEL_NOTE + "\n")
        sys.stderr.flush()


def check_temperature(args) -> float:
    """AR mode's temperature (0: greedy); refused in diffusion mode, whose temperatures are the
    schedule's --t-max and --t-min."""
    if args.temperature is None:
        return 0.0
    if args.mode != "ar":
        raise CliError("--temperature is for --mode ar; the diffusion sampler's temperatures are --t-max (the first "
                       "step's) and --t-min (the last step's)")  # fmt: skip
    if not 0 <= args.temperature < float("inf"):
        raise CliError(f"--temperature must be a number >= 0 (got {args.temperature})")
    return args.temperature


class RunTiming:
    """What `dgemma run` says on stderr when it is done: tokens, time, speed, model passes
    (`passes`: decoder passes in diffusion mode, encoder passes in AR mode)."""

    def __init__(self, passes: str = "decoder"):
        self.started, self.first_block, self.tokens, self.passes = time.perf_counter(), None, 0, 0
        self.kind = passes

    def add(self, block) -> None:
        if self.first_block is None:
            self.first_block = time.perf_counter() - self.started
        self.tokens += len(block.tokens)
        self.passes += block.decoder_passes

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        parts = [f"{self.tokens} tokens in {elapsed:.2f} s ({self.tokens / elapsed if elapsed > 0 else 0:.1f} tok/s)"]
        if self.passes:
            parts.append(f"{self.passes} {self.kind} passes ({self.tokens / self.passes:.2f} tokens/forward)")
        if self.first_block is not None:
            parts.append(f"first block after {self.first_block:.2f} s")
        return "dgemma: " + ", ".join(parts)


def cmd_run(args) -> int:
    from ..engine.events import Block, Draft

    args.prompt = run_prompt(args)
    temperature = check_temperature(args)
    apply_threads(args)
    suffix = run_suffix(args)
    model = load_model(args)
    model.generation_config.with_overrides(**sampler_knobs(args))  # the knobs checked before any output
    model.configure_engine(engine_options(args))
    tok = model.tokenizer
    if tok is None:
        raise CliError(f"{model.path} has no tokenizer.json: `dgemma run` needs one")
    if suffix is not None:
        return cmd_infill(model, args, suffix)
    if args.media:
        prompt = media_prompt(model, args)  # token ids and image patches
    elif args.chat:
        prompt = tok.apply_chat_template(chat_messages(args, args.prompt), add_generation_prompt=True)
    else:
        prompt = tok.encode(args.prompt)
    grammar = run_grammar(model, args)
    timing = RunTiming("encoder" if args.mode == "ar" else "decoder")
    if args.mode == "ar":
        from ..dense.ar import ar_stream

        events = ar_stream(model, prompt, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed)
    else:
        events = model.stream(
            prompt, drafts=args.show_canvas, seed=args.seed, sampling=args.sampling, grammar=grammar, **sampler_knobs(args)
        )
    demo_note(args)
    tokens: list[int] = []
    printed = ""
    if args.show_canvas:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        console = Console()
        with Live(Text(""), console=console, refresh_per_second=20, transient=False) as live:
            for ev in events:
                if isinstance(ev, Block):
                    timing.add(ev)
                    tokens += ev.tokens
                    live.update(Text(tok.decode(tokens)))
                elif isinstance(ev, Draft):
                    view = Text(tok.decode(tokens))
                    view.append(tok.decode(ev.canvas, skip_special_tokens=False), style="dim cyan")
                    view.append(f"\n[block {ev.block + 1}, step {ev.step}]", style="dim")
                    live.update(view)
        if not console.is_terminal:  # a pipe gets the final text only: end it as the plain mode does
            sys.stdout.write("\n")
    else:
        for ev in events:
            if isinstance(ev, Block):
                timing.add(ev)
                tokens += ev.tokens
                text = tok.decode(tokens)
                sys.stdout.write(text[len(printed) :] if text.startswith(printed) else "\n" + text)
                sys.stdout.flush()
                printed = text
        sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        sys.stderr.write(timing.line() + "\n")
    return 0


def cmd_make_tiny(args) -> int:
    from ..model.checkpoint import make_tiny_random

    path = make_tiny_random(args.out, seed=args.seed)
    print(f"wrote a tiny random DiffusionGemma checkpoint to {path}")
    return 0


def print_memory_plan(config, args) -> int:
    """`dgemma memory --card SIZE`: what serving takes on a device of SIZE bytes, by part, and
    whether it fits (the check `dgemma serve --device cuda` makes before loading)."""
    from ..api import resolve_dtype
    from ..engine.memory_plan import check_fits, plan_memory

    dtype = resolve_dtype(args.dtype)
    try:
        plan = plan_memory(config, dtype, args.quantization, args.group_size, args.max_active, args.max_context)
    except ValueError as e:
        raise CliError(str(e)) from None
    gib = 2**30
    print(f"serving {args.model or args.size} on a {args.card / gib:.1f} GiB device, {args.dtype}, "
          f"{plan.scheme or 'unquantised'} weights, batch {plan.batch}, context {plan.context}:")  # fmt: skip
    for part, size in plan.weights.items():
        print(f"  weights: {part:<12} {size / gib:8.2f} GiB")
    for name, size in (("KV cache", plan.kv_cache), ("step buffers", plan.step_buffers), ("reserve", plan.reserve)):
        print(f"  {name:<21} {size / gib:8.2f} GiB")
    print(f"  {'total':<21} {plan.total / gib:8.2f} GiB")
    try:
        check_fits(plan, args.card, config, dtype, args.group_size)
    except ValueError as e:
        print(f"does not fit: {e}")
        return 1
    print("fits")
    return 0


def cmd_memory(args) -> int:
    """KV cache bytes of one request: the paged layout against preallocated rows."""
    from ..api import resolve_dtype
    from ..config import load_model_config
    from ..engine.options import kv_report

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
    if args.card is not None:
        return print_memory_plan(config, args)
    r = kv_report(config, args.tokens, resolve_dtype(args.dtype), args.block_size)
    unit, scale = ("GiB", 2**30) if r["dense_total"] >= 2**30 else ("MiB", 2**20)
    print(f"KV cache for one request of {r['tokens']} tokens, {args.dtype}, blocks of {r['block_size']} positions "
          f"({args.model or args.size}: window {config.sliding_window})")  # fmt: skip
    print(f"{'layers':<20} {'bytes/token':>12} {'paged ' + unit:>10} {'preallocated rows ' + unit:>22}")
    for kind in r["paged"]:
        n = sum(1 for spec in config.layers if spec.kind == kind)
        print(f"{f'{n} {kind}':<20} {r['bytes_per_token'][kind]:>12} {r['paged'][kind] / scale:>10.2f} {r['dense'][kind] / scale:>22.2f}")
    print(f"{'total':<20} {sum(r['bytes_per_token'].values()):>12} {r['paged_total'] / scale:>10.2f} {r['dense_total'] / scale:>22.2f}")
    print("paged: sliding layers hold the blocks their window sees, global layers every block; "
          "preallocated rows: every layer holds every position")
    return 0


def add_media_flags(p: argparse.ArgumentParser) -> None:
    """`dgemma run`'s images and videos (a checkpoint with a vision tower); see docs/media.md."""
    p.add_argument("--image", dest="media", action="append", type=lambda path: ("image", path), default=[],
                   metavar="PATH", help="an image file (PNG, JPEG, WebP, GIF) for the prompt; repeatable")  # fmt: skip
    p.add_argument("--video", dest="media", action="append", type=lambda path: ("video", path), default=[],
                   metavar="PATH", help="a video file for the prompt (its sampled frames); repeatable")  # fmt: skip
    p.add_argument("--max-soft-tokens", type=int, default=None,
                   help="soft tokens per image: 70, 140, 280, 560 or 1120 (default: the processor config)")  # fmt: skip
    p.add_argument("--video-max-soft-tokens", type=int, default=None,
                   help="soft tokens per video frame: 70 .. 1120 as above (default: the processor config)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dgemma", description="Run, serve and fine-tune DiffusionGemma.")
    parser.add_argument("--verbose", "-v", action="store_true", help="log loading details")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate a completion, printed as each block commits")
    run.add_argument("prompt", nargs="?", default=None,
                     help="the text to complete ('-' reads it from standard input; or give --prompt-file)")  # fmt: skip
    run.add_argument("--prompt-file", metavar="FILE", default=None, help="read the prompt from FILE (UTF-8)")
    add_model_flags(run)
    add_sampler_flags(run)
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    run.add_argument("--system", help="system prompt (with --chat)")
    run.add_argument("--show-canvas", action="store_true", help="redraw the canvas live while it denoises")
    run.add_argument("--seed", type=int, default=None,
                     help="seed of the sampler's random numbers: the same seed gives the same text (default: random)")  # fmt: skip
    run.add_argument("--sampling", choices=["default", "reference"], default="default",
                     help="default: dgemma's engine; reference: transformers' random-number order, token for token "
                          "(default: default)")  # fmt: skip
    run.add_argument("--mode", choices=["diffusion", "ar"], default="diffusion",
                     help="diffusion: denoise canvases (the model's way); ar: autoregressive decoding with the encoder "
                          "(default: diffusion)")  # fmt: skip
    run.add_argument("--temperature", type=float, default=None,
                     help="with --mode ar: sampling temperature, 0 = greedy (default: 0); diffusion's temperatures "
                          "are --t-max (first step) and --t-min (last step)")  # fmt: skip
    run.add_argument("--quiet", "-q", action="store_true", help="no timing line on stderr after the completion")
    add_threads_flag(run)
    run.add_argument("--json-schema", metavar="FILE", help="the output is JSON matching this JSON Schema (enforced while denoising)")
    run.add_argument("--regex", help="the output matches this regular expression (enforced while denoising)")
    run.add_argument("--grammar", metavar="FILE", help="the output is a sentence of this Lark grammar (llguidance's dialect)")
    run.add_argument("--suffix", help="infill: print the text between the prompt (prefix) and this suffix")
    run.add_argument("--suffix-file", metavar="FILE", help="infill with the suffix read from FILE")
    run.add_argument("--span-length", type=int, default=None,
                     help="infill span in tokens (default: the model chooses among several lengths)")  # fmt: skip
    add_media_flags(run)
    add_engine_flags(run)
    run.set_defaults(func=cmd_run)

    tiny = sub.add_parser("make-tiny", help="write a tiny random checkpoint (for trying the tools)")
    tiny.add_argument("out", type=Path, help="directory to write the checkpoint to")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    tiny.set_defaults(func=cmd_make_tiny)

    mem = sub.add_parser("memory", help="KV cache bytes of one request of --tokens tokens (paged vs preallocated)")
    mem.add_argument("--model", "-m", help="checkpoint directory (its config.json); default: --size")
    mem.add_argument("--size", default="real", help="a model-size preset (default: real, the released model)")
    mem.add_argument("--tokens", type=int, default=131072, help="tokens of the request (default: 131072)")
    mem.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                     help="dtype of the KV cache and weights (default: bfloat16)")  # fmt: skip
    mem.add_argument("--block-size", type=int, default=None, help="positions per KV block (default: the canvas length)")
    mem.add_argument("--card", type=parse_size, default=None,
                     help="plan serving on a device of this many bytes (e.g. 24GB, 80GiB): weights, KV, step buffers, fit")  # fmt: skip
    mem.add_argument("--quantization", default=None, choices=["fp8", "int8", "int4", "nvfp4"], help="with --card: the scheme")
    mem.add_argument("--group-size", type=int, default=None, help="with --card: int4's group size (default 64)")
    mem.add_argument("--max-active", type=int, default=8, help="with --card: canvases denoised at once (default 8)")
    mem.add_argument("--max-context", type=int, default=None,
                     help="with --card: positions of the longest request (default: max_position_embeddings)")  # fmt: skip
    mem.set_defaults(func=cmd_memory)

    # Subcommands that live with their concern: each module defines add_cli(subparsers).
    for module in ("serve.server", "bench", "train.trainer", "quant.cli", "chat"):
        if importlib.util.find_spec(f"dgemma.{module}") is not None:
            importlib.import_module(f"dgemma.{module}").add_cli(sub)
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



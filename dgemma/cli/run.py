"""`dgemma run`: one completion printed as each block commits; with --suffix, infill (the text
between a prefix and a suffix). Also --chat, --image/--video, --json-schema/--regex/--grammar,
--mode ar and --show-canvas (the canvas redrawn while it denoises)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .common import (
    CliError,
    add_engine_flags,
    add_lora_flag,
    add_model_flags,
    add_sampler_flags,
    add_threads_flag,
    apply_threads,
    attach_lora,
    check_seed_flag,
    check_turbo_knobs,
    engine_options,
    load_model,
    print_growing,
    refuse_turbo,
    sampler_knobs,
)

DEMO_MODEL_NOTE = (
    "dgemma: no --model: the shipped demo model dgemma-tiny (10M parameters, trained on Python's "
    "standard library: expect Python-flavoured text, not working code); --model DIR or a hub id "
    "(owner/name) for a real checkpoint"
)


def chat_messages(args, content) -> list[dict]:
    """`dgemma run --chat`'s conversation: the --system prompt, then the user's content."""
    return ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": content}
    ]


def soft_token_budget(args, name: str) -> int | None:
    """--max-soft-tokens / --video-max-soft-tokens checked by the processor's own rule (the one
    the API and the server apply), or None when not given."""
    from ..inputs.model_inputs import MediaError
    from ..inputs.processor import check_budget

    value = getattr(args, name)
    if value is None:
        return None
    try:
        return check_budget(value)
    except MediaError as e:
        raise CliError(f"--{name.replace('_', '-')}: {str(e).removeprefix('max_soft_tokens ')}") from None


def media_prompt(model, args):
    """The prompt of `dgemma run --image/--video` as the processor builds it (ModelInputs). With
    --chat the media parts come first in the user turn, in command-line order; without, the prompt
    gets one placeholder per image/video prepended (and a newline), unless it holds placeholders."""
    if args.mode == "ar":
        raise CliError("--image and --video work in diffusion mode only, not with --mode ar")
    if not model.supports_images:
        raise CliError(f"--image/--video: {model.path or 'the model'} has no vision tower (or no processor config)")
    budgets = {name: soft_token_budget(args, name) for name in ("max_soft_tokens", "video_max_soft_tokens")}
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

    given = [
        (flag, value)
        for flag, value in (("--json-schema", args.json_schema), ("--regex", args.regex), ("--grammar", args.grammar))
        if value is not None
    ]
    if not given:
        return None
    if len(given) > 1:
        raise CliError(f"give one of --json-schema, --regex and --grammar (got {' and '.join(f for f, _ in given)})")
    flag, value = given[0]
    if args.mode == "ar" or args.sampling == "reference":
        raise CliError(f"{flag} works with the engine's sampler only (not with --mode ar or --sampling reference)")
    if flag == "--regex":
        kind, spec, where = "regex", value, flag
    else:
        try:
            spec = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"{flag}: cannot read {value}: {getattr(e, 'strerror', None) or e}") from None
        kind, where = "json_schema" if flag == "--json-schema" else "lark", f"{flag} {value}"  # errors name the file
    try:
        return model.compile_grammar(kind, spec)
    except GrammarError as e:
        raise CliError(f"{where}: {e}") from None


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
    for flag, bad in (
        ("--chat", args.chat),
        ("--mode ar", args.mode == "ar"),
        ("--sampling reference", args.sampling == "reference"),
        ("--image/--video", bool(args.media)),
        ("--json-schema/--regex/--grammar", any(v is not None for v in (args.json_schema, args.regex, args.grammar))),
    ):
        if bad:
            raise CliError(f"--suffix (infill) does not go with {flag}")
    if args.show_canvas and args.span_length is None:
        raise CliError("--show-canvas with --suffix needs --span-length (a chosen length is found by trying several)")
    return suffix


def cmd_infill(model, args, suffix: str, adapter: str | None = None) -> int:
    """`dgemma run PREFIX --suffix TEXT`: print the text between them (see engine/constraints/infill.py)."""
    from ..engine.events import Draft

    knobs = {k: v for k, v in sampler_knobs(args).items() if k != "max_new_tokens"}
    try:
        demo_note(args)
        if not args.show_canvas:
            started = time.perf_counter()
            result = model.infill(
                args.prompt, suffix, span_length=args.span_length, seed=args.seed, adapter=adapter, **knobs
            )
            sys.stdout.write(result.text + "\n")
            sys.stdout.flush()
            if not args.quiet:
                sys.stderr.write(
                    f"dgemma: a span of {result.span_length} tokens (of {len(result.scores)} candidate lengths) "
                    f"in {time.perf_counter() - started:.2f} s\n"
                )
            return 0
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        tok, n = model.tokenizer, args.span_length
        with Live(Text(""), console=Console(), refresh_per_second=20) as live:
            for ev in model.infill_stream(args.prompt, suffix, n, seed=args.seed, adapter=adapter, **knobs):
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


def utf8_text(data: bytes, source: str) -> str:
    """`data` as text, or the one-line error every prompt source gives for bytes that are not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CliError(
            f"{source}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); a prompt is UTF-8 text"
        ) from None


def run_prompt(args) -> str:
    """The prompt of `dgemma run`: the argument, standard input for '-', or --prompt-file; an
    empty one is refused (it would generate from <bos> alone: text about nothing)."""
    if args.prompt_file is not None:
        if args.prompt is not None:
            raise CliError("give the prompt or --prompt-file, not both")
        try:
            text = utf8_text(Path(args.prompt_file).read_bytes(), f"--prompt-file {args.prompt_file}")
        except OSError as e:
            raise CliError(f"--prompt-file: cannot read {args.prompt_file}: {e.strerror or e}") from None
    elif args.prompt == "-":
        stdin = getattr(sys.stdin, "buffer", None)  # bytes where there are (a test's StringIO has none)
        text = sys.stdin.read() if stdin is None else utf8_text(stdin.read(), "standard input ('-')")
    elif args.prompt is None:
        raise CliError(
            "no prompt: give the text to complete, '-' to read it from standard input, or --prompt-file FILE"
        )
    else:
        text = args.prompt
    if not text.strip() and not args.media:
        raise CliError(
            "the prompt is empty (or only white space): give the text to complete (with --chat, the question)"
        )
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
        raise CliError(
            "--temperature is for --mode ar; the diffusion sampler's temperatures are --t-max (the first "
            "step's) and --t-min (the last step's)"
        )
    if not 0 <= args.temperature < float("inf"):
        raise CliError(f"--temperature must be a number >= 0 (got {args.temperature})")
    return args.temperature


class RunTiming:
    """What `dgemma run` says on stderr when it is done: tokens, time, speed, model passes
    (`passes`: decoder passes in diffusion mode, encoder passes in AR mode)."""

    def __init__(self, passes: str = "decoder"):
        self.started, self.first_block, self.tokens, self.passes = time.perf_counter(), None, 0, 0
        self.kind = passes
        self.positions: int | None = None  # with turbo: canvas positions the decoder computed

    def counting(self, events):
        """`events` passed through; their return value's decoder positions noted (turbo's figure)."""
        out = yield from events
        self.positions = sum(getattr(out, "decoder_positions", None) or []) or None

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
        if self.positions and self.tokens:
            parts.append(f"{self.positions} decoder positions ({self.positions / self.tokens:.1f} per token)")
        if self.first_block is not None:
            parts.append(f"first block after {self.first_block:.2f} s")
        return "dgemma: " + ", ".join(parts)


def cmd_run(args) -> int:
    from ..engine.events import Block, Draft

    # a rank after the first (--tensor-parallel-size) gets rank 0's prompt once the ranks are joined
    follower = int(os.environ.get("RANK", "0")) > 0 and args.prompt == "-"
    args.prompt = "" if follower else run_prompt(args)
    temperature = check_temperature(args)
    refuse_turbo(
        args, "--sampling reference" if args.sampling == "reference" else "--mode ar" if args.mode == "ar" else None
    )
    check_seed_flag(args)
    if args.lora is not None and (args.mode == "ar" or args.sampling == "reference"):
        raise CliError("--lora works with the engine's sampler only (not with --mode ar or --sampling reference)")
    apply_threads(args)
    suffix = run_suffix(args)
    if args.show_canvas and not sys.stdout.isatty():  # a pipe or a file: there is no screen to redraw
        if not args.quiet:
            sys.stderr.write(
                "dgemma: --show-canvas draws only on a terminal; standard output is not one, so the text is "
                "printed as it is without the canvas\n"
            )
        args.show_canvas = False
    model = load_model(args)
    if model.net.shards is not None:
        args.prompt = model.net.shards.broadcast_object(args.prompt)
    config = model.generation_config.with_overrides(**sampler_knobs(args))  # the knobs checked before any output
    check_turbo_knobs(args, config)
    model.configure_engine(engine_options(args))
    adapter = attach_lora(model, args)
    tok = model.tokenizer
    if tok is None:
        raise CliError(f"{model.path} has no tokenizer.json: `dgemma run` needs one")
    if suffix is not None:
        return cmd_infill(model, args, suffix, adapter)
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
            prompt,
            drafts=args.show_canvas,
            seed=args.seed,
            sampling=args.sampling,
            grammar=grammar,
            adapter=adapter,
            **sampler_knobs(args),
        )
        if config.turbo:
            events = timing.counting(events)
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
    else:
        for ev in events:
            if isinstance(ev, Block):
                timing.add(ev)
                tokens += ev.tokens
                printed = print_growing(tok.decode(tokens), printed)
        sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        sys.stderr.write(timing.line() + "\n")
    return 0


def add_media_flags(p: argparse.ArgumentParser) -> None:
    """`dgemma run`'s images and videos (a checkpoint with a vision tower); see docs/media.md."""
    p.add_argument(
        "--image",
        dest="media",
        action="append",
        type=lambda path: ("image", path),
        default=[],
        metavar="PATH",
        help="an image file (PNG, JPEG, WebP, GIF) for the prompt; repeatable",
    )
    p.add_argument(
        "--video",
        dest="media",
        action="append",
        type=lambda path: ("video", path),
        default=[],
        metavar="PATH",
        help="a video file for the prompt (its sampled frames); repeatable",
    )
    p.add_argument(
        "--max-soft-tokens",
        type=int,
        default=None,
        help="soft tokens per image: 70, 140, 280, 560 or 1120 (default: the processor config)",
    )
    p.add_argument(
        "--video-max-soft-tokens",
        type=int,
        default=None,
        help="soft tokens per video frame: 70 .. 1120 as above (default: the processor config)",
    )


def add_cli(sub) -> None:
    """The `run` subcommand."""
    run = sub.add_parser("run", help="generate a completion, printed as each block commits")
    run.add_argument(
        "prompt",
        nargs="?",
        default=None,
        help="the text to complete ('-' reads it from standard input; or give --prompt-file)",
    )
    run.add_argument("--prompt-file", metavar="FILE", default=None, help="read the prompt from FILE (UTF-8)")
    add_model_flags(run)
    add_lora_flag(run)
    add_sampler_flags(run)
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    run.add_argument("--system", help="system prompt (with --chat)")
    run.add_argument("--show-canvas", action="store_true", help="redraw the canvas live while it denoises")
    run.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the sampler's random numbers: the same seed gives the same text (default: random)",
    )
    run.add_argument(
        "--sampling",
        choices=["default", "reference"],
        default="default",
        help="default: dgemma's engine; reference: transformers' random-number order, token for token "
        "(default: default)",
    )
    run.add_argument(
        "--mode",
        choices=["diffusion", "ar"],
        default="diffusion",
        help="diffusion: denoise canvases (the model's way); ar: autoregressive decoding with the encoder "
        "(default: diffusion)",
    )
    run.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="with --mode ar: sampling temperature, 0 = greedy (default: 0); diffusion's temperatures "
        "are --t-max (first step) and --t-min (last step)",
    )
    run.add_argument("--quiet", "-q", action="store_true", help="no timing line on stderr after the completion")
    add_threads_flag(run)
    run.add_argument(
        "--json-schema", metavar="FILE", help="the output is JSON matching this JSON Schema (enforced while denoising)"
    )
    run.add_argument("--regex", help="the output matches this regular expression (enforced while denoising)")
    run.add_argument(
        "--grammar", metavar="FILE", help="the output is a sentence of this Lark grammar (llguidance's dialect)"
    )
    run.add_argument("--suffix", help="infill: print the text between the prompt (prefix) and this suffix")
    run.add_argument("--suffix-file", metavar="FILE", help="infill with the suffix read from FILE")
    run.add_argument(
        "--span-length",
        type=int,
        default=None,
        help="infill span in tokens (default: the model chooses among several lengths)",
    )
    add_media_flags(run)
    add_engine_flags(run)
    run.set_defaults(func=cmd_run)

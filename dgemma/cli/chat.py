"""`dgemma chat`: an interactive multi-turn session in the terminal (issue #16).

Line editing and history come from Python's readline; the live canvas view is rich's Live, fed by
`Model.stream(..., drafts=True)`. Not a TTY (a pipe): one user message per input line, the answer
as plain text per turn, figures on stderr.

The model's engine (and its prefix cache) persists across turns, so turn N encodes only the
prompt tokens the cache does not hold. The cache keys whole blocks of token ids at fixed
positions, so turn N's prompt must repeat turn N-1's tokens exactly. Re-rendering the
conversation through the chat template does not: the template trims the answer (Gemma 4's
`| trim`) and the answer's text tokenizes differently from the tokens the model wrote (a leading
"\n" dropped, " py" becoming "py"), and one changed token early in a block loses that block and
every block after it. So the session keeps the token ids it encoded (the prompt, then the answer
as the model wrote it) and builds the next prompt as those ids followed by the template's own
rendering of what comes after the answer: its end-of-turn, the new user turn, the generation
prompt (the new rendering, less the last prompt's rendering and the answer's text). The engine's
exact-match cache then serves it unchanged; a partial-block match in the engine would still
re-encode everything from the first changed token (here the answer's first), and would move the
pass boundaries that keep a cached prefix bit-identical to a cold one. The model still sees the
template's conversation: the answer differs from the rendering only in whitespace the template
trims and in token boundaries. Where the template does not render the last prompt followed by
the text the kept tokens spell (special tokens inside the answer, a template that rewrites
earlier turns), or the conversation changed (/reset, /system, /load, images), the prompt is the
plain rendering, tokenized.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..engine.request import check_seed
from .common import (
    CliError,
    add_chat_template_flag,
    add_engine_flags,
    add_lora_flag,
    add_model_flags,
    add_sampler_flags,
    add_threads_flag,
    apply_chat_template_file,
    apply_threads,
    attach_lora,
    check_seed_flag,
    engine_options,
    load_model,
    print_growing,
    sampler_knobs,
)

log = logging.getLogger("dgemma")
HISTORY_FILE = Path.home() / ".cache" / "dgemma" / "chat_history"

# /set NAME VALUE: the sampler knobs (Model.stream's keyword arguments) and the seed
KNOBS = {
    "steps": ("max_denoising_steps", int),
    "entropy-bound": ("entropy_bound", float),
    "t-min": ("t_min", float),
    "t-max": ("t_max", float),
    "max-new-tokens": ("max_new_tokens", int),
    "seed": ("seed", int),
    "eos": ("eos_token_ids", None),  # "off": generate past EOS (long answers, benchmarks)
    "turbo": ("turbo", bool),  # "on" / "off": turbo denoising (engine/turbo.py)
}

HELP = """commands:
  /reset              forget the conversation (the system prompt stays)
  /system TEXT        set the system prompt (empty: none)
  /save FILE          write the conversation as JSON messages
  /load FILE          read a conversation written by /save
  /image PATH         attach an image (PNG, JPEG, WebP, GIF) to your next message (a model
                      with a vision tower); /image clear drops the attached ones
  /set NAME VALUE     a sampler knob: steps, entropy-bound, t-min, t-max, max-new-tokens, seed,
                      eos (off: answers run to max-new-tokens), turbo (on or off: stop
                      recomputing canvas positions that have converged)
                      (VALUE "default": the checkpoint's generation_config.json)
  /help               this text
Ctrl-C stops a generation at its next step (a second Ctrl-C at once; the partial answer stays in
the conversation) or clears the line; Ctrl-D leaves."""


def entropy_style(entropy: float) -> str:
    """A canvas position's colour by its entropy (nats): green when the model is sure, red when not."""
    return "green" if entropy < 0.5 else "yellow" if entropy < 2.0 else "red"


def canvas_frame(pieces: list[str], accepted: list[bool], entropy: list[float], frozen: list[bool] = ()):
    """One draft as the terminal draws it (rich Text): accepted positions bold, re-noised ones
    dim, each coloured by its entropy; with turbo, frozen positions (no longer computed) underlined."""
    from rich.text import Text

    view = Text()
    frozen = list(frozen) or [False] * len(pieces)
    for piece, kept, h, still in zip(pieces, accepted, entropy, frozen):
        view.append(piece, style=("bold " if kept else "dim ") + entropy_style(h) + (" underline" if still else ""))
    return view


def token_pieces(tokenizer, canvas: list[int]) -> list[str]:
    """Each canvas token's text on its own (special tokens by name): a frame's cells."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in canvas]


def plain_frame(pieces: list[str], accepted: list[bool], noise: str = "░") -> str:
    """One draft as plain text: accepted positions as their tokens, re-noised ones as `noise`
    (one per character of the token they show), so a sequence of frames reads as noise
    resolving into text."""
    return "".join(p if kept else noise * max(1, len(p.replace("\n", ""))) for p, kept in zip(pieces, accepted))


def _content_ok(content) -> bool:
    """A message's content as /save writes it: text, or a list of text and image parts."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict)
        and (
            p.get("type") == "text"
            and isinstance(p.get("text"), str)
            or p.get("type") == "image"
            and isinstance(p.get("image"), str)
        )
        for p in content
    )


@dataclass
class Encoded:
    """What the engine holds of the conversation after a turn: `messages` (a copy, the answer
    last), `prompt_text` (that turn's prompt as the template rendered it) and `ids` (that prompt's
    ids, then from `answer_start` the answer's tokens as the model wrote them, less a final EOS
    and whitespace)."""

    messages: list[dict]
    prompt_text: str
    ids: list[int]
    answer_start: int


class Session:
    def __init__(self, model, system: str | None, knobs: dict, seed: int | None, canvas: bool, tty: bool):
        self.model, self.tok = model, model.tokenizer
        self.system = system or None
        self.messages: list[dict] = []
        self.images: list[str] = []  # paths attached to the next user message (/image)
        self.encoded: Encoded | None = None  # the last turn's token ids, continued by the next prompt
        self.knobs = {k: v for k, v in knobs.items() if v is not None}
        self.adapter: str | None = None  # the --lora adapter every turn runs
        self.seed = seed
        self.tty = tty
        self.canvas = canvas and tty
        self.console = None
        if tty:
            from rich.console import Console

            self.console = Console()

    # ---------------------------------------------------------------- output
    def say(self, text: str, style: str | None = None) -> None:
        """A status line: styled on the terminal, on stderr for a pipe."""
        if self.console is not None:
            self.console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)
        else:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    # ---------------------------------------------------------------- commands
    def command(self, line: str) -> None:
        name, _, rest = line[1:].partition(" ")
        rest = rest.strip()
        if name == "help":
            self.say(HELP)
        elif name == "reset":
            self.messages = []
            self.say("conversation cleared", "dim")
        elif name == "system":
            self.system = rest or None
            self.say(f"system prompt {'set' if rest else 'cleared'}", "dim")
        elif name == "save":
            if not rest:
                return self.say("usage: /save FILE", "red")
            try:
                Path(rest).write_text(json.dumps(self.conversation(), indent=2, ensure_ascii=False) + "\n")
            except OSError as e:
                return self.say(f"cannot save: {e}", "red")
            self.say(f"saved {len(self.conversation())} messages to {rest}", "dim")
        elif name == "load":
            self.load(rest)
        elif name == "set":
            self.set(rest)
        elif name == "image":
            self.attach(rest)
        else:
            self.say(f"unknown command /{name} (/help lists them)", "red")

    def attach(self, path: str) -> None:
        """An image for the next user message, decoded now so that a bad file is named at once."""
        from ..inputs.model_inputs import MediaError

        if not path:
            return self.say("usage: /image PATH (or /image clear)", "red")
        if path == "clear":
            self.images = []
            return self.say("attached images dropped", "dim")
        if not self.model.supports_images:
            return self.say(
                f"/image: {self.model.path or 'this model'} has no vision tower: it cannot take images", "red"
            )
        try:
            self.model.processor.image(Path(path).expanduser())
        except (MediaError, OSError) as e:
            return self.say(f"/image: {e}", "red")
        self.images.append(str(Path(path).expanduser()))
        self.say(f"{len(self.images)} image(s) attached to your next message", "dim")

    def prompt(self) -> tuple:
        """The conversation as the model's prompt, and the template's text of it: token ids (the
        last turn's, continued with the rendering past its answer, where they spell the same
        conversation: module docstring), or the processor's ModelInputs and None when a message
        holds images."""
        conversation = self.conversation()
        if any(isinstance(m["content"], list) for m in conversation):
            return self.model.processor.apply_chat_template(conversation, add_generation_prompt=True), None
        text = self.tok.render_chat(conversation, add_generation_prompt=True)
        ids = self.continued(conversation, text)
        return (ids if ids is not None else self.tok.encode(text, add_special_tokens=False)), text

    def continued(self, conversation: list[dict], text: str) -> list[int] | None:
        """The last turn's ids and the tokens of `text` past its answer, or None when `text` does
        not render that turn's prompt followed by the text its answer's tokens spell."""
        prev = self.encoded
        if prev is None or conversation[: len(prev.messages)] != prev.messages or not text.startswith(prev.prompt_text):
            return None
        rest = text[len(prev.prompt_text) :]
        answer = self.tok.decode(prev.ids[prev.answer_start :], skip_special_tokens=False).strip()
        if not rest.startswith(answer):
            return None
        return prev.ids + self.tok.encode(rest[len(answer) :], add_special_tokens=False)

    def answer_ids(self, tokens: list[int]) -> list[int]:
        """An answer's tokens as the next prompt keeps them: less a final EOS (the template writes
        its own end-of-turn) and trailing whitespace (the template trims it; it ends the answer's
        last block, which a finished request never encodes, so no cached block is lost)."""
        eos = set(self.model.generation_config.eos_token_ids)
        end = len(tokens)
        if end and tokens[end - 1] in eos:
            end -= 1
        while end and not self.tok.decode([tokens[end - 1]], skip_special_tokens=False).strip():
            end -= 1
        return tokens[:end]

    def conversation(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def load(self, path: str) -> None:
        if not path:
            return self.say("usage: /load FILE", "red")
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, list) or not all(
                isinstance(m, dict)
                and m.get("role") in ("system", "user", "assistant")
                and _content_ok(m.get("content"))
                for m in data
            ):
                raise ValueError(
                    "expected a JSON list of {role, content} messages (content: text, or text and image parts)"
                )
            if any(isinstance(m["content"], list) for m in data) and not self.model.supports_images:
                raise ValueError("it holds images and this model has no vision tower")
        except (OSError, ValueError) as e:
            return self.say(f"cannot load {path}: {e}", "red")
        systems = [m["content"] for m in data if m["role"] == "system"]
        self.system = systems[-1] if systems else None
        self.messages = [{"role": m["role"], "content": m["content"]} for m in data if m["role"] != "system"]
        self.say(f"loaded {len(data)} messages from {path}", "dim")

    def set(self, rest: str) -> None:
        parts = rest.split()
        if len(parts) != 2 or parts[0] not in KNOBS:
            return self.say(f"usage: /set NAME VALUE, NAME one of {', '.join(KNOBS)}", "red")
        name, value = parts
        dest, kind = KNOBS[name]
        if value == "default":
            parsed = None
        elif kind is None:  # eos
            if value != "off":
                return self.say(f"/set {name}: only 'off' or 'default'", "red")
            parsed = []
        elif kind is bool:  # turbo
            if value not in ("on", "off"):
                return self.say(f"/set {name}: 'on', 'off' or 'default'", "red")
            parsed = value == "on"
        else:
            try:
                parsed = kind(value)
            except ValueError:
                return self.say(f"/set {name}: {value!r} is not a{'n integer' if kind is int else ' number'}", "red")
        if dest == "seed":
            try:  # the API's and the server's seed range
                self.seed = parsed if parsed is None else check_seed(parsed, "seed")
            except ValueError as e:
                return self.say(f"/set {name}: {e}", "red")
        elif parsed is None:
            self.knobs.pop(dest, None)
        else:
            try:  # the model's own check of the value
                self.model.sampling_request(1, **{**self.knobs, dest: parsed})
            except ValueError as e:
                return self.say(f"/set {name}: {e}", "red")
            why = self.past_the_limit(parsed) if dest == "max_new_tokens" else None
            if why is not None:
                return self.say(f"/set {name}: {why}", "red")
            self.knobs[dest] = parsed
        self.say(f"{name} = {value}", "dim")

    def past_the_limit(self, max_new_tokens: int) -> str | None:
        """Why answers of `max_new_tokens` can never follow this conversation (the engine's own
        refusal: the model's positions, the KV cache), with the most that can; None if they can."""
        held = max(len(self.encoded.ids), 1) if self.encoded is not None else 1
        refusal = self.model.engine.scheduler.refusal
        if refusal(held, max_new_tokens) is None:
            return None
        most, over = 0, max_new_tokens  # refusal(held, most) is None, refusal(held, over) is not
        while over - most > 1:
            mid = (most + over) // 2
            most, over = (mid, over) if refusal(held, mid) is None else (most, mid)
        positions = self.model.config.max_position_embeddings
        here = f"; this conversation holds {held} tokens" if self.encoded is not None else ""
        if most == 0:
            return f"no answer fits: the model has {positions} positions{here} (/reset starts anew)"
        return f"{max_new_tokens} is past the model's limit: at most {most} here ({positions} positions{here})"

    # ---------------------------------------------------------------- a turn
    def turn(self, text: str) -> None:
        from ..engine.events import Block, Draft

        content = [{"type": "image", "image": p} for p in self.images] + [{"type": "text", "text": text}]
        self.messages.append({"role": "user", "content": content if self.images else text})
        try:
            prompt, prompt_text = self.prompt()
            # on a terminal a step's draft comes back even with no canvas to draw: a Ctrl-C then
            # stops the answer within a step, not at its block's end
            events = self.model.stream(prompt, drafts=self.tty, seed=self.seed, adapter=self.adapter, **self.knobs)
        except ValueError as e:  # MediaError and ConfigError are ValueErrors: the message is not sent
            self.messages.pop()
            return self.say(f"error: {e}", "red")
        self.images = []
        stats = self.model.engine.stats
        before = (stats.prompt_tokens, stats.cached_tokens, stats.encoded_tokens)
        tokens: list[int] = []
        passes, first_block = 0, None
        start = time.perf_counter()
        live = None
        if self.canvas:
            from rich.live import Live
            from rich.text import Text

            live = Live(Text(""), console=self.console, refresh_per_second=20, transient=False)
            live.start()
        printed = ""
        ctrl_c, cut, failed = CtrlC(self.tty), False, None
        try:
            with ctrl_c:
                for ev in events:
                    if ctrl_c.pressed:
                        break
                    if isinstance(ev, Block):
                        first_block = first_block if first_block is not None else time.perf_counter() - start
                        tokens += ev.tokens
                        passes += ev.decoder_passes
                        answer = self.tok.decode(tokens)
                        if live is not None:
                            live.update(Text(answer))
                        elif self.tty:  # the answer as blocks commit
                            printed = print_growing(answer, printed)
                    elif isinstance(ev, Draft) and live is not None:
                        view = Text(self.tok.decode(tokens))
                        view.append_text(
                            canvas_frame(token_pieces(self.tok, ev.canvas), ev.accepted, ev.entropy, ev.frozen)
                        )
                        frozen = f", {sum(ev.frozen)} frozen" if ev.frozen else ""
                        view.append(
                            f"\n[block {ev.block + 1}, step {ev.step}: {sum(ev.accepted)}/{len(ev.accepted)} accepted{frozen}]",
                            style="dim",
                        )
                        live.update(view)
        except KeyboardInterrupt:  # a second Ctrl-C, or one without the terminal's handler: at once
            cut = True
        except Exception as e:  # the engine refused or failed the request: one line, the conversation stays
            log.debug("the turn failed", exc_info=True)
            failed = e
        finally:
            interrupted = cut or ctrl_c.pressed > 0
            events.close()  # cancels the request in the engine (nothing when it has finished)
            if live is not None:
                if interrupted:
                    live.update(Text(self.tok.decode(tokens)))
                live.stop()
        if failed is not None and not tokens:  # nothing was answered: as if the message was never sent
            if self.tty and live is None and printed:
                sys.stdout.write("\n")
            self.messages.pop()
            return self.say(f"error: {failed} (the message was not sent; the conversation stays)", "red")
        elapsed = time.perf_counter() - start
        answer = self.tok.decode(tokens).strip()
        self.messages.append({"role": "assistant", "content": answer})
        self.encoded = (
            None
            if prompt_text is None
            else Encoded(
                [dict(m) for m in self.conversation()], prompt_text, list(prompt) + self.answer_ids(tokens), len(prompt)
            )
        )
        if self.tty:
            if live is None:
                sys.stdout.write("\n")
            if interrupted:
                self.say("[generation stopped; the partial answer stays in the conversation]", "yellow")
        if failed is not None:
            self.say(f"error: {failed} (the partial answer stays in the conversation)", "red")
        else:
            sys.stdout.write(re.sub(r"[\r\n\x0b\x0c\x1c-\x1e\x85\u2028\u2029]+", " ", answer) + "\n")  # one line a turn
            sys.stdout.flush()
        prompt_new = stats.prompt_tokens - before[0]
        cached = stats.cached_tokens - before[1]
        encoded = stats.encoded_tokens - before[2]
        figures = [
            f"{len(tokens)} tokens",
            f"{len(tokens) / passes:.2f} tokens/forward" if passes else "- tokens/forward",
            f"{len(tokens) / elapsed:.1f} tok/s" if elapsed > 0 else "- tok/s",
            f"first block {first_block:.2f}s" if first_block is not None else "no block",
            f"encoded {prompt_new - cached} new prompt tokens ({cached} cached)",
            f"{encoded} encoder tokens in all",
        ]
        self.say("[" + ", ".join(figures) + "]", "dim")


class CtrlC:
    """Ctrl-C during an answer (on a terminal), as a request: the answer stops at its stream's
    next event (a denoising step), never inside the engine's step, whose state a KeyboardInterrupt
    could leave half-updated; a second Ctrl-C stops it at once. The trainer stops the same way."""

    def __init__(self, terminal: bool):
        self.terminal, self.pressed, self.previous = terminal, 0, None

    def __enter__(self) -> CtrlC:
        if self.terminal and threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._press)
        return self

    def _press(self, signum, frame) -> None:
        self.pressed += 1
        if self.pressed > 1:
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def read_lines(session: Session):
    """User lines: readline-edited input() on a terminal, stdin lines from a pipe."""
    if not session.tty:
        for line in sys.stdin:
            yield line.rstrip("\n")
        return
    while True:
        try:
            yield input(">>> ")
        except KeyboardInterrupt:  # clears the line
            sys.stdout.write("\n")
        except EOFError:
            sys.stdout.write("\n")
            return


def session_lines(session: Session, shards=None):
    """The user's lines; on a model split across ranks (--tensor-parallel-size), rank 0 reads them
    and every rank gets each one (each rank runs the same turns: parallel/lockstep.py says why)."""
    if shards is None or shards.size == 1:
        yield from read_lines(session)
        return
    lines = read_lines(session) if shards.rank == 0 else None
    while True:
        line = shards.broadcast_object(next(lines, None) if lines is not None else None)
        if line is None:
            return
        yield line


def setup_readline() -> None:
    try:
        import atexit
        import readline
    except ImportError:
        return
    try:
        HISTORY_FILE.parent.mkdir(parents=True, exist_ok=True)
        if HISTORY_FILE.exists():
            readline.read_history_file(HISTORY_FILE)
        readline.set_history_length(1000)
    except OSError:
        pass

    def save():
        try:
            readline.write_history_file(HISTORY_FILE)
        except OSError:
            pass

    atexit.register(save)


def cmd_chat(args) -> int:
    apply_threads(args)
    check_seed_flag(args)
    model = load_model(args)
    apply_chat_template_file(model, args)
    model.configure_engine(engine_options(args))
    adapter = attach_lora(model, args)
    if model.tokenizer is None:
        raise CliError(f"{model.path} has no tokenizer.json: `dgemma chat` needs one")
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    session = Session(model, args.system, sampler_knobs(args), args.seed, canvas=args.canvas, tty=tty)
    session.adapter = adapter
    if tty:
        # Ctrl-C stops a generation: a shell that starts us in the background (no job control)
        # hands SIGINT down ignored, and Python then leaves it ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
        setup_readline()
        session.say(f"dgemma chat with {model.path}: /help for commands, Ctrl-D to leave", "dim")
    for line in session_lines(session, model.net.shards):
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            session.command(line)
        else:
            session.turn(line)
    return 0


def add_cli(sub) -> None:
    """The `chat` subcommand."""
    p = sub.add_parser("chat", help="an interactive multi-turn chat in the terminal (live canvas view)")
    add_model_flags(p)
    add_lora_flag(p)
    add_sampler_flags(p)
    p.add_argument("--system", help="system prompt (/system changes it during the chat)")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampler seed of every turn, for repeatable answers (default: a random one per turn; /set seed)",
    )
    p.add_argument("--no-canvas", dest="canvas", action="store_false", help="do not draw the canvas while it denoises")
    add_chat_template_flag(p)
    add_threads_flag(p)
    add_engine_flags(p)
    p.set_defaults(func=cmd_chat)

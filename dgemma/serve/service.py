"""`Service`: what the routes share, and a request's run on the engine.

It owns the engine thread, the metrics, the grammar cache and the worker pools; it turns a checked
request (openai/protocol.py) and its prompt (prompts.py) into a generation config that fits the context,
then into engine requests, one per choice (`start`), or into an insertion (`insert`). Responses
are shaped from their updates in openai/responses.py.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from starlette.requests import Request

from ..config import ConfigError
from ..engine.constraints import FirstCanvas
from ..engine.constraints.grammar import Grammar, GrammarError
from ..engine.engine import Engine, EngineOptions
from ..engine.request import SEED_MAX, random_seed
from ..inputs.model_inputs import ModelInputs
from .engine_thread import EngineFailure, EngineThread, Generation, QueueFull, UnknownAdapter
from .errors import ApiError, excerpt
from .http.connection import watch_disconnect
from .http.request_log import count_completion_tokens
from .media.policy import MediaPolicy
from .metrics import Metrics
from .openai.insert import InsertError, Insertion, fixed_canvas, insert, span_lengths
from .openai.logprobs import TokenTexts
from .openai.protocol import (
    MAX_CHOICES_PER_REQUEST,
    Budgets,
    CompletionParams,
    RequestParams,
    parse_stop,
    request_top_logprobs,
    sampler_overrides,
)
from .prompts import PromptBuilder
from .reasoning import keeping_channel
from .structured.formats import GrammarCache, OutputFormat, StructuredError
from .text import TextStream
from .threads import CompileWorker
from .tools.calls import keeping_decoder
from .tools.grammar import lark_string, tool_call_grammar
from .tools.specs import ToolError, ToolSpec

MEDIA_WORKERS = 4  # requests whose media is fetched and decoded at once


def insertion_reason(found: Insertion) -> str:
    """An insertion's finish_reason: "timeout" when a candidate passed the deadline, else "stop"."""
    return "timeout" if found.timed_out else "stop"


def listed_name(served: str) -> str:
    """The served model's name as ollama lists it (/api/tags): `NAME:latest`, unless NAME has a
    tag of its own. Both APIs take it as well as NAME, as ollama takes a name with or without
    `:latest`."""
    return served if ":" in served.rsplit("/", 1)[-1] else f"{served}:latest"


@dataclass(frozen=True)
class RuntimeLora:
    """Whether clients may load and unload adapters while the server runs (`--allow-runtime-lora`),
    and the one directory they are read from (`--lora-dir`)."""

    allowed: bool = False
    directory: Path | None = None

    def __post_init__(self) -> None:
        if self.allowed and self.directory is None:
            raise ValueError("--allow-runtime-lora needs --lora-dir: the directory adapters may be loaded from")
        if self.directory is not None and not Path(self.directory).is_dir():
            raise ValueError(f"--lora-dir {self.directory} is not a directory")


class Service:
    """What the routes share: model, tokenizer, prompts, the engine thread, metrics and limits."""

    def __init__(
        self,
        model,
        served_model_name: str,
        max_active: int,
        max_queue: int,
        max_context: int,
        options: EngineOptions | None = None,
        media_policy: MediaPolicy | None = None,
        budgets: Budgets | None = None,
        sampler: dict | None = None,
        runtime_lora: RuntimeLora | None = None,
    ):
        if model.tokenizer is None:
            raise ValueError(f"{model.path} has no tokenizer.json: the server needs one")
        self.model, self.tokenizer, self.name = model, model.tokenizer, served_model_name
        self.names = frozenset(
            {served_model_name, listed_name(served_model_name)}
        )  # what requests may call it, either API
        self.tool_decode = keeping_decoder(self.tokenizer)
        self.prompts = PromptBuilder(model, max_context, media_policy or MediaPolicy())
        self.budgets = budgets or Budgets()
        # what a request that does not say gets: the checkpoint's generation config, with the
        # server's own defaults over it (`dgemma serve --turbo` and its knobs)
        self.defaults = model.generation_config.with_overrides(**(sampler or {}))
        # fetching and decoding media: a small pool of their own, so that slow remote images do not
        # starve the default pool every other request's tokenizing uses
        self.media_pool = ThreadPoolExecutor(MEDIA_WORKERS, thread_name_prefix="dgemma-media")
        self.canvas = model.config.canvas_length
        self.context = max_context
        self.created = int(time.time())
        self.metrics = Metrics()
        options = replace(options or EngineOptions(), max_active=max_active)
        net = model.engine_net
        # LoRA adapters served beside the base (dgemma/adapters/), named by a request's `model`
        self.adapters = model.adapters
        self.runtime_lora = runtime_lora or RuntimeLora()
        if self.runtime_lora.allowed and self.adapters is None:
            raise ValueError("runtime adapter loading needs the model's adapter slots (Model.enable_adapters)")
        slots = None if self.adapters is None else self.adapters.slots

        def new_engine() -> Engine:
            if net.shards is not None and net.shards.size > 1:  # rank 0 of a split model: the others replay its steps
                from ..parallel.lockstep import LeaderEngine

                return LeaderEngine(Engine(net, options), net.shards)
            return Engine(net, options, slots)

        self.engine_thread = EngineThread(new_engine, max_active, max_queue, self.metrics, self.adapters)
        self._grammars: GrammarCache | None = None
        self._grammars_lock = threading.Lock()
        # grammars are checked, written and compiled on one thread with a 64 MiB stack (llguidance
        # compiles recursively: see structured/limits.py), off the event loop
        self.compile_worker = CompileWorker()
        self._token_texts: TokenTexts | None = None

    def forced_call_format(self, spec: ToolSpec) -> OutputFormat | None:
        """The grammar of a forced tool call (tool_choice "required" or a named function), or None.
        Blocking (the first call reads tokenizer.json): run it on `compile_worker`."""
        if spec.choice not in ("required", "function"):
            return None
        try:
            lark = tool_call_grammar(spec, self._marker)
        except ToolError as e:
            raise ApiError(400, str(e), e.param, "invalid_value") from None
        except GrammarError as e:  # no EOS token: the call cannot be enforced
            raise ApiError(400, f"tool_choice: {e}", "tool_choice", "unsupported_parameter") from None
        # written from tools that check_tools held to the tool limits: no Lark limits of its own
        return OutputFormat("lark", lark, "tool_choice", generated=True)

    def _marker(self, text: str) -> str:
        """A Gemma 4 marker in Lark: its token where the tokenizer makes it one special token
        (grammar literals only match text), else its text."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.model.grammars.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return lark_string(text)

    def grammar(self, fmt: OutputFormat) -> Grammar:
        """`fmt` checked against the grammar limits and compiled against the checkpoint's
        tokenizer (cached). Blocking, and llguidance recurses natively: run it on `compile_worker`."""
        try:
            with self._grammars_lock:
                if self._grammars is None:
                    self._grammars = GrammarCache(self.model.grammars)
            return self._grammars.get(fmt)
        except StructuredError as e:
            raise ApiError(400, str(e), e.param, "invalid_value") from None
        except GrammarError as e:  # the checkpoint cannot do structured output at all
            raise ApiError(400, f"{fmt.param}: {e}", fmt.param, "unsupported_parameter") from None
        except RecursionError:  # not expected past the limits; the grammar's fault all the same
            raise ApiError(400, f"{fmt.param}: nested too deeply", fmt.param, "invalid_value") from None

    # ---------------------------------------------------------------- preparing
    async def off_loop(self, with_media: bool, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` on a worker thread (tokenizing, rendering, media), so the event loop keeps
        answering: on the media pool when the request holds media, else on the default pool."""
        if not with_media:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self.media_pool, functools.partial(fn, *args))

    @property
    def served_names(self) -> list[str]:
        """What requests may name as their `model`: the base, then each loaded adapter."""
        return [self.name] + ([] if self.adapters is None else self.adapters.names)

    def check_model(self, name: str) -> str | None:
        """The adapter a request's `model` names (None: the base), either API's way of writing it
        (NAME or NAME:latest); 404 naming the served models otherwise."""
        if name in self.names:
            return None
        if isinstance(name, str) and self.adapters is not None:
            for candidate in (name, name.removesuffix(":latest")):
                if self.adapters.get(candidate) is not None and not self.engine_thread.draining(candidate):
                    return candidate
        self.unknown_model(name)

    def unknown_model(self, name: object) -> NoReturn:
        """The 404 of a model this server does not serve (or an adapter being unloaded)."""
        served = ", ".join(f"'{n}'" for n in self.served_names if not self.engine_thread.draining(n))
        raise ApiError(
            404,
            f"model {excerpt(name)} does not exist; this server serves {served}",
            "model",
            "model_not_found",
        )

    def model_name(self, asked: str) -> str:
        """The model an answer names: the adapter the request ran, else the base's served name."""
        try:
            return self.check_model(asked) or self.name
        except ApiError:  # unloaded since: it still ran the adapter named so
            return asked

    def check_choices(self, params: RequestParams) -> None:
        """`n` within what one request may ask: MAX_CHOICES_PER_REQUEST and --max-active (the choices
        denoise side by side); 400 naming `n` otherwise."""
        limit = min(MAX_CHOICES_PER_REQUEST, self.engine_thread.max_active)
        if (params.n or 1) > limit:
            raise ApiError(
                400,
                f"n={params.n}: at most {limit} choices per request on this server ({MAX_CHOICES_PER_REQUEST}, "
                f"and at most --max-active={self.engine_thread.max_active})",
                "n",
                "invalid_value",
            )

    def generation_config(
        self, params: RequestParams, prompt: ModelInputs, max_tokens: int | None, partial: bool = False
    ):
        """The per-request GenerationConfig: checkpoint defaults, the client's knobs, and what fits
        the context (image soft tokens take positions like any prompt token). `partial`: blocks
        may commit fewer tokens than a canvas (a grammar), so the last canvas may start anywhere."""
        c, prompt_len = self.canvas, len(prompt.input_ids)
        room = self.context - prompt_len - c + 1 if partial else (self.context - prompt_len) // c * c
        if room < 1:
            images = f" ({prompt.num_image_tokens} of them image tokens; a smaller max_soft_tokens makes fewer)"
            raise ApiError(
                400,
                f"prompt is too long: {prompt_len} tokens{images if prompt.images else ''}; the context is "
                f"{self.context} positions per request and output comes in blocks of {c}, so a prompt may hold at "
                f"most {self.context - c} tokens",
                "prompt" if isinstance(params, CompletionParams) else "messages",
                "context_length_exceeded",
            )
        defaults = self.defaults
        if max_tokens is None:
            max_tokens = min(defaults.max_new_tokens, room)
        elif max_tokens > room:
            raise ApiError(
                400,
                f"max_tokens={max_tokens} does not fit: the prompt has {prompt_len} tokens and the context is "
                f"{self.context} positions, with output in blocks of {c}; at most {room} tokens fit",
                "max_tokens",
                "context_length_exceeded",
            )
        why = self.engine_thread.engine.scheduler.refusal(prompt_len, max_tokens, partial)
        if why is not None:
            raise ApiError(400, why, "max_tokens", "context_length_exceeded")
        steps, limit = params.max_denoising_steps, self.budgets.max_denoising_steps
        if steps is not None and steps > limit:
            raise ApiError(
                400,
                f"max_denoising_steps={steps} is above this server's limit of {limit} steps per canvas "
                "(--max-denoising-steps)",
                "max_denoising_steps",
                "invalid_value",
            )
        if steps is None and defaults.max_denoising_steps > limit:
            steps = limit
        # the client's knobs (None: the server's default, e.g. turbo's: dgemma serve --turbo), with the two
        # fitted above: max_tokens to the context, the steps to --max-denoising-steps
        fitted = {"max_new_tokens": max_tokens, "max_denoising_steps": steps}
        try:
            return defaults.with_overrides(**(sampler_overrides(params) | fitted))
        except ConfigError as e:
            raise ApiError(400, str(e), None, "invalid_value") from None

    # ---------------------------------------------------------------- running
    def start(
        self,
        params: RequestParams,
        prompt: ModelInputs,
        max_tokens: int | None,
        tools: bool = False,
        grammar: Grammar | None = None,
        thinking: bool = False,
        first_canvas: FirstCanvas | None = None,
        deadline: float | None = None,
        adapter: str | None = None,
    ) -> list[Generation]:
        """Submit the request's `n` choices, each an engine request of its own (seed: the
        request's seed + its index, modulo 2**64; without one, random each) with its own grammar state; with
        `tools`, their text keeps the tool-call tokens (for the parser); with `grammar`, their
        output is enforced to match it; with `thinking`, the text keeps the channel markers
        (for the reasoning parser). The engine encodes the shared prompt once (its scheduler
        holds the later choices until the first has put the prompt's blocks in the prefix cache).
        Past `deadline` (Budgets.deadline) the choices end with finish_reason "timeout". `adapter`:
        the LoRA adapter every choice runs (404 when it was unloaded meanwhile)."""
        stops = parse_stop(params.stop)
        config = self.generation_config(params, prompt, max_tokens, partial=grammar is not None)
        count = params.n or 1
        if params.seed is not None:
            seeds = [(params.seed + i) % (SEED_MAX + 1) for i in range(count)]
        else:
            seeds = [random_seed() for _ in range(count)]
        top = request_top_logprobs(params)
        extra = {} if top is None else {"top_logprobs": top}
        if not self.engine_thread.alive:
            raise ApiError(503, "the engine is not running", code="engine_stopped")
        decode = self.tool_decode if tools else self.tokenizer.decode
        if thinking:
            decode = keeping_channel(self.tokenizer, decode)
        gens: list[Generation] = []
        for seed in seeds:
            constraints = first_canvas if grammar is None else self.model.grammars.canvas(grammar, self.canvas)
            try:
                job = self.engine_thread.submit(
                    prompt.input_ids,
                    config,
                    seed,
                    drafts=params.stream_drafts,
                    images=prompt.images,
                    constraints=constraints,
                    deadline=deadline,
                    adapter=adapter,
                    **extra,
                )
            except (QueueFull, UnknownAdapter) as e:
                for gen in gens:  # all the choices or none
                    gen.cancel()
                if isinstance(e, UnknownAdapter):
                    self.unknown_model(adapter)  # unloaded (or being unloaded) since it was checked
                raise ApiError(429, str(e), None, "queue_full") from None
            text = TextStream(decode, stops, config.eos_token_ids, config.max_new_tokens)
            gens.append(Generation(self.engine_thread, job, text))
        return gens

    def first_canvas(self, params: CompletionParams, grammar: Grammar | None) -> FirstCanvas | None:
        """The `canvas` extension field as the first canvas's fixed tokens (400 naming it)."""
        if params.canvas is None:
            return None
        if grammar is not None:
            raise ApiError(
                400,
                "canvas: fixed canvas tokens and structured output in one request are not supported",
                "canvas",
                "unsupported_parameter",
            )
        try:
            return fixed_canvas(params.canvas, self.canvas, self.model.config.vocab_size)
        except (InsertError, ValueError) as e:
            raise ApiError(400, str(e), getattr(e, "param", "canvas"), "invalid_value") from None

    async def insert(
        self,
        request: Request,
        params: CompletionParams,
        prompt: ModelInputs,
        deadline: float | None = None,
        adapter: str | None = None,
    ) -> Insertion | None:
        """Insert mode: the span between the prompt and `suffix` (openai/insert.py); openai/responses.py shapes
        it. Its candidate spans are engine requests of their own: at most --max-active of them,
        all cancelled when the client goes away (then None: nobody reads an answer); past
        `deadline` the best candidate that finished wins (finish_reason "timeout")."""
        for name, bad in (
            ("n", (params.n or 1) > 1),
            ("logprobs", params.logprobs is not None),
            ("stream_drafts", params.stream_drafts),
            ("canvas", params.canvas is not None),
            ("stop", params.stop is not None),
            ("ignore_eos", params.ignore_eos),
        ):
            if bad:
                raise ApiError(400, f"{name}: not supported with suffix (insert mode)", name, "unsupported_parameter")
        if params.suffix is None:
            raise ApiError(400, "span_length needs suffix (insert mode)", "span_length", "invalid_value")
        try:
            lengths = span_lengths(params.span_length, params.max_tokens, self.canvas, self.engine_thread.max_active)
            end_tokens = self.model.end_tokens()
        except (InsertError, ValueError) as e:
            raise ApiError(400, str(e), getattr(e, "param", "suffix"), "invalid_value") from None
        suffix = await asyncio.to_thread(self.prompts.encode_text, params.suffix)
        config = self.generation_config(params, prompt, self.canvas).with_overrides(eos_token_ids=())
        seed = params.seed if params.seed is not None else random_seed()
        if not self.engine_thread.alive:
            raise ApiError(503, "the engine is not running", code="engine_stopped")
        started = time.perf_counter()
        work = asyncio.ensure_future(
            insert(
                self.engine_thread,
                prompt.input_ids,
                suffix,
                lengths,
                config,
                seed,
                self.canvas,
                self.model.config.vocab_size,
                end_tokens,
                deadline,
                adapter,
            )
        )
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(request, work.cancel))
        try:
            found = await work
        except asyncio.CancelledError:
            if not watcher.done():
                raise  # this handler itself was cancelled (shutdown)
            with self.metrics.lock:
                self.metrics.requests.inc(finish_reason="cancelled")
            return None
        except QueueFull as e:
            raise ApiError(429, str(e), None, "queue_full") from None
        except UnknownAdapter:
            self.unknown_model(adapter)
        except EngineFailure as e:
            raise ApiError(500, f"generation failed: {e}", code="engine_error") from None
        finally:
            watcher.cancel()
        with self.metrics.lock:
            self.metrics.requests.inc(finish_reason=insertion_reason(found))
            self.metrics.request_seconds.observe(time.perf_counter() - started)
        return found

    def token_texts(self) -> TokenTexts:
        """Token texts and bytes for logprobs (built on first use from llguidance's reading of
        tokenizer.json, which may take a second: run it off the loop)."""
        with self._grammars_lock:
            if self._token_texts is None:
                try:
                    decode_bytes = self.model.grammars.tokenizer.decode_bytes
                    self._token_texts = TokenTexts(lambda t: decode_bytes([t]))
                except GrammarError:  # no EOS token for llguidance: the tokenizer's own decoding
                    self._token_texts = TokenTexts(
                        lambda t: self.tokenizer.decode([t], skip_special_tokens=False).encode()
                    )
            return self._token_texts

    def usage(self, prompt: ModelInputs, gens: list[Generation]) -> dict:
        """The request's usage: its prompt counted once, the completion tokens, decoder passes and
        decoder positions (canvas positions computed: fewer than passes x canvas_length with turbo)
        of all its choices; cached tokens as the first choice found them (the fewest: the others
        also find the blocks it encoded)."""
        done, prompt_len = sum(g.completion_tokens for g in gens), len(prompt.input_ids)
        passes, cached = sum(g.decoder_passes for g in gens), min(g.cached_tokens for g in gens)
        per_forward = (
            gens[0].tokens_per_forward
            if len(gens) == 1
            else (sum(g.tokens_per_forward * g.decoder_passes for g in gens) / passes if passes else 0.0)
        )
        return {
            "prompt_tokens": prompt_len,
            "completion_tokens": done,
            "total_tokens": prompt_len + done,
            "prompt_tokens_details": {"cached_tokens": cached, "image_tokens": prompt.num_image_tokens},
            "decoder_passes": passes,
            "decoder_positions": sum(g.decoder_positions for g in gens),
            "tokens_per_forward": round(per_forward, 3),
        }

    def record(self, gen: Generation, reason: str) -> None:
        count_completion_tokens(gen.completion_tokens)  # the request's log line (http/request_log.py)
        now = time.perf_counter()
        with self.metrics.lock:
            self.metrics.requests.inc(finish_reason=reason)
            if reason != "cancelled":
                self.metrics.request_seconds.observe(now - gen.job.submitted)
            if gen.first_block_at is not None:
                self.metrics.first_block_seconds.observe(gen.first_block_at - gen.job.submitted)

"""The Python API: `dgemma.load(path)` returns a `Model` that generates, streams and scores canvases."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from . import api_requests
from .adapters import DEFAULT_MAX_LORAS, DEFAULT_MAX_RANK, AdapterBank, AdapterError, adapter_dtype
from .api_requests import SamplingRequest
from .config import GenerationConfig, ModelConfig
from .dense import canvas as dense_canvas
from .dense.reference import reference_events
from .engine.client import EngineClient
from .engine.constraints import FirstCanvas
from .engine.constraints.grammar import Grammar, GrammarCompiler, GrammarError
from .engine.constraints.infill import (
    DEFAULT_LENGTHS,
    EditResult,
    InfillResult,
    candidate_lengths,
    edit_plan,
    infill_plan,
    most_likely_span,
    snap_spans,
)
from .engine.engine import Engine, EngineOptions
from .engine.events import Block, Draft, GenerationOutput, collect
from .engine.request import AdapterRef, Request, validate_prompts
from .inputs.model_inputs import ImagePatches
from .inputs.tokenizer import Tokenizer
from .kernels.choice import engine_net
from .model.diffusion_gemma import DiffusionGemma


class Model:
    """A loaded DiffusionGemma checkpoint: network, configs and tokenizer."""

    def __init__(
        self,
        net: DiffusionGemma,
        generation_config: GenerationConfig,
        tokenizer: Tokenizer | None = None,
        path: Path | None = None,
        name: str | None = None,
        ranks=None,
    ):
        self.net = net
        self.ranks = ranks  # the ranks this process started (load(tensor_parallel_size=N) outside torchrun), or None
        # what `serve` calls it: the hub id of a hub checkpoint, else the directory's name
        self.name = name or (Path(os.path.abspath(path)).name if path else "dgemma")
        self.config: ModelConfig = net.config
        self.generation_config = generation_config
        self.tokenizer = tokenizer
        self.path = path
        self.engine_options = EngineOptions()
        self._engine_net: DiffusionGemma | None = None
        self._client: EngineClient | None = None
        self._processor = None
        self._grammars: GrammarCompiler | None = None
        # the LoRA adapters served on this base, chosen per request (dgemma/adapters/); None: none
        self.adapters: AdapterBank | None = None

    @property
    def engine_net(self) -> DiffusionGemma:
        """The network the engine and AR mode run (`kernels.choice.engine_net`: on CPU a copy with
        packed weights). The reference-exact paths (`sampling="reference"`, `canvas_logits`)
        always use `net`. Made on first use; after changing `net`'s weights in place or
        attaching adapters, call `reset_engine_net()`."""
        if self._engine_net is None:
            self._engine_net = engine_net(self.net)
        return self._engine_net

    def reset_engine_net(self) -> None:
        """Forget the packed copy and the engine, so the next generation runs `net` as it is now."""
        self._engine_net = None
        self._client = None

    def load_adapters(self, path: str | Path) -> list[str]:
        """Attach LoRA adapters from `path` to `net`, unmerged: PEFT's format (what `dgemma finetune`
        and PEFT's `save_pretrained` write) or dgemma's older one (train/lora.py); the next
        generation runs them. Returns the adapted modules' names."""
        from .train import lora

        names = lora.load_adapters(self.net, path)
        self.reset_engine_net()
        return names

    def enable_adapters(self, max_loras: int = DEFAULT_MAX_LORAS, max_rank: int = DEFAULT_MAX_RANK) -> AdapterBank:
        """Serve LoRA adapters on this base, chosen per request (`generate(..., adapter=NAME)`):
        `max_loras` resident at once, each of rank up to `max_rank`, their weights in slots made
        now beside the engine's network (kernels/lora.py). Drops the current engine (the next one
        runs the adapted network). Returns the bank (the same one when already enabled with these
        sizes)."""
        if self.adapters is not None:
            if (self.adapters.max_loras, self.adapters.max_rank) != (max_loras, max_rank):
                raise ValueError(
                    f"adapters are enabled with max_loras={self.adapters.max_loras}, "
                    f"max_rank={self.adapters.max_rank} already"
                )
            return self.adapters
        if self.net.shards is not None and self.net.shards.size > 1:
            raise ValueError(
                "LoRA adapters do not run on a model cut across ranks yet (tensor parallelism): serve them on one device"
            )
        self.adapters = AdapterBank(
            self.config, self.device, adapter_dtype(self.device, self.engine_input_net.dtype), max_loras, max_rank
        )
        self._client = None
        return self.adapters

    def add_adapter(self, name: str, path: str | Path) -> list[str]:
        """Load the LoRA adapter at `path` (a directory in PEFT's format, or a hub id) under `name`,
        unmerged beside the base (`enable_adapters` first, or it is called with its defaults);
        `generate(..., adapter=name)` runs it. Returns the linears it adapts. AdapterError (one
        line) when it does not fit the base or the bank."""
        bank = self.adapters or self.enable_adapters()
        return list(bank.load(name, path).targets)

    def remove_adapter(self, name: str) -> None:
        """Unload adapter `name` (and forget its prefix-cache blocks)."""
        bank = self.adapters
        if bank is None or bank.get(name) is None:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        entry = bank.get(name)
        if self._client is not None and self.engine.uses_adapter(entry.slot):
            raise AdapterError(f"adapter {name!r} is in use by a running generation")
        bank.remove(name)
        if self._client is not None and not bank.shares_key(entry.key):
            self.engine.forget_adapter(entry.key)

    def adapter_ref(self, name: str | None) -> AdapterRef | None:
        """The request-side reference of adapter `name` (None: the base alone)."""
        if name is None:
            return None
        entry = self.adapters.get(name) if self.adapters is not None else None
        if entry is None:
            loaded = ", ".join(repr(n) for n in self.adapters.names) if self.adapters else ""
            raise AdapterError(f"no adapter named {name!r} is loaded (loaded: {loaded or 'none'})")
        return entry.ref

    @property
    def engine(self) -> Engine:
        """The engine `generate` and `stream` share (its prefix cache persists across calls)."""
        return self._engine_client().engine

    def ar_events(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        seeds: list[int],
        eos_token_ids: tuple[int, ...],
    ):
        """AR mode's events (a `Block` of one token per row per step): on the engine's Triton path
        (a GPU) the device loop of engine/fused/ar.py, one captured graph a token; elsewhere
        dense/ar.py's loop on the engine's network."""
        self._outside_the_engine("mode='ar'")
        on_gpu_path = self.engine_options.triton or (self.engine_options.triton is None and self.device.type == "cuda")
        if on_gpu_path and self.engine.runner.triton:
            from .engine.fused.ar import device_ar_events

            return device_ar_events(self.engine, prompt_ids, max_new_tokens, temperature, seeds, eos_token_ids)
        from .dense.ar import ar_events

        return ar_events(self.engine_net, prompt_ids, max_new_tokens, temperature, seeds, eos_token_ids)

    def configure_engine(self, options: EngineOptions | None = None, **changes) -> None:
        """Set `EngineOptions` (block_size, kv_cache_memory, prefix_cache, prefill_chunk,
        max_active, batch_invariant, ...) for the next generation: a whole `options`, and/or
        fields to change; drops the current engine (and its prefix cache)."""
        self.engine_options = replace(options or self.engine_options, **changes)
        self._client = None

    @property
    def engine_input_net(self) -> DiffusionGemma:
        """The network an Engine with this model's options is given: the model's own on the Triton
        path (which makes its own fused copy, kernels/fused.py; a CPU's widened copy computes in
        float32 what the kernels read in bf16), `engine_net` otherwise."""
        return self.net if self.engine_options.triton else self.engine_net

    def _engine_client(self) -> EngineClient:
        if self._client is None:
            net = self.engine_input_net
            # ranks this process leads make the engine with it and replay its steps (parallel/leader.py)
            slots = None if self.adapters is None else self.adapters.slots
            engine = (
                Engine(net, self.engine_options, slots)
                if self.ranks is None
                else self.ranks.engine(net, self.engine_options)
            )
            self._client = EngineClient(engine)
        return self._client

    def close(self) -> None:
        """End the ranks `load(..., tensor_parallel_size=N)` started for this model (they end at
        the process's exit too); nothing for a model in one process or started by torchrun."""
        if self.ranks is not None:
            self._client = None
            self.ranks.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _outside_the_engine(self, what: str) -> None:
        """Refuse work that runs the net outside the engine when this process leads its ranks:
        they replay only the engine's steps (under torchrun every rank makes the same calls)."""
        if self.ranks is not None:
            raise ValueError(
                f"{what} runs the network outside the engine, which the ranks that dgemma.load started do "
                "not replay: use the engine's sampling, or start the ranks with torchrun (docs/parallel.md)"
            )

    @property
    def grammars(self) -> GrammarCompiler:
        """This checkpoint's tokenizer as llguidance reads it (built on first use)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise GrammarError("structured output needs the checkpoint's tokenizer.json")
            g = self.generation_config
            self._grammars = GrammarCompiler(
                self.tokenizer.to_json(), self.config.vocab_size, g.eos_token_ids, g.pad_token_id
            )
        return self._grammars

    def compile_grammar(self, kind: str, spec) -> Grammar:
        """A grammar for `generate(..., grammar=)`: kind "json_schema" (a dict or JSON text),
        "json_object", "regex" or "lark". GrammarError (a ValueError) names what is wrong."""
        return self.grammars.compile(kind, spec)

    def _grammar_constraints(self, grammar: Grammar | None, count: int, constraints):
        if grammar is None:
            return constraints
        if constraints is not None:
            raise ValueError("pass constraints or grammar, not both")
        if not isinstance(grammar, Grammar):
            raise ValueError(f"grammar must come from compile_grammar (got {type(grammar).__name__})")
        return [self.grammars.canvas(grammar, self.config.canvas_length) for _ in range(count)]

    @property
    def device(self) -> torch.device:
        return self.net.device

    @property
    def dtype(self) -> torch.dtype:
        return self.net.dtype

    # ---------------------------------------------------------------- inputs
    @property
    def supports_images(self) -> bool:
        """The checkpoint holds a vision tower and the processor files to feed it."""
        return self.net.vision is not None and self.processor is not None

    @property
    def processor(self):
        """The Gemma 4 image/video processor of this checkpoint (`inputs/processor.py`), or None
        when it has none: `model.processor(text, images=..., videos=...)` gives `ModelInputs`
        that `generate`, `stream` and `canvas_logits` take as prompts."""
        if self._processor is None and self.path is not None and self.tokenizer is not None:
            from .inputs.processor import Processor

            self._processor = Processor.from_dir(self.path, self.tokenizer) or False
        return self._processor or None

    def _split_prompts(self, prompts: Sequence) -> tuple[list[list[int]], list[list[ImagePatches]]]:
        """Token ids and images of each prompt (a string, token ids, or processor `ModelInputs`)."""
        return api_requests.split_prompts(prompts, self.tokenizer, self.net.vision is not None)

    def sampling_request(
        self,
        num_prompts: int,
        seed: int | Sequence[int] | None = None,
        sampling: str = "default",
        **overrides,
    ) -> SamplingRequest:
        """The generation config with this call's knobs, and a seed for each prompt (`seed`'s, or drawn)."""
        # every rank's engine replica must draw the same seeds (led ranks get them with each request)
        shards = self.net.shards if self.ranks is None else None
        return api_requests.sampling_request(self.generation_config, num_prompts, seed, sampling, overrides, shards)

    def _events(
        self,
        prompt_ids: list[list[int]],
        request: SamplingRequest,
        drafts: bool,
        user_seed: bool,
        constraints=None,
        images: list[list[ImagePatches]] | None = None,
        canvas: Sequence[Sequence[int]] | None = None,
        adapter: str | None = None,
    ) -> Iterator[Draft | Block]:
        images = images or [[] for _ in prompt_ids]
        initial = api_requests.initial_canvas(
            canvas, len(prompt_ids), self.config.canvas_length, self.config.vocab_size
        )
        ref = self.adapter_ref(adapter)
        if request.sampling == "reference":
            if ref is not None:
                raise ValueError("sampling='reference' runs the base network alone: it takes no adapter")
            self._outside_the_engine("sampling='reference'")
            if request.config.turbo:
                raise ValueError(
                    "sampling='reference' reproduces transformers step for step: turbo denoising approximates it; drop one of them"
                )
            if constraints is not None:
                raise ValueError("sampling='reference' takes no canvas constraints")
            validate_prompts(prompt_ids, self.config.vocab_size)
            placed = [dense_canvas.placed_images(self.net, p, im) if im else [] for p, im in zip(prompt_ids, images)]
            if user_seed:
                torch.manual_seed(request.seeds[0])
            return reference_events(
                self.net, prompt_ids, request.config, drafts=drafts, images=placed, initial_canvas=initial
            )
        validate_prompts(prompt_ids, self.config.vocab_size)
        requests = api_requests.engine_requests(prompt_ids, request, drafts, images, constraints, initial, ref)
        return self._engine_events(requests)

    def _engine_events(self, requests: list[Request]) -> Iterator[Draft | Block]:
        """Engine events with `row` = the prompt's index; returns the GenerationOutput. A generator:
        the engine is made (or reused) when the first event is read."""
        return (yield from api_requests.prompt_events(self._engine_client(), requests))

    # ---------------------------------------------------------------- generation
    def generate(
        self,
        prompts: Sequence,
        max_new_tokens: int | None = None,
        max_denoising_steps: int | None = None,
        entropy_bound: float | None = None,
        t_min: float | None = None,
        t_max: float | None = None,
        stability_threshold: int | None = None,
        confidence_threshold: float | None = None,
        seed: int | Sequence[int] | None = None,
        sampling: str = "default",
        eos_token_ids: Sequence[int] | None = None,
        mode: str = "diffusion",
        temperature: float = 0.0,
        constraints: Sequence | None = None,
        grammar: Grammar | None = None,
        canvas: Sequence[Sequence[int]] | None = None,
        turbo: bool | None = None,
        turbo_freeze_passes: int | None = None,
        turbo_freeze_entropy: float | None = None,
        turbo_refresh_every: int | None = None,
        turbo_dormant_entropy: float | None = None,
        adapter: str | None = None,
    ) -> GenerationOutput:
        """Generate for a batch of prompts (token-id lists of any lengths, or strings).

        Unset knobs come from the checkpoint's generation_config.json. `sampling="reference"`
        reproduces transformers' generate token for token after the same torch.manual_seed.
        `mode="ar"` decodes autoregressively with the encoder (greedy at temperature 0).
        `constraints`: one per prompt, a `CanvasConstraints` for every canvas of it, a function
        of the `Request` giving one per decoder pass, or None (see engine/constraints/__init__.py).
        `grammar` (from `compile_grammar`): every answer is a sentence of it, or a prefix of one
        when max_new_tokens ends it first (see engine/constraints/grammar.py). `canvas`: one list of
        canvas_length token ids per prompt, where its first canvas starts instead of random
        tokens (a warm start: transformers' `decoder_input_ids`, with either sampling).
        `turbo=True` stops recomputing converged canvas positions (engine/turbo.py: approximate,
        opt-in; the `turbo_*` knobs set when a position freezes, how often frozen keys are
        refreshed and which noise positions rest every other pass); `sampling="reference"` refuses it.
        `adapter`: the name of a LoRA adapter loaded with `add_adapter` (or `dgemma.load(lora=...)`)
        that every prompt runs with (None: the base).
        """
        prompt_ids, images = self._split_prompts(prompts)
        constraints = self._grammar_constraints(grammar, len(prompt_ids), constraints)
        if mode == "ar":
            if adapter is not None:
                raise ValueError("mode='ar' runs the base network alone: it takes no adapter")
            if any(images):
                raise ValueError("mode='ar' takes text prompts only (no images)")
            validate_prompts(prompt_ids, self.config.vocab_size)
            request = self.sampling_request(
                len(prompt_ids), seed=seed, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids
            )
            cfg = request.config
            return collect(
                self.ar_events(prompt_ids, cfg.max_new_tokens, temperature, request.seeds, cfg.eos_token_ids)
            )
        if mode != "diffusion":
            raise ValueError(f"mode must be 'diffusion' or 'ar', got {mode!r}")
        request = self.sampling_request(
            len(prompt_ids),
            seed=seed,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            max_denoising_steps=max_denoising_steps,
            entropy_bound=entropy_bound,
            t_min=t_min,
            t_max=t_max,
            stability_threshold=stability_threshold,
            confidence_threshold=confidence_threshold,
            eos_token_ids=eos_token_ids,
            turbo=turbo,
            turbo_freeze_passes=turbo_freeze_passes,
            turbo_freeze_entropy=turbo_freeze_entropy,
            turbo_refresh_every=turbo_refresh_every,
            turbo_dormant_entropy=turbo_dormant_entropy,
        )
        return collect(
            self._events(
                prompt_ids,
                request,
                drafts=False,
                user_seed=seed is not None,
                constraints=constraints,
                images=images,
                canvas=canvas,
                adapter=adapter,
            )
        )

    def stream(
        self,
        prompt,
        drafts: bool = False,
        seed: int | None = None,
        sampling: str = "default",
        constraints=None,
        grammar: Grammar | None = None,
        canvas: Sequence[int] | None = None,
        adapter: str | None = None,
        **knobs,
    ):
        """Yield `Block` events as each canvas commits (and `Draft` events per step if `drafts`);
        `constraints`, `grammar`, `canvas`, `adapter` as in `generate`, for this one prompt."""
        prompt_ids, images = self._split_prompts([prompt])
        request = self.sampling_request(1, seed=seed, sampling=sampling, **knobs)
        listed = None if constraints is None else [constraints]
        listed = self._grammar_constraints(grammar, 1, listed)
        return self._events(
            prompt_ids,
            request,
            drafts=drafts,
            user_seed=seed is not None,
            constraints=listed,
            images=images,
            canvas=None if canvas is None else [canvas],
            adapter=adapter,
        )

    # ---------------------------------------------------------------- seeded canvases (engine/constraints/infill.py)
    def infill(
        self,
        prefix: str,
        suffix: str,
        span_length: int | None = None,
        lengths: Sequence[int] = DEFAULT_LENGTHS,
        seed: int | None = None,
        adapter: str | None = None,
        **knobs,
    ) -> InfillResult:
        """The text between `prefix` and `suffix`: `span_length` tokens, or the candidate length
        (of `lengths`) whose canvas the model finds most likely (see engine/constraints/infill.py)."""
        tok, c = self._text_tokenizer(), self.config.canvas_length
        candidates = candidate_lengths(c, span_length, lengths)
        prefix_ids, suffix_ids = tok.encode(prefix), tok.encode(suffix, add_special_tokens=False)
        plans = [infill_plan(prefix_ids, suffix_ids, n, c, *self.end_tokens()) for n in candidates]
        blocks = self._seeded_blocks(plans, seed, adapter, **knobs)
        best, scores = most_likely_span(candidates, blocks)
        tokens = blocks[candidates.index(best)].tokens[:best]
        return InfillResult(tok.decode(tokens), tokens, best, scores)

    def infill_stream(
        self,
        prefix: str,
        suffix: str,
        span_length: int,
        seed: int | None = None,
        drafts: bool = True,
        adapter: str | None = None,
        **knobs,
    ):
        """`stream` of one infill canvas (Draft events show the span forming, the suffix fixed
        beside it; the Block holds the whole canvas, span first)."""
        tok, c = self._text_tokenizer(), self.config.canvas_length
        plan = infill_plan(
            tok.encode(prefix), tok.encode(suffix, add_special_tokens=False), span_length, c, *self.end_tokens()
        )
        return self.stream(
            plan.prompt,
            drafts=drafts,
            seed=seed,
            constraints=FirstCanvas(plan.constraints(self.config.vocab_size)),
            max_new_tokens=c,
            eos_token_ids=[],
            adapter=adapter,
            **knobs,
        )

    def edit(
        self,
        text: str,
        spans: Sequence[tuple[int, int]],
        seed: int | None = None,
        adapter: str | None = None,
        **knobs,
    ) -> EditResult:
        """`text` with the character ranges `spans` rewritten (snapped outward to token
        boundaries) and everything else kept byte for byte (see engine/constraints/infill.py)."""
        tok, c = self._text_tokenizer(), self.config.canvas_length
        ids, offsets = tok.encode_with_offsets(text)
        token_spans = snap_spans(list(spans), offsets, len(text))
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        plan = edit_plan(bos, ids, token_spans, c, *self.end_tokens())
        (block,) = self._seeded_blocks([plan], seed, adapter, **knobs)
        chars = [(offsets[a][0], offsets[b - 1][1]) for a, b in token_spans]
        replacements = [tok.decode(block.tokens[a:b]) for a, b in plan.free]
        out, at = [], 0
        for (a, b), new in zip(chars, replacements):
            out += [text[at:a], new]
            at = b
        return EditResult("".join(out) + text[at:], chars, replacements)

    def _text_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{self.path} has no tokenizer.json: infill and edit take text")
        return self.tokenizer

    def end_tokens(self) -> tuple[int, int]:
        """(EOS, pad): what an infill or edit canvas holds past the end of the text."""
        g = self.generation_config
        if not g.eos_token_ids or g.pad_token_id is None:
            raise ValueError("infill and edit need the checkpoint's EOS and pad tokens (generation_config.json)")
        return g.eos_token_ids[0], g.pad_token_id

    def _seeded_blocks(self, plans: list, seed: int | None, adapter: str | None = None, **knobs) -> list[Block]:
        """The committed canvas of each plan (one block each, with its log probabilities)."""
        ref = self.adapter_ref(adapter)
        request = self.sampling_request(
            len(plans), seed=seed, max_new_tokens=self.config.canvas_length, eos_token_ids=[], **knobs
        )
        requests = api_requests.seeded_requests(plans, request, self.config.vocab_size, ref)
        blocks: list[Block | None] = [None] * len(plans)
        for ev in self._engine_events(requests):
            if isinstance(ev, Block):
                blocks[ev.row] = ev
        return blocks

    @torch.no_grad()
    def canvas_logits(
        self,
        prompt_ids: Sequence,
        canvas_ids: Sequence | torch.Tensor,
        self_conditioning_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decoder pass: float32 logits [B, canvas_len, vocab] for canvases after encoding the prompts.

        Each prompt keeps its own positions (as if run alone); the canvas follows it. Prompts
        may be processor `ModelInputs` (with images).
        """
        self._outside_the_engine("canvas_logits")
        prompts, images = self._split_prompts(prompt_ids)
        return dense_canvas.canvas_logits(self.net, prompts, images, canvas_ids, self_conditioning_logits)

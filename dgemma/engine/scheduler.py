"""The scheduler: admission, KV blocks, prefix matches, cancellation, and what runs each step.

`schedule()` returns a `StepPlan`: the encoder work of this step (every block committed last
step, and prompt chunks within the step's prefill budget, shortest remaining prompt first), then
the requests whose canvases take a decoder pass. `update()` takes the runner's results and turns them into request state and
events: drafts, committed blocks (cut at EOS and max_new_tokens), finished requests.

Requests are admitted first come, first served while both KV pools can reserve what they may
need (their prompt and every block of max_new_tokens), so a running request never runs out of
blocks; a request that does not fit waits at the head of the queue. A request whose leading
prompt blocks a running request is computing right now (not yet in the prefix cache) is held
back until they are registered, then admitted with them cached: requests that share a prefix
and arrive together (the choices of an `n` > 1 request, agents resending one system prompt)
encode it once. Requests behind a held one may be admitted meanwhile; it keeps its place.
"""

from __future__ import annotations

import itertools
from collections import deque

import torch

from ..config import ModelConfig
from ..inputs.model_inputs import image_safe_end, splits_image
from .events import Block, Draft, Finished, cut_block, shown_entropy
from .kv.block_manager import BlockManager, extend_hashes
from .options import EngineOptions
from .request import Request, RequestStatus, image_spans, max_sequence_length
from .step_plan import DecodeResult, EncodeWork, EngineStats, StepPlan


def _root(req: Request) -> bytes | None:
    """Where the request's hash chain starts: its adapter's content hash (None: the base's)."""
    return None if req.adapter is None else req.adapter.key


def _draft_view(res: DecodeResult) -> tuple[list[bool], list[float]]:
    """A draft's accepted mask and entropies as lists (read from the device only for requests
    that stream drafts)."""
    accepted = res.accepted.tolist() if res.accepted is not None else []
    entropy = shown_entropy(res.entropy.tolist()) if res.entropy is not None else []
    return accepted, entropy


class Scheduler:
    def __init__(self, config: ModelConfig, options: EngineOptions, blocks: BlockManager, device: torch.device):
        self.config, self.options, self.blocks, self.device = config, options, blocks, device
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = EngineStats()
        self._ids = itertools.count()

    # ---------------------------------------------------------------- requests in and out
    def refusal(self, prompt_len: int, max_new_tokens: int, partial: bool = False) -> str | None:
        """Why a request of this size can never run here (None if it can): past the model's
        positions, or more KV blocks than the pools hold even when empty. `partial`: its blocks
        may commit fewer than a canvas of tokens (a grammar)."""
        cfg, c = self.config, self.config.canvas_length
        encoded = max_sequence_length(prompt_len, max_new_tokens, c, partial)
        last = encoded + c  # end of the last canvas
        if last > cfg.max_position_embeddings:
            return (
                f"prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} (in blocks of {c}) reaches "
                f"position {last}; the model's max_position_embeddings is {cfg.max_position_embeddings}"
            )
        fits, need = self.blocks.fits_at_all(encoded)
        if not fits:
            have = {k: p.num_blocks for k, p in self.blocks.pools.items()}
            return (
                f"prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} needs {need} KV blocks of "
                f"{self.options.block_size} positions; the KV cache holds {have}: raise the KV cache memory "
                f"or shorten the request"
            )
        return None

    def add(self, request: Request) -> int:
        why = self.refusal(len(request.prompt), request.config.max_new_tokens, request.partial_commits)
        if why is not None:
            raise ValueError(why)
        if request.images:
            request.image_spans = image_spans(request.prompt, request.images, self.config.vision.image_token_id)
            request.image_features = [None] * len(request.images)
        request.request_id = next(self._ids)
        request.generator = torch.Generator(device="cpu").manual_seed(request.seed)
        if self.blocks.prefix_cache:
            request.block_hashes = self.blocks.prompt_hashes(request.prompt, self._media(request), _root(request))
        self.waiting.append(request)
        return request.request_id

    def cancel(self, request_id: int) -> None:
        """Mark a request cancelled; it leaves at the next step boundary."""
        for r in itertools.chain(self.waiting, self.running):
            if r.request_id == request_id:
                r.cancelled = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def uses_adapter(self, slot: int) -> bool:
        """Whether a queued or running request runs the adapter in `slot`."""
        return any(r.adapter_slot == slot for r in itertools.chain(self.waiting, self.running))

    # ---------------------------------------------------------------- planning a step
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._drop_cancelled(plan.events)
        self._admit()
        budget = self.options.prefill_chunk
        # committed blocks first, then prompts with the fewest tokens left: a short prompt is not
        # held up behind a long one, which still gets what the step's budget leaves
        pending = sorted((r for r in self.running if r.pending_tokens), key=lambda r: (r.block == 0, r.pending_tokens))
        for req in pending:
            work, budget = self._encode_work(req, budget)
            if work is not None:
                self.blocks.allocate(req.request_id, req.kv, work.end)
                req.kv.length = work.start
                plan.encode.append(work)
        planned = {w.request.request_id: w.end for w in plan.encode}
        for req in self.running:
            if planned.get(req.request_id, req.kv.length) < len(req.sequence):
                continue  # still prefilling
            if req.canvas is None:
                req.start_canvas(self.config.canvas_length, self.config.vocab_size, self.device)
            elif callable(req.constraints):
                req.active_constraints = req.resolve_constraints()
            plan.decode.append(req)
        return plan

    def _encode_work(self, req: Request, budget: int) -> tuple[EncodeWork | None, int]:
        b, start, total = self.options.block_size, req.kv.length, len(req.sequence)
        invariant = self.options.batch_invariant
        if req.block > 0:  # a committed block: always encoded at once (its request waits for it)
            if invariant:  # redo the partial block before it, so that it is encoded as a whole block
                start = start // b * b
            return EncodeWork(req, start, total), budget
        end = min(total, start + budget)
        if invariant and end < total:
            end = end // b * b  # whole blocks only, so passes fall where a cold run's do
        end = image_safe_end(start, end, req.image_spans)
        if end <= start:
            return None, budget
        return EncodeWork(req, start, end), budget - (end - start)

    def _admit(self) -> None:
        limit, held = self.options.max_active, []
        while self.waiting and (limit is None or len(self.running) < limit):
            req = self.waiting.popleft()
            if self._prefix_in_flight(req):
                held.append(req)
                continue
            b = self.options.block_size
            inside_images = {m for m in range(len(req.block_hashes) + 1) if splits_image(m * b, req.image_spans)}
            cached = self.blocks.admit(
                req.request_id,
                req.kv,
                req.block_hashes,
                req.max_sequence_length(self.config.canvas_length),
                inside_images,
            )
            if cached is None:
                self.waiting.appendleft(req)
                break  # wait for blocks: no overtaking, so a long request is not starved
            req.cached_tokens = cached
            req.registered_blocks = cached // self.options.block_size
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.stats.prompt_tokens += len(req.prompt)
            self.stats.cached_tokens += cached
            self.stats.image_tokens += sum(e - s for s, e in req.image_spans)
        self.waiting.extendleft(reversed(held))  # back at the front, in their order

    def _prefix_in_flight(self, req: Request) -> bool:
        """Whether a running request is computing leading prompt blocks of `req` that the prefix
        cache does not hold yet (they will be registered within a few steps: `req` waits for
        them rather than encoding them a second time)."""
        if not self.blocks.prefix_cache or not req.block_hashes:
            return False
        cached = None
        for other in self.running:
            if other.registered_blocks >= len(req.block_hashes) or other.registered_blocks >= len(other.block_hashes):
                continue
            if req.block_hashes[other.registered_blocks] != other.block_hashes[other.registered_blocks]:
                continue  # a hash names its whole prefix: they part before the blocks `other` computes
            if cached is None:
                cached, _ = self.blocks.match(req.block_hashes)
            if cached <= other.registered_blocks:
                return True
        return False

    # ---------------------------------------------------------------- after the step
    def update(self, plan: StepPlan, decoded: list[DecodeResult]) -> list:
        events = plan.events
        self.stats.steps += 1
        for work in plan.encode:
            self._after_encode(work)
        converged = []
        for res in decoded:
            req = res.request
            req.canvas, req.argmax, req.soft, req.history = res.canvas, res.argmax, res.soft, res.history
            if res.turbo is not None:
                req.turbo = res.turbo
            last = req.block_ends(res.stop)
            req.step += 1
            req.block_passes += 1
            req.decoder_positions += res.positions
            self.stats.decoder_passes += 1
            self.stats.decoder_positions += res.positions
            if req.drafts:
                frozen = res.turbo.frozen.tolist() if res.turbo is not None else []
                events.append(
                    Draft(req.request_id, req.block, req.step, req.argmax.tolist(), *_draft_view(res), frozen)
                )
            if last:
                req.canvas_logprobs = res.logprobs
                converged.append(req)
        for req in converged:
            self._commit(req, events)
        return events

    def _after_encode(self, work: EncodeWork) -> None:
        req, b = work.request, self.options.block_size
        count = work.end - work.start
        req.encoded_tokens += count
        self.stats.encoded_tokens += count
        if self.blocks.prefix_cache:
            self._extend_hashes(req)
            full = req.kv.length // b
            if full > req.registered_blocks:
                self.blocks.register(req.kv, req.block_hashes[:full], req.registered_blocks, _root(req))
                req.registered_blocks = full
        rewind = req.kv.length // b * b if self.options.batch_invariant else req.kv.length
        self.blocks.release_behind_window(req.request_id, req.kv, rewind - (self.config.sliding_window - 1))

    def _extend_hashes(self, req: Request) -> None:
        extend_hashes(req.block_hashes, req.sequence, self.options.block_size, self._media(req), _root(req))

    @staticmethod
    def _media(req: Request) -> list[tuple[int, int, bytes]]:
        return [(s, e, image.key) for (s, e), image in zip(req.image_spans, req.images)]

    def _commit(self, req: Request, events: list) -> None:
        """The converged canvas's argmax becomes the request's next block (of it, what the
        constraints accept: a grammar's valid prefix)."""
        block = req.argmax.tolist()
        keep = req.commit_length(block)
        if keep == 0:  # nothing valid (never for a grammar's masked canvas): denoise a fresh canvas
            req.passes += req.block_passes
            req.canvas = None
            return
        block = block[:keep]
        eos, pad = req.config.eos_token_ids, req.config.pad_token_id
        tokens, hit_eos, counted = cut_block(block, eos, req.config.max_new_tokens - len(req.tokens))
        req.tokens += tokens
        req.counted += sum(1 for t in block[:counted] if t != pad)
        req.passes += req.block_passes
        done = hit_eos or len(req.tokens) >= req.config.max_new_tokens
        logprobs = None if req.canvas_logprobs is None else req.canvas_logprobs[: len(tokens)]
        events.append(Block(req.request_id, req.block, tokens, done, req.block_passes, logprobs))
        if done:
            self._finish(req, "eos" if hit_eos else "length", events)
            return
        req.sequence += block  # encoded next step, then the next canvas starts
        req.block += 1
        req.canvas = None

    def _finish(self, req: Request, reason: str, events: list) -> None:
        self.running.remove(req)
        self.blocks.free(req.request_id, req.kv)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        events.append(
            Finished(
                req.request_id,
                reason,
                req.tokens,
                req.passes,
                req.tokens_per_forward(),
                len(req.prompt),
                req.cached_tokens,
                req.decoder_positions,
            )
        )

    def _drop_cancelled(self, events: list) -> None:
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            req.status, req.finish_reason = RequestStatus.FINISHED, "cancelled"
            events.append(
                Finished(
                    req.request_id, "cancelled", req.tokens, req.passes, req.tokens_per_forward(), len(req.prompt), 0, 0
                )
            )
        for req in [r for r in self.running if r.cancelled]:
            req.passes += req.block_passes
            self._finish(req, "cancelled", events)

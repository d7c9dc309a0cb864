"""The engine: requests, cache slots, and one step of batched block diffusion.

Each `Request` owns its state (canvas, self-conditioning input, stopping history, generator) and
a row ("slot") of a shared KV cache. `Engine.step()` does, for everything it holds:

1. admit waiting requests into free slots and prefill their prompts (encoder pass);
2. one decoder pass over every denoising canvas, each at its own step and temperature;
3. per request: entropy-bound acceptance, renoising, adaptive stopping;
4. for canvases that converged: commit the argmax block, emit it, and either finish the request
   or encode the block into the cache and start the next canvas.

Requests join and leave at step boundaries, so the same engine serves `Model.generate` (all
prompts added up front) and the HTTP server (continuous batching).

Batch invariance: with `row_serial=True` (default on CPU) each request's passes run as a batch of
one, so its tokens are bit-identical to running it alone, whatever else is in the batch. Batched
passes (default on GPU) are faster but float rounding then depends on the batch.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

import torch

from . import sampler
from ..config import GenerationConfig
from .events import Block, Draft, Finished, cut_block
from ..kernels import native
from .kv_cache import CachePass, KVCache
from ..model.diffusion_gemma import DiffusionGemma


def room_needed(prompt_len: int, max_new_tokens: int, canvas_length: int) -> int:
    """Cache positions a request needs: its prompt plus every block it may commit."""
    return prompt_len + math.ceil(max_new_tokens / canvas_length) * canvas_length


class EngineFull(RuntimeError):
    """The waiting queue is at its limit."""


@dataclass
class Request:
    prompt: list[int]
    config: GenerationConfig
    seed: int
    drafts: bool = False
    request_id: int = -1
    # state
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    counted: int = 0
    passes: int = 0
    block: int = 0
    step: int = 0  # denoising steps done on the current canvas
    block_passes: int = 0
    canvas: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    soft: torch.Tensor | None = None
    history: torch.Tensor | None = None
    generator: torch.Generator | None = None
    cancelled: bool = False
    done: bool = False

    def tokens_per_forward(self) -> float:
        return self.counted / self.passes if self.passes else 0.0


class Engine:
    def __init__(
        self,
        net: DiffusionGemma,
        max_batch: int = 8,
        capacity: int = 4096,
        row_serial: bool | None = None,
        max_waiting: int | None = None,
        cuda_graphs: bool | None = None,
    ):
        self.net = net
        self.config = net.config
        self.max_batch = max_batch
        self.capacity = capacity
        self.row_serial = net.device.type == "cpu" if row_serial is None else row_serial
        self.max_waiting = max_waiting
        self.cache = KVCache(self.config, max_batch, capacity, net.device, net.dtype)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_batch))
        self._ids = itertools.count()
        use_graphs = net.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = DecoderGraphs() if use_graphs else None
        # GPU: sample every position (no host sync); CPU: only the accepted ones. Same tokens either way.
        self.sample_all_positions = net.device.type != "cpu"
        self.reuse_buffers = net.device.type == "cpu"
        self._buffers: dict[str, torch.Tensor] = {}
        # CPU with AVX-512: softcap + statistics + bf16 probabilities in one native pass per row
        self.native = native.extension() if net.device.type == "cpu" and self.config.vocab_size % 16 == 0 else None

    # ---------------------------------------------------------------- admission
    def add(self, request: Request) -> int:
        need = room_needed(len(request.prompt), request.config.max_new_tokens, self.config.canvas_length)
        if need > self.capacity:
            raise ValueError(
                f"prompt of {len(request.prompt)} tokens plus max_new_tokens={request.config.max_new_tokens} "
                f"needs {need} cache positions; this engine holds {self.capacity} per request"
            )
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise EngineFull(f"queue full ({self.max_waiting} waiting)")
        request.request_id = next(self._ids)
        request.generator = torch.Generator(device="cpu").manual_seed(request.seed)
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

    # ---------------------------------------------------------------- passes
    def _groups(self, requests: list[Request]) -> Iterable[list[Request]]:
        if self.row_serial:
            return ([r] for r in requests)
        return [requests] if requests else []

    def _rows(self, group: list[Request]) -> torch.Tensor | None:
        slots = [r.slot for r in group]
        if slots == list(range(self.max_batch)):
            return None
        return torch.tensor(slots, device=self.net.device)

    def _encode(self, group: list[Request], token_lists: list[list[int]]) -> None:
        lengths = [len(t) for t in token_lists]
        ids = torch.full((len(group), max(lengths)), self.config.pad_token_id, dtype=torch.long)
        for i, t in enumerate(token_lists):
            ids[i, : len(t)] = torch.tensor(t)
        plan = self.cache.plan_encoder(max(lengths), rows=self._rows(group), new_counts=lengths)
        self.net.encode(ids.to(self.net.device), self.cache, plan)
        self.cache.commit(plan)

    def _start_canvas(self, req: Request) -> None:
        c = self.config.canvas_length
        req.canvas = torch.randint(0, self.config.vocab_size, (c,), generator=req.generator).to(self.net.device)
        req.argmax = req.canvas.clone()
        req.soft = None
        req.history = None
        req.step = 0
        req.block_passes = 0

    def _temperatures(self, group: list[Request]) -> torch.Tensor:
        """Each request's temperature at its own step, one per canvas position [n * C, 1]."""
        temps = torch.stack(
            [
                sampler.temperature(
                    r.config.max_denoising_steps - r.step, r.config.max_denoising_steps, r.config.t_min, r.config.t_max
                )
                for r in group
            ]
        )
        return temps.repeat_interleave(self.config.canvas_length)[:, None].to(self.net.device)

    def _soft_inputs(self, group: list[Request]) -> torch.Tensor | None:
        if all(r.soft is None for r in group):
            return None
        # a zero input is exactly "no self-conditioning" (the MLP maps 0 to 0)
        zeros = torch.zeros(self.config.canvas_length, self.config.hidden_size, dtype=self.net.dtype, device=self.net.device)
        return torch.stack([zeros if r.soft is None else r.soft for r in group])

    def decoder_step(
        self, canvas: torch.Tensor, soft: torch.Tensor | None, temps: torch.Tensor, plan: CachePass
    ) -> tuple[torch.Tensor, ...]:
        """Decoder pass + everything the sampler needs from the logits, with no host synchronisation.

        Returns argmax [n, C], entropy [n, C], weights [n*C, V] (unnormalised probabilities) and the
        next step's self-conditioning input [n, C, H]. The [n*C, V] logits do not outlive this call.
        """
        n, c = canvas.shape
        hidden = self.net.decode(canvas, self.cache, plan, soft)
        if self.native is not None:
            stats, soft_input = self._native_statistics(hidden.view(n * c, -1), temps)
        else:
            # CPU: the [n * C, vocab] float32 logits and weights live in buffers reused every step (a
            # fresh 32 MB tensor is a fresh mmap: ~8 ms of page faults here); elsewhere the allocator caches.
            converted_head = self.reuse_buffers and self.net.dtype != torch.float32
            head_out = self._buffer("logits", n * c, torch.float32) if converted_head else None
            weights_out = self._buffer("weights", n * c, torch.float32) if self.reuse_buffers else None
            logits = self.net.logits(hidden, out=head_out).view(n * c, -1)
            stats = sampler.step_statistics(logits, temps, overwrite_logits=True, out=weights_out)
            del logits
            soft_input = stats.weights
        soft_next = self.net.soft_embed(soft_input.view(n, c, -1), stats.total.view(n, c))
        return stats.argmax.view(n, c), stats.entropy.view(n, c), stats.weights, soft_next

    def _native_statistics(self, hidden: torch.Tensor, temps: torch.Tensor) -> tuple[sampler.StepStatistics, torch.Tensor]:
        """`step_statistics` of the softcapped logits straight from the LM head's output, plus the
        self-conditioning matmul's input (the weights, in bf16 for a bf16 model)."""
        rows = hidden.shape[0]
        weights = self._buffer("weights", rows, torch.float32)
        low = self.net.dtype == torch.bfloat16
        probs = self._buffer("probs", rows, torch.bfloat16) if low else weights.new_empty(0, dtype=torch.bfloat16)
        cap = self.config.final_logit_softcapping or 0.0
        raw = self.net.lm_head(hidden)
        if raw.dtype not in (torch.float32, torch.bfloat16):  # the kernel reads fp32 or bf16
            raw = raw.float()
        argmax, entropy, total = self.native.step_statistics(raw, cap, temps.reshape(-1), weights, probs)
        return sampler.StepStatistics(argmax=argmax, entropy=entropy, weights=weights, total=total), (probs if low else weights)

    def _buffer(self, name: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, vocab] tensor kept across steps (CPU: a fresh 32 MB one is a fresh mmap)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows:
            buf = self._buffers[name] = torch.empty(rows, self.config.vocab_size, dtype=dtype, device=self.net.device)
        return buf[:rows]

    def _denoise(self, group: list[Request]) -> tuple[torch.Tensor, ...]:
        canvas = torch.stack([r.canvas for r in group])
        temps = self._temperatures(group)
        rows = self._rows(group)
        if self.graphs is not None:
            out = self.graphs.run(self, group, rows, canvas, self._soft_inputs(group), temps)
            if out is not None:
                return out
        plan = self.cache.plan_decoder(self.config.canvas_length, rows=rows)
        return self.decoder_step(canvas, self._soft_inputs(group), temps, plan)

    def _advance(self, group: list[Request], argmax, entropy, weights, soft_next) -> list[bool]:
        """Sampler decisions for a group after its pass; returns which canvases converged.

        Randomness comes from each request's own generator, a fixed amount per step. On CPU only
        the accepted positions are sampled; on GPU every position is (no host sync), and the
        unaccepted samples are discarded.
        """
        c, vocab, device = self.config.canvas_length, self.config.vocab_size, self.net.device
        bounds = torch.tensor([[r.config.entropy_bound] for r in group], device=device)
        accepted = sampler.entropy_bound_accept(entropy, bounds)
        uniforms = torch.stack([torch.rand(c, generator=r.generator) for r in group]).to(device, non_blocking=True)
        noise = torch.stack([torch.randint(0, vocab, (c,), generator=r.generator) for r in group])
        canvas = noise.to(device, non_blocking=True)
        if not self.sample_all_positions:
            picked = accepted.view(-1).nonzero().squeeze(-1)
            canvas.view(-1)[picked] = sampler.sample_from_weights(weights[picked], uniforms.view(-1)[picked])
        else:
            sampled = sampler.sample_from_weights(weights, uniforms.view(-1)).view(len(group), c)
            canvas = torch.where(accepted, sampled, canvas)
        stops = []
        for i, r in enumerate(group):
            stop, r.history = sampler.stable_and_confident(
                r.history, argmax[i : i + 1], entropy[i : i + 1], r.config.stability_threshold, r.config.confidence_threshold
            )
            stops.append(stop)
        argmax, soft_next = argmax.clone(), soft_next.clone()  # graph outputs are overwritten by the next replay
        converged = []
        for i, (r, stop) in enumerate(zip(group, torch.cat(stops).tolist())):
            r.canvas, r.argmax, r.soft = canvas[i], argmax[i], soft_next[i]
            r.step += 1
            r.block_passes += 1
            converged.append(stop or r.step >= r.config.max_denoising_steps)
        return converged

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self) -> list:
        """Advance every request by one decoder pass; returns the events it produced."""
        events: list = []
        self._drop_cancelled(events)

        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop(0)
            self.cache.reset_row(req.slot)
            admitted.append(req)
        for group in self._groups(admitted):
            self._encode(group, [r.prompt for r in group])
        for req in admitted:
            self._start_canvas(req)
            self.running.append(req)
        if not self.running:
            return events

        converged = []
        for group in self._groups(self.running):
            for req, done in zip(group, self._advance(group, *self._denoise(group))):
                if done:
                    converged.append(req)
                if req.drafts:
                    events.append(Draft(req.request_id, req.block, req.step, req.argmax.tolist()))

        to_encode = []
        for req in converged:
            block = req.argmax.tolist()
            tokens, hit_eos, counted = cut_block(block, req.config.eos_token_ids, req.config.max_new_tokens - len(req.tokens))
            req.tokens += tokens
            req.counted += sum(1 for t in block[:counted] if t != req.config.pad_token_id)
            req.passes += req.block_passes
            full = len(req.tokens) >= req.config.max_new_tokens
            req.done = hit_eos or full
            events.append(Block(req.request_id, req.block, tokens, req.done, req.block_passes))
            if req.done:
                self._finish(req, "eos" if hit_eos else "length", events)
            else:
                to_encode.append(req)
        for group in self._groups(to_encode):
            self._encode(group, [r.argmax.tolist() for r in group])
        for req in to_encode:
            req.block += 1
            self._start_canvas(req)
        return events

    def _finish(self, req: Request, reason: str, events: list) -> None:
        self.running.remove(req)
        self.free_slots.append(req.slot)
        self.free_slots.sort()
        events.append(Finished(req.request_id, reason, req.tokens, req.passes, req.tokens_per_forward()))

    def _drop_cancelled(self, events: list) -> None:
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            events.append(Finished(req.request_id, "cancelled", req.tokens, req.passes, req.tokens_per_forward()))
        for req in [r for r in self.running if r.cancelled]:
            req.passes += req.block_passes
            self._finish(req, "cancelled", events)


class DecoderGraphs:
    """CUDA-graph captures of `Engine.decoder_step`, one per group of rows.

    A decoder step's shapes and cache views are fixed while a group's rows keep their prefix
    lengths, i.e. for the whole of a block: the step is captured once and replayed every step of
    the block, and captured again when a row commits. If a capture fails, the engine falls back
    to eager steps for good (with a warning).
    """

    def __init__(self, max_graphs: int = 8):
        self.max_graphs = max_graphs
        self.captured: dict[tuple, tuple] = {}  # slots -> (lengths, graph, inputs, outputs)
        self.failed = False

    def run(self, engine: Engine, group, rows, canvas, soft, temps):
        if self.failed:
            return None
        slots = tuple(r.slot for r in group)
        lengths = tuple(engine.cache.lengths[s] for s in slots)
        entry = self.captured.get(slots)
        if entry is None or entry[0] != lengths:
            self.captured.pop(slots, None)
            while len(self.captured) >= self.max_graphs:
                self.captured.pop(next(iter(self.captured)))
            try:
                entry = (lengths, *self._capture(engine, rows, canvas, soft, temps))
            except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly
                import logging

                logging.getLogger("dgemma").warning("CUDA graph capture failed, running eagerly: %s", e)
                self.failed, self.captured = True, {}
                return None
            self.captured[slots] = entry
        _, graph, inputs, outputs = entry
        inputs["canvas"].copy_(canvas)
        inputs["temps"].copy_(temps)
        if soft is None:
            inputs["soft"].zero_()
        else:
            inputs["soft"].copy_(soft)
        graph.replay()
        return outputs

    @staticmethod
    def _capture(engine: Engine, rows, canvas, soft, temps):
        torch.cuda.empty_cache()
        n, c = canvas.shape
        inputs = {
            "canvas": canvas.clone(),
            "temps": temps.clone(),
            "soft": soft.clone() if soft is not None else torch.zeros(
                n, c, engine.config.hidden_size, dtype=engine.net.dtype, device=canvas.device
            ),
        }
        plan = engine.cache.plan_decoder(c, rows=rows)

        def step():
            return engine.decoder_step(inputs["canvas"], inputs["soft"], inputs["temps"], plan)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up outside the capture (allocator, kernel selection)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        return graph, inputs, outputs

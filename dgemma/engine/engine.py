"""The engine: a scheduler, a runner and the KV pool between them.

    plan = scheduler.schedule()    # admission, blocks, prefix matches, what runs this step
    out = runner.run(plan)         # encoder passes, then one decoder pass per denoising canvas
    events = scheduler.update(plan, out)

Requests join and leave at step boundaries, so the same engine serves `Model.generate` (all
prompts added up front), streams, and the HTTP server (continuous batching).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from ..kernels.lora import LoraSlots
from ..model.diffusion_gemma import DiffusionGemma
from .kv.block_manager import BlockManager
from .kv.budget import plan_blocks
from .kv.paged_cache import SequenceBlocks
from .options import EngineOptions
from .prefill import prefill
from .request import Request
from .runner import Runner
from .scheduler import Scheduler
from .sharded import runtime

__all__ = ["Engine", "EngineOptions", "Request", "make_current"]


def make_current(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing for other devices).

    Triton kernels launch on the current CUDA device, and CUDA graphs capture and replay on the
    current device's stream, whatever device their tensors are on: with the model on cuda:1 and
    the thread's current device left at cuda:0 (the default) they would run on the wrong GPU and
    fault. The engine calls this when it is built and before each step: the current device is
    per thread (the server steps the engine on its own thread) and another engine, on another
    GPU, may have changed it since (a cudaGetDevice, no synchronisation)."""
    if device.type == "cuda" and device.index is not None and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


def prompt_chunks(length: int, chunk: int, block_size: int, invariant: bool) -> list[tuple[int, int]]:
    """The (start, end) passes the scheduler encodes a `length`-token prompt in when it runs
    alone (`Scheduler._encode_work`): `chunk` tokens a step, cut at a whole block when batch
    invariant (resolved options make `chunk` a multiple of the block then)."""
    if chunk < 1 or (invariant and chunk % block_size):
        raise ValueError(f"a prefill chunk of {chunk} tokens is not whole blocks of {block_size}")
    spans, start = [], 0
    while start < length:
        end = min(length, start + chunk)
        if invariant and end < length:
            end = end // block_size * block_size
        spans.append((start, end))
        start = end
    return spans


class Engine:
    def __init__(self, net: DiffusionGemma, options: EngineOptions | None = None, adapters: LoraSlots | None = None):
        """`adapters`: the LoRA slots (an adapter bank's, dgemma/adapters/) whose adapters requests
        may name (`Request.adapter`); the runner's network adds their deltas per row."""
        self.device = net.device
        make_current(self.device)  # before anything below touches the device (memory, kernels, graphs)
        options = options or EngineOptions()
        if runtime.sharded(net) and options.triton is None:  # the Triton step reads whole vocabulary rows
            options = dataclasses.replace(options, triton=False)
        self.options = options.resolve(net.config, net.device, net.dtype)
        o = self.options
        num_blocks = plan_blocks(
            net.kv_config, net.dtype, o.block_size, o.kv_cache_memory, o.max_span(net.config), o.max_active
        )
        num_blocks = runtime.agreed_blocks(net, num_blocks)  # tensor parallel: every rank's scheduler the same
        blocks = BlockManager(
            num_blocks,
            self.options.block_size,
            net.config.sliding_window,
            self.options.max_span(net.config),
            prefix_cache=self.options.prefix_cache,
        )
        self.scheduler = Scheduler(net.config, self.options, blocks, net.device)
        if adapters is not None and runtime.sharded(net):
            raise ValueError(
                "LoRA adapters do not run on a model cut across ranks yet (tensor parallelism): serve them on one device"
            )
        self.runner = Runner(net, self.options, num_blocks, self.scheduler.stats, adapters)
        self._prefixes: dict[int, int] = {}  # encode_prefix sequences -> their block owner id
        self._prefix_owners = itertools.count(-1, -1)  # ids no request has

    @torch.no_grad()
    def step(self) -> list:
        """Advance every admitted request by one decoder pass; returns the events it produced."""
        make_current(self.device)
        plan = self.scheduler.schedule()
        out = self.runner.run(plan)
        return self.scheduler.update(plan, out)

    def add(self, request: Request) -> int:
        """Queue a request; returns its id. ValueError if it can never fit, or brings images to a
        checkpoint without a vision tower (the server bounds its queue itself)."""
        if request.images and self.runner.net.vision is None:
            raise ValueError("this checkpoint has no vision tower: it cannot take images")
        if request.adapter is not None:
            slots = self.runner.adapters
            if slots is None:
                raise ValueError(f"adapter {request.adapter.name!r}: this engine serves no LoRA adapters")
            if not 0 <= request.adapter.slot < slots.max_loras or slots.ranks[request.adapter.slot] == 0:
                raise ValueError(f"adapter {request.adapter.name!r} is not loaded")
        return self.scheduler.add(request)

    def uses_adapter(self, slot: int) -> bool:
        """Whether a queued or running request runs the adapter in `slot` (an unload waits for them)."""
        return self.scheduler.uses_adapter(slot)

    def forget_adapter(self, key: bytes) -> int:
        """Drop the prefix-cache blocks of the adapter whose content hash is `key` (it is being
        unloaded: nothing may match them again); returns how many block keys went."""
        return self.scheduler.blocks.forget(key)

    def cancel(self, request_id: int) -> None:
        self.scheduler.cancel(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def stats(self):
        return self.scheduler.stats

    def encode_prefix(self, tokens: list[int]) -> SequenceBlocks:
        """A sequence holding `tokens`' keys/values outside any request, encoded as a prompt is
        (tests and step timings: `runner.cache.plan_decoder(c, [kv])` then decodes after it).
        Its blocks stay taken until `release_prefix(kv)`.

        Encoded in the scheduler's chunks (`prefill_chunk` tokens, whole blocks when batch
        invariant), each followed by the release of the sliding blocks its window no longer sees:
        the sliding reservation holds a window and one chunk, so a prompt of any length up to the
        model's positions fits. ValueError for an empty or too long prompt, RuntimeError when
        the pools cannot hold it now."""
        make_current(self.device)
        cfg, o = self.runner.config, self.options
        if not tokens or len(tokens) > cfg.max_position_embeddings:
            raise ValueError(f"a prefix takes 1 to {cfg.max_position_embeddings} tokens (got {len(tokens)})")
        blocks = self.scheduler.blocks
        kv, owner = SequenceBlocks(), next(self._prefix_owners)
        if blocks.admit(owner, kv, [], len(tokens)) is None:
            raise RuntimeError(f"no room for a {len(tokens)}-token prefix in the KV cache")
        for start, end in prompt_chunks(len(tokens), o.prefill_chunk, o.block_size, bool(o.batch_invariant)):
            blocks.allocate(owner, kv, end)
            prefill(self.runner.net, self.runner.cache, [kv], [tokens[start:end]], self.runner.pass_tokens)
            blocks.release_behind_window(owner, kv, kv.length - (cfg.sliding_window - 1))
        self._prefixes[id(kv)] = owner
        return kv

    def release_prefix(self, kv: SequenceBlocks) -> None:
        self.scheduler.blocks.free(self._prefixes.pop(id(kv)), kv)

    def kv_usage(self) -> dict[str, dict[str, int]]:
        """Blocks per pool: used (held by requests), cached (evictable prefix blocks), free, total."""
        return self.scheduler.blocks.usage()

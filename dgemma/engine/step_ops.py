"""The per-step operations every decode path shares (engine/paths.py): a group's temperatures,
self-conditioning inputs, allowed-token masks and fixed tokens, the decoder pass and its
statistics, the random draws, sampling, log probabilities and a grammar's rows.

`StepOps` holds what they read: the network, the paged KV pool and the kernels kernels/choice.py
chose (the Triton step kernels on a GPU, which also draw from each request's Philox stream on the
device; dgemma's native statistics on an AVX-512 CPU; a vocabulary-sharded sampler under tensor
parallelism; else torch). Nothing here makes the host wait for the device, except where a method
says so.
"""

from __future__ import annotations

import contextlib

import torch

from ..kernels import lora, native, triton_step
from ..kernels.choice import KernelPlan
from ..model.diffusion_gemma import DiffusionGemma
from . import sampler
from .constraints.grammar import PassRows
from .kv.paged_cache import PagedKVCache, PagedPass
from .request import Request
from .sharded import runtime


def padding_canvas(canvas_length: int, vocab_size: int) -> torch.Tensor:
    """A padding row's canvas [C]: ids spread evenly over the vocabulary. Its output is dropped, but
    its positions still route through the MoE: a canvas of one token sends them all to the same
    top-k experts, whose GEMMs then run several row tiles while the others wait (issue 54, at batch
    sizes between the graphs' buckets); distinct tokens spread them like real text's."""
    return torch.arange(canvas_length, dtype=torch.long) * max(1, vocab_size // canvas_length) % vocab_size


class StepOps:
    """The operations of a step on `net` and `cache`, with the kernels `kernels` names."""

    def __init__(self, net: DiffusionGemma, kernels: KernelPlan, cache: PagedKVCache):
        self.net, self.config, self.kv_config, self.cache = net, net.config, net.kv_config, cache
        self.kernels = kernels
        self.triton = kernels.triton  # GPU: the Triton step kernels (statistics, Philox sampling, attention)
        self.native = native.extension() if kernels.statistics == "native" else None
        # tensor parallelism (dgemma/parallel): this rank's vocabulary shard's sampler
        self.sharded = runtime.ShardedSampler.of(net) if kernels.statistics == "sharded" else None
        # GPU: sample every position (no host sync); CPU: only the accepted ones. Same tokens either way.
        self.sample_all_positions = kernels.sample_all_positions
        self._buffers: dict[str, torch.Tensor] = {}
        self._blank: dict[str, torch.Tensor] | None = None
        # the self-conditioning GEMM's addend (beta = 0: never read), for the Triton statistics
        self.zero = torch.zeros(1, dtype=net.dtype, device=net.device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A step input built on the host, queued for the device without waiting: a blocking copy
        would make the host wait for every pass already queued."""
        return t.to(self.net.device, non_blocking=True)

    def blank_state(self) -> dict[str, torch.Tensor]:
        """A padding row's device state (made once): `padding_canvas`, no self-conditioning
        [C, H] (zeros: exactly none), a stop history [MAX_STABILITY, C] of -1 (none yet), and a
        fresh turbo canvas's state."""
        if self._blank is None:
            c, device = self.config.canvas_length, self.net.device
            self._blank = {
                "canvas": padding_canvas(c, self.config.vocab_size).to(device),
                "soft": torch.zeros(c, self.config.hidden_size, dtype=self.net.dtype, device=device),
                "history": torch.full((triton_step.MAX_STABILITY, c), -1, dtype=torch.long, device=device),
                # a turbo canvas's state (engine/turbo.py): nothing frozen, no streak, no token, entropy 0
                "frozen": torch.zeros(c, dtype=torch.bool, device=device),
                "streak": torch.zeros(c, dtype=torch.long, device=device),
                "tokens": torch.full((c,), -1, dtype=torch.long, device=device),
                "entropy": torch.zeros(c, dtype=torch.float32, device=device),
            }
            self._blank["rested"] = self._blank["frozen"]
        return self._blank

    def adapters(self, group: list[Request]) -> contextlib.AbstractContextManager:
        """The block's passes run each request's row with its LoRA adapter (kernels/lora.py: the
        rows grouped per adapter; a network without adapters runs as it is)."""
        return lora.selected(self.net, [r.adapter_slot for r in group])

    # ---------------------------------------------------------------- a group's step inputs
    def temperatures(self, group: list[Request]) -> torch.Tensor:
        """Each request's temperature at its own step, one per canvas position [n * C, 1]."""
        temps = torch.stack(
            [
                sampler.temperature(
                    r.config.max_denoising_steps - r.step, r.config.max_denoising_steps, r.config.t_min, r.config.t_max
                )
                for r in group
            ]
        )
        return self.to_device(temps.repeat_interleave(self.config.canvas_length)[:, None])

    def soft_inputs(self, group: list[Request]) -> torch.Tensor | None:
        """The group's self-conditioning inputs [n, C, H], or None when no request has one."""
        if all(r.soft is None for r in group):
            return None
        # a zero input is exactly "no self-conditioning" (the MLP maps 0 to 0)
        zeros = torch.zeros(
            self.config.canvas_length, self.config.hidden_size, dtype=self.net.dtype, device=self.net.device
        )
        return torch.stack([zeros if r.soft is None else r.soft for r in group])

    def allowed_masks(self, group: list[Request]) -> torch.Tensor | None:
        """Packed allowed-token masks [n * C, words] when any request has one (others allow all)."""
        masks = [r.active_constraints.allowed if r.active_constraints is not None else None for r in group]
        if all(m is None for m in masks):
            return None
        c, words = self.config.canvas_length, -(-self.config.vocab_size // 32)
        everything = torch.full((c, words), -1, dtype=torch.int32)
        return self.to_device(torch.cat([everything if m is None else m for m in masks]))

    def fixed_tokens(self, group: list[Request]) -> torch.Tensor | None:
        """[n, C] fixed token per position (-1: free), or None when no request fixes any."""
        fixed = [r.active_constraints.fixed if r.active_constraints is not None else None for r in group]
        if all(f is None for f in fixed):
            return None
        none = torch.full((self.config.canvas_length,), -1, dtype=torch.long)
        return self.to_device(torch.stack([none if f is None else f for f in fixed]))

    # ---------------------------------------------------------------- the pass and its statistics
    def decoder_step(
        self,
        canvas: torch.Tensor,
        soft: torch.Tensor | None,
        temps: torch.Tensor,
        plan: PagedPass,
        allowed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Decoder pass + everything the sampler needs from the logits, with no host synchronisation.

        Returns argmax [n, C], entropy [n, C], weights [n*C, V] (unnormalised probabilities), their
        totals [n*C] and the next step's self-conditioning input [n, C, H]. The [n*C, V] logits do
        not outlive this call.
        """
        return self.statistics(self.net.decode(canvas, plan, soft), temps, allowed)

    def statistics(
        self, hidden: torch.Tensor, temps: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """What the sampler needs from a decoder pass's final hidden states [n, c, H] (c: the
        canvas, or a turbo pass's active rows): argmax [n, c], entropy [n, c], weights [n*c, V]
        (unnormalised; with Triton, softmax's probabilities), totals [n*c] and the next
        self-conditioning input [n, c, H]."""
        n, c = hidden.shape[:2]
        if self.triton:  # one kernel for the statistics, one writing softmax's probabilities in the model's
            # dtype, one GEMM for the next self-conditioning input (its scale in the epilogue): 4 launches
            raw = self.net.lm_head(hidden.view(n * c, -1))
            low = self.net.dtype in (torch.bfloat16, torch.float16)
            argmax, entropy, total, probs = triton_step.step_statistics(
                raw,
                temps,
                self.config.final_logit_softcapping or 0.0,
                allowed,
                self.net.dtype if low else torch.float32,
                normalize=True,
            )
            scale = float(torch.tensor(self.config.embed_scale, dtype=torch.float32).to(self.net.dtype))
            soft_next = torch.addmm(self.zero, probs, self.net.embed_tokens.weight, beta=0, alpha=scale).view(n, c, -1)
            return argmax.view(n, c), entropy.view(n, c), probs, total, soft_next
        if self.native is not None:
            stats, soft_input = self._native_statistics(hidden.view(n * c, -1), temps, allowed)
        elif self.sharded is not None:  # this rank's vocabulary columns; the reductions span the ranks
            stats = self.sharded.statistics(self.net.logits(hidden).view(n * c, -1), temps, allowed)
            soft_input = stats.weights
        else:
            # CPU: the [n * C, vocab] float32 logits and weights live in buffers reused every step (a
            # fresh 32 MB tensor is a fresh mmap: ~8 ms of page faults here); elsewhere the allocator caches.
            converted_head = self.kernels.reuse_buffers and self.net.dtype != torch.float32
            head_out = self._buffer("logits", n * c, torch.float32) if converted_head else None
            weights_out = self._buffer("weights", n * c, torch.float32) if self.kernels.reuse_buffers else None
            logits = self.net.logits(hidden, out=head_out).view(n * c, -1)
            stats = sampler.step_statistics(logits, temps, overwrite_logits=True, out=weights_out, allowed=allowed)
            del logits
            soft_input = stats.weights
        soft_next = self.net.soft_embed(soft_input.view(n, c, -1), stats.total.view(n, c))
        return stats.argmax.view(n, c), stats.entropy.view(n, c), stats.weights, stats.total, soft_next

    def _native_statistics(
        self, hidden: torch.Tensor, temps: torch.Tensor, allowed: torch.Tensor | None
    ) -> tuple[sampler.StepStatistics, torch.Tensor]:
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
        mask = allowed if allowed is not None else torch.empty(0, dtype=torch.int32)
        argmax, entropy, total = self.native.step_statistics(raw, cap, temps.reshape(-1), weights, probs, mask)
        return sampler.StepStatistics(argmax=argmax, entropy=entropy, weights=weights, total=total), (
            probs if low else weights
        )

    def _buffer(self, name: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, vocab] tensor kept across steps (CPU: a fresh 32 MB one is a fresh mmap)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows:
            buf = self._buffers[name] = torch.empty(rows, self.config.vocab_size, dtype=dtype, device=self.net.device)
        return buf[:rows]

    # ---------------------------------------------------------------- randomness and sampling
    def draws(self, group: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """A pass's random numbers for each request, on the device: C uniforms and C noise tokens
        [n, C] each, a fixed amount a pass from the request's own stream (with the Triton kernels
        its Philox stream at its pass count, drawn on the device; else its torch generator)."""
        c, vocab = self.config.canvas_length, self.config.vocab_size
        if self.triton:
            seeds = self.to_device(torch.tensor([triton_step.seed_bits(r.seed) for r in group], dtype=torch.long))
            passes = self.to_device(torch.tensor([r.passes + r.block_passes for r in group], dtype=torch.long))
            return triton_step.philox_draws(seeds, passes, c, vocab)
        uniforms = torch.stack([torch.rand(c, generator=r.generator) for r in group])
        noise = torch.stack([torch.randint(0, vocab, (c,), generator=r.generator) for r in group])
        return self.to_device(uniforms), self.to_device(noise)

    def sample_rows(self, weights: torch.Tensor, total: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """One token per row of unnormalised `weights` [R, V] (this rank's columns when sharded),
        by inverse CDF at `uniforms` [R]: the Triton kernel, the shards' search, or torch."""
        if self.triton:
            return triton_step.sample_rows(weights, total, uniforms)
        if self.sharded is not None:
            return self.sharded.sample(weights, uniforms)
        return sampler.sample_from_weights(weights, uniforms)

    # ---------------------------------------------------------------- what the host reads
    def row_logprobs(self, weights: torch.Tensor, tokens: torch.Tensor, top_logprobs: int) -> list:
        """`sampler.row_logprobs` (over the ranks' shards when sharded)."""
        if self.sharded is not None:
            return self.sharded.row_logprobs(weights, tokens, top_logprobs)
        return sampler.row_logprobs(weights, tokens, top_logprobs)

    def logprobs(self, group: list[Request], argmax: torch.Tensor, weights: torch.Tensor, stops: list[bool]) -> list:
        """Per request, the log probabilities of its argmax canvas (the final one: after a
        grammar's refinement) under this pass, with its `top_logprobs` most likely tokens per
        position, when it asks and the pass ends its block (the canvas it commits); else None.
        `weights` are the pass's unnormalised probabilities at its temperature, 0 where the
        constraints' masks ban a token: log p = log(w[token] / sum w). Only the rows of those
        requests are read."""
        c, out = self.config.canvas_length, [None] * len(group)
        for i, r in enumerate(group):
            if r.top_logprobs is None or not r.block_ends(stops[i]):
                continue
            out[i] = self.row_logprobs(weights[i * c : (i + 1) * c], argmax[i], r.top_logprobs)
        return out

    def full_rows(self, weights: torch.Tensor) -> torch.Tensor | PassRows:
        """One canvas's weight rows [R, V] as a grammar's walk reads them: the rows themselves, or
        on a model cut by vocabulary `PassRows` over this rank's [R, Vs] (each shard's top-k
        gathered once per pass, one gather per position those do not settle; every rank walks
        the same canvas, so the collectives pair up), never a gathered [R, V]."""
        return weights if self.sharded is None else self.sharded.pass_rows(weights)

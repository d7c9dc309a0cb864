"""The runner: the passes a step plan asks for, on the KV pool, with the kernels this machine runs.

Which kernels run is decided once, by kernels/choice.py (`plan_kernels`): the runner follows its
`KernelPlan` for the step statistics (dgemma's native kernel on an AVX-512 CPU, the Triton
kernels on a GPU, which also sample from each request's Philox stream on the device, or torch;
all honour allowed-token masks), canvas attention (gathered keys and SDPA, or a Triton kernel
reading the paged pool in place: `PagedKVCache.plan_canvas`) and CUDA graphs for the decoder
step on a GPU (`graphs.DecoderGraphs`: one per batch-size bucket, replayed for any prefix
length; eager where a capture fails).

A step runs the plan's encoder work (prefill chunks, committed blocks) through `prefill`, then one
decoder pass per denoising canvas, each followed by the sampler: entropy-bound acceptance,
sampling of the accepted positions, renoising of the others, the stopping rule. Every random
number comes from the request's own stream (its torch generator; on GPU with Triton, its Philox
stream), a fixed amount per step.

With `batch_invariant` (CPU default) each request's passes run as a batch of one and encoder
passes are whole aligned blocks, so its tokens are bit-identical whatever else runs and whatever
the prefix cache held. Otherwise a step's canvases run as one batched decoder pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..kernels import native, triton_step
from ..kernels.choice import plan_kernels
from ..model.diffusion_gemma import DiffusionGemma
from . import prefill as prefill_pass
from . import sampler
from .constraints.grammar import PassRows
from .device import step as device_step
from .device import turbo as device_turbo
from .device.graphs import DecoderGraphs
from .device.step import decides_on_device
from .device.turbo import TurboCanvasPool
from .kv.paged_cache import PagedKVCache, PagedPass
from .options import EngineOptions
from .prefill import PlacedImage
from .request import Request
from .sharded import runtime
from .step_plan import DecodeResult, EncodeWork, EngineStats, StepPlan
from .turbo_step import turbo_step
from .vision_cache import VisionCache


@dataclass
class StepDecisions:
    """A group's sampler decisions after its pass, on the device: the next input canvases [n, C],
    argmax canvases [n, C], self-conditioning inputs [n, C, H], stop histories, stop flags [n],
    kept positions and shown entropies [n, C] (for drafts), and the pass's weights [n * C, V]."""

    canvas: torch.Tensor
    argmax: torch.Tensor
    soft_next: torch.Tensor
    histories: list[torch.Tensor | None]
    stops: torch.Tensor
    kept: torch.Tensor
    shown: torch.Tensor
    weights: torch.Tensor


class Runner:
    def __init__(
        self, net: DiffusionGemma, options: EngineOptions, num_blocks: dict[str, int], stats: EngineStats | None = None
    ):
        self.kernels = plan_kernels(net, bool(options.triton), bool(options.cuda_graphs))
        if (
            self.kernels.network == "triton"
        ):  # attention's norms + RoPE and the MoE block on the Triton kernels (kernels/gpu.py)
            from ..kernels.gpu import triton_modules

            net = triton_modules(net)
        self.net, self.config, self.options = net, net.config, options
        self.stats = stats if stats is not None else EngineStats()
        self.vision_cache = VisionCache()
        # tensor parallelism (dgemma/parallel): this rank's KV heads, its vocabulary shard's sampler
        self.kv_config = net.kv_config
        self.sharded = runtime.ShardedSampler.of(net) if self.kernels.statistics == "sharded" else None
        self.cache = PagedKVCache(self.kv_config, num_blocks, options.block_size, net.device, net.dtype)
        self.pass_tokens = options.block_size if options.batch_invariant else None
        self.triton = self.kernels.triton  # GPU: the Triton step kernels (statistics, Philox sampling, attention)
        self.native = native.extension() if self.kernels.statistics == "native" else None
        self.graphs = DecoderGraphs() if self.kernels.cuda_graphs else None
        self.turbo_pool: TurboCanvasPool | None = None  # turbo's canvas K/V on the device path (made on first use)
        # GPU: sample every position (no host sync); CPU: only the accepted ones. Same tokens either way.
        self.sample_all_positions = self.kernels.sample_all_positions
        self._buffers: dict[str, torch.Tensor] = {}
        self._blank: dict[str, torch.Tensor] | None = None
        # the self-conditioning GEMM's addend (beta = 0: never read), for engine/device/step.py
        self.zero = torch.zeros(1, dtype=net.dtype, device=net.device)

    def blank_state(self) -> dict[str, torch.Tensor]:
        """A padding row's device state (made once): canvas [C] of token 0, no self-conditioning
        [C, H] (zeros: exactly none), a stop history [MAX_STABILITY, C] of -1 (none yet), and a
        fresh turbo canvas's state."""
        if self._blank is None:
            c, device = self.config.canvas_length, self.net.device
            self._blank = {
                "canvas": torch.zeros(c, dtype=torch.long, device=device),
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

    @torch.no_grad()
    def run(self, plan: StepPlan) -> list[DecodeResult]:
        self._encode(plan.encode)
        results = []
        self._turbo_slots(plan.decode)
        groups = list(self._groups(plan.decode))
        on_device = [g for g in groups if decides_on_device(self, g[0])]
        graph_keys = [self._graph_key(g) for g in on_device]
        turbo_graphs = sum(device_turbo.holds_slot(g[0]) for g in groups)
        for group in groups:
            if device_turbo.holds_slot(group[0]):  # a turbo pass on the device
                results += device_turbo.turbo_group(self, group, copy_out=turbo_graphs > 1)
                continue
            if group[0].turbo is not None:
                results += turbo_step(self, group)
                continue
            if decides_on_device(self, group[0]):  # the whole step on the device (a graph replay)
                results += device_step.device_group(self, group, copy_out=graph_keys.count(self._graph_key(group)) > 1)
                continue
            decisions = self._decide(group, *self._denoise(group))
            results += self._results(group, decisions)
        return results

    def _encode(self, works: list[EncodeWork]) -> None:
        """The step's encoder work (prompt chunks, committed blocks). Batched: works without
        images share one prefill (one pass per layer for all of them, instead of one per request);
        batch-invariant runs, and works with images, encode one by one."""
        batched = [] if self.options.batch_invariant else [w for w in works if not w.request.images]
        if batched:
            prefill_pass.prefill(
                self.net,
                self.cache,
                [w.request.kv for w in batched],
                [w.request.sequence[w.start : w.end] for w in batched],
            )
        alone = [w for w in works if w.request.images] if batched else works
        for work in alone:
            req = work.request
            images = [self._images_in(work)] if req.images else None
            prefill_pass.prefill(
                self.net, self.cache, [req.kv], [req.sequence[work.start : work.end]], self.pass_tokens, images
            )

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A step input built on the host, queued for the device without waiting: a blocking copy
        would make the host wait for every pass already queued."""
        return t.to(self.net.device, non_blocking=True)

    # ---------------------------------------------------------------- images
    def _images_in(self, work: EncodeWork) -> list[PlacedImage]:
        """Soft tokens of the images (or their parts) inside the work's range, placed relative to
        its start; the vision tower runs for an image the first time any request needs it."""
        req, placed = work.request, []
        for k, (a, b) in enumerate(req.image_spans):
            if a >= work.end or b <= work.start:
                continue
            if req.image_features[k] is None:
                req.image_features[k] = self.image_features(req.images[k])
            lo = max(a, work.start)
            placed.append((lo - work.start, req.image_features[k][lo - a : min(b, work.end) - a]))
        return placed

    def image_features(self, image) -> torch.Tensor:
        """One image's soft tokens [num_soft_tokens, hidden], from the vision cache or the tower."""
        features, hit = self.vision_cache.get(image, self._encode_image)
        if hit:
            self.stats.vision_cache_hits += 1
        else:
            self.stats.vision_encodes += 1
        return features

    def _encode_image(self, image) -> torch.Tensor:
        n, device = image.num_patches, self.net.device
        if self.sharded is not None and self.net.shards.rank > 0:  # rank 0 runs the tower; its soft tokens come here
            return self._soft_tokens_from_rank_0(image)
        pixels = torch.from_numpy(image.pixel_values[None, :n]).to(device)
        positions = torch.from_numpy(image.position_ids[None, :n]).to(device)
        features = self.net.vision.image_features(pixels, positions)
        if self.sharded is not None:  # in the activations' dtype, as prefill writes them (and the other ranks receive)
            features = self.net.shards.broadcast(features.to(self.net.dtype).contiguous())
        return features

    def _soft_tokens_from_rank_0(self, image) -> torch.Tensor:
        """An image's soft tokens [num_soft_tokens, hidden] as rank 0's tower made them (every rank
        encodes the same images at the same step: their engines replay one scheduler's decisions)."""
        features = torch.empty(
            image.num_soft_tokens, self.config.hidden_size, dtype=self.net.dtype, device=self.net.device
        )
        return self.net.shards.broadcast(features)

    def _graph_key(self, group: list[Request]) -> tuple | None:
        """Which captured graph a device group replays (None: it runs eagerly)."""
        if self.graphs is None:
            return None
        masked = any(r.active_constraints is not None and r.active_constraints.allowed is not None for r in group)
        return self.graphs.bucket(len(group)), masked

    def _turbo_slots(self, requests: list[Request]) -> None:
        """Canvas K/V slots for the turbo requests whose passes run on the device (the pool made
        on first use: as many slots as the default graph buckets' largest, 8, ~55 MB each at the
        released size; more turbo requests at once take the eager turbo step)."""
        turbo = [r for r in requests if device_turbo.decides_turbo_on_device(self, r)]
        if not turbo:
            return
        if self.turbo_pool is None:
            slots = DecoderGraphs.BUCKETS[-1]
            self.turbo_pool = TurboCanvasPool(self.kv_config, slots, self.net.dtype, self.net.device)
        self.turbo_pool.assign(turbo)

    def _groups(self, requests: list[Request]) -> Iterable[list[Request]]:
        """Batch-invariant: one request per pass. Otherwise one batched pass, or with CUDA graphs
        chunks of at most the largest captured bucket (each chunk replays a graph; a larger group
        would run eagerly); requests whose whole step runs on the device (engine/device/step.py)
        apart from those that decide on the host. Turbo requests run in a group of their own
        (batched: all of them, each one's active rows padded to the group's most; batch-invariant:
        one each), eagerly (engine/turbo_step.py), unless they hold a canvas K/V slot: then in
        chunks like the device step's (engine/device/turbo.py: a graph per bucket of rows)."""
        on_slots = [r for r in requests if device_turbo.holds_slot(r)]
        turbo = [r for r in requests if r.turbo is not None and not device_turbo.holds_slot(r)]  # passes of their own
        if self.options.batch_invariant:
            return [[r] for r in requests if r.turbo is None] + [[r] for r in on_slots + turbo]
        device = [r for r in requests if decides_on_device(self, r)]  # steps whole on the device
        requests = [r for r in requests if r.turbo is None and not decides_on_device(self, r)]
        size = self.graphs.largest if self.graphs is not None else max(1, len(requests), len(device), len(on_slots))
        chunks = [requests[i : i + size] for i in range(0, len(requests), size)]
        chunks += [device[i : i + size] for i in range(0, len(device), size)]
        chunks += [on_slots[i : i + size] for i in range(0, len(on_slots), size)]
        return chunks + ([turbo] if turbo else [])

    # ---------------------------------------------------------------- the decoder pass
    def _denoise(self, group: list[Request]) -> tuple[torch.Tensor, ...]:
        canvas = torch.stack([r.canvas for r in group])
        temps = self.temperatures(group)
        soft = self._soft_inputs(group)
        allowed = self.allowed_masks(group)
        rows = [r.kv for r in group]  # eager: the graphs capture the whole device step (device_step.py)
        c = self.config.canvas_length
        plan = self.cache.plan_canvas(c, rows) if self.triton else self.cache.plan_decoder(c, rows)
        return self.decoder_step(canvas, soft, temps, plan, allowed)

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

    def _soft_inputs(self, group: list[Request]) -> torch.Tensor | None:
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
        n, c = canvas.shape
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

    # ---------------------------------------------------------------- the sampler
    def _decide(self, group: list[Request], argmax, entropy, weights, total, soft_next) -> StepDecisions:
        """Sampler decisions for a group after its pass, on the device: nothing here makes the host
        wait for the pass (tests/test_host_sync.py proves it on the meta device), except a grammar
        request's refinement, whose walk runs on the host (`_refine`).

        Randomness comes from each request's own stream, a fixed amount per step: its torch
        generator, or with the Triton kernels its Philox stream on the device (keyed by its seed,
        at its pass count). On CPU only the accepted positions are sampled; on GPU every position
        is (no host sync), and the unaccepted samples are discarded. Fixed positions of the
        canvas constraints are excluded from acceptance (entropy 0 counts nothing against the
        bound) and from the stopping statistics, and keep their tokens. Outputs of a captured
        graph are copied out: the next replay overwrites them.
        """
        fixed = self.fixed_tokens(group)
        free = None if fixed is None else fixed < 0
        bounds = self.to_device(torch.tensor([[r.config.entropy_bound] for r in group], dtype=torch.float32))
        accepted = sampler.entropy_bound_accept(entropy if free is None else entropy * free, bounds)
        if free is not None:
            accepted &= free
        canvas = self._sample(group, accepted, weights, total)
        argmax, entropy, soft_next = argmax.clone(), entropy.clone(), soft_next.clone()
        if fixed is not None:
            canvas = torch.where(free, canvas, fixed)
            argmax = torch.where(free, argmax, fixed)
        argmax = self._refine(group, argmax, weights)  # reads the canvas on the host: grammar requests only
        stops, histories = [], []
        for i, r in enumerate(group):
            stop, history = sampler.stable_and_confident(
                r.history,
                argmax[i : i + 1],
                entropy[i : i + 1],
                r.config.stability_threshold,
                r.config.confidence_threshold,
                None if free is None else free[i : i + 1],
            )
            stops.append(stop)
            histories.append(history)
        # what a draft shows: fixed positions keep their tokens, with nothing left to decide (entropy 0)
        kept, shown = (accepted, entropy) if free is None else (accepted | ~free, entropy * free)
        return StepDecisions(canvas, argmax, soft_next, histories, torch.cat(stops), kept, shown, weights)

    def _results(self, group: list[Request], d: StepDecisions) -> list[DecodeResult]:
        """What the scheduler needs on the host: the step's one read from the device (the stop
        flags), then, only for requests that ask when their block ends, the log probabilities of
        the canvas they commit."""
        stops = d.stops.tolist()
        logprobs = self._logprobs(group, d.argmax, d.weights, stops)
        return [
            DecodeResult(
                r,
                d.canvas[i],
                d.argmax[i],
                d.soft_next[i],
                d.histories[i],
                stop,
                logprobs[i],
                d.kept[i],
                d.shown[i],
                positions=self.config.canvas_length,
            )
            for i, (r, stop) in enumerate(zip(group, stops))
        ]

    def _sample(
        self, group: list[Request], accepted: torch.Tensor, weights: torch.Tensor, total: torch.Tensor
    ) -> torch.Tensor:
        """The next input canvas [n, C]: each accepted position's token sampled from the pass's
        weights, every other position a uniform random token (re-noised)."""
        c, vocab, device = self.config.canvas_length, self.config.vocab_size, self.net.device
        if self.triton:  # the request's Philox stream, at its pass count: drawn on the device
            seeds = self.to_device(
                torch.tensor([triton_step.seed_bits(r.seed) for r in group], dtype=torch.long)
            )  # seeds to 2^64 - 1
            passes = self.to_device(torch.tensor([r.passes + r.block_passes for r in group], dtype=torch.long))
            uniforms, noise = triton_step.philox_draws(seeds, passes, c, vocab)
            sampled = triton_step.sample_rows(weights, total, uniforms.view(-1)).view(len(group), c)
            return torch.where(accepted, sampled, noise)
        uniforms = torch.stack([torch.rand(c, generator=r.generator) for r in group]).to(device, non_blocking=True)
        noise = torch.stack([torch.randint(0, vocab, (c,), generator=r.generator) for r in group])
        canvas = noise.to(device, non_blocking=True)
        if not self.sample_all_positions:
            picked = accepted.view(-1).nonzero().squeeze(-1)
            canvas.view(-1)[picked] = self.sample_rows(weights[picked], total[picked], uniforms.view(-1)[picked])
            return canvas
        sampled = self.sample_rows(weights, total, uniforms.view(-1)).view(len(group), c)
        return torch.where(accepted, sampled, canvas)

    def sample_rows(self, weights: torch.Tensor, total: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """One token per row of unnormalised `weights` [R, V] (this rank's columns when sharded),
        by inverse CDF at `uniforms` [R]: the Triton kernel, the shards' search, or torch."""
        if self.triton:
            return triton_step.sample_rows(weights, total, uniforms)
        if self.sharded is not None:
            return self.sharded.sample(weights, uniforms)
        return sampler.sample_from_weights(weights, uniforms)

    def row_logprobs(self, weights: torch.Tensor, tokens: torch.Tensor, top_logprobs: int) -> list:
        """`sampler.row_logprobs` (over the ranks' shards when sharded)."""
        if self.sharded is not None:
            return self.sharded.row_logprobs(weights, tokens, top_logprobs)
        return sampler.row_logprobs(weights, tokens, top_logprobs)

    def full_rows(self, weights: torch.Tensor) -> torch.Tensor | PassRows:
        """One canvas's weight rows [R, V] as a grammar's walk reads them: the rows themselves, or
        on a model cut by vocabulary `PassRows` over this rank's [R, Vs] (each shard's top-k
        gathered once per pass, one gather per position those do not settle; every rank walks
        the same canvas, so the collectives pair up), never a gathered [R, V]."""
        return weights if self.sharded is None else self.sharded.pass_rows(weights)

    def _logprobs(self, group: list[Request], argmax: torch.Tensor, weights: torch.Tensor, stops: list[bool]) -> list:
        """Per request, the log probabilities of its argmax canvas (the final one: after `_refine`)
        under this pass, with its `top_logprobs` most likely tokens per position, when it asks
        and the pass ends its block (the canvas it commits); else None. `weights` are the pass's
        unnormalised probabilities at its temperature, 0 where the constraints' masks ban a
        token: log p = log(w[token] / sum w). Only the rows of those requests are read."""
        c, out = self.config.canvas_length, [None] * len(group)
        for i, r in enumerate(group):
            if r.top_logprobs is None or not r.block_ends(stops[i]):
                continue
            out[i] = self.row_logprobs(weights[i * c : (i + 1) * c], argmax[i], r.top_logprobs)
        return out

    def _refine(self, group: list[Request], argmax: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The argmax canvases after constraint sources that correct them once the pass is known
        (`refine(argmax [C], weights [C, V]) -> [C]`: a grammar's left-to-right walk, which
        replaces each rejected token by the most likely allowed one; its weights are `full_rows`
        of the request's C rows)."""
        if not any(r.refines for r in group):
            return argmax
        c = self.config.canvas_length
        refined = [
            self.to_device(r.constraints.refine(argmax[i].cpu(), self.full_rows(weights[i * c : (i + 1) * c])))
            if r.refines
            else argmax[i]
            for i, r in enumerate(group)
        ]
        return torch.stack(refined)

    def fixed_tokens(self, group: list[Request]) -> torch.Tensor | None:
        """[n, C] fixed token per position (-1: free), or None when no request fixes any."""
        fixed = [r.active_constraints.fixed if r.active_constraints is not None else None for r in group]
        if all(f is None for f in fixed):
            return None
        none = torch.full((self.config.canvas_length,), -1, dtype=torch.long)
        return self.to_device(torch.stack([none if f is None else f for f in fixed]))

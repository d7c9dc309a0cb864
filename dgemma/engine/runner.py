"""The runner: the passes a step plan asks for, on the KV pool, with the kernels this machine runs.

Which kernels run is decided once, by kernels/choice.py (`plan_kernels`): the step's shared
operations (step_ops.py) follow its `KernelPlan` for the statistics (dgemma's native kernel on an
AVX-512 CPU, the Triton kernels on a GPU, which also sample from each request's Philox stream on
the device, or torch; all honour allowed-token masks), canvas attention (gathered keys and SDPA,
or a Triton kernel reading the paged pool in place: `PagedKVCache.plan_canvas`) and CUDA graphs
for the fused paths on a GPU (`fused.graphs.DecoderGraphs`: one per batch-size bucket, replayed
for any prefix length; eager where a capture fails).

A step runs the plan's encoder work (prefill chunks, committed blocks) through `prefill`, then
each denoising canvas on its decode path (paths.py: the fused paths whole on the device, the host
paths eager), a group at a time: the pass, then the sampler (entropy-bound acceptance, sampling,
renoising, the stopping rule), every random number from the request's own stream.

With `batch_invariant` (CPU default) each request's passes run as a batch of one and encoder
passes are whole aligned blocks, so its tokens are bit-identical whatever else runs and whatever
the prefix cache held. Otherwise a step's canvases run as batched decoder passes.
"""

from __future__ import annotations

import torch

from ..kernels.choice import plan_kernels
from ..kernels.lora import LoraSlots, adapted_network
from ..model.diffusion_gemma import DiffusionGemma
from . import prefill as prefill_pass
from .fused.graphs import DecoderGraphs
from .fused.paths import FusedPath, FusedTurboPath
from .host.step import HostPath
from .host.turbo import HostTurboPath
from .kv.paged_cache import PagedKVCache
from .options import EngineOptions
from .paths import DecodePath, group_requests
from .prefill import PlacedImage
from .request import Request
from .step_ops import StepOps
from .step_plan import DecodeResult, EncodeWork, EngineStats, StepPlan
from .vision_cache import VisionCache


class Runner:
    def __init__(
        self,
        net: DiffusionGemma,
        options: EngineOptions,
        num_blocks: dict[str, int],
        stats: EngineStats | None = None,
        adapters: LoraSlots | None = None,
    ):
        kernels = plan_kernels(net, bool(options.triton), bool(options.cuda_graphs))
        if kernels.network == "triton":  # attention's norms + RoPE and the MoE block on the Triton kernels
            from ..kernels.fused import triton_modules

            net = triton_modules(net, adapters)
        if adapters is not None and getattr(net, "lora_rows", None) is None:  # the deltas beside the fast modules
            net = adapted_network(net, adapters)
        self.adapters = adapters
        self.net, self.config, self.options, self.kernels = net, net.config, options, kernels
        self.stats = stats if stats is not None else EngineStats()
        self.vision_cache = VisionCache()
        # tensor parallelism (dgemma/parallel): this rank's KV heads
        self.cache = PagedKVCache(net.kv_config, num_blocks, options.block_size, net.device, net.dtype)
        self.pass_tokens = options.block_size if options.batch_invariant else None
        self.ops = StepOps(net, kernels, self.cache)
        graphs = DecoderGraphs() if kernels.cuda_graphs else None
        self.host, self.host_turbo = HostPath(self.ops), HostTurboPath(self.ops)
        self.fused, self.fused_turbo = FusedPath(self.ops, graphs), FusedTurboPath(self.ops, graphs)

    @property
    def graphs(self) -> DecoderGraphs | None:
        """The CUDA graphs both fused paths replay (None: they run eagerly)."""
        return self.fused.graphs

    @graphs.setter
    def graphs(self, graphs: DecoderGraphs | None) -> None:  # (tests give fake graphs; AR mode reads their pool)
        self.fused.graphs = self.fused_turbo.graphs = graphs

    @property
    def triton(self) -> bool:
        """Whether the step runs the Triton kernels (a GPU, or Triton's interpreter)."""
        return self.ops.triton

    @torch.no_grad()
    def run(self, plan: StepPlan) -> list[DecodeResult]:
        self._encode(plan.encode)
        groups = self.groups(plan.decode)
        keys = [path.graph_key(group) for path, group in groups]
        return [
            result
            for (path, group), key in zip(groups, keys)
            for result in path.run(group, copy_out=key is not None and keys.count(key) > 1)
        ]

    def choose(self, requests: list[Request]) -> dict[int, DecodePath]:
        """Each request's decode path this step (paths.py): the first of fused turbo, host turbo,
        fused and host that accepts it, once the turbo requests that fit the device hold their slots."""
        self.fused_turbo.assign_slots(requests)
        order = (self.fused_turbo, self.host_turbo, self.fused, self.host)
        return {r.request_id: next(path for path in order if path.accepts(r)) for r in requests}

    def groups(self, requests: list[Request]) -> list[tuple[DecodePath, list[Request]]]:
        """The step's groups and their paths, in the order they run (`paths.group_requests`)."""
        chosen = self.choose(requests)
        order = (self.host, self.fused, self.fused_turbo, self.host_turbo)
        largest = self.graphs.largest if self.graphs is not None else None
        return group_requests(requests, lambda r: chosen[r.request_id], order, self.options.batch_invariant, largest)

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
                adapters=[w.request.adapter_slot for w in batched],
            )
        alone = [w for w in works if w.request.images] if batched else works
        for work in alone:
            req = work.request
            images = [self._images_in(work)] if req.images else None
            prefill_pass.prefill(
                self.net,
                self.cache,
                [req.kv],
                [req.sequence[work.start : work.end]],
                self.pass_tokens,
                images,
                [req.adapter_slot],
            )

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
        if (
            self.ops.sharded is not None and self.net.shards.rank > 0
        ):  # rank 0 runs the tower; its soft tokens come here
            return self._soft_tokens_from_rank_0(image)
        pixels = torch.from_numpy(image.pixel_values[None, :n]).to(device)
        positions = torch.from_numpy(image.position_ids[None, :n]).to(device)
        features = self.net.vision.image_features(pixels, positions)
        if (
            self.ops.sharded is not None
        ):  # in the activations' dtype, as prefill writes them (and the other ranks receive)
            features = self.net.shards.broadcast(features.to(self.net.dtype).contiguous())
        return features

    def _soft_tokens_from_rank_0(self, image) -> torch.Tensor:
        """An image's soft tokens [num_soft_tokens, hidden] as rank 0's tower made them (every rank
        encodes the same images at the same step: their engines replay one scheduler's decisions)."""
        features = torch.empty(
            image.num_soft_tokens, self.config.hidden_size, dtype=self.net.dtype, device=self.net.device
        )
        return self.net.shards.broadcast(features)

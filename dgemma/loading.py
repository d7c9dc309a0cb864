"""`dgemma.load`: a checkpoint (a directory, a hub id, or the shipped dgemma-tiny) read into a
`Model` (api.py), after its memory plan is checked against the device, on one process or cut
across ranks."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from . import devices
from .api import Model
from .config import load_generation_config, load_model_config
from .engine import engine as engine_core
from .inputs.tokenizer import Tokenizer
from .model import weights


def default_model_dir() -> Path:
    """Directory of the small model shipped inside the package (dgemma-tiny)."""
    return Path(__file__).resolve().parent / "assets" / "dgemma-tiny"


def load(
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = "auto",
    quantization: str | None = None,
    group_size: int | None = None,
    revision: str | None = None,
    force: bool = False,
    tensor_parallel_size: int = 1,
    expert_parallel: bool = False,
    lora: dict[str, str | Path] | None = None,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
) -> Model:
    """Load a checkpoint: a directory (config.json, safetensors, tokenizer) or a Hugging Face hub id
    (`owner/name`, at `revision`: a branch, tag or commit), fetched into the hub's cache (only the
    files dgemma reads; HF_TOKEN, HF_HOME and HF_HUB_OFFLINE=1 as huggingface_hub reads them). No
    path: the shipped dgemma-tiny. An existing directory wins over a hub id of the same name.

    `device`: "cpu", "cuda", "cuda:N" or "auto" (cuda when there is a GPU). `dtype`: "float32",
    "bfloat16", "float16", or "auto": the checkpoint's stored dtype (bf16 for the released model and
    the shipped dgemma-tiny; `devices.resolve_dtype`).

    `quantization` ("fp8", "int8", "int4", "nvfp4"; `group_size` for int4) quantises the text
    layers' linears and experts while loading, a layer at a time (see docs/quantization.md); "auto"
    picks the best scheme whose memory plan fits the device.

    Before any weights are read or downloaded, the memory plan of one request (dgemma/hub/fit.py)
    is checked against the device's memory: a plan that does not fit raises `dgemma.hub.FitError`
    saying what would, unless `force`. `model.name` is the hub id, or the directory's name.

    `tensor_parallel_size` N > 1 cuts the model across N ranks (dgemma/parallel: attention heads,
    MLPs, experts and vocabulary split, all-reduces where the partial sums meet; `expert_parallel`
    places whole experts per rank instead of splitting each). In a plain process this one becomes
    rank 0 and starts the other N - 1 on this host itself (parallel/leader.py): they replay its
    engine's steps, and end at `model.close()` or the process's exit; its torch threads become
    its share of the cores. Several hosts: call it in every one of N processes started by
    `torchrun` (or dgemma's launcher), each then making the same calls. A rank on a GPU takes
    cuda:LOCAL_RANK (or cuda:RANK of the ranks started here). Sizes that cannot be split are a one-line
    `ShardError` before any weights are read. Each rank reads only its share of each tensor; quantised
    weights (`quantization`, or a pre-quantised checkpoint) are split in their own layout
    (parallel/shard.py says where a split would cut a quantisation group).

    `lora` ({name: path or hub id}) loads LoRA adapters in PEFT's format beside the base, unmerged:
    `model.generate(..., adapter=name)` picks one per call, and the engine runs requests on
    different adapters (and none) in one step (dgemma/adapters/). `max_loras` adapters may be
    resident at once (default: 4, or as many as given), each of rank up to `max_lora_rank`
    (default: 16, or the largest given). Each adapter is read and checked against the base before
    any is installed: one that does not fit is an `AdapterError` of one line."""
    from functools import partial

    from .hub import FitRequest, resolve_checkpoint

    if path is None:
        path = default_model_dir()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"the shipped model is missing from {path}; pass a checkpoint directory")
    dev = devices.resolve_device(device)
    fit = (
        None
        if force and quantization != "auto"
        else FitRequest(
            dev,
            partial(devices.resolve_dtype, dtype, dev),
            quantization,
            group_size,
            tensor_parallel_size=tensor_parallel_size,
            expert_parallel=expert_parallel,
        )
    )
    checkpoint = resolve_checkpoint(path, revision, fit=fit, force=force)
    path, quantization = checkpoint.path, checkpoint.quantization if fit is not None else quantization
    config = load_model_config(path)
    generation_config = load_generation_config(path, config)
    # cuda:N current on this thread for what runs outside the engine too (AR mode, canvas_logits:
    # quantised linears launch Triton kernels on the current device); the engine makes it current itself
    engine_core.make_current(dev)
    shard, ranks = None, None
    if tensor_parallel_size != 1 or expert_parallel:
        from .parallel.group import join_ranks
        from .parallel.plan import ShardPlan
        from .parallel.shard import RankLayout, ShardedLoad, scheme_groups

        plan = ShardPlan.build(
            config, tensor_parallel_size, expert_parallel
        )  # a size that cannot be split: one line, now
        if quantization is not None:  # ... and quantisation groups a split would cut (a pre-quantised file's: at read)
            RankLayout.build(plan, 0, scheme_groups(quantization, group_size))
        if tensor_parallel_size > 1 and "WORLD_SIZE" not in os.environ:  # a plain process: it leads the ranks
            from .parallel.leader import LedRanks

            dtype_name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
            ranks = LedRanks.start(
                tensor_parallel_size,
                {
                    "path": str(path),
                    "device": str(device),
                    "dtype": dtype_name,
                    "quantization": quantization,
                    "group_size": group_size,
                    "force": True,
                    "tensor_parallel_size": tensor_parallel_size,
                    "expert_parallel": expert_parallel,
                },
                dev,
            )
            group, dev = ranks.group, ranks.device
        else:
            group, dev = join_ranks(tensor_parallel_size, dev)
        shard = ShardedLoad(group, expert_parallel)  # each rank reads its share of each tensor, on the meta model's cut
    split = {} if shard is None else {"shard": shard}  # one process: load_weights as ever
    try:
        net = weights.load_weights(
            config, path, dev, devices.resolve_dtype(dtype, dev, path), quantization, group_size, **split
        )
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    model = Model(net, generation_config, tokenizer, path, checkpoint.name, ranks)
    if lora or max_loras is not None or max_lora_rank is not None:
        attach_adapters(model, lora or {}, max_loras, max_lora_rank)
    return model


def attach_adapters(
    model: Model, lora: dict[str, str | Path], max_loras: int | None = None, max_lora_rank: int | None = None
) -> None:
    """`load`'s `lora`: every adapter read and checked first (AdapterError naming the first that does
    not fit), then the bank made (sized for them unless given) and each installed."""
    from .adapters import DEFAULT_MAX_LORAS, DEFAULT_MAX_RANK, AdapterError, read_adapter

    if not isinstance(lora, dict):
        raise AdapterError("lora takes a dict of adapter names to their directories (or hub ids)")
    read = [read_adapter(name, source, model.config, max_lora_rank) for name, source in lora.items()]
    rank = max_lora_rank or max([DEFAULT_MAX_RANK] + [a.rank for a in read])
    bank = model.enable_adapters(max_loras or max(DEFAULT_MAX_LORAS, len(read)), rank)
    for adapter in read:
        bank.install(adapter)

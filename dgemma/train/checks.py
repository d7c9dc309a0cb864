"""What can refuse a training run, checked before a byte of data or of the model is read and before
anything is written, so that a bad input is a one-line ValueError: the arguments (`TrainArgs`), the
device, the model's config, a quantised base (asked for with --quantization, or stored) and whether
its scheme trains here, the adapters and their targets, the checkpoint a run resumes, and a
fine-tuning run's memory plan (plan.py) against the device's memory.

What the checks settle is a `CheckedRun`: the trainer (trainer.py) and what it loads (loading.py)
are built from it; `plan_check` stops there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig, load_model_config, parse_model_config
from ..model.checkpoint import make_config
from ..model.diffusion_gemma import DiffusionGemma
from ..model.presets import PRESETS
from . import lora
from .chunked import chunk_rows
from .plan import FinetunePlan, FinetuneWork, finetune_refusal, plan_finetune
from .resume import checkpoint_args, latest_checkpoint


@dataclass
class TrainArgs:
    out: str
    data: list[str]
    config: str | None = None  # train: a preset name or a JSON file
    model: str | None = None  # finetune: a checkpoint directory
    tokenizer: str | None = None
    eval_data: list[str] | None = None
    eval_fraction: float = 0.02
    steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    seq_len: int = 256
    blocks: int = 1
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    ar_weight: float = 1.0
    sc_prob: float = 0.5
    dtype: str = "float32"
    device: str = "cpu"
    eval_every: int = 200
    eval_batches: int = 4
    save_every: int = 200
    save_minutes: float = 15.0
    keep: int = 2
    seed: int = 0
    threads: int | None = None
    log_every: int = 10
    save_dtype: str = "float32"
    init_std: float = 0.02
    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_targets: str = "attention,mlp"
    merge: bool = True
    fresh: bool = False
    generation: dict = field(default_factory=dict)
    quantization: str | None = None  # finetune: the frozen base in this scheme (QLoRA; needs lora_rank)
    group_size: int | None = None  # int4's group size (default 64)
    adapter: str | None = None  # finetune: start from these adapters (PEFT's format or dgemma's)
    checkpoint_layers: bool | None = None  # activation checkpointing per layer (None: on with a quantised base)
    loss_chunk_rows: int | None = None  # rows per loss chunk (None: about 64 MiB of logits; 0: whole logits)
    force: bool = False  # train even where the memory plan does not fit the device
    device_memory: int | None = None  # the memory the plan is checked against (None: the device's)


@dataclass
class CheckedRun:
    """What the checks settle about a run (`check_run`): the model's config, the checkpoint it
    resumes (None: it starts afresh), a pre-quantised checkpoint's scheme, --adapter's adapters,
    the adapters' rank (0: none, every parameter trains) and a fine-tuning run's memory plan."""

    args: TrainArgs
    device: torch.device
    config: ModelConfig
    resume_from: Path | None
    stored_scheme: str | None
    adapter_file: lora.AdapterFile | None
    lora_rank: int = 0
    plan: FinetunePlan | None = None

    @property
    def quantized(self) -> bool:
        """The base is quantised: asked for (--quantization), or stored so."""
        return self.args.quantization is not None or self.stored_scheme is not None

    @property
    def base_dtype(self) -> torch.dtype:
        """The base's dtype: bf16 for a quantised base with --dtype bfloat16, else float32 (under
        bf16 autocast where --dtype bfloat16 asks for it)."""
        return torch.bfloat16 if self.quantized and self.args.dtype == "bfloat16" else torch.float32

    def loss_rows(self) -> int | None:
        """Rows per loss chunk (None: the whole logits at once): --loss-chunk-rows, else chunks of
        about 64 MiB of logits where a micro-batch's whole logits would be larger (the released
        vocabulary), and the whole logits where they are not (small models compute as they always did)."""
        a = self.args
        if a.loss_chunk_rows is not None:
            return a.loss_chunk_rows or None
        rows = chunk_rows(self.config.vocab_size)
        return rows if a.batch_size * max(a.seq_len, a.blocks * self.config.canvas_length) > rows else None

    def finetune_work(self) -> FinetuneWork:
        """This run's plan.FinetuneWork (what `dgemma memory --finetune` plans)."""
        a = self.args
        checkpointing = self.quantized if a.checkpoint_layers is None else a.checkpoint_layers
        targets = tuple(self.adapter_file.names) if self.adapter_file else lora.resolve_targets(a.lora_targets)
        return FinetuneWork(
            scheme=a.quantization or self.stored_scheme,
            group_size=a.group_size,
            lora_rank=self.lora_rank,
            targets=tuple(t.split(".", 2)[2] if t.startswith("layers.") else t for t in targets),
            seq_len=a.seq_len,
            batch=a.batch_size,
            blocks=a.blocks,
            weight_dtype=self.base_dtype,
            act_dtype=torch.bfloat16 if a.dtype == "bfloat16" else torch.float32,
            checkpointing=checkpointing,
            chunk_rows=self.loss_rows() or 0,
            device="cpu" if self.device.type == "cpu" else "cuda",
        )


def check_args(a: TrainArgs, device: torch.device, world: int) -> None:
    """The arguments on their own (with the device and the number of processes): one line for the first that is wrong."""
    for name in (
        "steps",
        "batch_size",
        "grad_accum",
        "seq_len",
        "blocks",
        "eval_batches",
        "save_every",
        "log_every",
    ):
        if getattr(a, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive (got {getattr(a, name)})")
    if a.lr <= 0 or not 0 <= a.min_lr_ratio <= 1 or a.warmup < 0 or a.clip < 0:
        raise ValueError("need lr > 0, 0 <= min-lr-ratio <= 1, warmup >= 0 and clip >= 0")
    if not 0 <= a.sc_prob <= 1 or a.ar_weight < 0:
        raise ValueError("need 0 <= sc-prob <= 1 and ar-weight >= 0")
    if a.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16 (got {a.dtype})")
    if (a.config is None) == (a.model is None):
        raise ValueError("give either a model config (train) or a checkpoint (finetune)")
    if a.lora_rank < 0:
        raise ValueError(f"--lora-rank must be positive (got {a.lora_rank})")
    if a.loss_chunk_rows is not None and a.loss_chunk_rows < 0:
        raise ValueError(f"--loss-chunk-rows must be positive, or 0 for the whole logits (got {a.loss_chunk_rows})")
    check_device(device)
    if a.quantization is not None:
        from ..quant import schemes
        from ..quant.formats import check_scheme

        if schemes.find(a.quantization) is None:
            raise ValueError(f"--quantization {a.quantization!r}: not a scheme ({', '.join(schemes.names())})")
        check_scheme(a.quantization, schemes.get(a.quantization).group.chosen(a.group_size))
        if a.model is None:
            raise ValueError("--quantization quantises the base of a fine-tuning run (dgemma finetune --model ...)")
        check_scheme_runs(a.quantization, device)
        if world > 1:
            raise ValueError("--quantization trains on one process (one device); run it without torchrun")
    if a.adapter is not None and a.model is None:
        raise ValueError("--adapter continues adapters on a base: dgemma finetune --model ... --adapter DIR")


def check_run(args: TrainArgs, device: torch.device, out: Path, say) -> CheckedRun:
    """The checks after `check_args`, in order: the config (a checkpoint's, or --config's), a
    quantised base, the adapters' rank and shapes, the checkpoint the run resumes (the latest under
    `out` unless --fresh), and a fine-tuning run's memory plan (`say` prints its warning under --force)."""
    resume_from = None if args.fresh else latest_checkpoint(out)
    config = load_model_config(args.model) if args.model else model_config_from(args.config)
    scheme = stored_scheme(config, args.model)
    adapter_file = lora.read_adapters(args.adapter) if args.adapter else None
    run = CheckedRun(args, device, config, resume_from, scheme, adapter_file)
    check_quantized_base(run)
    run.lora_rank = adapter_rank(run)
    check_lora_fits(run)
    check_resume(run)
    run.plan = check_memory(run, say) if args.model else None
    return run


def model_config_from(spec: str) -> ModelConfig:
    """A preset name, a JSON file of `make_config` sizes, or an HF config.json."""
    if spec in PRESETS:
        return make_config(**PRESETS[spec])
    path = Path(spec)
    if path.is_dir():
        return load_model_config(path)
    if not path.exists():
        raise ConfigError(f"--config {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if "model_type" in data:
        return parse_model_config(data, where=str(path))
    try:
        return make_config(**data)
    except TypeError as e:
        raise ConfigError(f"{path}: {e}") from None


def stored_scheme(config: ModelConfig, model: str | None) -> str | None:
    """The scheme of a pre-quantised checkpoint (its quantization_config), else None."""
    if model is None:
        return None
    from ..hub.fit import quant_info

    info = quant_info(config.raw, Path(model))
    return None if info is None else info.scheme


def check_device(device: torch.device) -> None:
    """A device this machine has: one line where it does not (before anything is read or written)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device here; train on --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise ValueError(f"--device {device}: training runs on cpu or cuda")


def check_scheme_runs(scheme: str, device: torch.device) -> None:
    """Whether a base quantised by `scheme` trains on `device`: on a CPU every scheme of the table
    (native kernels or torch's dequantisation); on a GPU a scheme the Triton GEMM decodes, where
    triton runs. One line where it cannot."""
    from ..quant import schemes

    entry = schemes.find(scheme)
    if entry is None:
        raise ValueError(f"{scheme!r} is not a quantisation scheme ({', '.join(schemes.names())})")
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(f"a {scheme} base trains on cpu or cuda, not {device}")
    if entry.kernels.cuda is None:
        raise ValueError(f"--quantization {scheme}: the GPU kernels have no decoder for it; train it on --device cpu")
    from ..kernels import triton_quant

    if not triton_quant.available(device):
        raise ValueError(
            f"--quantization {scheme} on {device}: the Triton kernels do not run here (is triton installed?)"
        )


def check_quantized_base(run: CheckedRun) -> None:
    """A quantised base (asked for, or stored) trains adapters only, in a scheme it can hold."""
    a = run.args
    if run.stored_scheme is not None and a.quantization not in (None, run.stored_scheme):
        raise ValueError(
            f"{a.model} is already quantised ({run.stored_scheme}): drop --quantization, or give "
            f"--quantization {run.stored_scheme}"
        )
    if run.stored_scheme is not None:
        check_scheme_runs(run.stored_scheme, run.device)
    if run.quantized and a.lora_rank == 0 and run.adapter_file is None:
        scheme = a.quantization or run.stored_scheme
        raise ValueError(
            f"the {scheme} base is frozen: give --lora-rank R (e.g. 16) to train adapters on it "
            "(full fine-tuning needs the full-precision base, without --quantization)"
        )


def adapter_rank(run: CheckedRun) -> int:
    """The adapters' rank: --lora-rank, or --adapter's (which must agree when both are given)."""
    a, adapter = run.args, run.adapter_file
    if adapter is None:
        return a.lora_rank
    if a.lora_rank not in (0, adapter.rank):
        raise ValueError(f"--lora-rank {a.lora_rank}, but --adapter {a.adapter} has rank {adapter.rank}")
    return adapter.rank


def check_lora_fits(run: CheckedRun) -> None:
    """The targets name linears the model has; --adapter's and a resumed checkpoint's adapters
    have the shapes this base needs (checked on the model's modules on the meta device: nothing
    read yet, no memory)."""
    a = run.args
    if not run.lora_rank:
        return
    with torch.device("meta"):
        meta = DiffusionGemma(run.config)
    if run.adapter_file is None:
        lora.target_modules(meta, lora.resolve_targets(a.lora_targets))
    else:
        lora.check_adapter(run.adapter_file, meta, a.adapter)
    if run.resume_from is not None:
        lora.check_adapter(lora.read_adapters(run.resume_from), meta, run.resume_from)


def check_resume(run: CheckedRun) -> None:
    """A run resumes on the base it was trained on: the same scheme and group size (the
    quantised base is rebuilt exactly from them), the same adapters' rank."""
    if run.resume_from is None:
        return
    saved = checkpoint_args(run.resume_from)
    a = run.args
    mine = {"quantization": a.quantization or run.stored_scheme, "lora_rank": run.lora_rank}
    theirs = {"quantization": saved.get("quantization"), "lora_rank": saved.get("lora_rank", 0)}
    if saved.get("quantization") is None and run.stored_scheme is not None:
        theirs["quantization"] = run.stored_scheme  # a pre-quantised base, stored as such both times
    if mine["quantization"] is not None and mine["quantization"] == theirs["quantization"]:
        mine["group_size"], theirs["group_size"] = a.group_size, saved.get("group_size")
    for key, value in mine.items():
        if theirs[key] != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"{run.resume_from} was trained with {flag} {theirs[key]}, this run has {flag} {value}: "
                f"give {flag} {theirs[key]} to resume it, or --fresh to start over"
            )


def check_memory(run: CheckedRun, say) -> FinetunePlan:
    """The run's memory plan against the device's memory (`device_memory`, which the CLI sets
    from DGEMMA_DEVICE_MEMORY as for `dgemma run`): refused before loading, saying what would
    fit, unless --force (then `say` prints it as a warning)."""
    from ..hub.fit import device_memory

    work = run.finetune_work()
    plan = plan_finetune(run.config, work)
    memory, where = device_memory(run.device, run.args.device_memory)
    if memory is not None and plan.total > memory:
        message = finetune_refusal(run.config, work, plan, memory, where)
        if not run.args.force:
            raise ValueError(message)
        say(f"warning: {message}")
    return plan

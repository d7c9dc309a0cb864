"""`dgemma train` (from a config) and `dgemma finetune` (from a checkpoint, full or LoRA).

The loop is plain: AdamW, linear warmup then cosine decay, gradient accumulation, clipping,
optional bf16 autocast, periodic eval, checkpoints. Under `torchrun` the same command shards the
model with FSDP2 (`fully_shard` on each layer and the root) and splits each step's examples
across ranks.

Exact resume: the examples and the diffusion noise of step s come from generators seeded by
(seed, s, example index), the learning rate is a function of s, and a checkpoint (resume.py) holds
the fp32 weights and the optimizer state. So a run restarted from step s's checkpoint continues exactly as
the uninterrupted run would have. A kill loses the steps since the last checkpoint; Ctrl-C or
SIGTERM finishes the current step, saves, and exits.

Output layout (`--out DIR`):
    DIR/config.json, model.safetensors, tokenizer.json, ...   the final model (HF layout)
    DIR/adapter_config.json, adapter_model.safetensors        LoRA runs: the adapters alone (PEFT's format)
    DIR/checkpoints/step-NNNNNN/                               resumable checkpoints (last `--keep`)
    DIR/log.jsonl                                              one line per logged step and eval

QLoRA (`quantization`, with `lora_rank`): the base is quantised while it loads, a layer at a
time (or read as stored from a pre-quantised checkpoint), and stays frozen in the packed format
inference uses; only the float32 adapters and their AdamW state train. Activations are the base's
dtype (float32, or bf16 with `--dtype bfloat16`: then the base runs in bf16, not under autocast).
Activation checkpointing and the chunked loss (objective.py) are on by default there. Before a
byte of the model is read, the run's memory plan (memory_plan.plan_finetune) is checked against
the device's memory, and every input is checked (data, targets, adapters, the checkpoint a run
resumes), so a bad one is a one-line error with nothing written.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import (
    ConfigError,
    GenerationConfig,
    ModelConfig,
    load_generation_config,
    load_model_config,
    parse_model_config,
)
from ..inputs.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer
from ..model.checkpoint import init_weights, make_config, save_checkpoint
from ..model.diffusion_gemma import DiffusionGemma
from ..model.presets import PRESETS
from ..model.weights import load_weights
from . import lora, resume
from .chunked import chunk_rows
from .data import ExampleOrder, iter_records, load_examples
from .objective import Losses, TrainingModule, collate, draw_noise, example_generator
from .resume import (
    checkpoint_args,
    checkpoint_dir,
    cpu_net,
    full_state,
    latest_checkpoint,
    publish,
    restore_optimizer,
    staging_dir,
)
from .tokenizer_train import as_tokenizer, train_bpe

EVAL_SALT = 0xE7A1


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
class TrainResult:
    step: int
    interrupted: bool
    out: Path
    last_losses: dict
    eval: dict


# ------------------------------------------------------------------ pure helpers


def lr_at(step: int, base: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `min_ratio * base` at `total`."""
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return base * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def example_indices(step: int, micro: int, rank: int, args: TrainArgs, world: int) -> list[int]:
    """Global indices of the examples one rank reads in one micro-batch of one step.

    The step's examples are [step * G, (step + 1) * G) with G = batch * accum * world, handed out
    micro-batch-major, so `world=2, accum=1` reads the same examples as `world=1, accum=2`.
    """
    per_step = args.batch_size * args.grad_accum * world
    first = step * per_step + (micro * world + rank) * args.batch_size
    return list(range(first, first + args.batch_size))


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


# ------------------------------------------------------------------ distributed


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world): 1 process unless launched by torchrun with WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def agree(flag: bool, world: int) -> bool:
    """True on every rank if it is True on any (stop and save decisions must be collective)."""
    if world == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def mean_across(values: list[float], world: int) -> list[float]:
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / world).tolist()


def shard(module: TrainingModule, device: torch.device) -> TrainingModule:
    """FSDP2: each transformer layer is its own shard group, the root holds embeddings and the rest."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in module.net.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


# ------------------------------------------------------------------ the trainer


class Trainer:
    def __init__(self, args: TrainArgs, check_only: bool = False):
        """Check the run (arguments, base, adapters, the checkpoint it resumes, its memory plan),
        then read the data and the model; `check_only` stops after the checks (nothing read or
        written beyond config files: `plan_check`)."""
        self.args = args
        self.out = Path(args.out)
        self.device = torch.device(args.device)
        if args.threads:
            torch.set_num_threads(args.threads)
        self.rank, self.world = init_distributed(self.device)
        self.is_main = self.rank == 0
        self.stop_requested = False
        self._validate()
        if args.warmup >= args.steps:
            peak = lr_at(args.steps - 1, args.lr, args.warmup, args.steps, args.min_lr_ratio)
            self._say(
                f"warning: --warmup {args.warmup} is not below --steps {args.steps}: the learning rate only climbs "
                f"to {peak:.3g}, never to --lr {args.lr:g}; give a --warmup below --steps (e.g. {args.steps // 10})"
            )
        self.resume_from = None if args.fresh else latest_checkpoint(self.out)
        # Everything that can refuse the run does so before anything is written or the model is read.
        self.config = load_model_config(args.model) if args.model else model_config_from(args.config)
        self.stored_scheme = _stored_scheme(self.config, args.model)
        self.quantized = args.quantization is not None or self.stored_scheme is not None
        self.base_dtype = torch.bfloat16 if self.quantized and args.dtype == "bfloat16" else torch.float32
        self.adapter_file = lora.read_adapters(args.adapter) if args.adapter else None
        self._check_quantized_base()
        self.lora_rank = self._lora_rank()
        self._check_lora_fits()
        self._check_resume()
        self.plan = self._check_memory() if args.model else None
        if check_only:
            return
        self.tok = self._tokenizer()
        if self.tok.vocab_size > self.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.tok.vocab_size} tokens but the model only {self.config.vocab_size}"
            )
        self.train_set, self.eval_set = self._data()
        self.out.mkdir(parents=True, exist_ok=True)
        if self.quantized and self.device.type == "cpu":
            training_heap()
        self.net, self.generation = self._model()
        self.lora_mode = self.lora_rank > 0
        self.lora_scale = None
        if self.lora_mode:
            if self.adapter_file is not None:
                lora.apply_lora(self.net, self.lora_rank, self.adapter_file.alpha, self.adapter_file.names)
                lora.load_adapters(self.net, args.adapter)
            else:
                lora.apply_lora(self.net, self.lora_rank, args.lora_alpha, args.lora_targets, seed=args.seed)
            self.lora_scale = self.net.lora_config["lora_alpha"] / self.lora_rank
            if self.resume_from is not None:
                lora.load_adapters(self.net, self.resume_from)
        self.net.to(self.device)
        checkpoint_layers = self.quantized if args.checkpoint_layers is None else args.checkpoint_layers
        rows = self.loss_rows()
        self.module = TrainingModule(
            self.net, args.ar_weight, args.sc_prob > 0, checkpoint_layers=checkpoint_layers, chunk_rows=rows or None
        )
        if self.world > 1:
            shard(self.module, self.device)
        self.optimizer = self._optimizer()
        self.step = 0
        if self.resume_from is not None:
            self._load_state(self.resume_from)
        self.log_file = self.out / "log.jsonl"

    # ---- setup
    def _validate(self) -> None:
        a = self.args
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
        check_device(self.device)
        if a.quantization is not None:
            from ..quant import schemes
            from ..quant.formats import check_scheme

            if schemes.find(a.quantization) is None:
                raise ValueError(f"--quantization {a.quantization!r}: not a scheme ({', '.join(schemes.names())})")
            check_scheme(a.quantization, schemes.get(a.quantization).group.chosen(a.group_size))
            if a.model is None:
                raise ValueError("--quantization quantises the base of a fine-tuning run (dgemma finetune --model ...)")
            check_scheme_runs(a.quantization, self.device)
            if self.world > 1:
                raise ValueError("--quantization trains on one process (one device); run it without torchrun")
        if a.adapter is not None and a.model is None:
            raise ValueError("--adapter continues adapters on a base: dgemma finetune --model ... --adapter DIR")

    def _check_quantized_base(self) -> None:
        """A quantised base (asked for, or stored) trains adapters only, in a scheme it can hold."""
        a = self.args
        if self.stored_scheme is not None and a.quantization not in (None, self.stored_scheme):
            raise ValueError(
                f"{a.model} is already quantised ({self.stored_scheme}): drop --quantization, or give "
                f"--quantization {self.stored_scheme}"
            )
        if self.stored_scheme is not None:
            check_scheme_runs(self.stored_scheme, self.device)
        if self.quantized and a.lora_rank == 0 and self.adapter_file is None:
            scheme = a.quantization or self.stored_scheme
            raise ValueError(
                f"the {scheme} base is frozen: give --lora-rank R (e.g. 16) to train adapters on it "
                "(full fine-tuning needs the full-precision base, without --quantization)"
            )

    def _lora_rank(self) -> int:
        """The adapters' rank: --lora-rank, or --adapter's (which must agree when both are given)."""
        a, adapter = self.args, self.adapter_file
        if adapter is None:
            return a.lora_rank
        if a.lora_rank not in (0, adapter.rank):
            raise ValueError(f"--lora-rank {a.lora_rank}, but --adapter {a.adapter} has rank {adapter.rank}")
        return adapter.rank

    def _meta_net(self) -> DiffusionGemma:
        """The model's modules on the meta device (no memory): what targets and adapters are checked against."""
        with torch.device("meta"):
            return DiffusionGemma(self.config)

    def _check_lora_fits(self) -> None:
        """The targets name linears the model has; --adapter's and a resumed checkpoint's adapters
        have the shapes this base needs (checked on the meta model: nothing read yet)."""
        a = self.args
        if not self.lora_rank:
            return
        meta = self._meta_net()
        if self.adapter_file is None:
            lora.target_modules(meta, lora.resolve_targets(a.lora_targets))
        else:
            lora.check_adapter(self.adapter_file, meta, a.adapter)
        if self.resume_from is not None:
            lora.check_adapter(lora.read_adapters(self.resume_from), meta, self.resume_from)

    def _check_resume(self) -> None:
        """A run resumes on the base it was trained on: the same scheme and group size (the
        quantised base is rebuilt exactly from them), the same adapters' rank."""
        if self.resume_from is None:
            return
        saved = checkpoint_args(self.resume_from)
        a = self.args
        mine = {"quantization": a.quantization or self.stored_scheme, "lora_rank": self.lora_rank}
        theirs = {"quantization": saved.get("quantization"), "lora_rank": saved.get("lora_rank", 0)}
        if saved.get("quantization") is None and self.stored_scheme is not None:
            theirs["quantization"] = self.stored_scheme  # a pre-quantised base, stored as such both times
        if mine["quantization"] is not None and mine["quantization"] == theirs["quantization"]:
            mine["group_size"], theirs["group_size"] = a.group_size, saved.get("group_size")
        for key, value in mine.items():
            if theirs[key] != value:
                flag = "--" + key.replace("_", "-")
                raise ValueError(
                    f"{self.resume_from} was trained with {flag} {theirs[key]}, this run has {flag} {value}: "
                    f"give {flag} {theirs[key]} to resume it, or --fresh to start over"
                )

    def loss_rows(self) -> int | None:
        """Rows per loss chunk (None: the whole logits at once): --loss-chunk-rows, else chunks of
        about 64 MiB of logits where a micro-batch's whole logits would be larger (the released
        vocabulary), and the whole logits where they are not (small models compute as they always did)."""
        a = self.args
        if a.loss_chunk_rows is not None:
            return a.loss_chunk_rows or None
        rows = chunk_rows(self.config.vocab_size)
        return rows if a.batch_size * max(a.seq_len, a.blocks * self.config.canvas_length) > rows else None

    def finetune_work(self):
        """This run's memory_plan.FinetuneWork (what `dgemma memory --finetune` plans)."""
        from ..memory_plan import FinetuneWork

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

    def _check_memory(self):
        """The run's memory plan against the device's memory (`device_memory`, which the CLI sets
        from DGEMMA_DEVICE_MEMORY as for `dgemma run`): refused before loading, saying what would
        fit, unless --force."""
        from ..hub.fit import device_memory
        from ..memory_plan import finetune_refusal, plan_finetune

        work = self.finetune_work()
        plan = plan_finetune(self.config, work)
        memory, where = device_memory(self.device, self.args.device_memory)
        if memory is not None and plan.total > memory:
            message = finetune_refusal(self.config, work, plan, memory, where)
            if not self.args.force:
                raise ValueError(message)
            self._say(f"warning: {message}")
        return plan

    def _tokenizer(self) -> Tokenizer:
        a = self.args
        if a.tokenizer:
            path = Path(a.tokenizer)
            return Tokenizer.from_dir(path) if path.is_dir() else _from_file(path)
        if a.model:
            if not (Path(a.model) / "tokenizer.json").exists():
                raise ValueError(f"{a.model} has no tokenizer.json; pass --tokenizer")
            return Tokenizer.from_dir(a.model)
        saved = self.out / "tokenizer.json"
        if not saved.exists():
            if self.is_main:
                vocab = model_config_from(a.config).vocab_size
                self._say(f"training a {vocab}-token BPE tokenizer on {', '.join(a.data)}")
                texts = (_record_text(rec) for _, rec in iter_records(a.data))
                trained = train_bpe(texts, vocab)
                self.out.mkdir(parents=True, exist_ok=True)
                trained.save(str(saved))
            if self.world > 1:
                dist.barrier()
        return _from_file(saved)

    def _model(self) -> tuple[DiffusionGemma, GenerationConfig]:
        a = self.args
        config = self.config
        if a.model:
            generation = load_generation_config(a.model, config)
            source = self.resume_from if (self.resume_from and not self.lora_rank) else Path(a.model)
            # a quantised base: each layer quantised as it is read (or read as stored)
            scheme = a.quantization if self.stored_scheme is None else None
            net = load_weights(config, source, "cpu", self.base_dtype, scheme, a.group_size)
            for p in net.parameters():
                if not p.data.untyped_storage().resizable():  # memory-mapped from the file: own the memory
                    p.data = p.data.clone()
        else:
            generation = GenerationConfig(eos_token_ids=(1, 6), pad_token_id=0)
            with torch.device("cpu"):
                net = DiffusionGemma(config)
            init_weights(net, std=a.init_std, seed=a.seed)
            if self.resume_from is not None:
                net.load_state_dict(load_weights(config, self.resume_from, "cpu", torch.float32).state_dict())
        if a.generation:
            generation = generation.with_overrides(**a.generation)
        net.train()
        for p in net.parameters():
            p.requires_grad_(True)
        return net, generation

    def _optimizer(self) -> torch.optim.Optimizer:
        a = self.args
        params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        decay = [p for n, p in params if p.dim() >= 2]
        no_decay = [p for n, p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=a.lr, betas=a.betas, eps=1e-8)

    def _load_state(self, ckpt: Path) -> None:
        self.step = restore_optimizer(self.module, self.optimizer, ckpt)
        self._say(f"resuming from {ckpt} (step {self.step})")

    def _data(self):
        a = self.args
        fraction = 0.0 if a.eval_data else a.eval_fraction
        train, held = load_examples(a.data, self.tok, a.seq_len, fraction)
        if a.eval_data:
            held, _ = load_examples(a.eval_data, self.tok, a.seq_len, 0.0)
        return ExampleOrder(train, a.seed), (ExampleOrder(held, a.seed) if held else None)

    # ---- one step
    def _micro_batch(self, indices: list[int], order: ExampleOrder, step: int, salt: int = 0):
        a, c = self.args, self.net.config.canvas_length
        gens = [example_generator(a.seed, step, i, salt) for i in indices]
        examples = [order[i] for i in indices]
        batch = collate(examples, c, gens, blocks=a.blocks, pad_id=self.net.config.pad_token_id)
        noise = draw_noise(gens, c, self.net.config.vocab_size, a.sc_prob, blocks=a.blocks)
        return batch.to(self.device), noise.to(self.device)

    def _autocast(self):
        """bf16 autocast over float32 weights; a quantised base in bf16 runs in bf16 itself."""
        if self.args.dtype == "bfloat16" and not self.quantized:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def train_step(self, step: int) -> dict:
        a = self.args
        lr = lr_at(step, a.lr, a.warmup, a.steps, a.min_lr_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        totals = [0.0, 0.0, 0.0]
        tokens = 0
        for micro in range(a.grad_accum):
            batch, noise = self._micro_batch(
                example_indices(step, micro, self.rank, a, self.world), self.train_set, step
            )
            with self._autocast():
                losses: Losses = self.module(batch, noise)
            (losses.total / a.grad_accum).backward()
            for i, v in enumerate((losses.total, losses.diffusion, losses.ar)):
                totals[i] += v.item() / a.grad_accum
            tokens += sum(batch.lengths)
        params = [p for p in self.module.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, a.clip if a.clip > 0 else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss, diffusion, ar = mean_across(totals, self.world)
        return {
            "loss": loss,
            "diffusion": diffusion,
            "ar": ar,
            "lr": lr,
            "grad_norm": float(norm),
            "tokens": tokens * self.world,
        }

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean losses over the first `eval_batches` batches of the held-out set, with fixed noise."""
        if self.eval_set is None:
            return {}
        a = self.args
        self.module.eval()
        sums = [0.0, 0.0]
        for b in range(a.eval_batches):
            first = (b * self.world + self.rank) * a.batch_size
            batch, noise = self._micro_batch(list(range(first, first + a.batch_size)), self.eval_set, 0, EVAL_SALT)
            with self._autocast():
                losses = self.module(batch, noise)
            sums[0] += losses.diffusion.item() / a.eval_batches
            sums[1] += losses.ar.item() / a.eval_batches
        self.module.train()
        diffusion, ar = mean_across(sums, self.world)
        return {"eval_diffusion": diffusion, "eval_ar": ar}

    # ---- saving
    def save(self, final: bool = False) -> Path:
        """A resumable checkpoint at self.step (or the final model in --out); atomic on disk."""
        model_sd, optim_sd = full_state(self.module, None if final else self.optimizer, self.world)
        target = self.out if final else checkpoint_dir(self.out, self.step)
        if self.is_main:
            save_dtype = {"float32": None, "bfloat16": torch.bfloat16}[self.args.save_dtype] if final else None
            tmp = target if final else staging_dir(target)
            if not final:
                shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True, exist_ok=True)
            if self.lora_mode:  # PEFT's format (lora.py), which PEFT, transformers and dgemma load
                lora.write_adapters(
                    tmp,
                    lora.adapter_tensors(model_sd, prefix="net."),
                    self.lora_rank,
                    self.net.lora_config["lora_alpha"],
                    base_model=lora.base_model_name(self.args.model),
                    linears=lora.layer_linears(self.net),
                    use_rslora=self.net.lora_config.get("use_rslora", False),
                )
            if not self.lora_mode or (final and self.args.merge and not self.quantized):
                net = cpu_net(self.net.config, model_sd, self.lora_scale)
                template = self.tok.chat_template or DEFAULT_CHAT_TEMPLATE
                save_checkpoint(net, tmp, self.generation, self.tok, template, dtype=save_dtype)
            if not final:
                resume.write_state(tmp, self.step, optim_sd, {**asdict(self.args), "lora_rank": self.lora_rank})
                publish(tmp, target, self.args.keep)
            else:
                (tmp / "train_args.json").write_text(json.dumps(asdict(self.args), indent=2) + "\n")
        if self.world > 1:
            dist.barrier()
        return target

    # ---- the loop
    def _say(self, text: str) -> None:
        if self.is_main:
            print(text, file=sys.stderr, flush=True)

    def _log(self, record: dict) -> None:
        if self.is_main:
            with self.log_file.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def _on_signal(self, signum, frame) -> None:
        if self.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop_requested = True
        self._say("\nstopping after this step (Ctrl-C again to abort without saving)")

    def run(self, on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
        handlers = {}
        try:
            if threading.current_thread() is threading.main_thread():
                for s in (signal.SIGINT, signal.SIGTERM):
                    handlers[s] = signal.signal(s, self._on_signal)
            return self._loop(on_step)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)

    def _loop(self, on_step) -> TrainResult:
        a = self.args
        n_params = self.config.num_parameters()
        n_train = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        base = f", base {self.net.quantization[0]}" if self.quantized else ""
        plan = f", planned peak {self.plan.total / 2**30:.2f} GiB" if self.plan is not None else ""
        self._say(
            f"dgemma {'finetune' if a.model else 'train'}: {n_params / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trained"
            f"{base}), {len(self.train_set)} training sequences, {self.world} process(es), steps {self.step} -> "
            f"{a.steps}{plan}"
        )
        from tqdm import tqdm

        bar = tqdm(
            total=a.steps,
            initial=self.step,
            disable=not (self.is_main and sys.stderr.isatty()),
            dynamic_ncols=True,
            unit="step",
        )
        last_save, t_start, record, evals = time.time(), time.time(), {}, {}
        interrupted = False
        if self.step == 0:  # the held-out losses before training: what the run's evals compare with
            start = self.evaluate()
            if start:
                self._log({"step": 0, **start})
                self._say(f"step 0: eval diffusion {start['eval_diffusion']:.4f}, eval ar {start['eval_ar']:.4f}")
        while self.step < a.steps:
            t0 = time.time()
            record = self.train_step(self.step)
            self.step += 1
            dt = time.time() - t0
            record.update(
                step=self.step, tokens_per_s=record["tokens"] / dt, step_s=dt, elapsed_s=time.time() - t_start
            )
            bar.update(1)
            bar.set_postfix(
                loss=f"{record['loss']:.3f}",
                diff=f"{record['diffusion']:.3f}",
                ar=f"{record['ar']:.3f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
            )
            if self.step % a.log_every == 0 or self.step == a.steps:
                self._log(record)
                if bar.disable:
                    self._say(
                        f"step {self.step}/{a.steps} loss {record['loss']:.4f} (diffusion {record['diffusion']:.4f}, "
                        f"ar {record['ar']:.4f}) lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s"
                    )
            if self.step % a.eval_every == 0 or self.step == a.steps:
                evals = self.evaluate()
                if evals:
                    self._log({"step": self.step, **evals})
                    self._say(
                        f"step {self.step}: eval diffusion {evals['eval_diffusion']:.4f}, "
                        f"eval ar {evals['eval_ar']:.4f}"
                    )
            stop = agree(self.stop_requested, self.world)
            due = self.step % a.save_every == 0 or time.time() - last_save > a.save_minutes * 60
            if agree(due or stop, self.world) or self.step == a.steps:
                path = self.save()
                last_save = time.time()
                if stop:
                    self._say(f"stopped at step {self.step}; checkpoint {path}; run the same command to resume")
                    interrupted = True
                    break
            if on_step is not None:
                on_step(self.step, record)
        bar.close()
        if not interrupted:
            self.save(final=True)
            self._say(f"wrote {self.out}")
            if self.quantized and a.merge:
                self._say(
                    "a quantised base: wrote the adapters only; `dgemma merge-lora --model BASE --adapter "
                    f"{self.out} --out DIR` merges them onto the full-precision base"
                )
        return TrainResult(self.step, interrupted, self.out, record, evals)


TRAINING_MMAP_THRESHOLD = 1 << 20
TRAINING_TRIM_THRESHOLD = 16 << 20


def training_heap() -> bool:
    """glibc malloc for a QLoRA step on a CPU: tensors of 1 MB and more mapped fresh and unmapped
    when freed, at most 16 MB of freed heap kept. The CLI keeps up to 1 GB of freed memory for
    inference's repeated step temporaries (kernels/cpu.keep_freed_memory); a training step's
    temporaries are many and of every size (each layer's recompute, each loss chunk), and the heap
    kept them as fragments: on the mid model at 256 tokens the step's peak RSS over the model was
    0.60 GiB with the CLI's setting, 0.25 GiB with this one, against 0.16 GiB of live tensors
    (scripts/qlora_memory.py). The page faults this costs are small beside a step's GEMMs."""
    from ..kernels.cpu import keep_freed_memory

    return keep_freed_memory(TRAINING_MMAP_THRESHOLD, TRAINING_TRIM_THRESHOLD)


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


def _stored_scheme(config: ModelConfig, model: str | None) -> str | None:
    """The scheme of a pre-quantised checkpoint (its quantization_config), else None."""
    if model is None:
        return None
    from ..hub.fit import quant_info

    info = quant_info(config.raw, Path(model))
    return None if info is None else info.scheme


def _record_text(rec: dict) -> str:
    if "text" in rec:
        return str(rec["text"])
    if "messages" in rec:
        return "\n".join(str(m.get("content", "")) for m in rec["messages"] if isinstance(m, dict))
    return f"{rec.get('prompt', '')}{rec.get('completion', '')}"


def _from_file(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return as_tokenizer(HFTokenizer.from_file(str(path)))
    except Exception as e:
        raise ConfigError(f"{path} is not a valid tokenizer.json: {e}") from None


def plan_check(args: TrainArgs):
    """The checks `Trainer` makes before it reads anything (a bad input or a memory plan that does
    not fit: one-line ValueError); returns the plan (memory_plan.FinetunePlan) of a fine-tuning run."""
    return Trainer(args, check_only=True).plan


def train(args: TrainArgs, on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
    """Run (or resume) a training run described by `args`."""
    return Trainer(args).run(on_step)

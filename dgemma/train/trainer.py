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
byte of the model is read, the run's memory plan (plan.py's plan_finetune) is checked against
the device's memory, and every input is checked (data, targets, adapters, the checkpoint a run
resumes: checks.py), so a bad one is a one-line error with nothing written.
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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..inputs.tokenizer import DEFAULT_CHAT_TEMPLATE
from ..model.checkpoint import save_checkpoint
from . import lora, resume
from .checks import TrainArgs, check_args, check_run
from .data import ExampleOrder, load_examples
from .loading import attach_adapters, load_network, load_tokenizer
from .objective import Losses, TrainingModule, collate, draw_noise, example_generator
from .resume import checkpoint_dir, cpu_net, full_state, publish, restore_optimizer, staging_dir

EVAL_SALT = 0xE7A1


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
        """Check the run (arguments, base, adapters, the checkpoint it resumes, its memory plan:
        checks.py), then read the data and the model (loading.py); `check_only` stops after the
        checks (nothing read or written beyond config files: `plan_check`)."""
        self.args = args
        self.out = Path(args.out)
        self.device = torch.device(args.device)
        if args.threads:
            torch.set_num_threads(args.threads)
        self.rank, self.world = init_distributed(self.device)
        self.is_main = self.rank == 0
        self.stop_requested = False
        check_args(args, self.device, self.world)
        if args.warmup >= args.steps:
            peak = lr_at(args.steps - 1, args.lr, args.warmup, args.steps, args.min_lr_ratio)
            self._say(
                f"warning: --warmup {args.warmup} is not below --steps {args.steps}: the learning rate only climbs "
                f"to {peak:.3g}, never to --lr {args.lr:g}; give a --warmup below --steps (e.g. {args.steps // 10})"
            )
        # Everything that can refuse the run does so before anything is written or the model is read.
        self.checked = check_run(args, self.device, self.out, self._say)
        self.config, self.resume_from, self.plan = self.checked.config, self.checked.resume_from, self.checked.plan
        self.quantized, self.lora_rank = self.checked.quantized, self.checked.lora_rank
        if check_only:
            return
        self.tok = load_tokenizer(self.checked, self.out, self.is_main, self.world, self._say)
        if self.tok.vocab_size > self.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.tok.vocab_size} tokens but the model only {self.config.vocab_size}"
            )
        self.train_set, self.eval_set = self._data()
        self.out.mkdir(parents=True, exist_ok=True)
        if self.quantized and self.device.type == "cpu":
            training_heap()
        self.net, self.generation = load_network(self.checked)
        self.lora_mode = self.lora_rank > 0
        self.lora_scale = attach_adapters(self.net, self.checked)
        self.net.to(self.device)
        checkpoint_layers = self.quantized if args.checkpoint_layers is None else args.checkpoint_layers
        rows = self.checked.loss_rows()
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


def plan_check(args: TrainArgs):
    """The checks `Trainer` makes before it reads anything (a bad input or a memory plan that does
    not fit: one-line ValueError); returns the plan (plan.FinetunePlan) of a fine-tuning run."""
    return Trainer(args, check_only=True).plan


def train(args: TrainArgs, on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
    """Run (or resume) a training run described by `args`."""
    return Trainer(args).run(on_step)

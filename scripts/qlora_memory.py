"""Peak memory and time of one QLoRA optimizer step on this CPU, beside the plan's figure.

    python scripts/qlora_memory.py --size mid --quantization int4 --seq-len 512 --lora-rank 16
    python scripts/qlora_memory.py --size real --seq-len 512        # the released size: ~18 GiB of RAM

The base has random weights of the preset's size, in the packed format `dgemma finetune
--quantization` holds (no checkpoint of that size on disk): `--build packed` (int4, the default)
draws the int4 codes and group scales themselves, which takes seconds where quantising 25B random
weights on two cores takes most of an hour; `--build quantised` draws each matrix (each expert) and
quantises it (quant/modules.random_quantized_model). Both hold the same bytes and run the same
kernels; the loss of random weights means nothing. Adapters of rank R on attention and the dense MLP, float32 activations, activation
checkpointing per layer and the chunked loss, as `dgemma finetune --quantization` runs them
(train/objective.py, train/trainer.py); plain AdamW over the adapters. One sequence of
--seq-len tokens whose last three quarters are supervised, one canvas block, self-conditioning on.

Measured: the process's resident memory (Linux: VmRSS, and VmHWM reset through
/proc/self/clear_refs just before the step) and the step's wall time. Planned:
train/plan.py's plan_finetune for the same run on a CPU (what `dgemma memory --finetune --device cpu`
prints and `dgemma finetune` checks). A benchmark, not a test: docs/training.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dgemma.model.checkpoint import make_config  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402
from dgemma.quant.modules import random_quantized_model  # noqa: E402
from dgemma.train import lora  # noqa: E402
from dgemma.train.chunked import chunk_rows  # noqa: E402
from dgemma.train.objective import Example, TrainingModule, collate, draw_noise, example_generator  # noqa: E402
from dgemma.train.plan import FinetuneWork, plan_finetune  # noqa: E402
from dgemma.train.trainer import training_heap  # noqa: E402

GIB = 2**30


def status(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Make VmHWM the current RSS (Linux: 5 > /proc/PID/clear_refs), so the next peak is the step's."""
    Path("/proc/self/clear_refs").write_text("5")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def packed_random_model(config, group_size: int, dtype: torch.dtype, seed: int):
    """A DiffusionGemma whose int4 weights are random codes and group scales drawn in place (the
    model's structure from random_quantized_model on the meta device), its other matrices normal
    (std 0.02), its norms and scalars ones: the int4 base's bytes and kernels, built in seconds."""
    from torch import nn

    net = random_quantized_model(config, "int4", group_size, dtype, device="meta")
    gen = torch.Generator().manual_seed(seed)
    for module in net.modules():
        for name, t in list(module._parameters.items()):
            if t is not None and t.device.type == "meta":
                value = torch.empty(t.shape, dtype=t.dtype)
                value.normal_(0, 0.02, generator=gen) if t.dim() >= 2 else value.fill_(1.0)
                module._parameters[name] = nn.Parameter(value, requires_grad=False)
        for name, t in list(module._buffers.items()):
            if t is None or t.device.type != "meta":
                continue
            if name == "weight_packed":  # eight random 4-bit codes a word
                value = torch.randint(-(2**31), 2**31 - 1, t.shape, dtype=torch.int32, generator=gen)
            elif name == "weight_scale":  # codes in [-8, 7] times 0.02 / 7: about the init's spread
                value = torch.full(t.shape, 0.02 / 7, dtype=t.dtype)
            else:
                value = torch.ones(t.shape, dtype=t.dtype)
            module._buffers[name] = value
    return net.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="mid", choices=list(PRESETS))
    p.add_argument("--quantization", default="int4", choices=["int4", "nvfp4", "fp8", "int8"])
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--build",
        choices=["packed", "quantised"],
        default=None,
        help="random int4 codes and scales (default for int4), or random weights quantised (other schemes)",
    )
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    training_heap()  # the trainer's malloc settings for a QLoRA run on a CPU
    torch.manual_seed(args.seed)
    config = make_config(**PRESETS[args.size])
    group = args.group_size or (64 if args.quantization == "int4" else None)

    rss_start = status("VmRSS")
    t0 = time.time()
    build = args.build or ("packed" if args.quantization == "int4" else "quantised")
    if build == "packed" and args.quantization != "int4":
        p.error("--build packed draws int4 codes; other schemes are built --build quantised")
    if build == "packed":
        net = packed_random_model(config, group, torch.float32, args.seed)
    else:
        net = random_quantized_model(config, args.quantization, group, torch.float32, seed=args.seed)
    build_s = time.time() - t0
    lora.apply_lora(net, args.lora_rank, seed=args.seed)
    with torch.no_grad():  # non-zero B: the adapters change the outputs, as after some training
        for m in lora.adapters(net).values():
            m.B.normal_(0, 0.01)
    net.train()
    rss_base = status("VmRSS")

    rows = chunk_rows(config.vocab_size)
    module = TrainingModule(net, 1.0, True, checkpoint_layers=True, chunk_rows=rows)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)

    gen = torch.Generator().manual_seed(args.seed)
    ids = [2] + torch.randint(10, config.vocab_size, (args.seq_len - 1,), generator=gen).tolist()
    supervised = args.seq_len // 4
    example = Example(ids, [False] * supervised + [True] * (args.seq_len - supervised), complete=False)
    gens = [example_generator(args.seed, 0, 0)]
    batch = collate([example], config.canvas_length, gens)
    noise = draw_noise(gens, config.canvas_length, config.vocab_size, sc_prob=1.0)

    reset_peak()
    t0 = time.time()
    losses = module(batch, noise)
    losses.total.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step_s = time.time() - t0
    peak = status("VmHWM")

    work = FinetuneWork(
        scheme=args.quantization,
        group_size=group,
        lora_rank=args.lora_rank,
        seq_len=args.seq_len,
        weight_dtype=torch.float32,
        act_dtype=torch.float32,
        checkpointing=True,
        chunk_rows=rows,
        device="cpu",
    )
    plan = plan_finetune(config, work)
    result = {
        "size": args.size,
        "quantization": args.quantization,
        "seq_len": args.seq_len,
        "lora_rank": args.lora_rank,
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "loss": losses.total.item(),
        "build": build,
        "build_s": round(build_s, 1),
        "step_s": round(step_s, 2),
        "rss_start_gib": rss_start / GIB,
        "rss_base_gib": rss_base / GIB,
        "peak_rss_gib": peak / GIB,
        "plan_gib": plan.total / GIB,
        "plan_parts_gib": {k: v / GIB for k, v in plan.parts.items()},
        "peak_vs_plan": peak / plan.total,
    }
    print(
        f"{args.size}, {args.quantization} base, rank {args.lora_rank}, {args.seq_len} tokens, on {result['cpu']} "
        f"({result['threads']} threads):"
    )
    print(f"  built the {build} base in {build_s:.1f} s; resident after it: {rss_base / GIB:.2f} GiB")
    print(f"  one optimizer step: {step_s:.2f} s, peak RSS {peak / GIB:.2f} GiB (measured)")
    print(f"  the plan for the same run: {plan.total / GIB:.2f} GiB (planned): {plan.describe()}")
    print(f"  measured / planned: {peak / plan.total:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

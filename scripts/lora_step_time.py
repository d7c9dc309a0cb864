"""Decoder step time with LoRA adapters (kernels/lora.py) against none, on this CPU.

    python scripts/lora_step_time.py --size tiny --size mid [--requests 4] [--rank 16] [--repeats 5]

For each size (`tiny`: the shipped dgemma-tiny; others: a random model of the preset, as `dgemma
bench --size` builds it) and each pass mode (the CPU default, batch invariant: a request a pass;
`--batched-passes`: one pass for every canvas of the step), `--requests` requests with a
`--prompt-len` prompt are admitted and encoded, then whole engine decoder steps are timed over:

    none            an engine without adapters (the base's network as ever)
    base rows       an engine with 4 rank-R adapters loaded, every request on the base
    one adapter     every request on the same adapter
    four adapters   request i on adapter i % 4 (a batched pass groups its rows per adapter)

Every adapter targets the attention projections and the dense MLP of every layer (PEFT's usual
set) with random non-zero A and B. Medians of `--repeats` rounds, interleaved; ratios to `none`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import dgemma  # noqa: E402
from dgemma.adapters import AdapterBank, AdapterWeights, adapter_dtype  # noqa: E402
from dgemma.adapters.bank import content_key  # noqa: E402
from dgemma.benchmark import random_model  # noqa: E402
from dgemma.devices import resolve_dtype  # noqa: E402
from dgemma.engine.engine import Engine, EngineOptions, Request  # noqa: E402
from dgemma.engine.step_plan import StepPlan  # noqa: E402
from dgemma.kernels.cpu import describe, keep_freed_memory  # noqa: E402
from dgemma.kernels.lora import site_shapes  # noqa: E402

ADAPTERS = 4


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")


def random_adapter(name: str, config, rank: int, seed: int) -> AdapterWeights:
    gen = torch.Generator().manual_seed(seed)
    weights = {
        target: (torch.randn(rank, k, generator=gen) * 0.02, torch.randn(n, rank, generator=gen) * 0.02)
        for target, (k, n) in site_shapes(config).items()
    }
    return AdapterWeights(name, "random", rank, 2.0, weights, content_key(2.0, weights))


def prepared(engine: Engine, model, prompt: list[int], adapter) -> Request:
    """A request admitted, its prompt encoded and its first canvas started (no decoder pass yet)."""
    cfg = model.generation_config.with_overrides(
        max_new_tokens=2 * model.config.canvas_length,
        eos_token_ids=(),
        max_denoising_steps=1000,
        confidence_threshold=1e-12,
    )
    req = Request(list(prompt), cfg, 0, adapter=adapter)
    engine.add(req)
    while req.canvas is None:
        plan = engine.scheduler.schedule()
        engine.runner.run(StepPlan(encode=plan.encode))
        engine.scheduler.update(StepPlan(encode=plan.encode, events=plan.events), [])
    return req


def one_step(engine: Engine, requests: list[Request]) -> float:
    start = time.perf_counter()
    engine.runner.run(StepPlan(decode=requests))
    return time.perf_counter() - start


def measure(size: str, dtype: torch.dtype, args) -> None:
    model = dgemma.load(dtype=dtype) if size == "tiny" else random_model(size, "cpu", dtype)
    net, config = model.engine_net, model.config
    bank = AdapterBank(config, net.device, adapter_dtype(net.device, net.dtype), ADAPTERS, args.rank)
    refs = [bank.install(random_adapter(f"a{i}", config, args.rank, i)).ref for i in range(ADAPTERS)]
    prompt = [(7 * i + 3) % (config.vocab_size - 10) + 5 for i in range(args.prompt_len)]
    n = args.requests
    print(
        f"\n# {size} ({dtype}, {config.num_layers} layers, hidden {config.hidden_size}, canvas {config.canvas_length}), "
        f"{n} requests, prompt {args.prompt_len}, {ADAPTERS} adapters of rank {args.rank} on q/k/v/o and the dense "
        f"MLP; CPU {cpu_name()}, {torch.get_num_threads()} threads; {describe(net)}; medians of {args.repeats}"
    )
    print("| passes | adapters | step ms | x none |")
    print("|---|---|---|---|")
    for invariant in (True, False):
        options = EngineOptions(prefix_cache=False, max_active=3 * n, batch_invariant=invariant)
        plain, adapted = Engine(net, options), Engine(net, options, bank.slots)
        rows = {
            "none": (plain, [prepared(plain, model, prompt, None) for _ in range(n)]),
            "base rows": (adapted, [prepared(adapted, model, prompt, None) for _ in range(n)]),
            "one adapter": (adapted, [prepared(adapted, model, prompt, refs[0]) for _ in range(n)]),
            "four adapters": (adapted, [prepared(adapted, model, prompt, refs[i % ADAPTERS]) for i in range(n)]),
        }
        times: dict[str, list[float]] = {name: [] for name in rows}
        for engine, requests in rows.values():  # warm-up
            one_step(engine, requests)
        for _ in range(args.repeats):
            for name, (engine, requests) in rows.items():
                times[name].append(one_step(engine, requests))
        base = statistics.median(times["none"])
        mode = "a request a pass (batch invariant)" if invariant else "batched (--batched-passes)"
        for name, values in times.items():
            ms = statistics.median(values) * 1000
            print(f"| {mode} | {name} | {ms:.1f} | {ms / 1000 / base:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", action="append", default=None, help="tiny (the shipped model) or a preset; repeatable")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    for size in args.size or ["tiny", "mid"]:
        measure(size, resolve_dtype(args.dtype), args)


if __name__ == "__main__":
    main()

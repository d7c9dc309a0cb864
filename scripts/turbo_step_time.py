"""Turbo's step-time curve: one decoder step with 100 / 50 / 25 / 10% of the canvas active.

    python scripts/turbo_step_time.py [--size mid] [--dtype bfloat16] [--quantization int4] [--repeats 5]
    python scripts/turbo_step_time.py --size real --quantization int4 --repeats 2   # the released size, ~15 GB

Builds a random model of the named size (as `dgemma bench --size`), prefills a `--prompt-len`
prompt, then times engine steps of one request whose canvas has the given share of positions
active (the others frozen, their keys and values in the turbo buffer): the exact step (turbo off)
first, then a turbo step at each share, interleaved over `--repeats` rounds, medians reported as
ratios to the exact step of the same run. `--modules` splits each step into the decoder layers
(attention, dense MLP, router, experts) and the rest (LM head, statistics, self-conditioning,
sampler): where the time goes when few rows are active (the MoE still reads most experts).
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
from step_breakdown import timed  # noqa: E402  (scripts/step_breakdown.py's wrapper)

from dgemma.benchmark import random_model  # noqa: E402
from dgemma.devices import resolve_dtype  # noqa: E402
from dgemma.engine.engine import Engine, EngineOptions, Request  # noqa: E402
from dgemma.engine.step_plan import StepPlan  # noqa: E402
from dgemma.engine.turbo import TurboState  # noqa: E402
from dgemma.kernels.cpu import keep_freed_memory  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402

SHARES = (1.0, 0.5, 0.25, 0.1)


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")


def prepared(engine: Engine, model, prompt: list[int], turbo: bool) -> Request:
    """A request admitted, its prompt encoded and its first canvas started (no decoder pass yet)."""
    cfg = model.generation_config.with_overrides(
        max_new_tokens=2 * model.config.canvas_length,
        eos_token_ids=(),
        max_denoising_steps=1000,
        confidence_threshold=1e-12,
        turbo=turbo,
    )
    req = Request(list(prompt), cfg, 0)
    engine.add(req)
    while req.canvas is None:
        plan = engine.scheduler.schedule()
        engine.runner.run(StepPlan(encode=plan.encode))
        engine.scheduler.update(
            StepPlan(encode=plan.encode, events=plan.events), []
        )  # the canvas starts with the last chunk
    return req


def freeze_share(req: Request, share: float, net) -> None:
    """Leave `share` of the canvas active, the rest frozen (keys/values: whatever the buffer holds)."""
    c = req.canvas.numel()
    state = TurboState.fresh(c, req.canvas.device, req.turbo)
    state.ensure_buffers(net.config, net.dtype, net.device)
    active = max(1, round(share * c))
    state.frozen[active:] = True
    state.tokens = req.canvas.clone()
    state.passes = 1  # not a canvas's first pass: only the active rows are queries
    req.turbo = state


def one_step(engine: Engine, req: Request) -> float:
    start = time.perf_counter()
    engine.runner.run(StepPlan(decode=[req]))
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="mid", choices=list(PRESETS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modules", action="store_true")
    args = p.parse_args()
    keep_freed_memory()
    # random weights built directly in the dtype (quantised with --quantization), as `dgemma bench` builds them
    model = random_model(args.size, "cpu", resolve_dtype(args.dtype), args.quantization)
    net = model.engine_net
    engine = Engine(net, EngineOptions(prefix_cache=False, max_active=2))
    prompt = [(7 * i + 3) % (model.config.vocab_size - 10) + 5 for i in range(args.prompt_len)]
    exact = prepared(engine, model, prompt, turbo=False)
    turbo = prepared(engine, model, prompt, turbo=True)
    split: dict[str, float] = {}
    if args.modules:  # time inside the decoder layers and inside the experts, per step kind
        net._run_layers = timed(split, "layers", net._run_layers)
        for layer in net.layers:
            if hasattr(layer, "experts"):
                layer.experts.forward = timed(split, "experts", layer.experts.forward)
    parts: dict[str, dict[str, list[float]]] = {}

    one_step(engine, exact)  # warm-up
    for share in SHARES:
        freeze_share(turbo, share, net)
        one_step(engine, turbo)
    times: dict[str, list[float]] = {"exact": []} | {f"{int(s * 100)}%": [] for s in SHARES}

    def measured(name: str, req: Request) -> None:
        split.clear()
        times[name].append(one_step(engine, req))
        for key, value in split.items():
            parts.setdefault(name, {}).setdefault(key, []).append(value)

    for _ in range(args.repeats):
        measured("exact", exact)
        for share in SHARES:
            freeze_share(turbo, share, net)
            measured(f"{int(share * 100)}%", turbo)
    base = statistics.median(times["exact"])
    print(
        f"# {args.size} {args.dtype} {args.quantization or 'unquantised'}, canvas {model.config.canvas_length}, "
        f"prompt {args.prompt_len}; CPU {cpu_name()}, {torch.get_num_threads()} threads; medians of {args.repeats}"
    )
    cols = " layers ms | experts ms |" if args.modules else ""
    print("| step | active positions | ms | x exact |" + cols)
    print("|---|---|---|---|" + "---|---|" * bool(args.modules))
    c = model.config.canvas_length
    for name, values in times.items():
        active = c if name == "exact" else max(1, round(float(name[:-1]) / 100 * c))
        ms = statistics.median(values) * 1000
        extra = "".join(
            f" {statistics.median(parts.get(name, {}).get(k, [0.0])) * 1000:.1f} |" for k in ("layers", "experts")
        )
        print(
            f"| {'exact' if name == 'exact' else 'turbo'} | {active} ({name if name != 'exact' else '100%'}) | {ms:.1f} | "
            f"{ms / 1000 / base:.2f} |" + (extra if args.modules else "")
        )


if __name__ == "__main__":
    main()

"""Where one engine step's time goes: decoder pass, logits + sampler statistics + self-conditioning, sampler decisions.

    python scripts/step_breakdown.py [--size mid] [--dtype bfloat16] [--quantization int4] [--steps 8] [--modules] [--profile]

Builds a random model of the named size (dgemma/model/presets.py, as `dgemma bench --size`),
prefills a 512-token prompt, then times `--steps` engine steps (16 fixed denoising steps per
canvas, as the benchmark). `--modules` adds the time inside each kind of decoder module
(attention, dense MLP, router, experts) per step;
`--profile` adds torch.profiler's table of the most expensive ops (it does not see inside the
native kernels).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dgemma.benchmark import FIXED_STEPS_CONFIDENCE, random_model  # noqa: E402
from dgemma.devices import resolve_dtype  # noqa: E402
from dgemma.engine.engine import Engine, EngineOptions, Request  # noqa: E402
from dgemma.kernels.cpu import keep_freed_memory  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402


def timed(totals: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        totals[key] = totals.get(key, 0.0) + time.perf_counter() - start
        return out

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="mid", choices=list(PRESETS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None, help="quantise at load (fp8, int8, int4, nvfp4), as bench's flag")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--modules", action="store_true")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    keep_freed_memory()  # as the CLI does
    # random weights built directly in the dtype (quantised with --quantization), as `dgemma bench` builds them
    model = random_model(args.size, "cpu", resolve_dtype(args.dtype), args.quantization)
    net = model.engine_net
    cfg = model.generation_config.with_overrides(
        max_new_tokens=4 * model.config.canvas_length,
        eos_token_ids=(),
        max_denoising_steps=16,
        confidence_threshold=FIXED_STEPS_CONFIDENCE,
    )
    engine = Engine(net, EngineOptions(prefix_cache=False))
    prompt = torch.randint(10, model.config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    engine.add(Request(prompt.tolist(), cfg, seed=0))
    for _ in range(3):  # prefill and warm-up
        engine.step()
    totals: dict[str, float] = {}
    net.decode = timed(totals, "decoder pass", net.decode)
    ops, host = engine.runner.ops, engine.runner.host
    ops.decoder_step = timed(totals, "decoder step", ops.decoder_step)
    host.decide = timed(totals, "sampler decisions", host.decide)  # on the device
    host.results = timed(totals, "sampler decisions", host.results)  # the host's read
    module_kinds = ("self_attn", "mlp", "router", "experts") if args.modules else ()
    for layer in net.layers:
        for kind in module_kinds:
            module = getattr(layer, kind)
            module.forward = timed(totals, f"  {kind} ({type(module).__name__})", module.forward)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - start) / args.steps * 1000
    ms = {k: v / args.steps * 1000 for k, v in totals.items()}
    print(
        f"{args.size} {args.dtype}{' ' + args.quantization if args.quantization else ''}, threads {torch.get_num_threads()}: {wall:.1f} ms per engine step"
    )
    print(f"  decoder pass                         {ms['decoder pass']:7.1f} ms")
    print(f"  logits, statistics, self-cond input  {ms['decoder step'] - ms['decoder pass']:7.1f} ms")
    print(f"  sampler decisions                    {ms['sampler decisions']:7.1f} ms")
    print(f"  other (commit, bookkeeping)          {wall - ms['decoder step'] - ms['sampler decisions']:7.1f} ms")
    for name in (k for k in ms if k.startswith("  ")):
        print(f"  decoder pass, all layers: {name.strip():30s} {ms[name]:7.1f} ms")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()

"""GPU benchmark for the real-size DiffusionGemma text stack with random bf16 weights.

Run on a bare H200 (or any large CUDA GPU) from the repository root:

    PYTHONUNBUFFERED=1 python3 scripts/gpu_bench.py [--quick]

It needs only torch, safetensors and tokenizers (present on the lent machine's image) and the
dgemma sources on PYTHONPATH (the script adds the repo root). It prints:

1. the measured device-to-device copy bandwidth and the memory-bandwidth floor of a decoder step
   (every weight read once: nearly all 128 experts are hit by 256 tokens x top-8);
2. ms per decoder step (decoder forward + logits + sampler statistics) for a 256-token canvas
   at batch 1, 4, 8 after a 4096-token prompt, eager and (where it works) CUDA-graph captured;
3. decode tokens/s at 16 fixed denoising steps (batch 1), through the engine.

`--quantization int4|nvfp4|fp8|int8` builds the weights directly quantised on the GPU (the
Triton / FP8 kernels of dgemma/kernels/triton_quant.py then run every quantised matmul).

`--device cpu --size tiny --prompt-len 64 --quick` runs the same code on the CPU in seconds (no
CUDA graphs): a test does, so the script cannot rot between the rare sessions with a GPU.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dgemma.engine import sampler  # noqa: E402
from dgemma.model.checkpoint import make_config  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402
from dgemma.engine.kv_cache import DenseKVCache  # noqa: E402
from dgemma.engine.prefill import prefill  # noqa: E402
from dgemma.model.diffusion_gemma import DiffusionGemma  # noqa: E402


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, gb: float = 4.0) -> float:
    """Bytes per second moved by a device-to-device copy (read + write counted)."""
    n = int(gb * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    synchronize(device)
    return 2 * a.numel() * 2 * 10 / (time.perf_counter() - start)


@torch.no_grad()
def build(size: str, device: str, dtype=torch.bfloat16) -> DiffusionGemma:
    config = make_config(**PRESETS[size])
    with torch.device("meta"):
        net = DiffusionGemma(config)
    gen = torch.Generator(device=device).manual_seed(0)
    for module in net.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() >= 2:
                value = torch.randn(p.shape, generator=gen, device=device, dtype=dtype) * 0.02
            else:
                value = torch.ones(p.shape, device=device, dtype=dtype)
            module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
        for name, b in list(module.named_buffers(recurse=False)):
            module._buffers[name] = torch.ones(b.shape, device=device, dtype=dtype)
    return net.eval()


def weight_bytes(net: DiffusionGemma) -> int:
    return sum(t.numel() * t.element_size() for t in list(net.parameters()) + list(net.buffers()))


@torch.no_grad()
def step_time(net: DiffusionGemma, batch: int, prompt_len: int, graphs: bool, iters: int = 10) -> float:
    """ms per decoder step: decode + logits + step statistics + self-conditioning input."""
    cfg, device = net.config, net.device.type
    c = cfg.canvas_length
    cache = DenseKVCache(cfg, batch, prompt_len + 2 * c, device, net.dtype)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len)).tolist()
    prefill(net, cache, list(range(batch)), ids, pass_tokens=1024)  # chunks bound activation memory
    canvas = torch.randint(0, cfg.vocab_size, (batch, c), device=device)
    soft = torch.zeros(batch, c, cfg.hidden_size, device=device, dtype=net.dtype)
    plan = cache.plan_decoder(c)
    temp = torch.full((batch * c, 1), 0.6, device=device)

    def one_step():
        logits = net.logits(net.decode(canvas, plan, soft))
        stats = sampler.step_statistics(logits.view(-1, cfg.vocab_size), temp)
        soft.copy_(net.soft_embed(stats.weights.view(batch, c, -1), stats.total.view(batch, c)))
        return stats.entropy

    fn = one_step
    if graphs:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                one_step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_step()
        fn = graph.replay
    for _ in range(3):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return 1000 * (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="real", choices=list(PRESETS))
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="batch 1 only, fewer iterations")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of this script")
    parser.add_argument("--quantization", choices=["fp8", "int8", "int4", "nvfp4"], default=None,
                        help="weights built directly quantised (int4: group 64)")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("this script needs a CUDA GPU (or --device cpu for a smoke run)")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}, size={args.size}", flush=True)
    bw = copy_bandwidth(device, gb=4.0 if device == "cuda" else 0.25)
    t0 = time.perf_counter()
    if args.quantization:
        from dgemma.quant.formats import DEFAULT_GROUP_SIZE
        from dgemma.quant.modules import random_quantized_model

        config = make_config(**PRESETS[args.size])
        net = random_quantized_model(config, args.quantization, DEFAULT_GROUP_SIZE, torch.bfloat16, device=device)
    else:
        net = build(args.size, device)
    nbytes = weight_bytes(net)
    what = f"{args.quantization} (+ bf16)" if args.quantization else "bf16"
    print(f"built {nbytes / 1e9:.1f} GB of {what} weights in {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s -> weight-read floor {1000 * nbytes / bw:.2f} ms per decoder step")
    print(f"{'batch':>5} {'eager ms/step':>14} {'graph ms/step':>14} {'floor ms':>9}")
    for batch in [1] if args.quick else [1, 4, 8]:
        eager = step_time(net, batch, args.prompt_len, graphs=False)
        if device != "cuda":
            graph = f"{'n/a':>14}"
        else:
            try:
                graph = f"{step_time(net, batch, args.prompt_len, graphs=True):14.2f}"
            except Exception as e:  # report, do not hide: capture can fail on dynamic ops
                graph = f"{'failed':>14}  ({type(e).__name__}: {str(e)[:80]})"
            torch.cuda.empty_cache()
        print(f"{batch:5d} {eager:14.2f} {graph} {1000 * nbytes / bw:9.2f}", flush=True)

    from dgemma.config import GenerationConfig
    from dgemma.engine.client import EngineClient
    from dgemma.engine.engine import Engine, EngineOptions, Request

    steps, new_tokens = 16, 2 * net.config.canvas_length if args.quick else 512
    cfg = GenerationConfig(max_new_tokens=new_tokens, max_denoising_steps=steps, confidence_threshold=1e-30)
    prompt = torch.randint(0, net.config.vocab_size, (args.prompt_len,)).tolist()
    # no prefix cache: the timed run must encode its prompt like the warm-up did
    options = EngineOptions(batch_invariant=False, prefix_cache=False, kv_cache_memory=2 * 2**30)
    client = EngineClient(Engine(net, options))
    client.finish([Request(prompt, cfg, 0)])  # warm-up
    synchronize(device)
    start = time.perf_counter()
    out = client.finish([Request(prompt, cfg, 0)])[0]
    synchronize(device)
    total = time.perf_counter() - start
    n = len(out.tokens)
    print(
        f"engine, batch 1, prompt {args.prompt_len}, {n} new tokens, {steps} fixed steps: "
        f"{n / total:.0f} output tok/s incl. prefill ({total:.2f} s, {out.decoder_passes} decoder passes, "
        f"{1000 * total / out.decoder_passes:.1f} ms per pass incl. prefill and commits; "
        f"{math.ceil(new_tokens / net.config.canvas_length)} canvases)"
    )


if __name__ == "__main__":
    main()

"""The one prepared GPU check: correctness of the GPU path, then its speed, in one run.

On a bare H200 (or any large CUDA GPU), from the repository root:

    PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py            # about 2-3 minutes

It needs only torch, triton, safetensors and tokenizers (the lent machine's image: torch 2.11,
triton 3.6) and imports no server code. It prints:

1. checks, each PASS or FAIL with its error: the Triton kernels against the torch code they
   replace, on the device (step statistics, sampling, norm + RoPE, the MoE block); one decoder
   pass of the shipped dgemma-tiny on the GPU in bf16 against the CPU in float32 (relative L2
   error under 5%); the engine's
   decoder step with the paged attention kernel against the gathered-SDPA step; a bucketed CUDA
   graph's replays (other groups, other prefix lengths) against eager steps;
2. a table: copy bandwidth; ms per decoder step of the real-size model at batch 1, 4 and 8 in bf16
   and FP8 (eager and CUDA graph) next to the weight-read floor (weight bytes / copy bandwidth);
   decode tokens/s at 16 fixed steps after a 4096-token prompt; peak memory.

`--smoke` runs the same code on a CPU in under a minute (Triton's interpreter, the "test" size,
graph replays run eagerly): the test suite does, so the script cannot rot between the rare
sessions with a GPU. Exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on the CPU

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dgemma.config import GenerationConfig  # noqa: E402
from dgemma.engine import sampler  # noqa: E402
from dgemma.engine.client import EngineClient  # noqa: E402
from dgemma.engine.engine import Engine, EngineOptions, Request  # noqa: E402
from dgemma.engine.kv_cache import DenseKVCache  # noqa: E402
from dgemma.engine.prefill import prefill  # noqa: E402
from dgemma.engine.graphs import DecoderGraphs, cuda_capture, eager_capture  # noqa: E402
from dgemma.kernels import triton_layer, triton_step  # noqa: E402
from dgemma.model import rope  # noqa: E402
from dgemma.model.checkpoint import make_config  # noqa: E402
from dgemma.model.diffusion_gemma import DiffusionGemma, Experts, RMSNorm  # noqa: E402
from dgemma.model.presets import PRESETS  # noqa: E402

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def guarded(fn):
    """A check that raises is a FAIL with its error, and the run goes on."""

    def run(*args):
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - report every failure, keep checking
            check(fn.__name__, False, f"{type(e).__name__}: {str(e)[:300]}")

    return run


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ checks
@guarded
def kernels_vs_torch(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    rows, vocab = (64, 4096) if not SMOKE else (8, 300)
    raw = (torch.randn(rows, vocab, generator=g) * 6).to(device)
    temps = torch.rand(rows, generator=g).add(0.2).to(device)
    argmax, entropy, total, probs = triton_step.step_statistics(raw, temps, 30.0)
    ref = sampler.step_statistics(torch.tanh(raw.float() / 30) * 30, temps[:, None])
    err = float((entropy - ref.entropy).abs().max())
    check("step statistics", bool((argmax == ref.argmax).all()) and err < 1e-4, f"argmax equal, entropy max error {err:.2e}")
    u = torch.rand(rows, generator=g).to(device)
    agree = float((triton_step.sample_rows(probs, total, u) == sampler.sample_from_weights(ref.weights, u)).float().mean())
    check("sampling", agree > 0.95, f"{agree:.1%} of rows pick the torch token")
    uniforms, noise = triton_step.philox_draws(torch.tensor([1, 1], device=device), torch.tensor([0, 0], device=device), 256, vocab)
    check("philox", bool(torch.equal(uniforms[0], uniforms[1])) and 0.4 < float(uniforms.mean()) < 0.6, "per-request streams")

    t, heads, d = (512, 8, 256) if not SMOKE else (6, 2, 16)
    x = torch.randn(t, heads, d, generator=g).to(device, torch.bfloat16)
    norm = RMSNorm(d).to(device)
    norm.weight.data = torch.rand(d, generator=g).to(device) + 0.5
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device).float() / d))
    cos, sin = rope.cos_sin(torch.arange(t, device=device)[None], freqs, torch.float32)
    with torch.no_grad():
        got = triton_layer.norm_rope(x, norm.weight, cos[0], sin[0], norm.eps)
        exact = rope.apply_rope(norm(x.float())[None], cos, sin)[0]
    err = float((got.float() - exact).abs().max() / exact.abs().max())
    check("norm + rope", err < 1e-2, f"bf16, max error {err:.2e} of the largest value")

    cfg = make_config(**PRESETS["test" if SMOKE else "mid"])
    experts = Experts(cfg).to(device)
    for p in experts.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.05).to(device)
    n = 256 if not SMOKE else 12
    tokens = torch.randn(n, cfg.hidden_size, generator=g).to(device)
    logits = torch.randn(n, cfg.num_experts, generator=g).to(device)
    w, idx = logits.softmax(-1).topk(cfg.top_k_experts, dim=-1)
    with torch.no_grad():
        got, want = triton_layer.moe_experts(experts, tokens, idx, w), experts(tokens, idx, w)
    err = float((got - want).abs().max() / want.abs().max())
    check("MoE block", err < 1e-4, f"float32, max error {err:.2e} of the largest value")


def tiny_model(device: torch.device, dtype: torch.dtype, seed: int = 0) -> DiffusionGemma:
    torch.manual_seed(seed)
    net = DiffusionGemma(make_config(**PRESETS["test"]))
    for name, p in net.named_parameters():
        if p.dim() >= 2:
            p.data.normal_(0, 0.05)
    return net.to(device, dtype).eval()


@guarded
@torch.no_grad()
def pass_vs_cpu(device: torch.device) -> None:
    import dgemma  # the shipped dgemma-tiny: trained weights, whose logits bf16 rounds as a real model's

    cpu = dgemma.load(dtype="float32").net
    gpu = dgemma.load(device=device.type, dtype="bfloat16").net
    cfg = cpu.config
    prompts = [list(range(300, 337)), list(range(500, 511))]
    canvas = torch.randint(0, cfg.vocab_size, (2, cfg.canvas_length), generator=torch.Generator().manual_seed(1))
    out = []
    for net in (cpu, gpu):
        cache = DenseKVCache(cfg, 2, 40 + cfg.canvas_length, net.device, net.dtype)
        prefill(net, cache, [0, 1], prompts)
        out.append(net.logits(net.decode(canvas.to(net.device), cache.plan_decoder(cfg.canvas_length), None)).float().cpu())
    err = float((out[0] - out[1]).norm() / out[0].norm())
    check(f"one decoder pass, {device.type} bf16 vs cpu float32", err < 0.05, f"relative error {err:.2e} (L2 over the logits)")


@guarded
@torch.no_grad()
def engine_step_and_graphs(device: torch.device) -> None:
    net = tiny_model(device, torch.float32)
    engine = Engine(net, EngineOptions(triton=True, block_size=8, batch_invariant=False, kv_cache_memory=2**26))
    runner, cfg = engine.runner, net.config
    c = cfg.canvas_length
    rows = [engine.encode_prefix(list(range(k, k + length))) for k, length in ((3, 11), (5, 47), (9, 2))]
    g = torch.Generator().manual_seed(2)
    graphs = DecoderGraphs(buckets=(4,), capture=cuda_capture if device.type == "cuda" else eager_capture)
    worst_graph, agree = 0.0, []
    for group in ([rows[1]], [rows[2], rows[0], rows[1]], [rows[0], rows[2]]):
        canvas = torch.randint(0, cfg.vocab_size, (len(group), c), generator=g).to(device)
        soft = (torch.randn(len(group), c, cfg.hidden_size, generator=g) * 0.1).to(device)
        temps = (torch.rand(len(group) * c, 1, generator=g) + 0.2).to(device)
        kernel = runner.decoder_step(canvas, soft, temps, runner.cache.plan_canvas(c, group))
        gathered = runner.decoder_step(canvas, soft, temps, runner.cache.plan_decoder(c, group))
        agree.append(float((kernel[0] == gathered[0]).float().mean()))
        replayed = [t.clone() for t in graphs.run(runner, [SimpleNamespace(kv=kv) for kv in group], canvas, soft, temps)]
        # relative to each output's scale: padded rows change a matmul's blocking, hence its rounding
        worst_graph = max(worst_graph, max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                                           for a, b in zip(replayed, kernel)))  # fmt: skip
    check("paged attention step vs gathered SDPA", min(agree) > 0.95, f"argmax agreement {min(agree):.1%} (random tiny model)")
    check(f"graph replay vs eager ({'CUDA graph' if device.type == 'cuda' else 'replayed eagerly'})",
          worst_graph < 1e-3 and list(graphs.captured) == [4], f"3 groups, 1 capture, max difference {worst_graph:.1e} of scale")  # fmt: skip


# ------------------------------------------------------------------------------------ the table
def copy_bandwidth(device: torch.device, gib: float) -> float:
    """Bytes per second moved by a device-to-device copy (read + write counted)."""
    a = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
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
def build(size: str, device: torch.device, scheme: str | None) -> DiffusionGemma:
    """Random weights of a preset size, in bf16 or built directly quantised (no bf16 copy)."""
    config = make_config(**PRESETS[size])
    if scheme is not None:
        from dgemma.quant.modules import random_quantized_model

        return random_quantized_model(config, scheme, None, torch.bfloat16, device=device).eval()
    with torch.device("meta"):
        net = DiffusionGemma(config)
    gen = torch.Generator(device=device).manual_seed(0)
    for module in net.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            value = torch.randn(p.shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02 if p.dim() >= 2 else \
                torch.ones(p.shape, device=device, dtype=torch.bfloat16)  # fmt: skip
            module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
        for name, b in list(module.named_buffers(recurse=False)):
            module._buffers[name] = torch.ones(b.shape, device=device, dtype=torch.bfloat16)
    return net.eval()


def weight_bytes(net: DiffusionGemma) -> int:
    from dgemma.quant.modules import weight_bytes as parts

    return sum(parts(net).values())


@torch.no_grad()
def step_ms(engine: Engine, kv, batch: int, graphs: bool, iters: int) -> float:
    """ms per decoder step (decode, LM head, statistics, self-conditioning input) of `batch`
    canvases after the prefix `kv` (rows share it: a decoder pass only reads the cache)."""
    runner, cfg = engine.runner, engine.runner.config
    device, c = runner.net.device, cfg.canvas_length
    canvas = torch.randint(0, cfg.vocab_size, (batch, c), device=device)
    soft = torch.zeros(batch, c, cfg.hidden_size, device=device, dtype=runner.net.dtype)
    temps = torch.full((batch * c, 1), 0.6, device=device)

    group = [SimpleNamespace(kv=kv) for _ in range(batch)]  # what the graphs read of a request
    if graphs:
        buckets = DecoderGraphs(buckets=(batch,), capture=cuda_capture if device.type == "cuda" else eager_capture)

        def step():
            return buckets.run(runner, group, canvas, soft, temps)
    else:

        def step():
            return runner.decoder_step(canvas, soft, temps, runner.cache.plan_canvas(c, [kv] * batch))

    for _ in range(1 if SMOKE else 3):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    synchronize(device)
    return 1000 * (time.perf_counter() - start) / iters


def table(device: torch.device, size: str, prompt_len: int, batches: list[int], iters: int) -> None:
    bw = copy_bandwidth(device, 4.0 if device.type == "cuda" else 0.1)
    print(f"\ncopy bandwidth {bw / 1e12:.3f} TB/s; size {size}, prompt {prompt_len}, canvas {PRESETS[size]['canvas_length']}")
    print(f"{'weights':>8} {'batch':>5} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'graph/floor':>11}")
    for scheme in (None, "fp8"):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            net = build(size, device, scheme)
            nbytes = weight_bytes(net)
            engine = Engine(net, EngineOptions(triton=True, batch_invariant=False, prefix_cache=False,
                                               kv_cache_memory=4 * 2**30 if device.type == "cuda" else 2**26))  # fmt: skip
            prompt = torch.randint(0, net.config.vocab_size, (prompt_len,)).tolist()
            kv = engine.encode_prefix(prompt)
            floor = 1000 * nbytes / bw
            for batch in batches:
                eager = step_ms(engine, kv, batch, graphs=False, iters=iters)
                try:
                    graph = f"{step_ms(engine, kv, batch, graphs=True, iters=iters):9.2f}"
                    ratio = f"{float(graph) / floor:11.2f}"
                except Exception as e:  # noqa: BLE001 - report it, keep measuring
                    graph, ratio = f"{'failed':>9}", f"  ({type(e).__name__}: {str(e)[:100]})"
                print(f"{scheme or 'bf16':>8} {batch:5d} {eager:9.2f} {graph} {floor:9.2f} {ratio}", flush=True)
            engine.release_prefix(kv)
            decode_rate(net, prompt, scheme)
            if device.type == "cuda":
                print(f"{'':>8} peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB ({nbytes / 2**30:.1f} GiB of weights)")
            del net, engine
        except Exception as e:  # noqa: BLE001
            print(f"{scheme or 'bf16':>8} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            FAILED.append(f"table {scheme or 'bf16'}")


@torch.no_grad()
def decode_rate(net: DiffusionGemma, prompt: list[int], scheme: str | None) -> None:
    """Decode tokens/s at 16 fixed denoising steps (--smoke: 2), batch 1, through the engine
    (prefill included)."""
    c, steps = net.config.canvas_length, 2 if SMOKE else 16
    cfg = GenerationConfig(max_new_tokens=(1 if SMOKE else 2) * c, max_denoising_steps=steps, confidence_threshold=1e-30,
                           eos_token_ids=())  # fmt: skip
    kv_memory = 4 * 2**30 if net.device.type == "cuda" else 2**26
    client = EngineClient(Engine(net, EngineOptions(triton=True, batch_invariant=False, prefix_cache=False, kv_cache_memory=kv_memory)))
    if not SMOKE:
        client.finish([Request(prompt, cfg, 0)])  # warm-up (graph captures)
    synchronize(net.device)
    start = time.perf_counter()
    out = client.finish([Request(prompt, cfg, 0)])[0]
    synchronize(net.device)
    seconds = time.perf_counter() - start
    print(f"{scheme or 'bf16':>8} engine: {len(out.tokens)} tokens at {steps} fixed steps after a {len(prompt)}-token prompt: "
          f"{len(out.tokens) / seconds:.0f} tok/s incl. prefill ({seconds:.2f} s, {out.decoder_passes} passes)", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="on a CPU: the interpreter, the 'test' size, graphs replayed eagerly")
    p.add_argument("--size", default=None, help="table model size (default: real; --smoke: test)")
    p.add_argument("--prompt-len", type=int, default=None, help="table prompt length (default: 4096; --smoke: 24)")
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("scripts/gpu_check.py needs a CUDA GPU (or --smoke for a CPU run)")
    device = torch.device("cpu" if args.smoke else "cuda")
    import triton

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {name}", flush=True)
    start = time.perf_counter()
    kernels_vs_torch(device)
    pass_vs_cpu(device)
    engine_step_and_graphs(device)
    print(f"checks: {len(FAILED)} failed ({time.perf_counter() - start:.0f} s)", flush=True)
    size = args.size or ("test" if args.smoke else "real")
    prompt_len = args.prompt_len or (24 if args.smoke else 4096)
    table(device, size, prompt_len, [1] if args.smoke else [1, 4, 8], 1 if args.smoke else 10)
    print(f"done in {time.perf_counter() - start:.0f} s; {'FAILED: ' + ', '.join(FAILED) if FAILED else 'all checks passed'}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()

"""The one prepared GPU check: correctness of the GPU path, then its speed, in one run.

The device plan: a lent GPU machine is rare and short (a session gets about 15 minutes of device
time, at most 8 minutes a call, and the machine takes minutes to start), so the check is ONE call,
from the repository root, under a timeout that leaves time to read what came back:

    PYTHONUNBUFFERED=1 timeout 470 python3 scripts/gpu_check.py     # 3-4 min expected, unmeasured

It needs only torch, triton, safetensors and tokenizers (the lent machine's image: torch 2.11,
triton 3.6) and imports no server code. A hang is not silent: every 120 s (--hang-dump) and on
`timeout`'s SIGTERM every thread's traceback goes to stderr. Triton's compiled kernels go to
.cache/triton in the repository (ignored by git; TRITON_CACHE_DIR, unless set), so a second call on
the same warm machine skips the compiles. Each section's seconds are printed after it. It prints:

1. checks, each PASS or FAIL with its error: the Triton kernels against the torch code they
   replace, on the device (step statistics, sampling, norm + RoPE, the MoE block in bf16 against
   float32 of the same bf16 values); one decoder pass of the shipped dgemma-tiny on the GPU in bf16
   against the CPU in float32 (relative L2 error under 5%); in bf16, the engine's decoder step with
   the paged attention kernel against the gathered-SDPA step, and a bucketed CUDA graph's replays
   (other groups, other prefix lengths, one with allowed-token masks through the masked graph)
   against eager steps, both on the bucket's padded inputs (the capture itself: near-exact) and on
   the group's own (padding changes bf16 rounding). A bucket that did not capture is a FAIL with
   the capture's error, never a timing of nothing;
2. a table: copy bandwidth; ms per decoder step of the real-size model at batch 1, 4 and 8 in bf16
   and FP8 (eager and CUDA graph) next to the weight-read floor (weight bytes / copy bandwidth);
   the first eager step of each runs under torch.cuda.set_sync_debug_mode("error"), so a host sync
   inside the step is a FAIL with its stack; decode tokens/s at 16 fixed steps after a 4096-token
   prompt (a FAIL if the engine's graphs did not capture); peak memory.

`--smoke` runs the same code on a CPU in under a minute (Triton's interpreter, the "test" size,
graph replays run eagerly): the test suite does, so the script cannot rot between the rare
sessions with a GPU. Exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on the CPU
# compiled kernels kept in the repository (ignored by git): a second call on the same machine skips the compiles
os.environ.setdefault("TRITON_CACHE_DIR", str(ROOT / ".cache" / "triton"))

sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dgemma.config import GenerationConfig  # noqa: E402
from dgemma.engine import sampler  # noqa: E402
from dgemma.engine.client import EngineClient  # noqa: E402
from dgemma.engine.engine import Engine, EngineOptions, Request  # noqa: E402
from dgemma.engine.device_step import eager_step, run_step  # noqa: E402
from dgemma.engine.graphs import DecoderGraphs, cuda_capture, eager_capture  # noqa: E402
from dgemma.dense.kv_cache import DenseKVCache  # noqa: E402
from dgemma.engine.prefill import prefill  # noqa: E402
from dgemma.kernels import triton_layer, triton_step  # noqa: E402
from dgemma.model import rope  # noqa: E402
from dgemma.model.checkpoint import make_config  # noqa: E402
from dgemma.model.diffusion_gemma import DiffusionGemma, Experts  # noqa: E402
from dgemma.model.layers import RMSNorm  # noqa: E402
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


@contextlib.contextmanager
def section(name: str):
    """Print how many seconds the block took (also when it raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        print(f"[{time.perf_counter() - start:.1f} s] {name}", flush=True)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


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
        p.data = (torch.randn(p.shape, generator=g) * 0.05).to(device, torch.bfloat16)
    n = 256 if not SMOKE else 12
    tokens = torch.randn(n, cfg.hidden_size, generator=g).to(device, torch.bfloat16)
    logits = torch.randn(n, cfg.num_experts, generator=g).to(device)
    w, idx = logits.softmax(-1).topk(cfg.top_k_experts, dim=-1)
    with torch.no_grad():  # bf16, the path a user runs (float32 takes torch's fallback grouped matmul)
        got, torch_bf16 = triton_layer.moe_experts(experts, tokens, idx, w), experts(tokens, idx, w)
        exact = copy.deepcopy(experts).float()(tokens.float(), idx, w)  # float32 of the same bf16 values
    err, torch_err = relative(got, exact), relative(torch_bf16, exact)
    check("MoE block", got.dtype == torch.bfloat16 and err < 2e-2,
          f"bf16, max error {err:.2e} of the largest value vs float32 (torch's bf16 path: {torch_err:.2e})")  # fmt: skip


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


def random_masks(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Packed allowed-token masks int32 [rows, ceil(V / 32)] (bit t % 32 of word t // 32), each
    token allowed with probability 1/2."""
    words = -(-vocab // 32)
    bits = torch.zeros(rows, words * 32, dtype=torch.bool)
    bits[:, :vocab] = torch.rand(rows, vocab, generator=g) < 0.5
    packed = (bits.view(rows, words, 32).long() << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def requests_at(net, kvs, canvas, soft, seed: int) -> list:
    """Requests as the device step reads them (engine/step_inputs.py, device_step.py): row i of
    `canvas` / `soft` after prefix kvs[i], mid-block, no history, nothing fixed."""
    gen = GenerationConfig(max_denoising_steps=16)
    return [SimpleNamespace(kv=kv, config=gen, step=3, seed=seed * 100 + i, passes=5, block_passes=2, canvas=canvas[i],
                            soft=None if soft is None else soft[i], history=None, active_constraints=None)
            for i, kv in enumerate(kvs)]  # fmt: skip


def device_outputs(out, n: int, c: int) -> tuple:
    """A device step's argmax, entropies (as shown), probabilities and self-conditioning input of
    its first n rows, as `compare` reads them."""
    canvas, argmax, history, stop, kept, shown, soft_next, probs = out
    return argmax[:n], shown[:n], probs[: n * c], soft_next[:n]


def compare(got, want) -> tuple[float, float]:
    """(argmax agreement, worst relative L2 difference of the float outputs) of two decoder steps'
    outputs (argmax, entropy, weights, total, self-conditioning input)."""
    agree = float((got[0] == want[0]).float().mean())
    return agree, max(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)) for a, b in zip(got[1:], want[1:]))


@guarded
@torch.no_grad()
def engine_step_and_graphs(device: torch.device) -> None:
    """In bf16 (the path a user runs): the paged attention step against gathered SDPA, and
    bucketed graph replays (three groups in one 4-row bucket at other prefix lengths, the last with
    allowed-token masks through the masked graph; --smoke: a 2-row bucket, groups of 1, 2, 1)
    against the eager step on the group's own inputs and on the bucket's padded inputs (the same
    kernels and shapes as the capture).

    Tolerances: this random tiny model in bf16 is rough (either attention path is 4-8% L2 off
    float32 in its hidden states on a CPU), so two paths of the same step (paged vs gathered; the
    padded replay vs the group's own step, whose matmuls block differently) may differ by up to
    20% L2 and flip near-tied argmaxes, while a wrong prefix or stale input is ~90% off (measured
    on a CPU: 7e-2 vs 0.9); a replay against the eager step on the very same inputs must agree
    (1% L2, at least 90% of argmaxes: expected bitwise); no replay may pick a masked-out token.
    (--smoke: the eager step on the bucket's inputs runs for the masked group only: an eager
    replay is that step by construction.)"""
    net = tiny_model(device, torch.bfloat16)
    engine = Engine(net, EngineOptions(triton=True, block_size=8, batch_invariant=False, kv_cache_memory=2**26))
    runner, cfg = engine.runner, net.config
    c = cfg.canvas_length
    rows = [engine.encode_prefix(list(range(k, k + length))) for k, length in ((3, 11), (5, 47), (9, 2))]
    g = torch.Generator().manual_seed(2)
    bucket = 2 if SMOKE else 4  # the interpreter's time grows with the rows
    graphs = DecoderGraphs(buckets=(bucket,), capture=cuda_capture if device.type == "cuda" else eager_capture)
    paths, own, same, banned, missing = [], [], [], 0, {}
    for k, group in enumerate(([rows[1]], [rows[2], rows[0], rows[1]][:bucket], [rows[0], rows[2]][: bucket - 1])):
        n, masked = len(group), k == 2
        canvas = torch.randint(0, cfg.vocab_size, (n, c), generator=g).to(device)
        soft = (torch.randn(n, c, cfg.hidden_size, generator=g) * 0.1).to(device, net.dtype)
        temps = (torch.rand(n * c, 1, generator=g) + 0.2).to(device)
        allowed = random_masks(n * c, cfg.vocab_size, g).to(device) if masked else None
        kernel = runner.decoder_step(canvas, soft, temps, runner.cache.plan_canvas(c, group), allowed)
        if not masked:
            paths.append(compare(kernel, runner.decoder_step(canvas, soft, temps, runner.cache.plan_decoder(c, group))))
        reqs = requests_at(net, group, canvas, soft, k)
        out = graphs.run(runner, reqs, allowed)
        if out is None:  # a FAIL with the capture's error, not a comparison with nothing
            reason = graphs.failures.get((bucket, masked))
            missing[masked] = f"the {bucket}-row {'masked ' if masked else ''}bucket did not capture: {reason}"
            continue
        replayed = device_outputs([t.clone() for t in out], n, c)
        own.append(compare(replayed, device_outputs(eager_step(runner, reqs, allowed), n, c)))
        if device.type == "cuda" or masked:
            entry = graphs.steps[(bucket, masked)]
            same.append(compare(replayed, device_outputs(run_step(runner, entry.static), n, c)))
        if masked:
            picked = replayed[0].reshape(-1).cpu()
            banned = int((((allowed.cpu()[torch.arange(n * c), picked // 32] >> (picked % 32)) & 1) == 0).sum())
    agree, diff = min(a for a, _ in paths), max(d for _, d in paths)
    check("paged attention step vs gathered SDPA", diff < 0.2,
          f"bf16, {diff:.1e} L2 apart, argmax agreement {agree:.1%} (random tiny model)")  # fmt: skip
    name = f"graph replay vs eager ({'CUDA graph' if device.type == 'cuda' else 'replayed eagerly'})"
    if missing:
        check(name, False, "; ".join(missing.values())[:500])
        return
    same_agree, same_diff = min(a for a, _ in same), max(d for _, d in same)
    own_agree, own_diff = min(a for a, _ in own), max(d for _, d in own)
    ok = same_agree >= 0.9 and same_diff < 1e-2 and own_diff < 0.2 and banned == 0
    ok = ok and sorted(graphs.steps) == [(bucket, False), (bucket, True)] and not graphs.failures
    check(name, ok,
          f"bf16, 3 groups in a {bucket}-row bucket (1 masked, 2 captures); vs eager on the bucket's inputs "
          f"{same_diff:.1e} L2 apart, argmax {same_agree:.1%} equal; vs the group's own {own_diff:.1e}, "
          f"{own_agree:.1%}; {banned} masked-out tokens picked")  # fmt: skip


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
    """ms per decoder step (engine/device_step.py: its inputs' copy, the pass, LM head,
    statistics, self-conditioning input, sampling and decisions) of `batch` canvases after the
    prefix `kv` (rows share it: a decoder pass only reads the cache)."""
    runner, cfg = engine.runner, engine.runner.config
    device, c = runner.net.device, cfg.canvas_length
    canvas = torch.randint(0, cfg.vocab_size, (batch, c), device=device)
    soft = torch.zeros(batch, c, cfg.hidden_size, device=device, dtype=runner.net.dtype)
    group = requests_at(runner.net, [kv] * batch, canvas, soft, 0)
    if graphs:
        buckets = DecoderGraphs(buckets=(batch,), capture=cuda_capture if device.type == "cuda" else eager_capture)

        def step():
            out = buckets.run(runner, group)
            if out is None:  # not a timing of nothing
                raise RuntimeError(f"no CUDA graph for batch {batch}: {buckets.failures.get((batch, False), 'not captured')}")
            return out
    else:

        def step():
            return eager_step(runner, group, None)

        if device.type == "cuda":
            without_host_sync(step, f"the eager step at batch {batch}")
    for _ in range(1 if SMOKE else 3):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    synchronize(device)
    return 1000 * (time.perf_counter() - start) / iters


def without_host_sync(step, what: str) -> None:
    """Run `step()` once under torch.cuda.set_sync_debug_mode("error"): a host sync inside it
    raises where it happens, which is a FAIL with that stack (and the run goes on)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except Exception as e:  # noqa: BLE001 - report it with its stack, keep measuring
        check(f"no host sync in {what}", False, f"{type(e).__name__}: {str(e)[:200]}")
        print(traceback.format_exc()[-4000:], flush=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def table(device: torch.device, size: str, prompt_len: int, batches: list[int], iters: int) -> None:
    bw = copy_bandwidth(device, 4.0 if device.type == "cuda" else 0.1)
    print(f"\ncopy bandwidth {bw / 1e12:.3f} TB/s; size {size}, prompt {prompt_len}, canvas {PRESETS[size]['canvas_length']}")
    print(f"{'weights':>8} {'batch':>5} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'graph/floor':>11}")
    for scheme in (None, "fp8"):
        with section(f"table, {scheme or 'bf16'}"):
            table_rows(device, size, prompt_len, batches, iters, bw, scheme)


def table_rows(device: torch.device, size: str, prompt_len: int, batches: list[int], iters: int, bw: float, scheme) -> None:
    """The table's rows of one weight scheme (None: bf16), then the engine's decode rate."""
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
            except Exception as e:  # noqa: BLE001 - a FAIL with its reason; keep measuring
                graph, ratio = f"{'failed':>9}", f"  ({type(e).__name__}: {str(e)[:300]})"
                FAILED.append(f"graph {scheme or 'bf16'} batch {batch}")
            print(f"{scheme or 'bf16':>8} {batch:5d} {eager:9.2f} {graph} {floor:9.2f} {ratio}", flush=True)
        engine.release_prefix(kv)
        del engine
        decode_rate(net, prompt, scheme)
        if device.type == "cuda":
            print(f"{'':>8} peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB ({nbytes / 2**30:.1f} GiB of weights)")
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
    graphs = getattr(client.engine.runner, "graphs", None)
    if graphs is not None and graphs.failures:
        check(f"{scheme or 'bf16'} engine's CUDA graphs", False, "; ".join(f"{k}: {v}" for k, v in graphs.failures.items())[:300])
    print(f"{scheme or 'bf16':>8} engine: {len(out.tokens)} tokens at {steps} fixed steps after a {len(prompt)}-token prompt: "
          f"{len(out.tokens) / seconds:.0f} tok/s incl. prefill ({seconds:.2f} s, {out.decoder_passes} passes)", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="on a CPU: the interpreter, the 'test' size, graphs replayed eagerly")
    p.add_argument("--size", default=None, help="table model size (default: real; --smoke: test)")
    p.add_argument("--prompt-len", type=int, default=None, help="table prompt length (default: 4096; --smoke: 24)")
    p.add_argument("--hang-dump", type=float, default=None,
                   help="seconds between dumps of every thread's traceback, for a hang (default: 120; --smoke: 600)")  # fmt: skip
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("scripts/gpu_check.py needs a CUDA GPU (or --smoke for a CPU run)")
    # a hang shows where every thread is: periodically, and when `timeout` kills the run
    faulthandler.dump_traceback_later(args.hang_dump or (600.0 if args.smoke else 120.0), repeat=True)
    if hasattr(faulthandler, "register"):  # not on Windows
        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    try:
        run_all(args)
    finally:
        faulthandler.cancel_dump_traceback_later()
    sys.exit(1 if FAILED else 0)


def run_all(args) -> None:
    device = torch.device("cpu" if args.smoke else "cuda")
    import triton

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    cache = os.environ["TRITON_CACHE_DIR"]
    print(f"torch {torch.__version__}, triton {triton.__version__}, {name}; TRITON_CACHE_DIR {cache}", flush=True)
    start = time.perf_counter()
    for check_fn, what in ((kernels_vs_torch, "kernels vs torch"), (pass_vs_cpu, "decoder pass vs cpu"),
                           (engine_step_and_graphs, "engine step and graphs")):  # fmt: skip
        with section(what):
            check_fn(device)
    print(f"checks: {len(FAILED)} failed ({time.perf_counter() - start:.0f} s)", flush=True)
    size = args.size or ("test" if args.smoke else "real")
    prompt_len = args.prompt_len or (24 if args.smoke else 4096)
    table(device, size, prompt_len, [1] if args.smoke else [1, 4, 8], 1 if args.smoke else 10)
    print(f"done in {time.perf_counter() - start:.0f} s; {'FAILED: ' + ', '.join(FAILED) if FAILED else 'all checks passed'}")


if __name__ == "__main__":
    main()

"""The whole device measurement in one call: the GPU path's correctness, then where its time goes.

The device plan: a lent GPU machine is rare and short (a session gets about 15 minutes of device
time, at most 10 minutes a call, and the machine takes minutes to start), so the check is ONE call,
from the repository root, with a timeout that leaves time to rerun it:

    set -o pipefail; PYTHONUNBUFFERED=1 timeout 420 python3 scripts/gpu_check.py --out $OUT 2>&1 | tee $OUT/gpu_check.log

Its measurements stop starting after --budget seconds (330: under 6 minutes with the checks),
each skipped one saying so. It needs only torch, triton, safetensors and tokenizers (the lent
machine's image: torch 2.11, triton 3.6) and imports no server code. A hang is not silent: every
120 s (--hang-dump) and on `timeout`'s SIGTERM every thread's traceback goes to stderr. Triton's
compiled kernels go to .cache/triton in the repository (ignored by git; TRITON_CACHE_DIR, unless
set), so a second call on the same warm machine skips the compiles. Each section's seconds are
printed after it ("[12.3 s] step table bf16"). It prints:

1. checks, each PASS or FAIL with its error: the Triton kernels against the torch code they
   replace, on the device (step statistics, sampling, norm + RoPE, the MoE block in bf16 against
   float32 of the same bf16 values); one decoder pass of the shipped dgemma-tiny on the GPU in bf16
   against the CPU in float32 (relative L2 error under 5%); in bf16, the engine's decoder step with
   the paged attention kernel against the gathered-SDPA step, and a bucketed CUDA graph's replays
   (other groups, other prefix lengths, one with allowed-token masks through the masked graph)
   against eager steps, both on the bucket's padded inputs (the capture itself: near-exact) and on
   the group's own (padding changes bf16 rounding). A bucket that did not capture is a FAIL with
   the capture's error, never a timing of nothing;
2. per weight scheme (bf16, nvfp4, fp8, int4: random weights of the released size built on the
   device, measured, freed):
   - the step table: ms per decoder step after prompts of 512 and 4096 tokens (each encoded as
     the scheduler encodes it, in prefill chunks), eager at batch 1 (its first step under
     torch.cuda.set_sync_debug_mode("error"): a host sync in it is a FAIL with its stack) and
     under a CUDA graph at batch 1, 4 and 8 (median of CUDA-event-timed steps), each next to its
     floor (weight bytes / the measured copy bandwidth) and their ratio;
   - bf16 and nvfp4: a profile of one graph replay at batch 1 (torch.profiler sees the kernels
     inside a graph): the top 15 kernels by GPU time, their count, the achieved GB/s of each GEMM
     whose weight bytes one eager step attributes to its kernel's name (Triton kernels; cuBLAS
     GEMMs only together, the others "n/a"); the replay's median time over 20 CUDA-event-timed
     replays after warm-up;
   - with `--roofline FILE` (the JSON of `python scripts/roofline.py --json --kind step --batch 1`,
     written on any machine with triton 3.9: the roofline PREDICTED from the sm90 compile), every
     scheme is profiled and each kernel's measured time is printed beside its predicted one
     (Triton kernels by name; cuBLAS's GEMMs together; torch's own kernels together);
   - engine decode tokens/s through `dgemma.benchmark.run_dgemma` (tokens after every row's first
     block over the time after it, as vLLM counts; 16 fixed steps, 512-token prompt, 512 new
     tokens; one engine reused, its graphs captured by an untimed warm-up): bf16's default, turbo
     and AR peers at batch 1 and 16 (AR: 64 tokens), the other schemes' default at batch 1;
3. the PTX of every quantised GEMM variant the run compiled (read from Triton's JIT cache: what
   this machine's triton made), gzipped under --out (default ./gpu_check_out);
4. one line per target of the open GPU issues (46 and 47, "Targets on an H200"): met or not, with
   the figure; and every figure as JSON in --out/gpu_check.json.

`--smoke` runs the same code on a CPU (Triton's interpreter, the "test" size, graphs replayed
eagerly, bf16 and nvfp4, prompts of 24 and 96 tokens in 16-token prefill chunks so the sliding
window's reservation binds): the test suite does, so the script cannot rot between the rare
sessions with a GPU. Exit code 1 when a check or a section fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import json
import os
import re
import signal
import statistics
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on the CPU
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the test suite's processes share 2 cores: one thread each
# compiled kernels kept in the repository (ignored by git): a second call on the same machine skips the compiles
os.environ.setdefault("TRITON_CACHE_DIR", str(ROOT / ".cache" / "triton"))

sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from dgemma.api import Model  # noqa: E402
from dgemma.benchmark import BenchEngine, bench_kv_memory, random_weights, run_dgemma  # noqa: E402
from dgemma.config import GenerationConfig  # noqa: E402
from dgemma.dense.kv_cache import DenseKVCache  # noqa: E402
from dgemma.engine import sampler  # noqa: E402
from dgemma.engine.engine import Engine, EngineOptions  # noqa: E402
from dgemma.engine.fused.graphs import DecoderGraphs, cuda_capture, eager_capture  # noqa: E402
from dgemma.engine.fused.step import eager_step, run_step  # noqa: E402
from dgemma.engine.options import DEFAULT_PREFILL_CHUNK  # noqa: E402
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
    check(
        "step statistics",
        bool((argmax == ref.argmax).all()) and err < 1e-4,
        f"argmax equal, entropy max error {err:.2e}",
    )
    u = torch.rand(rows, generator=g).to(device)
    agree = float(
        (triton_step.sample_rows(probs, total, u) == sampler.sample_from_weights(ref.weights, u)).float().mean()
    )
    check("sampling", agree > 0.95, f"{agree:.1%} of rows pick the torch token")
    uniforms, noise = triton_step.philox_draws(
        torch.tensor([1, 1], device=device), torch.tensor([0, 0], device=device), 256, vocab
    )
    check(
        "philox",
        bool(torch.equal(uniforms[0], uniforms[1])) and 0.4 < float(uniforms.mean()) < 0.6,
        "per-request streams",
    )

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
    check(
        "MoE block",
        got.dtype == torch.bfloat16 and err < 2e-2,
        f"bf16, max error {err:.2e} of the largest value vs float32 (torch's bf16 path: {torch_err:.2e})",
    )


def tiny_model(device: torch.device, dtype: torch.dtype, seed: int = 0) -> DiffusionGemma:
    torch.manual_seed(seed)
    net = DiffusionGemma(make_config(**PRESETS["test"]))
    for p in net.parameters():
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
        out.append(
            net.logits(net.decode(canvas.to(net.device), cache.plan_decoder(cfg.canvas_length), None)).float().cpu()
        )
    err = float((out[0] - out[1]).norm() / out[0].norm())
    check(
        f"one decoder pass, {device.type} bf16 vs cpu float32",
        err < 0.05,
        f"relative error {err:.2e} (L2 over the logits)",
    )


def random_masks(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Packed allowed-token masks int32 [rows, ceil(V / 32)] (bit t % 32 of word t // 32), each
    token allowed with probability 1/2."""
    words = -(-vocab // 32)
    bits = torch.zeros(rows, words * 32, dtype=torch.bool)
    bits[:, :vocab] = torch.rand(rows, vocab, generator=g) < 0.5
    packed = (bits.view(rows, words, 32).long() << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def compare(got, want) -> tuple[float, float]:
    """(argmax agreement, worst relative L2 difference of the float outputs) of two decoder steps'
    outputs (argmax, entropy, weights, total, self-conditioning input)."""
    agree = float((got[0] == want[0]).float().mean())
    return agree, max(
        float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)) for a, b in zip(got[1:], want[1:])
    )


def requests_at(net, kvs, canvas, soft, seed: int) -> list:
    """Requests as the device step reads them (engine/fused/inputs.py, engine/fused/step.py): row i of
    `canvas` / `soft` after prefix kvs[i], mid-block, no history, nothing fixed."""
    gen = GenerationConfig(max_denoising_steps=16)
    return [
        SimpleNamespace(
            kv=kv,
            config=gen,
            step=3,
            seed=seed * 100 + i,
            passes=5,
            block_passes=2,
            canvas=canvas[i],
            soft=None if soft is None else soft[i],
            history=None,
            active_constraints=None,
            adapter_slot=-1,  # no LoRA adapter
        )
        for i, kv in enumerate(kvs)
    ]


def device_outputs(out, n: int, c: int) -> tuple:
    """A device step's argmax, entropies (as shown), probabilities and self-conditioning input of
    its first n rows, as `compare` reads them."""
    canvas, argmax, history, stop, kept, shown, soft_next, probs = out
    return argmax[:n], shown[:n], probs[: n * c], soft_next[:n]


def engine_with_prefixes(net: DiffusionGemma) -> tuple:
    """The Triton path's runner on `net` and three encoded prefixes of 11, 47 and 2 tokens (their
    SequenceBlocks), for the engine-step checks."""
    engine = Engine(net, EngineOptions(triton=True, block_size=8, batch_invariant=False, kv_cache_memory=2**26))
    return engine.runner, [engine.encode_prefix(list(range(k, k + length))) for k, length in ((3, 11), (5, 47), (9, 2))]


def paged_vs_gathered(device: torch.device) -> tuple[float, float]:
    """(argmax agreement, worst relative L2) of the paged attention step against gathered SDPA in
    float32, three groups at other prefix lengths. float32, not bf16: on this random tiny model
    bf16's rounding alone moved the two paths 25% L2 apart (2 of 8 argmaxes) on a CPU, where
    float32 agreed to 3e-6; a wrong prefix or position is ~90% off either way. (On a GPU the
    GEMMs' float32 is TF32: ~1e-3.)"""
    net = tiny_model(device, torch.float32)
    runner, rows = engine_with_prefixes(net)
    cfg, c = net.config, net.config.canvas_length
    g = torch.Generator().manual_seed(2)
    found = []
    for group in ([rows[1]], [rows[2], rows[0]], [rows[0], rows[2], rows[1]]):
        n = len(group)
        canvas = torch.randint(0, cfg.vocab_size, (n, c), generator=g).to(device)
        soft = (torch.randn(n, c, cfg.hidden_size, generator=g) * 0.1).to(device)
        temps = (torch.rand(n * c, 1, generator=g) + 0.2).to(device)
        paged = runner.ops.decoder_step(canvas, soft, temps, runner.cache.plan_canvas(c, group))
        found.append(compare(paged, runner.ops.decoder_step(canvas, soft, temps, runner.cache.plan_decoder(c, group))))
    return min(a for a, _ in found), max(d for _, d in found)


@guarded
@torch.no_grad()
def engine_step_and_graphs(device: torch.device) -> None:
    """The paged attention step against gathered SDPA (float32: `paged_vs_gathered`), and in bf16
    (the path a user runs) bucketed graph replays (three groups in one 4-row bucket at other prefix lengths, the last with
    allowed-token masks through the masked graph; --smoke: a 2-row bucket, groups of 1, 2, 1)
    against the eager step on the group's own inputs and on the bucket's padded inputs (the same
    kernels and shapes as the capture).

    Tolerances: this random tiny model in bf16 is rough (either attention path is 4-8% L2 off
    float32 in its hidden states on a CPU), so two paths of the same step (the padded replay vs
    the group's own step, whose matmuls block differently) may differ by up to
    20% L2 and flip near-tied argmaxes, while a wrong prefix or stale input is ~90% off (measured
    on a CPU: 7e-2 vs 0.9); a replay against the eager step on the very same inputs must agree
    (1% L2, at least 90% of argmaxes: expected bitwise); no replay may pick a masked-out token.
    (--smoke: the eager step on the bucket's inputs runs for the masked group only: an eager
    replay is that step by construction.)"""
    net = tiny_model(device, torch.bfloat16)
    runner, rows = engine_with_prefixes(net)
    cfg, c = net.config, net.config.canvas_length
    g = torch.Generator().manual_seed(2)
    bucket = 2 if SMOKE else 4  # the interpreter's time grows with the rows
    graphs = DecoderGraphs(buckets=(bucket,), capture=cuda_capture if device.type == "cuda" else eager_capture)
    own, same, banned, missing = [], [], 0, {}
    for k, group in enumerate(([rows[1]], [rows[2], rows[0], rows[1]][:bucket], [rows[0], rows[2]][: bucket - 1])):
        n, masked = len(group), k == 2
        canvas = torch.randint(0, cfg.vocab_size, (n, c), generator=g).to(device)
        soft = (torch.randn(n, c, cfg.hidden_size, generator=g) * 0.1).to(device, net.dtype)
        allowed = random_masks(n * c, cfg.vocab_size, g).to(device) if masked else None
        reqs = requests_at(net, group, canvas, soft, k)
        out = graphs.run(runner.ops, reqs, allowed)
        if out is None:  # a FAIL with the capture's error, not a comparison with nothing
            reason = graphs.failures.get((bucket, masked))
            missing[masked] = f"the {bucket}-row {'masked ' if masked else ''}bucket did not capture: {reason}"
            continue
        replayed = device_outputs([t.clone() for t in out], n, c)
        own.append(compare(replayed, device_outputs(eager_step(runner.ops, reqs, allowed), n, c)))
        if device.type == "cuda" or masked:
            entry = graphs.steps[(bucket, masked)]
            same.append(compare(replayed, device_outputs(run_step(runner.ops, entry.static), n, c)))
        if masked:
            picked = replayed[0].reshape(-1).cpu()
            banned = int((((allowed.cpu()[torch.arange(n * c), picked // 32] >> (picked % 32)) & 1) == 0).sum())
    agree, diff = paged_vs_gathered(device)
    check(
        "paged attention step vs gathered SDPA",
        diff < 1e-2 and agree >= 0.9,
        f"float32, {diff:.1e} L2 apart, argmax agreement {agree:.1%} (random tiny model)",
    )
    name = f"graph replay vs eager ({'CUDA graph' if device.type == 'cuda' else 'replayed eagerly'})"
    if missing:
        check(name, False, "; ".join(missing.values())[:500])
        return
    same_agree, same_diff = min(a for a, _ in same), max(d for _, d in same)
    own_agree, own_diff = min(a for a, _ in own), max(d for _, d in own)
    ok = same_agree >= 0.9 and same_diff < 1e-2 and own_diff < 0.2 and banned == 0
    ok = ok and sorted(graphs.steps) == [(bucket, False), (bucket, True)] and not graphs.failures
    check(
        name,
        ok,
        f"bf16, 3 groups in a {bucket}-row bucket (1 masked, 2 captures); vs eager on the bucket's inputs "
        f"{same_diff:.1e} L2 apart, argmax {same_agree:.1%} equal; vs the group's own {own_diff:.1e}, "
        f"{own_agree:.1%}; {banned} masked-out tokens picked",
    )


# ------------------------------------------------------------------------------------ settings
ALL_SCHEMES = "bf16,nvfp4,fp8,int4"  # bf16 first, then the 4-bit build a 24 GB card holds


class Settings(NamedTuple):
    """What one run measures (the device run's defaults; `--smoke`: the same code at CPU sizes)."""

    device: torch.device
    size: str
    schemes: list  # None is bf16; bf16 first: its sections come first if the budget runs out
    prompts: list[int]  # the step table's prefix lengths; the first one also the engine runs' prompt
    batches: list[int]  # the step table's batches (graph steps; eager at batch 1)
    engine_batches: list[int]  # the engine's decode rates (bf16: every peer; other schemes: batch 1)
    new_tokens: int  # per request of the engine runs
    steps: int  # fixed denoising steps per canvas
    ar_tokens: int  # new tokens of an AR run
    prefill_chunk: int  # below the prompts on --smoke, so the sliding reservation binds
    group_size: int | None  # int4's
    iters: int  # timed steps of one table cell (median) ...
    step_seconds: float  # ... or fewer (at least 2) where they would take longer than this
    replays: int  # CUDA-event-timed graph replays of the profile (median)
    out: Path
    deadline: float  # time.perf_counter() past which the measurements not yet begun are skipped
    roofline: dict | None = None  # scripts/roofline.py's JSON (--roofline): predicted times beside the profile's

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        return self.deadline - time.perf_counter()


def settings_from(args) -> Settings:
    smoke = args.smoke
    # --smoke: the two schemes the profile covers (fp8 and int4 take the same code with another build)
    schemes = [
        None if s == "bf16" else s for s in (args.schemes or ("bf16,nvfp4" if smoke else ALL_SCHEMES)).split(",")
    ]
    return Settings(
        device=torch.device("cpu" if smoke else "cuda"),
        size=args.size or ("test" if smoke else "real"),
        schemes=schemes,
        prompts=[int(n) for n in (args.prompt_lens or ("24,96" if smoke else "512,4096")).split(",")],
        batches=[1] if smoke else [1, 4, 8],
        engine_batches=[1, 2] if smoke else [1, 16],
        new_tokens=16 if smoke else 512,
        steps=1 if smoke else 16,
        ar_tokens=3 if smoke else 64,
        prefill_chunk=16 if smoke else DEFAULT_PREFILL_CHUNK,
        group_size=16 if smoke else None,
        iters=1 if smoke else 20,
        step_seconds=0.0 if smoke else 1.0,
        replays=1 if smoke else 20,
        out=Path(args.out),
        deadline=time.perf_counter() + args.budget,
        roofline=json.loads(Path(args.roofline).read_text()) if args.roofline else None,
    )


def name_of(scheme: str | None) -> str:
    return scheme or "bf16"


# ------------------------------------------------------------------------------------ the step table
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


def build(size: str, device: torch.device, scheme: str | None, group_size: int | None = None) -> DiffusionGemma:
    """Random weights of a preset size built on the device, in bf16 or directly quantised (no bf16
    copy): `dgemma bench`'s own builder."""
    return random_weights(make_config(**PRESETS[size]), device, torch.bfloat16, scheme, group_size)


def weight_bytes(net: DiffusionGemma) -> int:
    from dgemma.quant.modules import weight_bytes as parts

    return sum(parts(net).values())


def median_ms(step, iters: int, device: torch.device, seconds: float = 0.0) -> float:
    """Median ms of `step()`: CUDA events around each call on a GPU (no host sync between calls),
    wall time elsewhere; `iters` calls, or fewer (at least 2) where they would take over `seconds`
    (judged from the first)."""
    times, pairs = [], []
    for i in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            pairs.append((start, end))
            if i == 0 and seconds:
                end.synchronize()
                iters = max(2, min(iters, int(seconds / max(start.elapsed_time(end) / 1000, 1e-6))))
        else:
            began = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - began))
            if i == 0 and seconds:
                iters = max(2, min(iters, int(seconds / max(times[0] / 1000, 1e-6))))
        if i + 1 >= iters:
            break
    if pairs:
        pairs[-1][1].synchronize()
        times = [a.elapsed_time(b) for a, b in pairs]
    return statistics.median(times)


@torch.no_grad()
def step_ms(
    engine: Engine, kv, batch: int, graphs: bool, iters: int, buckets: DecoderGraphs | None = None, seconds: float = 0.0
) -> float:
    """Median ms per decoder step (engine/fused/step.py: its inputs' copy, the pass, LM head,
    statistics, self-conditioning input, sampling and decisions) of `batch` canvases after the
    prefix `kv` (rows share it: a decoder pass only reads the cache), eager or replaying a CUDA graph (`buckets`' graph of that batch, captured on first use; a
    capture that fails raises with its reason: never a timing of nothing)."""
    step = decoder_step(engine, kv, batch, graphs, buckets)
    for _ in range(0 if SMOKE else 3):  # --smoke: the interpreter's time is the check's; a capture runs the step once
        step()
    synchronize(engine.device)
    return median_ms(step, iters, engine.device, seconds)


def decoder_step(engine: Engine, kv, batch: int, graphs: bool, buckets: DecoderGraphs | None = None):
    """`step()`: one decoder step of `batch` canvases after `kv`, eager or by a graph replay."""
    runner, cfg = engine.runner, engine.runner.config
    device, c = runner.net.device, cfg.canvas_length
    canvas = torch.randint(0, cfg.vocab_size, (batch, c), device=device)
    soft = torch.zeros(batch, c, cfg.hidden_size, device=device, dtype=runner.net.dtype)
    group = requests_at(runner.net, [kv] * batch, canvas, soft, 0)
    if graphs:
        buckets = buckets or DecoderGraphs(
            buckets=(batch,), capture=cuda_capture if device.type == "cuda" else eager_capture
        )

        def step():
            out = buckets.run(runner.ops, group)
            if out is None:  # not a timing of nothing
                key = (buckets.bucket(batch), False)
                raise RuntimeError(f"no CUDA graph for batch {batch}: {buckets.failures.get(key, 'not captured')}")
            return out

        return step

    def step():
        return eager_step(runner.ops, group, None)

    if device.type == "cuda":
        without_host_sync(step, f"the eager step at batch {batch}")
    return step


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


def table_engine(net: DiffusionGemma, s: Settings) -> Engine:
    """An engine whose KV pool holds one prefix of each table prompt (the rows of a batch share it)."""
    block = net.config.canvas_length
    memory = bench_kv_memory(net.kv_config, net.dtype, block, len(s.prompts), max(s.prompts) + block)
    return Engine(
        net,
        EngineOptions(
            triton=True,
            batch_invariant=False,
            prefix_cache=False,
            kv_cache_memory=memory,
            prefill_chunk=s.prefill_chunk,
        ),
    )


TABLE_HEADER = (
    f"{'weights':>8} {'prompt':>6} {'batch':>5} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'graph/floor':>11}"
)


def table_rows(engine: Engine, s: Settings, scheme, floor: float, buckets: DecoderGraphs, report: dict) -> dict:
    """The step table's rows of one scheme: each prompt's prefix encoded (in the scheduler's
    chunks), then the eager step at batch 1 and a graph step at every batch. Returns the prefixes
    by length (the caller releases them). --smoke: the long prompt in bf16 only, the eager step
    once (the interpreter's time)."""
    prefixes = {}
    for length in s.prompts if not (SMOKE and scheme is not None) else s.prompts[:1]:
        if s.left() < 0:
            print(f"{name_of(scheme):>8} {length:6d} skipped: past --budget", flush=True)
            continue
        prompt = torch.randint(
            0, engine.runner.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length)
        )
        began = time.perf_counter()
        prefixes[length] = kv = engine.encode_prefix(prompt.tolist())
        synchronize(s.device)
        print(
            f"{name_of(scheme):>8} {length:6d} prefix encoded in {time.perf_counter() - began:.2f} s "
            f"({-(-length // s.prefill_chunk)} chunks)",
            flush=True,
        )
        for batch in s.batches:
            if s.left() < 0:
                print(f"{name_of(scheme):>8} {length:6d} {batch:5d} skipped: past --budget", flush=True)
                continue
            eager = f"{'-':>9}"
            if batch == 1 and not (SMOKE and length != s.prompts[0]):
                eager = f"{step_ms(engine, kv, batch, False, s.iters, seconds=s.step_seconds):9.2f}"
            try:
                ms = step_ms(engine, kv, batch, True, s.iters, buckets, s.step_seconds)
                graph, ratio = f"{ms:9.2f}", f"{ms / floor:11.2f}"
                report["step"][(name_of(scheme), length, batch)] = ms
            except Exception as e:  # noqa: BLE001 - a FAIL with its reason; keep measuring
                graph, ratio = f"{'failed':>9}", f"  ({type(e).__name__}: {str(e)[:300]})"
                FAILED.append(f"graph {name_of(scheme)} prompt {length} batch {batch}")
            print(f"{name_of(scheme):>8} {length:6d} {batch:5d} {eager} {graph} {floor:9.2f} {ratio}", flush=True)
    return prefixes


# ------------------------------------------------------------------------------------ the profile
GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm"}
GEMM_NAME = re.compile(r"gemm|matmul|xmma|cutlass|nvjet|wgmma|grouped_mm|scaled_mm|aten::(?:mm|addmm|bmm)$", re.I)


class WeightReads(TorchDispatchMode):
    """Weight bytes each kernel reads in one eager step, by the name the profiler gives it: an
    ATen GEMM's ("aten::mm") weight operands, and a Triton kernel's weight arguments (by its
    function's name, which is its CUDA kernel's). A weight is a tensor on a parameter's or
    buffer's storage. The library kernels an ATen GEMM runs on a GPU have other names: those are
    only attributed together."""

    def __init__(self, net: DiffusionGemma):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in list(net.parameters()) + list(net.buffers())}
        self.by_name: Counter = Counter()

    def weight_bytes(self, values) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in values
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in GEMM_OPS:
            self.by_name[f"aten::{name}"] += self.weight_bytes(list(args) + list(kwargs.values()))
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def recording(self):
        """Inside: ATen GEMMs and Triton launches (compiled or interpreted) are counted."""
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        saved = [(cls, cls.run) for cls in (JITFunction, InterpretedFunction)]

        def counted(run):
            def launch(fn, *args, **kwargs):
                self.by_name[fn.__name__] += self.weight_bytes(list(args) + list(kwargs.values()))
                return run(fn, *args, **kwargs)

            return launch

        try:
            for cls, run in saved:
                cls.run = counted(run)
            with self:
                yield self
        finally:
            for cls, run in saved:
                cls.run = run


def kernel_times(prof, cuda: bool) -> list[tuple[str, int, float]]:
    """(name, count, microseconds) per kernel of a profile, most time first: the device's kernels
    (and copies) on a GPU, each op's own CPU time elsewhere."""
    from torch.autograd import DeviceType

    rows: dict[str, list] = {}
    if cuda:
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                row = rows.setdefault(e.name, [0, 0.0])
                row[0] += 1
                row[1] += e.time_range.elapsed_us()
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                rows[e.key] = [e.count, e.self_cpu_time_total]
    return sorted(((k, n, us) for k, (n, us) in rows.items()), key=lambda r: -r[2])


@torch.no_grad()
def profile_replay(engine: Engine, kv, buckets: DecoderGraphs, scheme, s: Settings, report: dict) -> None:
    """One graph replay at batch 1 under torch.profiler (which sees the kernels inside a graph):
    the top 15 kernels by GPU time (CPU time on --smoke), their count, achieved GB/s of each GEMM
    whose weight bytes one eager step attributes to its name (else n/a), and the replay's median
    time over `s.replays` CUDA-event-timed replays after warm-up."""
    from torch.profiler import ProfilerActivity, profile

    reads = WeightReads(engine.runner.net)
    with reads.recording():
        decoder_step(engine, kv, 1, False)()
    step = decoder_step(engine, kv, 1, True, buckets)
    for _ in range(0 if SMOKE else 3):
        step()
    synchronize(s.device)
    ms = median_ms(step, s.replays, s.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.cuda else [])
    with profile(activities=activities) as prof:
        step()
        synchronize(s.device)
    kernels = kernel_times(prof, s.cuda)
    if not kernels:
        raise RuntimeError("the profiler saw no kernels in the replay")
    total = sum(us for _, _, us in kernels)
    where = "GPU" if s.cuda else "CPU (self)"
    print(
        f"{name_of(scheme)}: one graph replay at batch 1, prompt {kv.length}: {ms:.2f} ms (median of {s.replays}, "
        f"{'CUDA events' if s.cuda else 'wall'}); profiled {len(kernels)} kernels, {sum(n for _, n, _ in kernels)} "
        f"launches, {total / 1000:.2f} ms {where} time",
        flush=True,
    )
    print(f"  {'kernel':60s} {'count':>5} {'ms':>8} {'share':>6} {'GB/s':>8}")
    top = []
    for name, count, us in kernels[:15]:
        nbytes = reads.by_name.get(name, 0)
        rate = (
            f"{nbytes / (us * 1e-6) / 1e9:8.1f}" if nbytes and us else f"{'n/a' if GEMM_NAME.search(name) else '':>8}"
        )
        print(f"  {name[:60]:60s} {count:5d} {us / 1000:8.3f} {us / max(total, 1e-9):6.1%} {rate}")
        top.append({"kernel": name, "count": count, "us": us, "weight_bytes": nbytes or None})
    named = {name for name, _, _ in kernels}
    gemm_us = sum(us for name, _, us in kernels if GEMM_NAME.search(name) and name not in reads.by_name)
    library = sum(
        v for k, v in reads.by_name.items() if k.startswith("aten::") and k not in named
    )  # on a GPU: all of them
    if gemm_us and library:
        print(
            f"  library GEMM kernels together (n/a above): {library / 1e9:.2f} GB of weights in {gemm_us / 1000:.3f} ms "
            f"= {library / (gemm_us * 1e-6) / 1e9:.0f} GB/s"
        )
    report["profile"][name_of(scheme)] = {"replay_ms": ms, "kernels": top, "weight_bytes_by_name": dict(reads.by_name)}
    if s.roofline is not None:
        scenario = f"step {name_of(scheme)} batch 1"
        summary = next((x for x in s.roofline.get("scenarios", []) if x["scenario"] == scenario), None)
        if summary is None:
            print(f"  predicted: the roofline given has no '{scenario}'", flush=True)
            return
        rows = beside_prediction(kernels, summary)
        print(
            f"  measured beside the roofline's PREDICTION ({scenario}, prefix {summary['prefix']}; this replay's prefix {kv.length}):"
        )
        print(prediction_table(rows, ms, summary["predicted_ms"]), flush=True)
        report["profile"][name_of(scheme)]["predicted"] = rows


def roofline_group(name: str, predicted: dict) -> str:
    """The roofline's name for a profiled kernel: a Triton kernel's own (its CUDA name starts with
    it), "cuBLAS" for the library's GEMMs, "torch ops" for the rest (copies included)."""
    triton_names = sorted((k for k in predicted if k.startswith("_")), key=len, reverse=True)
    found = next((k for k in triton_names if name == k or name.startswith(k + "_") or name.startswith(k + "(")), None)
    if found:
        return found
    return "cuBLAS" if GEMM_NAME.search(name) else "torch ops"


def beside_prediction(kernels: list[tuple[str, int, float]], summary: dict) -> list[dict]:
    """Measured microseconds per roofline kernel name (a profile's `kernel_times`) beside the
    roofline's predicted ones (scripts/roofline.py's JSON for one step), most measured first."""
    predicted = summary["predicted_us_by_kernel"]
    launches: dict[str, int] = {}
    for k in summary["kernels"]:
        name = (
            "cuBLAS"
            if k["kernel"].startswith("cuBLAS")
            else "torch ops"
            if k["kernel"].startswith("torch")
            else k["kernel"]
        )
        launches[name] = launches.get(name, 0) + k["launches"]
    measured: dict[str, list] = {}
    for name, count, us in kernels:
        row = measured.setdefault(roofline_group(name, predicted), [0, 0.0])
        row[0] += count
        row[1] += us
    names = sorted(
        set(measured) | set(predicted), key=lambda n: -max(measured.get(n, [0, 0.0])[1], predicted.get(n, 0.0))
    )
    return [
        dict(
            kernel=n,
            measured_count=measured.get(n, [0, 0.0])[0],
            measured_us=measured.get(n, [0, 0.0])[1],
            predicted_launches=launches.get(n, 0),
            predicted_us=predicted.get(n),
        )
        for n in names
    ]


def prediction_table(rows: list[dict], replay_ms: float, predicted_ms: float) -> str:
    lines = [
        f"    {'kernel':28s} {'measured n':>10} {'ms':>8} {'predicted n':>11} {'predicted ms':>12} {'measured/predicted':>18}"
    ]
    for r in rows:
        ratio = f"{r['measured_us'] / r['predicted_us']:.2f}" if r["predicted_us"] and r["measured_us"] else "-"
        pred = f"{r['predicted_us'] / 1000:12.3f}" if r["predicted_us"] is not None else f"{'-':>12}"
        lines.append(
            f"    {r['kernel'][:28]:28s} {r['measured_count']:10d} {r['measured_us'] / 1000:8.3f} "
            f"{r['predicted_launches']:11d} {pred} {ratio:>18}"
        )
    lines.append(
        f"    {'the step':28s} {'':10s} {replay_ms:8.3f} {'':11s} {predicted_ms:12.3f} {replay_ms / predicted_ms:18.2f}"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ engine decode rates
def engine_model(net: DiffusionGemma, s: Settings) -> Model:
    model = Model(net, GenerationConfig(eos_token_ids=(), pad_token_id=0))
    model.engine_options = EngineOptions(triton=True, batch_invariant=False, prefill_chunk=s.prefill_chunk)
    return model


def engine_runs(scheme, s: Settings) -> list[tuple[str, str, dict | None, int]]:
    """(peer, mode, turbo knobs, batch) of a scheme's engine runs: bf16 the default, turbo and AR
    peers at each engine batch, the others the default at batch 1. --smoke: bf16's default and
    turbo at the larger batch, AR at 1 (nvfp4 runs the default at 1: the interpreter's time)."""
    if scheme is not None:
        return [("dgemma", "diffusion", None, 1)]
    runs = [
        (peer, mode, turbo, b)
        for b in s.engine_batches
        for peer, mode, turbo in (
            ("dgemma", "diffusion", None),
            ("dgemma-turbo", "diffusion", {}),
            ("dgemma-ar", "ar", None),
        )
    ]
    if SMOKE:
        small, large = s.engine_batches[0], s.engine_batches[-1]
        runs = [r for r in runs if (r[1] == "ar") == (r[3] == small) or small == large]
    return runs


def engine_rates(net: DiffusionGemma, scheme, s: Settings, report: dict) -> None:
    """Decode tokens/s through `benchmark.run_dgemma` (vLLM's definition: tokens after every row's
    first block over the time after it), `s.steps` fixed steps, the first table prompt, one engine
    reused (its graphs captured by an untimed warm-up, outside the timed runs)."""
    model = engine_model(net, s)
    runs = engine_runs(scheme, s)
    prompt_len, largest = s.prompts[0], max(b for *_, b in runs)
    bench = BenchEngine.build(model, largest, prompt_len, s.new_tokens)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, net.config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(largest)]
    for peer, mode, turbo, batch in runs:
        if s.left() < 0:
            print(f"{name_of(scheme):>8} {peer} batch {batch}: skipped, past --budget", flush=True)
            continue
        new = s.ar_tokens if mode == "ar" else s.new_tokens
        r = run_dgemma(model, prompts[:batch], new, s.steps, False, mode, turbo=turbo, engine=bench)
        report["decode"][(name_of(scheme), peer, batch)] = r.decode_tps
        per_token = f" ({1000 * batch / r.decode_tps:.1f} ms a token)" if mode == "ar" and r.decode_tps else ""
        print(
            f"{name_of(scheme):>8} {peer} batch {batch}: decode {r.decode_tps:.0f} tok/s{per_token}, tokens after the "
            f"first block over the time after it; {r.tokens} tokens in {r.seconds:.2f} s, ttft {r.ttft:.2f} s, "
            f"encoder {r.encoder_seconds:.2f} s, {r.ms_per_step:.1f} ms a step, {r.decoder_passes} passes",
            flush=True,
        )
    graphs = getattr(bench.engine.runner, "graphs", None)
    if graphs is not None and graphs.failures:
        check(
            f"{name_of(scheme)} engine's CUDA graphs",
            False,
            "; ".join(f"{k}: {v}" for k, v in graphs.failures.items())[:300],
        )


# ------------------------------------------------------------------------------------ PTX
QUANT_KERNEL_MODULES = ("dgemma.kernels.triton_quant",)  # and any other dgemma.kernels module named *quant*


def compiled_kernels(functions) -> list[tuple[str, str, object]]:
    """(function name, cache key, CompiledKernel) of every kernel Triton's JIT compiled for
    `functions` (JITFunctions, or autotuners / heuristics around one): read from each one's
    per-device cache, whose first mapping holds the compiled kernels (triton 3.x)."""
    found = []
    for fn in functions:
        while not hasattr(fn, "device_caches") and hasattr(fn, "fn"):
            fn = fn.fn
        for caches in getattr(fn, "device_caches", {}).values():
            table = next((c for c in (caches if isinstance(caches, tuple) else (caches,)) if isinstance(c, dict)), {})
            for key, kernel in table.items():
                if hasattr(kernel, "asm"):
                    found.append((getattr(fn, "__name__", "?"), str(key), kernel))
    return found


def quant_functions() -> list:
    """The Triton kernels of the quantised GEMMs' modules (whatever their names)."""
    import importlib

    from triton.runtime.jit import KernelInterface

    for name in QUANT_KERNEL_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    modules = [
        m
        for name, m in list(sys.modules.items())
        if name in QUANT_KERNEL_MODULES or (name.startswith("dgemma.kernels.") and "quant" in name)
    ]
    return [v for m in modules for v in vars(m).values() if isinstance(v, KernelInterface)]


def write_ptx(s: Settings, report: dict) -> None:
    """The PTX of every quantised GEMM variant compiled in this run, in one gzipped text file
    under --out (what the machine's triton made; a CPU's triton is newer)."""
    import gzip

    functions = quant_functions()
    kernels = compiled_kernels(functions)
    s.out.mkdir(parents=True, exist_ok=True)
    path = s.out / "quant_gemm_ptx.txt.gz"
    with gzip.open(path, "wt") as f:
        for name, key, kernel in kernels:
            warps = getattr(getattr(kernel, "metadata", None), "num_warps", "?")
            f.write(f"// ===== {name}  num_warps={warps}  key={key}\n{kernel.asm.get('ptx', '// no ptx')}\n")
    names = sorted({name for name, _, _ in kernels})
    report["ptx"] = {"file": str(path), "variants": len(kernels), "kernels": names}
    if kernels:
        print(f"PTX of {len(kernels)} quantised GEMM variants ({', '.join(names)}) written to {path}", flush=True)
        return
    how = "the Triton interpreter compiles nothing" if SMOKE else "no quantised GEMM kernel was compiled"
    print(
        f"PTX: none ({how}); {len(functions)} Triton functions in the quantised GEMMs' modules; {path} is empty",
        flush=True,
    )
    if not SMOKE and any(scheme in ("int4", "nvfp4") for scheme in s.schemes):
        FAILED.append("PTX of the quantised GEMMs")


# ------------------------------------------------------------------------------------ targets
# The open GPU issues' targets on an H200 ("Targets on an H200" of issues 46 and 47): a benchmark,
# reported here, never a test. (issue, what, kind of figure, its key, comparison, bound, unit)
TARGETS = [
    ("46", "bf16 graph step, batch 1", "step", ("bf16", 1), "<=", 14.0, "ms"),
    ("46", "fp8 graph step, batch 1", "step", ("fp8", 1), "<=", 7.0, "ms"),
    ("46", "int4 graph step, batch 1", "step", ("int4", 1), "<=", 4.5, "ms"),
    ("46", "nvfp4 graph step, batch 1", "step", ("nvfp4", 1), "<=", 4.5, "ms"),
    ("46", "bf16 decode, batch 1", "decode", ("bf16", 1), ">=", 1100, "tok/s"),
    ("46", "fp8 decode, batch 1", "decode", ("fp8", 1), ">=", 2200, "tok/s"),
    ("46", "int4 decode, batch 1", "decode", ("int4", 1), ">=", 3400, "tok/s"),
    ("46", "nvfp4 decode, batch 1", "decode", ("nvfp4", 1), ">=", 3400, "tok/s"),
    ("47", "AR, bf16, batch 1", "ar_ms", ("bf16", 1), "<=", 4.0, "ms a token"),
    ("47", "turbo / default decode, bf16, batch 1", "turbo", ("bf16", 1), ">=", 1.0, "x"),
    ("47", "turbo / default decode, bf16, batch 16", "turbo", ("bf16", 16), ">=", 1.3, "x"),
]


def target_value(report: dict, kind: str, key: tuple, s: Settings) -> float | None:
    """The figure a target is judged on (None: not measured). --smoke: its small batches stand in
    for 1 and 16."""
    scheme, batch = key
    batch = {1: s.engine_batches[0], 16: s.engine_batches[-1]}.get(batch, batch) if kind != "step" else batch
    decode = report["decode"]
    if kind == "step":
        return report["step"].get((scheme, s.prompts[0], batch))
    if kind == "decode":
        return decode.get((scheme, "dgemma", batch))
    if kind == "ar_ms":
        rate = decode.get((scheme, "dgemma-ar", batch))
        return 1000 * batch / rate if rate else None
    turbo, default = decode.get((scheme, "dgemma-turbo", batch)), decode.get((scheme, "dgemma", batch))
    return turbo / default if turbo and default else None


def print_targets(report: dict, s: Settings) -> None:
    print(
        f"targets of the open GPU issues (graph steps at prompt {s.prompts[0]}; decode at {s.steps} fixed steps, "
        f"prompt {s.prompts[0]}, {s.new_tokens} new tokens):",
        flush=True,
    )
    for issue, what, kind, key, op, bound, unit in TARGETS:
        value = target_value(report, kind, key, s)
        if value is None:
            verdict = "not measured"
        else:
            met = value <= bound if op == "<=" else value >= bound
            verdict = f"{'met' if met else 'NOT met'} ({value:.2f} {unit})"
        report["targets"].append({"issue": issue, "target": f"{what} {op} {bound} {unit}", "value": value})
        print(f"  issue {issue}: {what} {op} {bound} {unit}: {verdict}", flush=True)


# ------------------------------------------------------------------------------------ the run
def measure(s: Settings, report: dict) -> None:
    """The step table, the profile and the engine's decode rates, one scheme at a time (built on
    the device, measured, freed)."""
    bw = copy_bandwidth(s.device, 4.0 if s.cuda else 0.1)
    report["copy_bandwidth"] = bw
    print(
        f"\ncopy bandwidth {bw / 1e12:.3f} TB/s; size {s.size}, canvas {PRESETS[s.size]['canvas_length']}, "
        f"prefill chunk {s.prefill_chunk}",
        flush=True,
    )
    print(TABLE_HEADER, flush=True)
    for scheme in s.schemes:
        if s.left() < 0:
            print(f"{name_of(scheme):>8} skipped: past --budget", flush=True)
            continue
        if s.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        net = None
        try:
            with section(f"build {name_of(scheme)}"):
                net = build(s.size, s.device, scheme, s.group_size if scheme == "int4" else None)
                synchronize(s.device)
            nbytes = weight_bytes(net)
            floor = 1000 * nbytes / bw
            engine = table_engine(net, s)
            buckets = DecoderGraphs(buckets=tuple(s.batches), capture=cuda_capture if s.cuda else eager_capture)
            with section(f"step table {name_of(scheme)}"):
                prefixes = table_rows(engine, s, scheme, floor, buckets, report)
            profiled = scheme in (None, "nvfp4") or s.roofline is not None  # with predictions: every scheme
            if profiled and s.prompts[0] in prefixes and s.left() > 0:
                with section(f"profile {name_of(scheme)}"):
                    guarded_profile(engine, prefixes[s.prompts[0]], buckets, scheme, s, report)
            for kv in prefixes.values():
                engine.release_prefix(kv)
            del engine, buckets, prefixes  # the table's graphs and KV pool go before the engine runs'
            with section(f"engine decode {name_of(scheme)}"):
                engine_rates(net, scheme, s, report)
            if s.cuda:
                print(
                    f"{name_of(scheme):>8} peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB "
                    f"({nbytes / 2**30:.1f} GiB of weights)",
                    flush=True,
                )
        except Exception as e:  # noqa: BLE001 - a FAIL with its reason; the next scheme is measured
            print(f"{name_of(scheme):>8} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            print(traceback.format_exc()[-3000:], flush=True)
            FAILED.append(f"measurement {name_of(scheme)}")
        finally:
            del net  # the next scheme's weights get the memory


def guarded_profile(engine, kv, buckets, scheme, s: Settings, report: dict) -> None:
    try:
        profile_replay(engine, kv, buckets, scheme, s, report)
    except Exception as e:  # noqa: BLE001 - a FAIL with its reason; keep measuring
        check(f"profile {name_of(scheme)}", False, f"{type(e).__name__}: {str(e)[:300]}")
        print(traceback.format_exc()[-3000:], flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--smoke", action="store_true", help="on a CPU: the interpreter, the 'test' size, graphs replayed eagerly"
    )
    p.add_argument("--size", default=None, help="model size of the measurements (default: real; --smoke: test)")
    p.add_argument(
        "--prompt-lens",
        default=None,
        help="the step table's prompts, comma separated (default: 512,4096; --smoke: 24,96)",
    )
    p.add_argument(
        "--schemes", default=None, help=f"weights measured, in order (default: {ALL_SCHEMES}; --smoke: bf16,nvfp4)"
    )
    p.add_argument(
        "--out", default="gpu_check_out", help="folder for the PTX and the figures' JSON (default: ./gpu_check_out)"
    )
    p.add_argument(
        "--budget",
        type=float,
        default=330.0,
        help="seconds after which measurements not yet begun are skipped, each with a line (default: 330)",
    )
    p.add_argument(
        "--roofline",
        default=None,
        help="scripts/roofline.py's JSON (--json --kind step --batch 1): predicted times beside the profile's",
    )
    p.add_argument(
        "--hang-dump",
        type=float,
        default=None,
        help="seconds between dumps of every thread's traceback, for a hang (default: 120; --smoke: 600)",
    )
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("scripts/gpu_check.py needs a CUDA GPU (or --smoke for a CPU run)")
    unknown = sorted(set((args.schemes or ALL_SCHEMES).split(",")) - set(ALL_SCHEMES.split(",")))
    if unknown:
        p.error(f"--schemes takes bf16, fp8, int4, nvfp4 (got {', '.join(unknown)})")
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
    s = settings_from(args)
    import triton

    name = torch.cuda.get_device_name() if s.cuda else "cpu (Triton interpreter)"
    cache = os.environ["TRITON_CACHE_DIR"]
    print(f"torch {torch.__version__}, triton {triton.__version__}, {name}; TRITON_CACHE_DIR {cache}", flush=True)
    start = time.perf_counter()
    for check_fn, what in (
        (kernels_vs_torch, "kernels vs torch"),
        (pass_vs_cpu, "decoder pass vs cpu"),
        (engine_step_and_graphs, "engine step and graphs"),
    ):
        with section(what):
            check_fn(s.device)
    print(f"checks: {len(FAILED)} failed ({time.perf_counter() - start:.0f} s)", flush=True)
    report = {"device": name, "step": {}, "decode": {}, "profile": {}, "targets": []}
    s.out.mkdir(parents=True, exist_ok=True)
    measure(s, report)
    for what, fn in (("PTX", write_ptx), ("targets", lambda s, report: print_targets(report, s))):
        with section(what):
            try:
                fn(s, report)
            except Exception as e:  # noqa: BLE001 - a FAIL with its reason; the figures are still written
                check(what, False, f"{type(e).__name__}: {str(e)[:300]}")
    report["failed"] = list(FAILED)
    (s.out / "gpu_check.json").write_text(json.dumps(jsonable(report), indent=1))
    print(
        f"done in {time.perf_counter() - start:.0f} s; {'FAILED: ' + ', '.join(FAILED) if FAILED else 'all checks passed'}"
    )


def jsonable(value):
    """The report with tuple keys joined (JSON keys are strings)."""
    if isinstance(value, dict):
        return {(" ".join(map(str, k)) if isinstance(k, tuple) else k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


if __name__ == "__main__":
    main()

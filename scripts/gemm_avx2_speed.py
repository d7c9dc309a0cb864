"""Speed of the native AVX2 GEMMs on stored weights (kernels/csrc/gemm_avx2.cpp) against oneDNN's
float32 GEMM on a weight packed once (the float32 model's path), torch's F.linear and the widened
path (bf16 weight rows widened tile by tile + torch.mm). Milliseconds per call (over
interleaved rounds; by default the 10th percentile of all calls: a shared machine's noise hits
every variant alike and only ever slows a call; with --threads 1, the thread's CPU time) and the
ratio to packed.

Run on an AVX2-only CPU, or emulate one on a newer CPU:

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 python scripts/gemm_avx2_speed.py

Options: --rounds R (default 7), --shapes M,K,N [M,K,N ...], --only name[,name...], --threads T,
--stat p10|median.

Then the soft embedding, probs [M, vocab] @ E [vocab, hidden] with E bf16 as stored: gemm_bf16_nn
against packed float32 (E widened and transposed once) and WidenedSoftEmbed (--soft-shapes
M,vocab,hidden ...; default 256,32768,1024; --soft-shapes with no value: none).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from dgemma.kernels import avx2, cpu
from dgemma.kernels.native import cpu_model
from dgemma.kernels.widened import WidenedLinear, WidenedSoftEmbed
from dgemma.quant import formats

SHAPES = [
    (32, 1024, 1024),
    (32, 512, 1024),
    (256, 1024, 1024),
    (256, 1024, 2048),
    (256, 2048, 1024),
    (256, 1024, 32768),
]


def timer(fn, clock, min_seconds: float = 0.15, min_calls: int = 2) -> list[float]:
    """ms of each call of fn, over enough calls to last min_seconds of `clock`."""
    samples, start = [], clock()
    while len(samples) < min_calls or clock() - start < min_seconds:
        t = clock()
        fn()
        samples.append(1e3 * (clock() - t))
    return samples


def variants(m: int, k: int, n: int, ext):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    w_bf16 = w.bfloat16()
    w_f32 = w_bf16.float()
    packed = cpu._pack(w_f32)
    widened = WidenedLinear(w_bf16)
    out = torch.empty(m, n)
    q8 = formats.quantize(w, "int8")
    q4 = formats.quantize(w, "int4", formats.DEFAULT_GROUP_SIZE, torch.bfloat16)
    qf8 = formats.quantize(w, "fp8")
    v = {
        "packed f32": lambda: cpu._packed_matmul(x, packed),
        "F.linear f32": lambda: F.linear(x, w_f32),
        "widened bf16": lambda: widened(x),
    }
    if ext is not None:
        s4 = q4.parts["weight_scale"]
        v |= {
            "gemm_bf16": lambda: ext.gemm_bf16(x, w_bf16, out),
            "gemm_int8": lambda: ext.gemm_int8(x, q8.parts["weight"], q8.parts["weight_scale"], out),
            "gemm_int4": lambda: ext.gemm_int4(x, q4.parts["weight_packed"], s4, k // s4.shape[-1], out),
            "gemm_fp8": lambda: ext.gemm_fp8(x, qf8.parts["weight"].view(torch.uint8), qf8.parts["weight_scale"], out),
        }
        if k % 16 == 0:
            qn = formats.quantize(w, "nvfp4")
            gs = qn.parts["weight_global_scale"].item()
            sn = qn.parts["weight_scale"].view(torch.uint8)
            v["gemm_nvfp4"] = lambda: ext.gemm_nvfp4(x, qn.parts["weight_packed"], sn, gs, out)
        # a check that each computes the product (loose: bf16 / quantised weights vs float32)
        exact = x.double() @ w_f32.double().T
        got = ext.gemm_bf16(x, w_bf16, out)
        assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max(), "gemm_bf16 disagrees with the reference"
    return v


def soft_variants(m: int, vocab: int, hidden: int, ext):
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(m, vocab, generator=g), -1)
    table = (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16()
    packed = cpu._pack(table.float().t().contiguous())
    widened = WidenedSoftEmbed(table)
    out = torch.empty(m, hidden)
    v = {"packed f32": lambda: cpu._packed_matmul(probs, packed), "widened soft-embed": lambda: widened(probs)}
    if ext is not None:
        v["gemm_bf16_nn"] = lambda: ext.gemm_bf16_nn(probs, table, out)
        exact = probs.double() @ table.double()
        got = ext.gemm_bf16_nn(probs, table, out)
        assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max(), (
            "gemm_bf16_nn disagrees with the reference"
        )
    return v


def measure(v: dict, rounds: int, clock, stat) -> tuple[float, str]:
    for fn in v.values():  # warm up (first-call packing, buffers, the pool)
        fn()
    times: dict[str, list[float]] = {name: [] for name in v}
    for r in range(rounds):
        names = list(v) if r % 2 == 0 else list(reversed(v))
        for name in names:
            times[name] += timer(v[name], clock)
    med = {name: stat(t) for name, t in times.items()}
    base = med["packed f32"]
    return base, "  ".join(f"{name} {t:7.3f} ({t / base:4.2f}x)" for name, t in med.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", nargs="*", help="M,K,N triples")
    parser.add_argument("--only", help="comma-separated variant names (packed f32 always runs)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument(
        "--stat",
        choices=("p10", "median"),
        default="p10",
        help="per variant, the 10th percentile of its calls (default: robust to other load) or the median",
    )
    parser.add_argument("--soft-shapes", nargs="*", default=["256,32768,1024"], help="M,vocab,hidden triples")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    ext = avx2.extension()
    # one thread: its own CPU time (a shared machine's other load then only costs cache state);
    # more: wall time
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    stat = (lambda t: sorted(t)[len(t) // 10]) if args.stat == "p10" else statistics.median
    env = " ".join(
        f"{k}={os.environ[k]}"
        for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
        if k in os.environ
    )
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; env: {env or '(none)'}")
    print(f"native GEMMs: {'built' if ext is not None else 'unavailable (torch variants only)'}")
    what = "thread CPU time" if clock is time.thread_time else "wall time"
    print(f"ms per call ({what}), {args.stat} of the calls of {args.rounds} interleaved rounds (ratio to packed f32)\n")
    for m, k, n in shapes:
        v = variants(m, k, n, ext)
        if args.only:
            keep = {"packed f32", *args.only.split(",")}
            v = {name: fn for name, fn in v.items() if name in keep}
        base, cells = measure(v, args.rounds, clock, stat)
        gflops = 2 * m * k * n / base / 1e6
        print(f"M={m:4d} K={k:5d} N={n:6d} [packed {gflops:5.1f} GFLOP/s]  {cells}")
    for m, vocab, hidden in (tuple(int(v) for v in s.split(",")) for s in args.soft_shapes):
        base, cells = measure(soft_variants(m, vocab, hidden, ext), args.rounds, clock, stat)
        gflops = 2 * m * vocab * hidden / base / 1e6
        print(f"soft embed M={m:4d} vocab={vocab:6d} hidden={hidden:5d} [packed {gflops:5.1f} GFLOP/s]  {cells}")


if __name__ == "__main__":
    main()

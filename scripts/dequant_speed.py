"""Native weight dequantisation (dgemma/kernels/csrc/dequant.cpp) against torch's `formats.dequantize`.

    python scripts/dequant_speed.py [--rows 2048] [--cols 1024] [--threads 2] [--dtype float32] [--repeat 20]

For a [rows, cols] weight per scheme (and plain bf16, widened): the median (and best) ms of
`avx2.dequantize_into` / `widen_into` into a preallocated output and of the torch path
(`formats.dequantize(q, dtype)`; for bf16, `out.copy_(w)`), plus a [256, cols] tile of each natively (the
size a matmul tile dequantises) in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dgemma.kernels import avx2  # noqa: E402
from dgemma.quant import formats  # noqa: E402


def median_s(fn, repeat: int) -> tuple[float, float]:
    """(median, best) seconds of `repeat` calls: on shared cores, a call whose second thread was
    descheduled waits a scheduler tick (ms); the best one shows the kernel's own time."""
    fn()  # warm: page in the output, wake the thread pool
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernel = avx2.extension()
    print(
        f"[{args.rows}, {args.cols}] -> {args.dtype}, {args.threads} threads, "
        f"ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, native kernel {'on' if kernel else 'OFF (torch path both sides)'}"
    )
    w = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0)) * 0.02
    cases = [("bf16 widen", None)] + [(s, formats.quantize(w, s, 64, torch.bfloat16)) for s in formats.SCHEMES]
    print("median (best) of each; speed-up of the medians")
    print(f"{'scheme':<12}{'native ms':>18}{'torch ms':>18}{'speed-up':>10}{'256-row tile us':>20}")
    for name, q in cases:
        out = torch.empty(args.rows, args.cols, dtype=dtype)
        tile = out[:256]
        if q is None:
            wb = w.bfloat16()
            native = median_s(lambda wb=wb, out=out: avx2.widen_into(wb, out), args.repeat)
            ref = median_s(lambda wb=wb, out=out: out.copy_(wb), args.repeat)
            small = median_s(lambda wb=wb, tile=tile: avx2.widen_into(wb[:256], tile), args.repeat * 5)
            assert torch.equal(out, wb.to(dtype))
        else:
            native = median_s(lambda q=q, out=out: avx2.dequantize_into(q, out), args.repeat)
            ref = median_s(lambda q=q: formats.dequantize(q, dtype), args.repeat)
            qt = q.rows(0, 256)
            small = median_s(lambda qt=qt, tile=tile: avx2.dequantize_into(qt, tile), args.repeat * 5)
            assert torch.equal(out, formats.dequantize(q, dtype))
        ms = lambda t: f"{t[0] * 1e3:.3f} ({t[1] * 1e3:.3f})"  # noqa: E731
        us = f"{small[0] * 1e6:.1f} ({small[1] * 1e6:.1f})"
        print(f"{name:<12}{ms(native):>18}{ms(ref):>18}{ref[0] / native[0]:>9.1f}x{us:>20}")


if __name__ == "__main__":
    main()

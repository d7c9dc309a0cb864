"""bf16, int8 and int4 against float32 on this CPU: `dgemma bench` rows run in alternation, one
process per run, so a shared machine's drift hits every row alike; prints ms per decoder step
(median over rounds), the ratio to float32 within each round (median, min-max), resident memory
and which kernels ran, under the CPU's name and flags.

This is the measurement the quantisation issue asks for on a CPU with AVX2 only (AMD Zen 2/3):

    python scripts/cpu_speed.py                  # --size mid, 3 rounds: about 15 min on 2 cores

On a CPU with AVX-512 BF16 or AMX, `--emulate-avx2` limits oneDNN, ATen and MKL to AVX2 and sets
`DGEMMA_CPU_ISA=avx2`, so dgemma picks every kernel as on an AVX2-only CPU (no AVX-512 statistics
or RMSNorm kernels, no native bf16): an emulation of the instruction set, not of Zen 2/3's cores,
caches or memory, reported as such. Options: --size, --rounds,
--rows float32,bfloat16,int8,int4 (int8 and int4 are bf16 checkpoints quantised at load),
--steps, --new-tokens, --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dgemma.kernels.choice import native_bf16  # noqa: E402
from dgemma.kernels.native import cpu_flags, cpu_model  # noqa: E402

EMULATE_AVX2 = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "DGEMMA_CPU_ISA": "avx2",
}
ROWS = {  # row name -> bench arguments
    "float32": ["--dtype", "float32"],
    "bfloat16": ["--dtype", "bfloat16"],
    "int8": ["--dtype", "bfloat16", "--quantization", "int8"],
    "int4": ["--dtype", "bfloat16", "--quantization", "int4"],
}
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def bench_once(row: str, args, emulate: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if emulate:
        env.update(EMULATE_AVX2)
    argv = [
        sys.executable,
        "-m",
        "dgemma.cli",
        "bench",
        "--size",
        args.size,
        "--peers",
        "default",
        "--runs",
        "1",
        "--steps",
        str(args.steps),
        "--new-tokens",
        str(args.new_tokens),
        "--prompt-len",
        str(args.prompt_len),
        "--json",
        *ROWS[row],
    ]
    run = subprocess.run(argv, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"bench for row {row} failed:\n{run.stderr[-3000:]}")
    report = json.loads(run.stdout[run.stdout.index("{") :])
    return {"ms_per_step": report["rows"][0]["ms_per_step"], "setup": report["setup"], **report["memory_bytes"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="mid")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", default="float32,bfloat16,int8,int4")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--emulate-avx2", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or "float32" not in rows:
        p.error(f"--rows takes {', '.join(ROWS)} and must include float32 (got {args.rows!r})")

    flags = cpu_flags()
    if native_bf16() and not args.emulate_avx2:
        print(
            "note: this CPU has native bf16 (AVX-512 BF16 or AMX): these are its own figures, not an AVX2-only "
            "CPU's; --emulate-avx2 emulates one",
            file=sys.stderr,
        )
    runs: dict[str, list[dict]] = {r: [] for r in rows}
    for k in range(args.rounds):
        for row in rows if k % 2 == 0 else rows[::-1]:  # alternate the order: no row always runs first
            runs[row].append(bench_once(row, args, args.emulate_avx2))
            print(f"round {k + 1}/{args.rounds} {row}: {runs[row][-1]['ms_per_step']:.1f} ms/step", file=sys.stderr)

    gib = lambda n: n / 2**30  # noqa: E731
    table = []
    for row in rows:
        ratios = [r["ms_per_step"] / f["ms_per_step"] for r, f in zip(runs[row], runs["float32"])]
        last = runs[row][-1]
        table.append(
            {
                "row": row,
                "ms_per_step": statistics.median(r["ms_per_step"] for r in runs[row]),
                "vs_float32": statistics.median(ratios),
                "vs_float32_min": min(ratios),
                "vs_float32_max": max(ratios),
                "weights_gib": gib(sum(last["weights"].values())),
                "rss_after_gib": gib(max(r["rss_now"] or 0 for r in runs[row])),
                "peak_rss_gib": gib(max(r["peak_rss"] for r in runs[row])),
                "kernels": last["setup"].split("kernels: ", 1)[-1],
            }
        )
    cpu = f"{cpu_model()}; flags: {', '.join(f for f in FLAGS if f in flags) or 'none of ' + ', '.join(FLAGS)}"
    mode = "emulated AVX2-only (--emulate-avx2)" if args.emulate_avx2 else "native"
    if args.json:
        print(json.dumps({"cpu": cpu, "mode": mode, "rounds": args.rounds, "size": args.size, "rows": table}, indent=2))
        return 0
    print(
        f"CPU: {cpu}; {os.cpu_count()} cores visible; {mode}; --size {args.size}, {args.rounds} rounds, "
        f"{args.steps} steps, {args.new_tokens} new tokens after {args.prompt_len}"
    )
    print("| row | ms per decoder step | vs float32 (min-max) | weights | RSS after | peak RSS | kernels |")
    print("|---|---|---|---|---|---|---|")
    for t in table:
        print(
            f"| {t['row']} | {t['ms_per_step']:.0f} | {t['vs_float32']:.2f}x ({t['vs_float32_min']:.2f}-"
            f"{t['vs_float32_max']:.2f}) | {t['weights_gib']:.2f} GiB | {t['rss_after_gib']:.2f} GiB | "
            f"{t['peak_rss_gib']:.2f} GiB | {t['kernels']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

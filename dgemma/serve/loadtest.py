"""Load test for `dgemma serve`: 1, 4, 16 ... concurrent streaming clients; tokens/s and latency percentiles.

    python -m dgemma.serve.loadtest --model DIR                # starts `dgemma serve` on a free port, then drives it
    python -m dgemma.serve.loadtest --url http://127.0.0.1:8000 --served-model-name NAME

Each client sends `--requests` streaming completions one after another (fixed seeds, `ignore_eos`, so
every request yields exactly `--max-tokens` tokens). Per concurrency level it reports aggregate output
tokens/s over the level's wall time, end-to-end latency and time to the first committed block
(p50/p90/p99), and tokens per decoder forward. Needs httpx (`pip install -e '.[test]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass
class Sample:
    latency: float
    first_block: float
    tokens: int
    passes: int


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def one_request(client, url: str, body: dict) -> Sample:
    start = time.perf_counter()
    first = None
    usage: dict = {}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                first = time.perf_counter() - start
    latency = time.perf_counter() - start
    return Sample(latency, first if first is not None else latency, usage.get("completion_tokens", 0), usage.get("decoder_passes", 0))


async def run_level(url: str, model: str, clients: int, requests: int, args) -> dict:
    import httpx

    def body(client: int, i: int) -> dict:
        b = {
            "model": model,
            "prompt": f"Client {client}, request {i}: write a short function that reverses a list.",
            "max_tokens": args.max_tokens,
            "seed": 1000 * client + i,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        if args.steps is not None:
            b["max_denoising_steps"] = args.steps
        return b

    async def worker(client_id: int, http) -> list[Sample]:
        return [await one_request(http, url, body(client_id, i)) for i in range(requests)]

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(worker(c, http) for c in range(clients)))
        wall = time.perf_counter() - start
    samples = [s for r in results for s in r]
    tokens = sum(s.tokens for s in samples)
    lat = [s.latency for s in samples]
    first = [s.first_block for s in samples]
    return {
        "clients": clients,
        "requests": len(samples),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "latency_p50": percentile(lat, 50),
        "latency_p90": percentile(lat, 90),
        "latency_p99": percentile(lat, 99),
        "first_block_p50": percentile(first, 50),
        "first_block_p90": percentile(first, 90),
        "tokens_per_forward": tokens / max(1, sum(s.passes for s in samples)),
        "mean_latency": statistics.fmean(lat),
    }


def table(rows: list[dict]) -> str:
    head = (
        "| clients | requests | tokens | wall s | tokens/s | latency p50 s | p90 s | p99 s "
        "| first block p50 s | p90 s | tokens/forward |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['requests']} | {r['tokens']} | {r['wall_s']:.1f} | {r['tokens_per_s']:.1f} "
            f"| {r['latency_p50']:.2f} | {r['latency_p90']:.2f} | {r['latency_p99']:.2f} "
            f"| {r['first_block_p50']:.2f} | {r['first_block_p90']:.2f} | {r['tokens_per_forward']:.2f} |"
        )
    return "\n".join(lines)


def start_server(args) -> tuple[subprocess.Popen, str]:
    """`dgemma serve` on a free port; returns the process and its URL once it answers /health."""
    import httpx

    cmd = [sys.executable, "-m", "dgemma.cli", "serve", "--model", args.model, "--port", "0", "--device", args.device,
           "--max-active", str(args.max_active), "--max-queue", str(args.max_queue), "--log-level", "warning",
           "--served-model-name", args.served_model_name] + (["--batched-passes"] if args.batched_passes else [])  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ})
    line = proc.stdout.readline()
    found = re.search(r"on (http://\S+)", line)
    if not found:
        proc.kill()
        raise RuntimeError(f"`dgemma serve` did not start: {line.strip()}{proc.stdout.read().strip()}")
    url = found.group(1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("`dgemma serve` did not answer /health within 60 s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dgemma.serve.loadtest", description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="checkpoint directory: start `dgemma serve` for it")
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model-name", default="dgemma", help="model id to request (default: dgemma)")
    p.add_argument("--device", default="cpu", help="with --model: device for the server (default: cpu)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="client counts (default: 1 4 16)")
    p.add_argument("--requests", type=int, default=2, help="requests per client per level (default: 2)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default: 128)")
    p.add_argument("--steps", type=int, default=None, help="max_denoising_steps (default: the checkpoint's)")
    p.add_argument("--max-active", type=int, default=16, help="with --model: server canvases (default: 16)")
    p.add_argument("--max-queue", type=int, default=64, help="with --model: server queue (default: 64)")
    p.add_argument("--batched-passes", action="store_true", help="with --model: serve with --batched-passes")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--json", action="store_true", help="print the rows as JSON as well")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.concurrency) < 1 or args.requests < 1 or args.max_tokens < 1:
        print("loadtest: error: --concurrency, --requests and --max-tokens must be positive", file=sys.stderr)
        return 2
    try:
        import httpx
    except ImportError:
        print("loadtest: error: needs httpx (pip install -e '.[test]')", file=sys.stderr)
        return 2
    proc = None
    try:
        if args.model:
            proc, url = start_server(args)
        else:
            url = args.url.rstrip("/")
        # warm-up (first-call kernel setup), not measured
        asyncio.run(run_level(url, args.served_model_name, 1, 1, args))
        rows = []
        for n in args.concurrency:
            rows.append(asyncio.run(run_level(url, args.served_model_name, n, args.requests, args)))
            print(f"{n} clients: {rows[-1]['tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True)
    except (RuntimeError, OSError, httpx.HTTPError) as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(table(rows))
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

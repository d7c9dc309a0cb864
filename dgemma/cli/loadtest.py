"""Load test for `dgemma serve`: 1, 4, 16 ... concurrent streaming clients; tokens/s and latency percentiles.

    python -m dgemma.cli.loadtest --model DIR                # starts `dgemma serve` on a free port, then drives it
    python -m dgemma.cli.loadtest --url http://127.0.0.1:8000 --served-model-name NAME
    python -m dgemma.cli.loadtest --model DIR --multi-turn --turns 3 --prefix-tokens 2048
    python -m dgemma.cli.loadtest --model DIR --multi-turn --server-arg=--no-prefix-cache   # flags for `dgemma serve`

Each client sends `--requests` streaming completions one after another (fixed seeds, `ignore_eos`, so
every request yields exactly `--max-tokens` tokens). Per concurrency level it reports aggregate output
tokens/s over the level's wall time, end-to-end latency and time to the first committed block
(p50/p90/p99), and tokens per decoder forward. Needs httpx (`pip install -e '.[test]'`).

`--multi-turn` measures what a chat client gets from a prefix cache: each client holds `--requests`
conversations one after another through streaming `/v1/chat/completions`. A conversation opens with a
long system prompt of about `--prefix-tokens` tokens, shared by all clients of a level (repeated text;
two warm-up probes measure how many characters make that many tokens with the server's tokenizer), then
runs `--turns` turns; each turn resends the whole history (system prompt, user messages, the assistant
replies as the server returned them) plus a new short user message, with a fixed seed per (client,
conversation, turn) and `ignore_eos`. Every level opens its system prompt with its own first line, so a
level does not find the previous level's prompt cached. Per (level, turn) it reports prompt tokens and
cached prompt tokens as the server's `usage` gives them (`usage.prompt_tokens_details.cached_tokens`,
"-" where the server does not report it), reply tokens, time to the first streamed chunk with content
(p50/p90) and end-to-end latency (p50/p90).

`--server-arg` (repeatable; write it `--server-arg=--flag` for flags) is appended to the `dgemma serve`
command line when the script starts the server itself (`--model`).
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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any


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


async def stream_chunks(client, url: str, body: dict) -> AsyncIterator[dict]:
    """The JSON chunks of one streamed response (until [DONE]); HTTP and in-stream errors raise."""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            yield chunk


async def one_request(client, url: str, body: dict) -> Sample:
    start = time.perf_counter()
    first = None
    usage: dict = {}
    async for chunk in stream_chunks(client, url + "/v1/completions", body):
        if chunk.get("usage"):
            usage = chunk["usage"]
        elif first is None and chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
            first = time.perf_counter() - start
    latency = time.perf_counter() - start
    return Sample(
        latency,
        first if first is not None else latency,
        usage.get("completion_tokens", 0),
        usage.get("decoder_passes", 0),
    )


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


def markdown_table(columns: tuple[tuple[str, str, Callable[[Any], str]], ...], rows: list[dict]) -> str:
    """`rows` as a Markdown table: one column per (header, the row's key, how its value is written)."""
    lines = ["| " + " | ".join(head for head, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(write(r[key]) for _, key, write in columns) + " |" for r in rows]
    return "\n".join(lines)


def _seconds(x: float) -> str:
    return f"{x:.2f}"


def _tenths(x: float) -> str:
    return f"{x:.1f}"


LEVEL_COLUMNS = (
    ("clients", "clients", str),
    ("requests", "requests", str),
    ("tokens", "tokens", str),
    ("wall s", "wall_s", _tenths),
    ("tokens/s", "tokens_per_s", _tenths),
    ("latency p50 s", "latency_p50", _seconds),
    ("p90 s", "latency_p90", _seconds),
    ("p99 s", "latency_p99", _seconds),
    ("first block p50 s", "first_block_p50", _seconds),
    ("p90 s", "first_block_p90", _seconds),
    ("tokens/forward", "tokens_per_forward", _seconds),
)


# ------------------------------------------------------------------------------- multi-turn chat
PREFIX_TEXT = (
    "The assistant helps engineers with software. It writes short, correct and readable code, explains its "
    "reasoning in plain words, names the trade-offs of each approach, points out edge cases and failure modes, "
    "and asks a question when a request is unclear instead of guessing what was meant. "
)
TASKS = (
    "write a short function that reverses a list.",
    "now make it work in place, without a copy.",
    "add a docstring and two unit tests.",
    "what is its time and memory complexity?",
    "rewrite it as a generator.",
)


@dataclass
class ChatTurn:
    latency: float
    first_block: float
    prompt_tokens: int
    cached_tokens: int | None  # None: the server did not report it
    completion_tokens: int
    text: str


def system_prompt(tag: str, chars: int) -> str:
    """The shared system prompt: a first line naming `tag`, then `chars` characters of repeated text (cut at a space)."""
    body = (PREFIX_TEXT * (chars // len(PREFIX_TEXT) + 1))[:chars]
    if " " in body and not body.endswith(" "):
        body = body[: body.rfind(" ") + 1]
    return f"Session {tag}.\n{body}".rstrip()


def user_message(client: int, conversation: int, turn: int) -> str:
    return f"Client {client}, conversation {conversation}, turn {turn + 1}: {TASKS[turn % len(TASKS)]}"


def chat_body(model: str, messages: list[dict], seed: int, args) -> dict:
    b = {
        "model": model,
        "messages": list(messages),
        "max_tokens": args.max_tokens,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if args.steps is not None:
        b["max_denoising_steps"] = args.steps
    return b


async def one_chat(client, url: str, body: dict) -> ChatTurn:
    start = time.perf_counter()
    first = None
    usage: dict = {}
    parts: list[str] = []
    async for chunk in stream_chunks(client, url + "/v1/chat/completions", body):
        if chunk.get("usage"):
            usage = chunk["usage"]
        if not chunk.get("choices"):
            continue
        delta = chunk["choices"][0].get("delta") or {}
        content = delta.get("content")
        if content is None or ("role" in delta and not content):  # the opening role chunk carries no block
            continue
        if first is None:
            first = time.perf_counter() - start
        parts.append(content)
    latency = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return ChatTurn(
        latency,
        first if first is not None else latency,
        usage.get("prompt_tokens", 0),
        cached if isinstance(cached, int) else None,
        usage.get("completion_tokens", 0),
        "".join(parts),
    )


async def calibrate(url: str, model: str, args) -> tuple[int, float]:
    """Characters of repeated text that tokenise to about --prefix-tokens, and the characters per token measured.

    Two probes (also the warm-up, with a first line of their own so they prime no level's cache): the
    system prompt's first line alone, and with --prefix-tokens characters (at most that many tokens:
    no tokenizer gives more than one token per ASCII byte); the difference in prompt tokens gives the ratio.
    """
    import httpx

    probe_chars = max(args.prefix_tokens, 64)
    async with httpx.AsyncClient(timeout=args.timeout) as http:
        counts = []
        for chars in (0, probe_chars):
            messages = [
                {"role": "system", "content": system_prompt("warm-up", chars)},
                {"role": "user", "content": user_message(0, 0, 0)},
            ]
            counts.append((await one_chat(http, url, chat_body(model, messages, 0, args))).prompt_tokens)
    measured = len(system_prompt("warm-up", probe_chars)) - len(system_prompt("warm-up", 0))
    tokens = counts[1] - counts[0]
    per_token = measured / tokens if tokens > 0 else 1.0
    return round(args.prefix_tokens * per_token), per_token


async def run_chat_level(url: str, model: str, clients: int, tag: str, chars: int, args) -> tuple[list[dict], float]:
    """One level of --multi-turn: rows per turn, and the level's aggregate output tokens/s."""
    import httpx

    system = system_prompt(tag, chars)

    async def conversation(client_id: int, k: int, http) -> list[ChatTurn]:
        messages = [{"role": "system", "content": system}]
        turns = []
        for t in range(args.turns):
            messages.append({"role": "user", "content": user_message(client_id, k, t)})
            seed = 1_000_000 * client_id + 1000 * k + t
            turn = await one_chat(http, url, chat_body(model, messages, seed, args))
            messages.append({"role": "assistant", "content": turn.text})
            turns.append(turn)
        return turns

    async def worker(client_id: int, http) -> list[list[ChatTurn]]:
        return [await conversation(client_id, k, http) for k in range(args.requests)]

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(worker(c, http) for c in range(clients)))
        wall = time.perf_counter() - start
    conversations = [conv for r in results for conv in r]
    rows = []
    for t in range(args.turns):
        turns = [conv[t] for conv in conversations]
        cached = [x.cached_tokens for x in turns if x.cached_tokens is not None]
        first = [x.first_block for x in turns]
        lat = [x.latency for x in turns]
        rows.append(
            {
                "clients": clients,
                "turn": t + 1,
                "requests": len(turns),
                "prompt_tokens": statistics.fmean(x.prompt_tokens for x in turns),
                "prompt_tokens_min": min(x.prompt_tokens for x in turns),
                "prompt_tokens_max": max(x.prompt_tokens for x in turns),
                "cached_tokens": statistics.fmean(cached) if cached else None,
                "completion_tokens": statistics.fmean(x.completion_tokens for x in turns),
                "first_block_p50": percentile(first, 50),
                "first_block_p90": percentile(first, 90),
                "latency_p50": percentile(lat, 50),
                "latency_p90": percentile(lat, 90),
            }
        )
    tokens = sum(x.completion_tokens for conv in conversations for x in conv)
    return rows, tokens / wall


def _count(x: float | None) -> str:
    if x is None:
        return "-"
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


CHAT_COLUMNS = (
    ("clients", "clients", str),
    ("turn", "turn", str),
    ("requests", "requests", str),
    ("prompt tokens", "prompt_tokens", _count),
    ("cached tokens", "cached_tokens", _count),
    ("reply tokens", "completion_tokens", _count),
    ("first block p50 s", "first_block_p50", _seconds),
    ("p90 s", "first_block_p90", _seconds),
    ("latency p50 s", "latency_p50", _seconds),
    ("p90 s", "latency_p90", _seconds),
)


def run_multi_turn(url: str, args) -> tuple[list[dict], str]:
    """All levels of --multi-turn; the rows, and a line on the system prompt's size."""
    chars, per_token = asyncio.run(calibrate(url, args.served_model_name, args))
    rows: list[dict] = []
    for i, n in enumerate(args.concurrency):
        level, tps = asyncio.run(run_chat_level(url, args.served_model_name, n, f"{i + 1}", chars, args))
        rows += level
        print(f"{n} clients, {args.turns} turns: {tps:.1f} tokens/s", file=sys.stderr, flush=True)
    first = rows[0]["prompt_tokens"] if rows else 0
    note = (
        f"shared system prompt: {len(system_prompt('1', chars))} characters, about {round(chars / per_token)} tokens "
        f"({per_token:.2f} characters per token measured); turn-1 prompts hold {_count(first)} tokens "
        f"in all (chat template and user message included)"
    )
    return rows, note


def start_server(args) -> tuple[subprocess.Popen, str]:
    """`dgemma serve` on a free port; returns the process and its URL once it answers /health."""
    import httpx

    cmd = [
        sys.executable,
        "-m",
        "dgemma.cli",
        "serve",
        "--model",
        args.model,
        "--port",
        "0",
        "--device",
        args.device,
        "--max-active",
        str(args.max_active),
        "--max-queue",
        str(args.max_queue),
        "--log-level",
        "warning",
        "--served-model-name",
        args.served_model_name,
    ] + (["--batched-passes"] if args.batched_passes else [])
    cmd += args.server_arg or []
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
    p = argparse.ArgumentParser(prog="python -m dgemma.cli.loadtest", description=__doc__.split("\n")[0])
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
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="with --model: one more argument for `dgemma serve` (repeatable; --server-arg=--flag)",
    )
    chat = p.add_argument_group("multi-turn chat (--multi-turn)")
    chat.add_argument(
        "--multi-turn",
        action="store_true",
        help="chat conversations through /v1/chat/completions that resend their history each turn",
    )
    chat.add_argument("--turns", type=int, default=2, help="turns per conversation (default: 2)")
    chat.add_argument(
        "--prefix-tokens", type=int, default=2048, help="about this many tokens of shared system prompt (default: 2048)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.concurrency) < 1 or args.requests < 1 or args.max_tokens < 1:
        print("loadtest: error: --concurrency, --requests and --max-tokens must be positive", file=sys.stderr)
        return 2
    if args.turns < 1 or args.prefix_tokens < 0:
        print("loadtest: error: --turns must be positive and --prefix-tokens not negative", file=sys.stderr)
        return 2
    if args.server_arg and not args.model:
        print("loadtest: error: --server-arg needs --model (the script starts the server)", file=sys.stderr)
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
        if args.multi_turn:
            rows, note = run_multi_turn(url, args)
        else:
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
    if args.multi_turn:
        print(note)
        print(markdown_table(CHAT_COLUMNS, rows))
    else:
        print(markdown_table(LEVEL_COLUMNS, rows))
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

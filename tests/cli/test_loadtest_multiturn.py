"""`python -m dgemma.cli.loadtest --multi-turn`: chat conversations that resend their history each turn."""

import json

import pytest

from dgemma.cli import loadtest
from dgemma.model.checkpoint import make_tiny_random


@pytest.mark.slow
@pytest.mark.subprocess
def test_multi_turn_load_script(tmp_path, capsys):
    ckpt = make_tiny_random(tmp_path / "ckpt", seed=0)
    argv = [
        "--model",
        str(ckpt),
        "--multi-turn",
        "--turns",
        "2",
        "--concurrency",
        "1",
        "--requests",
        "1",
        "--prefix-tokens",
        "300",
        "--max-tokens",
        "32",
        "--steps",
        "4",
        "--json",
    ]
    assert loadtest.main(argv) == 0
    out = capsys.readouterr().out
    assert "shared system prompt:" in out
    assert "| clients | turn | requests | prompt tokens | cached tokens |" in out
    assert "\n| 1 | 1 | 1 | " in out and "\n| 1 | 2 | 1 | " in out  # one row per (concurrency, turn)
    rows = json.loads(out[out.index("\n[") + 1 :])
    assert [(r["clients"], r["turn"], r["requests"]) for r in rows] == [(1, 1, 1), (1, 2, 1)]
    first, second = rows
    assert first["completion_tokens"] == 32  # ignore_eos: every reply is --max-tokens long
    # the byte-level tokenizer: ~1 token per character, so the system prompt alone is ~300 tokens
    assert 300 <= first["prompt_tokens"] < 300 + 150
    # turn 2 resends turn 1's prompt and the reply, plus a new user message
    assert second["prompt_tokens"] >= first["prompt_tokens"] + first["completion_tokens"]


def test_system_prompt_and_flags():
    assert loadtest.system_prompt("1", 0) == "Session 1."
    p = loadtest.system_prompt("1", 500)
    assert p == loadtest.system_prompt("1", 500) and p.startswith("Session 1.\n")  # deterministic
    assert (
        400 < len(p) <= len("Session 1.\n") + 500
        and loadtest.system_prompt("2", 500)[len("Session 2.") :] == p[len("Session 1.") :]
    )
    args = loadtest.build_parser().parse_args(["--url", "http://x", "--multi-turn"])
    assert (args.turns, args.prefix_tokens, args.server_arg) == (2, 2048, [])
    args = loadtest.build_parser().parse_args(["--model", "m", "--server-arg=--no-prefix-cache", "--server-arg", "x"])
    assert args.server_arg == ["--no-prefix-cache", "x"] and not args.multi_turn
    assert loadtest.main(["--url", "http://127.0.0.1:9", "--server-arg=--x"]) == 2


def test_one_chat_reads_stream_and_cached_tokens():
    """The stream parser, against a canned OpenAI-style stream (no engine): content, usage, cached tokens."""
    import asyncio

    import httpx

    def sse(*chunks):
        return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    def delta(d, reason=None):
        return {"choices": [{"index": 0, "delta": d, "finish_reason": reason}]}

    def usage(details):
        u = {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43}
        if details is not None:
            u["prompt_tokens_details"] = details
        return {"choices": [], "usage": u}

    async def run(details):
        body = sse(
            delta({"role": "assistant", "content": ""}),
            delta({"content": "ab"}),
            delta({"content": "c"}),
            delta({}, "length"),
            usage(details),
        )
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport) as http:
            return await loadtest.one_chat(http, "http://x", {})

    turn = asyncio.run(run({"cached_tokens": 32}))
    assert (turn.text, turn.prompt_tokens, turn.cached_tokens, turn.completion_tokens) == ("abc", 40, 32, 3)
    assert turn.first_block <= turn.latency
    assert asyncio.run(run(None)).cached_tokens is None and asyncio.run(run({})).cached_tokens is None

"""The OpenAI-compatible server, driven by the official `openai` client against a tiny random model.

Expected texts come from `Model.generate` in this process: with a fixed seed a request's tokens
do not depend on what else the engine runs (row-serial passes on CPU), so the server must return
exactly the same text, alone or among 16 concurrent streams.
"""

import asyncio
import re
import time

import httpx
import openai
import pytest

from dgemma.serve.app import create_app
from dgemma.serve.engine_thread import TextStream
from dgemma.serve.http.listener import ServerThread
from servers import MODEL  # conftest.py's session fixtures: `model` (tiny, random), its `server` and `client`

FAST = {"max_denoising_steps": 6, "ignore_eos": True}  # few steps; no EOS, so lengths are exact


def expected_tokens(model, ids, max_tokens, seed, steps=6):
    out = model.generate([ids], max_new_tokens=max_tokens, seed=seed, max_denoising_steps=steps, eos_token_ids=[])
    return out.sequences[0]


def metric(server, name):
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "dgemma_requests_total",
        "dgemma_generation_tokens_total",
        "dgemma_tokens_per_forward",
        "dgemma_step_seconds",
        "dgemma_queue_depth",
        "dgemma_active_canvases",
    ):
        assert f"# TYPE {name} " in text


@pytest.mark.slow
def test_completion_matches_engine(model, client):
    ids = model.tokenizer.encode("def fibonacci(n):")
    r = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=64, seed=3, extra_body=FAST)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == model.tokenizer.decode(expected_tokens(model, ids, 64, 3))
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 64, len(ids) + 64)
    # token-id prompts are accepted too
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=64, seed=3, extra_body=FAST)
    assert r2.choices[0].text == r.choices[0].text


@pytest.mark.slow
def test_chat_uses_chat_template(model, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ids = model.tokenizer.apply_chat_template(messages)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, seed=5, extra_body=FAST)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == model.tokenizer.decode(expected_tokens(model, ids, 40, 5))
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 40
    # content given as text parts renders the same prompt
    parts = [
        messages[0],
        {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]},
    ]
    r2 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=40, seed=5, extra_body=FAST)
    assert r2.choices[0].message.content == r.choices[0].message.content


@pytest.mark.slow
def test_prefix_cache_in_usage_and_metrics(model, server, client):
    """A prompt sharing a long prefix with an earlier one: cached tokens in usage, the same text
    as generate, blocks and hit rate in /metrics; tokens per forward as generate counts it."""
    shared = "import os\nimport sys\n" * 12  # a few blocks of 32 byte tokens
    first = client.completions.create(model=MODEL, prompt=shared + "a", max_tokens=32, seed=8, extra_body=FAST)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=shared + "b", max_tokens=64, seed=9, extra_body=FAST)
    ids = model.tokenizer.encode(shared + "b")
    assert second.usage.prompt_tokens_details.cached_tokens == len(model.tokenizer.encode(shared + "a")) // 32 * 32 > 0
    expected = model.generate([ids], max_new_tokens=64, seed=9, max_denoising_steps=6, eos_token_ids=[])
    assert second.choices[0].text == model.tokenizer.decode(expected.sequences[0])
    usage = second.usage.model_dump()
    assert usage["decoder_passes"] == expected.decoder_passes[0]
    assert usage["tokens_per_forward"] == round(expected.tokens_per_forward[0], 3)
    text = httpx.get(server.url + "/metrics").text
    for kind in ("sliding_attention", "full_attention"):
        for state in ("used", "cached", "free"):
            assert re.search(rf'^dgemma_kv_blocks{{kind="{kind}",state="{state}"}} \d+$', text, re.M)
    assert metric(server, "dgemma_prefix_cache_hit_rate") > 0
    assert metric(server, "dgemma_prefix_cache_hit_tokens_total") >= second.usage.prompt_tokens_details.cached_tokens


def test_seed_reproducibility(client):
    def run(seed):
        return (
            client.completions.create(model=MODEL, prompt="x = ", max_tokens=32, seed=seed, extra_body=FAST)
            .choices[0]
            .text
        )

    a, b, c = run(11), run(11), run(12)
    assert a == b
    assert a != c


def test_eos_ends_request_with_stop(model, client):
    # defaults from generation_config.json: EOS is live; the random model emits one early for this seed
    ids, eos = model.tokenizer.encode("hi"), model.generation_config.eos_token_ids
    for seed in range(50):  # a seed for which the random model emits an EOS
        out = model.generate([ids], max_new_tokens=96, seed=seed, max_denoising_steps=6).sequences[0]
        if out[-1] in eos and len(out) < 96:
            break
    else:
        pytest.skip("no seed gives an EOS")
    r = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=96, seed=seed, extra_body={"max_denoising_steps": 6}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == model.tokenizer.decode(out) and r.usage.completion_tokens == len(out)


@pytest.mark.slow
def test_streaming_sends_each_block_before_the_end(model, server, client):
    engine_thread = server.app.state.service.engine_thread
    blocks = 8  # canvases of 32 tokens
    stream = client.completions.create(
        model=MODEL,
        prompt="import os",
        max_tokens=32 * blocks,
        seed=7,
        stream=True,
        extra_body={"max_denoising_steps": 16, "ignore_eos": True},
    )
    texts, in_flight_at_first = [], None
    for chunk in stream:
        if chunk.choices[0].finish_reason is None:
            texts.append(chunk.choices[0].text)
            if in_flight_at_first is None:
                in_flight_at_first = engine_thread.in_flight
        else:
            assert chunk.choices[0].finish_reason == "length"
    assert len(texts) == blocks  # one chunk per committed block
    assert in_flight_at_first == 1  # the first block arrived while the request was still running
    ids = model.tokenizer.encode("import os")
    assert "".join(texts) == model.tokenizer.decode(expected_tokens(model, ids, 32 * blocks, 7, steps=16))


@pytest.mark.slow
def test_chat_stream_with_drafts_and_usage(model, client):
    messages = [{"role": "user", "content": "write a poem"}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=64,
        seed=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**FAST, "stream_drafts": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    drafts = [c.choices[0].model_extra["draft"] for c in chunks if c.choices and "draft" in c.choices[0].model_extra]
    assert drafts and {d["block"] for d in drafts} == {0, 1}
    assert all(1 <= d["step"] <= 6 and isinstance(d["text"], str) for d in drafts)
    # each frame is the library's draft of that step, position by position, with its token texts
    ids = model.tokenizer.apply_chat_template(messages)
    library = {
        (d.block, d.step): d
        for d in model.stream(ids, drafts=True, seed=2, max_new_tokens=64, max_denoising_steps=6, eos_token_ids=[])
        if hasattr(d, "step")
    }
    c = model.config.canvas_length
    for d in drafts:
        mine = library[(d["block"], d["step"])]
        assert (d["tokens"], d["accepted"], d["entropy"]) == (mine.canvas, mine.accepted, mine.entropy)
        assert len(d["pieces"]) == c
        for token, piece in zip(d["tokens"], d["pieces"]):  # as logprobs show tokens (part of a character: \xNN)
            alone = model.tokenizer.decode([token], skip_special_tokens=False)
            assert piece == alone or not alone or "\ufffd" in alone
    # drafts carry no content; committed text is the same as without drafts
    assert all(not c.choices[0].delta.content for c in chunks if c.choices and "draft" in c.choices[0].model_extra)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = model.tokenizer.apply_chat_template(messages)
    assert content == model.tokenizer.decode(expected_tokens(model, ids, 64, 2))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 64
    assert chunks[-2].choices[0].finish_reason == "length"
    # without the extension, no draft frames
    plain = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=64, seed=2, stream=True, extra_body=FAST
        )
    )
    assert not any("draft" in c.choices[0].model_extra for c in plain)


def _stop_across_blocks(model, ids):
    """A seed, a stop string straddling the first block boundary, the text before it, and the full text."""
    for seed in range(50):
        tokens = expected_tokens(model, ids, 96, seed)
        text = model.tokenizer.decode(tokens)
        k = len(model.tokenizer.decode(tokens[:32]))
        for width in (4, 3, 2):
            for j in range(k - width + 1, k):
                stop = text[j : j + width]
                if "\ufffd" not in stop and text.find(stop) == j:
                    return seed, stop, text[:j], text
    pytest.skip("no clean stop string at the block boundary")


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_blocks(model, client, stream):
    ids = model.tokenizer.encode("a b c")
    seed, stop, before, full = _stop_across_blocks(model, ids)
    args = dict(model=MODEL, prompt="a b c", max_tokens=96, seed=seed, stop=[stop, "never-appears"], extra_body=FAST)
    if stream:
        chunks = list(client.completions.create(stream=True, **args))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**args)
        text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert 32 < r.usage.completion_tokens < 96
    assert text == before and stop not in text and reason == "stop"
    # a stop string that never occurs changes nothing
    r = client.completions.create(**{**args, "stop": "never-appears"})
    assert r.choices[0].text == full and r.choices[0].finish_reason == "length"


@pytest.mark.slow
def test_sixteen_concurrent_streams_match_solo(model, server):
    prompts = [f"request {i}: " + "abc" * i for i in range(16)]
    expected = [
        model.tokenizer.decode(expected_tokens(model, model.tokenizer.encode(p), 64, 100 + i))
        for i, p in enumerate(prompts)
    ]
    before = httpx.get(server.url + "/metrics").text
    batched_before = _steps_above(before, 8)

    async def one(client, i):
        stream = await client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=64, seed=100 + i, stream=True, extra_body=FAST
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    texts = asyncio.run(main())
    assert texts == expected
    # and they really ran together: some steps denoised more than 8 canvases at once
    assert _steps_above(httpx.get(server.url + "/metrics").text, 8) > batched_before


def _steps_above(metrics_text, n):
    count = float(re.search(r"^dgemma_step_canvases_count (\S+)$", metrics_text, re.M).group(1))
    below = float(re.search(rf'^dgemma_step_canvases_bucket{{le="{n}"}} (\S+)$', metrics_text, re.M).group(1))
    return count - below


@pytest.mark.slow
def test_cancelled_stream_frees_its_slot_and_full_queue_gets_429(model):
    app = create_app(model, MODEL, max_active=1, max_queue=1)
    engine_thread = app.state.service.engine_thread
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        long = dict(model=MODEL, prompt="long", max_tokens=3000, seed=0, stream=True, extra_body={"ignore_eos": True})
        a = client.completions.create(**long)  # holds the only slot: ~94 blocks of up to 48 steps
        next(iter(a))
        b = client.completions.create(**long)  # waits in the queue
        with pytest.raises(openai.RateLimitError, match="server busy"):
            client.completions.create(model=MODEL, prompt="x", max_tokens=8)
        a.close()
        b.close()
        deadline = time.monotonic() + 20
        while engine_thread.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (
            engine_thread.in_flight == 0
            and not engine_thread.engine.scheduler.running
            and not engine_thread.engine.scheduler.waiting
        )
        assert metric(server, 'dgemma_requests_total{finish_reason="cancelled"}') == 2
        r = client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body=FAST)
        assert r.usage.completion_tokens == 8
        # a non-streaming request whose client gives up is cancelled too
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=1.0).completions.create(
                model=MODEL, prompt="x", max_tokens=3000, extra_body={"ignore_eos": True}
            )
        deadline = time.monotonic() + 20
        while engine_thread.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine_thread.in_flight == 0
        assert metric(server, 'dgemma_requests_total{finish_reason="cancelled"}') == 3


@pytest.mark.slow
@pytest.mark.subprocess
def test_serve_cli_and_load_script(model, capsys):
    """`python -m dgemma.cli.loadtest --model` starts `dgemma serve` in a subprocess and drives it."""
    from dgemma.cli import loadtest

    argv = [
        "--model",
        str(model.path),
        "--concurrency",
        "1",
        "2",
        "--requests",
        "1",
        "--max-tokens",
        "32",
        "--steps",
        "2",
    ]
    assert loadtest.main(argv) == 0
    out = capsys.readouterr().out
    assert "| 1 | 1 | 32 |" in out and "| 2 | 2 | 64 |" in out
    assert loadtest.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and loadtest.percentile([1.0, 2.0], 99) == 2.0


def test_text_stream_cuts_and_holds_back():
    def ords(text):
        return [ord(c) for c in text]

    def decode(ids):
        return "".join(map(chr, ids))

    ts = TextStream(decode, ["END", "xy"], eos=(), max_tokens=100)
    assert ts.add(ords("abcEN")) == "abc"  # "EN" may be the start of "END": held back
    assert ts.add(ords("Dzz")) == "" and ts.stopped and ts.text == "abc"
    assert ts.completion_tokens() == 6  # up to and including the token that completed "END"
    ts = TextStream(decode, ["END", "xy"], eos=(), max_tokens=100)
    assert ts.add(ords("a xy b END")) == "a " and ts.stopped  # the earliest stop string wins
    ts = TextStream(decode, ["END"], eos=(), max_tokens=100)
    assert ts.add(ords("abE")) == "ab" and ts.add(ords("Nope"), last=True) == "ENope" and not ts.stopped
    ts = TextStream(decode, [], eos=(1,), max_tokens=6)
    assert ts.add(ords("ab\ufffd")) == "ab"  # a split multi-byte character waits for the next block
    assert ts.draft(ords("cdefgh")) == "\ufffdcde"  # cut at max_tokens
    assert ts.add(ords("c"), last=True) == "\ufffdc"


def test_serve_cli_errors_are_one_line(model, tmp_path, capsys):
    from dgemma.cli import main
    from dgemma.serve.http.listener import bind

    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", "--model", str(model.path), "--max-context", "8"]) == 2
    assert "max_context must be between 33" in capsys.readouterr().err
    assert main(["serve", "--model", str(model.path), "--kv-cache-memory", "1KB"]) == 2
    assert "holds no KV block" in capsys.readouterr().err
    for flag, value in (("--block-size", "0"), ("--prefill-chunk", "0")):
        assert main(["serve", "--model", str(model.path), flag, value]) == 2
        assert "must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: exit 2 with usage
        main(["serve", "--model", str(model.path), "--kv-cache-memory", "lots"])
    assert "is not a size" in capsys.readouterr().err
    busy = bind("127.0.0.1", 0)
    busy.listen()
    try:
        assert main(["serve", "--model", str(model.path), "--port", str(busy.getsockname()[1])]) == 2
        assert "cannot listen on 127.0.0.1" in capsys.readouterr().err
    finally:
        busy.close()


def test_openapi_declares_the_request_bodies(server, model):
    spec = httpx.get(server.url + "/openapi.json").json()
    for path, name, field in (
        ("/v1/completions", "CompletionRequest", "prompt"),
        ("/v1/chat/completions", "ChatCompletionRequest", "messages"),
    ):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        schema = spec["components"]["schemas"][name]
        assert field in schema["required"] and schema["properties"]["model"]["enum"] == [MODEL]
        assert schema["additionalProperties"] is False and "max_denoising_steps" in schema["properties"]
    assert httpx.get(server.url + "/docs").status_code == 200
    with ServerThread(create_app(model, MODEL, docs=False)) as s:
        assert httpx.get(s.url + "/openapi.json").status_code == 404
        assert httpx.get(s.url + "/docs").status_code == 404
        assert httpx.get(s.url + "/health").status_code == 200

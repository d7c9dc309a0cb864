"""Bad requests get a 4xx with an OpenAI-style error body that names the problem; the server lives on."""

import json

import httpx
import openai
import pytest

import dgemma
from dgemma.engine.request import SEED_MAX
from dgemma.model.checkpoint import make_tiny_random
from dgemma.serve.app import create_app
from dgemma.serve.http.listener import ServerThread

MODEL = "tiny"
CONTEXT = 512  # small, so "too long" is cheap to send
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 8}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = dgemma.load(make_tiny_random(tmp_path_factory.mktemp("errs") / "ckpt", seed=1))
    with ServerThread(create_app(model, MODEL, max_active=2, max_queue=4, max_context=CONTEXT)) as s:
        yield s


def completion(**changes):
    body = {**OK, **changes}
    return {k: v for k, v in body.items() if v is not ...}


def chat(**changes):
    body = {**CHAT, **changes}
    return {k: v for k, v in body.items() if v is not ...}


C, CH = "/v1/completions", "/v1/chat/completions"
# (name, method, path, body: dict -> JSON, bytes -> raw, status, words the message must hold)
BAD = [
    ("malformed JSON", "POST", C, b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
    ("empty body", "POST", C, b"", 400, "empty"),
    ("body is an array", "POST", C, b"[1, 2]", 400, "JSON object"),
    ("NaN literal", "POST", C, b'{"model": "tiny", "prompt": "x", "max_tokens": NaN}', 400, "NaN"),
    ("nested too deeply", "POST", C, b"[" * 100_000 + b"]" * 100_000, 400, "nested"),
    ("not UTF-8", "POST", C, b"\xff\xfe{\x00", 400, "not valid JSON"),
    ("body too large", "POST", C, b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}', 413, "exceeds"),
    ("missing model", "POST", C, completion(model=...), 400, "model"),
    ("unknown model", "POST", C, completion(model="gpt-4"), 404, "gpt-4"),
    ("model not a string", "POST", C, completion(model=123), 400, "model"),
    ("missing prompt", "POST", C, completion(prompt=...), 400, "prompt"),
    ("prompt is an object", "POST", C, completion(prompt={"text": "hi"}), 400, "prompt"),
    ("empty token list", "POST", C, completion(prompt=[]), 400, "prompt"),
    ("token id outside vocab", "POST", C, completion(prompt=[5, 99999]), 400, "99999"),
    ("negative token id", "POST", C, completion(prompt=[-1]), 400, "-1"),
    ("several prompts", "POST", C, completion(prompt=["a", "b"]), 400, "one prompt"),
    (
        "lone surrogate in prompt",
        "POST",
        C,
        b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 4}',
        400,
        "tokenized",
    ),
    ("prompt longer than context", "POST", C, completion(prompt=[7] * 600), 400, "too long"),
    ("negative max_tokens", "POST", C, completion(max_tokens=-5), 400, "max_tokens"),
    ("zero max_tokens", "POST", C, completion(max_tokens=0), 400, "max_tokens"),
    ("max_tokens as a string", "POST", C, completion(max_tokens="10"), 400, "max_tokens"),
    ("max_tokens as a float", "POST", C, completion(max_tokens=10.5), 400, "max_tokens"),
    ("absurd max_tokens", "POST", C, completion(max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens beyond context", "POST", C, completion(max_tokens=600), 400, "does not fit"),
    ("negative seed", "POST", C, completion(seed=-1), 400, "seed"),
    ("huge seed", "POST", C, completion(seed=2**70), 400, "seed"),
    ("seed of 2**64", "POST", C, completion(seed=2**64), 400, "seed"),
    ("seed as a bool", "POST", C, completion(seed=True), 400, "seed"),
    ("stop not a string", "POST", C, completion(stop=5), 400, "stop"),
    ("too many stop strings", "POST", C, completion(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("empty stop string", "POST", C, completion(stop=[""]), 400, "stop"),
    ("stream not a bool", "POST", C, completion(stream="yes"), 400, "stream"),
    ("zero denoising steps", "POST", C, completion(max_denoising_steps=0), 400, "max_denoising_steps"),
    ("absurd denoising steps", "POST", C, completion(max_denoising_steps=10**9), 400, "max_denoising_steps"),
    ("negative entropy_bound", "POST", C, completion(entropy_bound=-1.0), 400, "entropy_bound"),
    ("t_min above t_max", "POST", C, completion(t_min=0.9, t_max=0.5), 400, "t_max must be greater than t_min"),
    ("t_max not a number", "POST", C, completion(t_max="hot"), 400, "t_max"),
    ("zero confidence_threshold", "POST", C, completion(confidence_threshold=0), 400, "confidence_threshold"),
    ("negative stability_threshold", "POST", C, completion(stability_threshold=-1), 400, "stability_threshold"),
    ("ignore_eos not a bool", "POST", C, completion(ignore_eos="true"), 400, "ignore_eos"),
    ("unknown field", "POST", C, completion(frobnicate=1), 400, "frobnicate"),
    ("n above the server's limit", "POST", C, completion(n=3), 400, "n=3: at most 2 choices"),
    ("n of 0", "POST", C, completion(n=0), 400, "n"),
    ("best_of", "POST", C, completion(best_of=2), 400, "best_of"),
    ("logprobs above 20", "POST", C, completion(logprobs=21), 400, "logprobs"),
    ("chat: top_logprobs without logprobs", "POST", CH, chat(top_logprobs=2), 400, "top_logprobs needs logprobs: true"),
    ("chat: logprobs not a bool", "POST", CH, chat(logprobs=5), 400, "logprobs"),
    ("temperature out of range", "POST", C, completion(temperature=5), 400, "temperature"),
    ("stream_options without stream", "POST", C, completion(stream_options={"include_usage": True}), 400, "stream"),
    ("stream_drafts without stream", "POST", C, completion(stream_drafts=True), 400, "stream"),
    ("chat: no messages", "POST", CH, chat(messages=...), 400, "messages"),
    ("chat: empty messages", "POST", CH, chat(messages=[]), 400, "messages"),
    ("chat: message not an object", "POST", CH, chat(messages=["hi"]), 400, "messages[0]"),
    ("chat: unknown role", "POST", CH, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    ("chat: content a number", "POST", CH, chat(messages=[{"role": "user", "content": 5}]), 400, "content"),
    (
        "chat: image part",
        "POST",
        CH,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "text parts",
    ),
    (
        "chat: unknown message key",
        "POST",
        CH,
        chat(messages=[{"role": "user", "content": "hi", "mood": "sad"}]),
        400,
        "mood",
    ),
    (
        "chat: tools with a bad function name",
        "POST",
        CH,
        chat(tools=[{"type": "function", "function": {"name": "get weather"}}]),
        400,
        "tool",
    ),
    ("chat: max_completion_tokens negative", "POST", CH, chat(max_completion_tokens=-1), 400, "max_completion_tokens"),
    ("GET on a POST route", "GET", C, None, 405, "not allowed"),
    ("unknown route", "POST", "/v1/embeddings", completion(), 404, "no route"),
    ("unknown model info", "GET", "/v1/models/gpt-4", None, 404, "gpt-4"),
]


def send(server, method, path, body):
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    return httpx.request(
        method, server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60
    )


@pytest.mark.parametrize("name,method,path,body,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_a_clear_4xx(server, name, method, path, body, status, words):
    r = send(server, method, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"], error
    assert isinstance(error["type"], str) and "Traceback" not in error["message"]


@pytest.mark.slow
def test_server_survives_the_bad_requests(server):
    assert len(BAD) >= 25
    for _, method, path, body, _, _ in BAD:  # again, back to back
        assert 400 <= send(server, method, path, body).status_code < 500
    metrics = httpx.get(server.url + "/metrics").text
    assert 'code="5' not in metrics
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = client.completions.create(
        model=MODEL, prompt="still here?", max_tokens=8, extra_body={"max_denoising_steps": 4}
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, extra_body={"max_denoising_steps": 4}
    )
    assert r.choices[0].message.role == "assistant"


def test_openai_client_sees_typed_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="t_max must be greater than t_min"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body={"t_min": 2.0, "t_max": 1.0}
        )


def test_seed_range_is_the_engines(server):
    """One seed range for the API, the CLI and the server: [0, 2**64-1] (engine/request.py)."""
    assert SEED_MAX == 2**64 - 1
    r = send(server, "POST", C, completion(seed=SEED_MAX, n=2, max_denoising_steps=4))  # the second choice: seed 0
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    r = send(server, "POST", C, completion(seed=SEED_MAX + 1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


def test_engine_failure_is_contained(tmp_path):
    """A fault inside the engine fails the requests it held (500), and the next request is served."""
    model = dgemma.load(make_tiny_random(tmp_path / "ckpt", seed=2))
    app = create_app(model, MODEL, max_active=2, max_queue=2, max_context=CONTEXT)
    engine_thread = app.state.service.engine_thread
    calls = []

    def failing_step():
        calls.append(1)
        raise RuntimeError("simulated device fault")

    engine_thread.engine.step = failing_step
    with ServerThread(app) as server:
        r = send(server, "POST", C, completion(max_denoising_steps=2))
        assert r.status_code == 500 and "simulated device fault" in r.json()["error"]["message"]
        assert calls == [1]
        r = send(server, "POST", C, completion(max_denoising_steps=2))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert calls == [1]  # served by a fresh engine
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}

"""Work nobody waits for, and input larger than the context, against `dgemma serve` (a subprocess):
denoising steps are capped, every request has a deadline that ends it with finish_reason
"timeout", insert mode's candidates fit --max-active and leave with their client, and an 8 MB
prompt is refused before it is rendered or tokenized while /health keeps answering. Seeded
answers sent between the hostile requests come back exactly as they do alone."""

import json
import re
import socket
import threading
import time

import httpx
import pytest

from serve_process import ServeProcess, wait_until

MODEL = "dgemma-tiny"
pytestmark = pytest.mark.subprocess  # `dgemma serve` in a subprocess (serve_process.py)
STEPS = 16
NORMAL = {"model": MODEL, "prompt": "import os\n", "max_tokens": 16, "seed": 11, "max_denoising_steps": 6}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 8,
    "seed": 5,
    "max_denoising_steps": 6,
}
# every step used: nothing is stable or confident enough to stop a canvas early
SLOW = {"max_denoising_steps": STEPS, "confidence_threshold": 1e-12, "stability_threshold": 4096}


@pytest.fixture(scope="module")
def server():
    flags = [
        "--served-model-name",
        MODEL,
        "--max-denoising-steps",
        str(STEPS),
        "--request-timeout",
        "3",
        "--max-active",
        "2",
        "--max-queue",
        "0",
    ]
    with ServeProcess(flags) as s:
        s.start_rss = s.rss()
        for path, body in (("/v1/completions", NORMAL), ("/v1/chat/completions", CHAT)):
            httpx.post(s.url + path, json=body, timeout=60)  # warm-up: a first pass may be slow on a loaded host
        s.baselines = {
            "/v1/completions": complete_text(s, "/v1/completions", NORMAL),
            "/v1/chat/completions": complete_text(s, "/v1/chat/completions", CHAT),
        }
        yield s


def text_of(response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def finished_in_time(response) -> bool:
    """False for an answer this server ended at its 3 s deadline or refused as busy: on a slow or
    loaded host a normal request can meet either, which says nothing about what it would answer."""
    return response.status_code != 429 and not (
        response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "timeout"
    )


def complete_text(server, path: str, body: dict, attempts: int = 5) -> str:
    """The text of `body`'s whole answer (retried while busy or past its deadline; any other
    answer, right or wrong, is returned at once)."""
    for _ in range(attempts):
        response = httpx.post(server.url + path, json=body, timeout=60)
        if finished_in_time(response):
            return text_of(response)
        time.sleep(0.5)
    raise AssertionError(f"{path} did not answer in time in {attempts} attempts: {response.text[:300]}")


def normal_answers_are_unchanged(server) -> None:
    for path, body in (("/v1/completions", NORMAL), ("/v1/chat/completions", CHAT)):
        assert complete_text(server, path, body) == server.baselines[path]


@pytest.fixture(autouse=True)
def still_serving(server):
    yield
    assert server.alive, server.output[-3000:]
    assert wait_until(lambda: server.healthy(), 20)
    assert wait_until(
        lambda: metric(server, "dgemma_active_canvases") == 0, 30
    )  # the last case's work has left its slots
    normal_answers_are_unchanged(server)
    assert server.peak_rss() < server.start_rss + 300 * 2**20
    assert "Traceback" not in server.output, server.output[-3000:]


def error_of(response) -> str:
    return response.json()["error"]["message"]


def metric(server, name: str, **labels) -> float:
    text = httpx.get(server.url + "/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{{{want}}} (\S+)$" if labels else rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


# ------------------------------------------------------------------------------------ denoising steps
@pytest.mark.slow
def test_more_steps_than_the_server_allows_is_a_400(server):
    response = httpx.post(server.url + "/v1/completions", json={**NORMAL, "max_denoising_steps": STEPS + 1})
    assert response.status_code == 400
    assert f"max_denoising_steps={STEPS + 1}" in error_of(response) and "--max-denoising-steps" in error_of(response)


@pytest.mark.slow
def test_the_checkpoint_default_is_capped_too(server):
    """dgemma-tiny's generation_config asks for 48 steps; this server allows 16 per canvas."""
    body = {
        **NORMAL,
        "max_tokens": 64,
        "max_denoising_steps": None,
        **{k: v for k, v in SLOW.items() if k != "max_denoising_steps"},
    }
    usage = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"]
    blocks = -(-64 // 32)
    assert 0 < usage["decoder_passes"] <= STEPS * blocks


# ------------------------------------------------------------------------------------ deadlines
def long_request(**more) -> dict:
    return {**NORMAL, "max_tokens": 1900, "ignore_eos": True, **SLOW, **more}


@pytest.mark.slow
def test_a_request_past_its_deadline_ends_as_timeout(server):
    started = time.monotonic()
    response = httpx.post(server.url + "/v1/completions", json=long_request(), timeout=60)
    elapsed = time.monotonic() - started
    body = response.json()
    assert response.status_code == 200 and body["choices"][0]["finish_reason"] == "timeout"
    assert 3 <= elapsed < 3 + 10
    assert 0 < body["usage"]["completion_tokens"] < 1900  # what it committed in time comes back


@pytest.mark.slow
def test_a_streamed_chat_past_its_deadline_ends_as_timeout(server):
    body = {**CHAT, **SLOW, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = [ln for ln in response.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    reasons = [c["finish_reason"] for ln in lines[:-1] for c in json.loads(ln[6:])["choices"] if c["finish_reason"]]
    assert reasons == ["timeout"]


@pytest.mark.slow
def test_a_request_that_cannot_start_in_time_ends_as_timeout():
    with ServeProcess(["--served-model-name", MODEL, "--request-timeout", "0.001"]) as s:
        for path, body in (
            ("/v1/completions", NORMAL),
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", {**NORMAL, "suffix": "\n"}),
        ):
            response = httpx.post(s.url + path, json=body, timeout=60)
            assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "timeout"
        assert s.healthy() and "Traceback" not in s.output


# ------------------------------------------------------------------------------------ insert mode
@pytest.mark.slow
def test_insert_candidates_fit_max_active(server):
    """Nine candidate span lengths by default; this server admits 2 and queues none, so more
    than two candidate requests would be a 429."""
    response = httpx.post(
        server.url + "/v1/completions",
        json={**NORMAL, "prompt": "def f(x):\n", "suffix": "\n    return y\n"},
        timeout=60,
    )
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.slow
def test_insert_candidates_leave_with_their_client(server):
    cancelled = metric(server, "dgemma_requests_total", finish_reason="cancelled")
    body = json.dumps(
        {**NORMAL, **SLOW, "max_denoising_steps": STEPS, "prompt": "def f(x):\n", "suffix": "\n    return y\n"}
    )
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        time.sleep(0.05)  # an insert answer takes ~0.2 s on a fast CPU (an AMX Xeon): leave well before it
    assert wait_until(lambda: "went away before its answer to /v1/completions" in server.output, 10)
    assert wait_until(lambda: metric(server, "dgemma_requests_total", finish_reason="cancelled") > cancelled, 10)
    assert wait_until(lambda: metric(server, "dgemma_active_canvases") == 0, 10)


# ------------------------------------------------------------------------------------ input size
def health_times(server, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        started = time.monotonic()
        try:
            httpx.get(server.url + "/health", timeout=30)
        except httpx.HTTPError:
            pass
        out.append(time.monotonic() - started)
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize(
    "path,make",
    [
        ("/v1/completions", lambda text: {**NORMAL, "prompt": text}),
        ("/v1/completions", lambda text: {**NORMAL, "prompt": [text]}),
        ("/v1/completions", lambda text: {**NORMAL, "prompt": "x", "suffix": text}),
        ("/v1/chat/completions", lambda text: {**CHAT, "messages": [{"role": "user", "content": text}]}),
        (
            "/v1/chat/completions",
            lambda text: {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
        ),
    ],
)
def test_a_prompt_larger_than_the_context_is_refused_before_work(server, path, make):
    stop, times = threading.Event(), []
    watcher = threading.Thread(target=health_times, args=(server, stop, times))
    watcher.start()
    try:
        started = time.monotonic()
        response = httpx.post(server.url + path, json=make("def f(x):\n    return x\n" * 300_000), timeout=60)  # 7.5 MB
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        watcher.join()
    assert response.status_code == 400 and "characters" in error_of(response) and "context" in error_of(response)
    assert elapsed < 5
    assert times and max(times) < 1.0


@pytest.mark.slow
def test_a_prompt_that_fits_still_passes(server):
    text = "x = 1\n" * 200  # 1,200 characters, inside dgemma-tiny's 2048-token context
    response = httpx.post(server.url + "/v1/completions", json={**NORMAL, "prompt": text, "max_tokens": 8}, timeout=60)
    assert response.status_code == 200


# ------------------------------------------------------------------------------------ nothing mixed
@pytest.mark.slow
def test_hostile_traffic_beside_seeded_requests_changes_none_of_them(server):
    """Normal seeded requests run while hostile ones come and go (oversized prompts, too many
    steps, deadlines, clients that leave): every normal answer is the one it gets alone."""
    stop, failures, answered = threading.Event(), [], []

    def normal(path: str, body: dict) -> None:
        while not stop.is_set():
            response = httpx.post(server.url + path, json=body, timeout=60)
            if not finished_in_time(response):  # busy, or past its deadline: never a mixed answer
                time.sleep(0.05)
                continue
            got = text_of(response)
            answered.append(path)
            if got != server.baselines[path]:
                failures.append((path, got))

    def hostile() -> None:
        big = "x" * 200_000
        for body in (
            {**NORMAL, "prompt": big},
            {**NORMAL, "max_denoising_steps": STEPS * 4},
            long_request(seed=99),
            {**CHAT, "messages": [{"role": "user", "content": big}]},
        ):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            assert httpx.post(server.url + path, json=body, timeout=60).status_code in (200, 400, 429)
        try:  # a client that leaves mid-request
            httpx.post(server.url + "/v1/completions", json=long_request(seed=98), timeout=0.5)
        except httpx.TimeoutException:
            pass

    workers = [
        threading.Thread(target=normal, args=("/v1/completions", NORMAL)),
        threading.Thread(target=normal, args=("/v1/chat/completions", CHAT)),
    ]
    for w in workers:
        w.start()
    hostile()
    stop.set()
    for w in workers:
        w.join(120)
    assert not failures and len(answered) >= 2

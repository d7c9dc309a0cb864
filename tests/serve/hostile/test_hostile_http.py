"""Hostile networks against `dgemma serve` (a subprocess): the static routes read no path from the
client, DNS rebinding and cross-site pages are refused, the API key holds on every API route,
connections that send nothing or too little are closed, and an aborted upload is one log line.
After each case the server answers a normal request with the same text as before."""

import socket
import time

import httpx
import pytest

from serve_process import ServeProcess, wait_until

MODEL = "dgemma-tiny"
pytestmark = pytest.mark.subprocess  # `dgemma serve` in a subprocess (serve_process.py)
KEY = "k3y-for-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
NORMAL = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8, "seed": 7, "max_denoising_steps": 4}
READ_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def server():
    flags = [
        "--served-model-name",
        MODEL,
        "--api-key",
        KEY,
        "--read-timeout",
        str(READ_TIMEOUT),
        "--allowed-hosts",
        "proxy.example",
        "--allowed-origins",
        "http://localhost:3000",
    ]
    with ServeProcess(flags) as s:
        s.start_rss = s.rss()
        s.baseline = httpx.post(s.url + "/v1/completions", json=NORMAL, headers=AUTH, timeout=60).json()["choices"][0][
            "text"
        ]
        yield s


@pytest.fixture(autouse=True)
def still_serving(server):
    """Every case: the process lives, answers the normal request with its text, within its memory."""
    yield
    assert server.alive, server.output[-3000:]
    again = httpx.post(server.url + "/v1/completions", json=NORMAL, headers=AUTH, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == server.baseline
    assert server.peak_rss() < server.start_rss + 300 * 2**20
    assert "Traceback" not in server.output, server.output[-3000:]


def error_of(response) -> str:
    return response.json()["error"]["message"]


# ------------------------------------------------------------------------------------ static files
@pytest.mark.parametrize(
    "query",
    [
        "name=../../../../etc/passwd",
        "name=../../../../etc/passwd&kind=text/html",
        "name=../../../../etc/does-not-exist",
        "kind=text/html",
    ],
)
def test_static_routes_read_no_path_or_type_from_the_client(server, query):
    response = httpx.get(f"{server.url}/ui/app.js?{query}")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/javascript")
    assert "root:" not in response.text and "dgemma playground" in response.text


def test_traversal_in_the_path_is_no_route(server):
    for path in ("/ui/../../../../etc/passwd", "/ui/%2e%2e/%2e%2e/etc/passwd", "/ui/app.js/../../server.py"):
        response = httpx.get(server.url + path, headers=AUTH)
        assert response.status_code == 404 and "root:" not in response.text


# ------------------------------------------------------------------------------------ Host and Origin
@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:8000",
        "127.0.0.1.nip.io",
        "attacker.com.",
        "a b",
        "[::1",
        "localhost:port",
        "8.8.8.8",
    ],
)
def test_foreign_host_names_are_refused(server, host):
    """DNS rebinding: a page's own name pointing at 127.0.0.1 reaches the server, and is refused."""
    response = httpx.get(server.url + "/v1/models", headers={"Host": host, **AUTH})
    assert response.status_code == 403 and "--allowed-hosts" in error_of(response)
    assert httpx.post(server.url + "/v1/completions", headers={"Host": host, **AUTH}, json=NORMAL).status_code == 403


@pytest.mark.slow
@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "LOCALHOST:1",
        "127.0.0.1",
        "[::1]:8000",
        "10.1.2.3",
        "192.168.0.7:80",
        "box.local",
        "dev.localhost",
        "svc.internal",
        "proxy.example",
        "0.0.0.0",
    ],
)
def test_local_names_and_allowed_hosts_pass(server, host):
    assert httpx.get(server.url + "/v1/models", headers={"Host": host, **AUTH}).status_code == 200


@pytest.mark.parametrize(
    "origin", ["http://evil.example", "null", "http://localhost:3001", "https://localhost:3000", "file://"]
)
def test_cross_site_pages_cannot_post(server, origin):
    """A page elsewhere sends a simple text/plain POST (no preflight): refused before any work."""
    body = b'{"model": "dgemma-tiny", "prompt": "x", "max_tokens": 4}'
    response = httpx.post(
        server.url + "/v1/completions", content=body, headers={"Origin": origin, "Content-Type": "text/plain", **AUTH}
    )
    assert response.status_code == 403 and "--allowed-origins" in error_of(response)
    assert "access-control-allow-origin" not in response.headers


@pytest.mark.slow
def test_same_origin_allowed_origins_and_curl_pass(server):
    port = server.url.rsplit(":", 1)[1]
    same = httpx.post(
        server.url + "/v1/completions", json=NORMAL, headers={"Origin": f"http://127.0.0.1:{port}", **AUTH}
    )
    assert same.status_code == 200
    allowed = httpx.post(
        server.url + "/v1/completions", json=NORMAL, headers={"Origin": "http://localhost:3000", **AUTH}
    )
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://localhost:3000"
    preflight = httpx.options(
        server.url + "/v1/completions",
        headers={
            "Origin": "http://localhost:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    # curl -d: no Origin, a form content type, a JSON body
    curl = httpx.post(
        server.url + "/v1/completions",
        content=httpx.Request("POST", "/", json=NORMAL).content,
        headers={"Content-Type": "application/x-www-form-urlencoded", **AUTH},
    )
    assert curl.status_code == 200


# ------------------------------------------------------------------------------------ API key
@pytest.mark.slow
@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/v1/models"),
        ("GET", "/v1/models/dgemma-tiny"),
        ("GET", "/metrics"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/nothing"),
    ],
)
@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong", "Bearer", f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}"]
)
def test_api_routes_need_the_key(server, method, path, auth):
    headers = {} if auth is None else {"Authorization": auth}
    response = httpx.request(method, server.url + path, json=NORMAL if method == "POST" else None, headers=headers)
    assert response.status_code == 401 and "API key" in error_of(response)
    assert response.headers["www-authenticate"] == "Bearer"


def test_the_key_in_the_query_string_is_not_a_key(server):
    assert httpx.get(f"{server.url}/v1/models?api_key={KEY}").status_code == 401


def test_open_routes_need_no_key(server):
    for path in ("/health", "/", "/ui/app.js", "/ui/style.css", "/openapi.json", "/docs"):
        assert httpx.get(server.url + path).status_code == 200, path
    assert httpx.get(server.url + "/metrics", headers={"authorization": f"bearer {KEY}"}).status_code == 200


# ------------------------------------------------------------------------------------ slow clients
def raw(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (reads EOF, or an answer then EOF) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.slow
def test_a_connection_that_sends_nothing_is_closed(server):
    with raw(server) as sock:
        started = time.monotonic()
        assert closed_within(sock, READ_TIMEOUT + 5)
        assert time.monotonic() - started >= READ_TIMEOUT * 0.8
    assert wait_until(lambda: "no complete request headers" in server.output, 5)


@pytest.mark.slow
def test_headers_sent_a_byte_at_a_time_are_cut_off(server):
    """Slowloris: each byte resets no timer; the headers must be complete within --read-timeout."""
    request = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 1000
    with raw(server) as sock:
        started = time.monotonic()
        for byte in request:
            try:
                sock.send(bytes([byte]))
            except OSError:
                break  # closed on us: what we wanted
            time.sleep(0.05)
            if time.monotonic() - started > READ_TIMEOUT + 5:
                break
        assert closed_within(sock, 2)
        assert time.monotonic() - started < READ_TIMEOUT + 5


@pytest.mark.slow
def test_an_idle_keep_alive_connection_gets_a_deadline_again(server):
    with raw(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert b"200 OK" in sock.recv(4096)
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # the second request starts, and stalls
        assert closed_within(sock, READ_TIMEOUT + 5)


@pytest.mark.slow
def test_a_body_that_never_comes_is_a_408(server):
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
        'Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"model":'
    )
    with raw(server) as sock:
        sock.sendall(head.encode())
        sock.settimeout(READ_TIMEOUT + 5)
        answer = b""
        while b"read-timeout" not in answer and (chunk := sock.recv(4096)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"--read-timeout" in answer


def test_an_aborted_upload_is_one_log_line(server):
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    )
    for _ in range(3):
        with raw(server) as sock:
            sock.sendall(head.encode() + b'{"model": "dgemma-tiny", "messages": [' + b" " * 5000)
            time.sleep(0.2)
    assert wait_until(lambda: server.output.count("went away while sending its request body") >= 3, 10)
    # (the autouse check asserts that no traceback was logged)


@pytest.mark.slow
def test_too_many_connections_get_503_not_a_hang():
    with ServeProcess(["--served-model-name", MODEL, "--limit-concurrency", "3", "--read-timeout", "20"]) as s:
        socks = [raw(s) for _ in range(3)]
        try:
            time.sleep(0.3)
            assert httpx.get(s.url + "/health", timeout=10).status_code == 503
        finally:
            for sock in socks:
                sock.close()
        assert wait_until(lambda: s.healthy(), 10)


# ------------------------------------------------------------------------------------ the flags
@pytest.mark.slow
@pytest.mark.parametrize(
    "flags,words",
    [
        (["--api-key", ""], "--api-key"),
        (["--api-key", " padded "], "--api-key"),
        (["--allowed-origins", "evil"], "is not an origin"),
        (["--allowed-origins", "http://x:99999"], "is not an origin"),
        (["--request-timeout", "-1"], "--request-timeout"),
        (["--request-timeout", "nan"], "--request-timeout"),
        (["--request-timeout", "inf"], "--request-timeout"),
        (["--read-timeout", "0"], "--read-timeout"),
        (["--read-timeout", "inf"], "--read-timeout"),
        (["--limit-concurrency", "0"], "--limit-concurrency"),
        (["--max-denoising-steps", "0"], "--max-denoising-steps"),
    ],
)
def test_bad_safety_flags_are_one_line_before_loading(flags, words):
    import subprocess

    from serve_process import cli_command

    run = subprocess.run([*cli_command(), "serve", "--port", "0", *flags], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and words in run.stderr and "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("dgemma: error:")


@pytest.mark.slow
def test_the_key_may_come_from_the_environment():
    with ServeProcess(["--served-model-name", MODEL], env={"DGEMMA_API_KEY": "from-env"}) as s:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200
        assert "API key required" in s.output

"""`dgemma serve`'s line a request (serve/http/request_log.py): client, method, path, status, the
completion tokens generated and seconds, written once the response has ended (a stream's tokens
all counted); a hostile path cannot write lines of its own; `--quiet` (request_log=False): none."""

from __future__ import annotations

import logging
import re

import httpx
import pytest

from dgemma.serve.app import create_app
from dgemma.serve.http.listener import ServerThread
from dgemma.serve.http.request_log import MAX_PATH, printable
from servers import MODEL

LOGGER = "dgemma.serve.requests"
LINE = re.compile(r"^127\.0\.0\.1 (\S+) (\S+) (\d+) (\d+) tokens (\d+\.\d\d) s$")


def lines(caplog) -> list[tuple]:
    found = [LINE.match(r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert all(found), [r.getMessage() for r in caplog.records if r.name == LOGGER]
    return [m.groups()[:4] for m in found]


@pytest.fixture(scope="module")
def logged(model):
    with ServerThread(create_app(model, MODEL, max_active=2, max_queue=2, request_log=True)) as server:
        yield server


def test_a_line_a_request_with_its_tokens_streamed_or_not(logged, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "seed": 1}
    whole = httpx.post(logged.url + "/v1/completions", json=body, timeout=60).json()
    with httpx.stream("POST", logged.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks
    httpx.post(logged.url + "/v1/completions", json={**body, "model": "nosuch"}, timeout=60)
    httpx.get(logged.url + "/health", timeout=60)
    tokens = str(whole["usage"]["completion_tokens"])
    assert lines(caplog) == [
        ("POST", "/v1/completions", "200", tokens),
        ("POST", "/v1/completions", "200", tokens),  # the same seed: the same tokens, counted at the stream's end
        ("POST", "/v1/completions", "404", "0"),
        ("GET", "/health", "200", "0"),
    ]


def test_a_hostile_path_stays_on_its_line(logged, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    httpx.get(logged.url + "/v1/x%0A127.0.0.1%20GET%20/fake%20200" + "a" * 500, timeout=60)
    ((method, path, status, _),) = lines(caplog)
    assert (
        (method, status) == ("GET", "404")
        and "\n" not in path
        and path.startswith("/v1/x\\x0a127.0.0.1%20GET%20/fake%20200")
    )
    assert path.endswith("a...") and len(path) > MAX_PATH
    assert printable("/a\x1b[2J\u2028b") == "/a\\x1b[2J\\x2028b"


def test_quiet_logs_no_request(model, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with ServerThread(create_app(model, MODEL, max_active=1, max_queue=1)) as server:  # the default: off
        assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    assert not [r for r in caplog.records if r.name == LOGGER]
    from dgemma.cli import build_parser

    assert build_parser().parse_args(["serve", "--quiet"]).quiet and not build_parser().parse_args(["serve"]).quiet

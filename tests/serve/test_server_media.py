"""Images and video in the server, driven by the official `openai` client: data, file and remote
URLs within the operator's limits, usage and /metrics counts, the vision cache, and a suite of bad
media that each get a 400 naming the problem while the server keeps answering.

Remote media comes from a local http.server on 127.0.0.1; nothing reaches another host.
"""

import base64
import re
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import openai
import pytest

import dgemma
from dgemma.serve.media.policy import MediaPolicy
from media_samples import PNG, data_url, image_part, mp4_bytes, png_bytes, user
from servers import VISION_FAST as FAST
from servers import VISION_MODEL as MODEL
from servers import serve_vision as serve

CONTEXT = 1024  # a 1120-token image does not fit; a 70-token one does
MAX_BYTES = 200_000


# ------------------------------------------------------------------------------------ media
def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid PNG header claiming width x height pixels, over a few bytes of data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
    )


# ------------------------------------------------------------------------------------ a local media host
class MediaHost(BaseHTTPRequestHandler):
    """/img.png, /redirect (to /img.png), /to-file (a redirect to file://), /big (no length),
    /big-declared, /slow (headers late), /drip (body slower than the deadline), anything else 404."""

    release = threading.Event()  # set at teardown, so no handler sleeps on

    def do_GET(self):
        path = self.path
        if path == "/img.png":
            return self._send(PNG)
        if path in ("/redirect", "/to-file"):
            self.send_response(302)
            self.send_header("Location", "/img.png" if path == "/redirect" else "file:///etc/hostname")
            self.end_headers()
            return None
        if path == "/big":
            self.send_response(200)
            self.end_headers()
            for _ in range(MAX_BYTES // 10_000 + 2):
                self.wfile.write(b"\0" * 10_000)
            return None
        if path == "/big-declared":
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
            return None
        if path == "/slow":
            self.release.wait(5)
            return self._send(PNG)
        if path == "/drip":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"\0")
                self.wfile.flush()
                if self.release.wait(0.1):
                    break
            return None
        self.send_error(404)
        return None

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class QuietHost(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        """The dgemma server hangs up on /big, /slow and /drip on purpose: no traceback for that."""


@pytest.fixture(scope="module")
def media_host():
    host = QuietHost(("127.0.0.1", 0), MediaHost)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{host.server_address[1]}"
    MediaHost.release.set()
    host.shutdown()
    host.server_close()


# ------------------------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def model(vision_checkpoint):
    return dgemma.load(vision_checkpoint)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The allowed media dir (an image, a symlink out of it) and a file outside it."""
    root = tmp_path_factory.mktemp("media")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(outside / "secret.png")
    return allowed, outside


@pytest.fixture(scope="module")
def server(model, dirs):
    # the local media host is on loopback, which remote fetches refuse unless the operator names it
    policy = MediaPolicy(
        allowed_dir=dirs[0],
        allow_remote=True,
        allowed_domains=("127.0.0.1",),
        max_bytes=MAX_BYTES,
        timeout=0.5,
        max_items=3,
    )
    with serve(model, max_context=CONTEXT, media_policy=policy) as s:
        yield s


@pytest.fixture(scope="module")
def default_server(model):
    """The defaults: data URLs only."""
    with serve(model) as s:
        yield s


@pytest.fixture(scope="module")
def text_server():
    """The shipped text-only dgemma-tiny."""
    with serve(dgemma.load()) as s:
        yield s


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def chat(server, messages, **body):
    return server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, seed=1, extra_body={**FAST, **body}
    )


def expected_inputs(model, messages, budget=70):
    """What the server should build: the same parts, as the processor takes them."""
    parts = []
    for part in messages[0]["content"]:
        if part["type"] == "image_url":
            raw = base64.b64decode(part["image_url"]["url"].partition(",")[2])
            parts.append({"type": "image", "image": raw})
        else:
            parts.append(part)
    return model.processor.apply_chat_template([{"role": "user", "content": parts}], max_soft_tokens=budget)


def vision_counts(server) -> tuple[float, float]:
    return metric(server, "dgemma_vision_encodes_total"), metric(server, "dgemma_vision_cache_hits_total")


# ------------------------------------------------------------------------------------ what works
def test_data_url_image_gets_a_completion(model, server):
    messages = user(image_part(data_url(PNG)))
    r = chat(server, messages)
    inputs = expected_inputs(model, messages)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(inputs.input_ids)
    details = r.usage.prompt_tokens_details.model_dump()
    assert details["image_tokens"] == inputs.num_image_tokens > 0
    assert "cached_tokens" in details
    expected = model.generate([inputs], max_new_tokens=8, seed=1, max_denoising_steps=2, eos_token_ids=[])
    assert r.choices[0].message.content == model.tokenizer.decode(expected.sequences[0])


def test_the_same_image_runs_the_vision_tower_once(server):
    image = image_part(data_url(png_bytes(seed=7)))
    encodes, hits = vision_counts(server)
    first = chat(server, [{"role": "user", "content": [{"type": "text", "text": "A "}, image]}])
    assert vision_counts(server) == (encodes + 1, hits)
    # other text before the image: the prefix cache cannot serve it, the vision cache does
    chat(server, [{"role": "user", "content": [{"type": "text", "text": "B "}, image]}])
    assert vision_counts(server) == (encodes + 1, hits + 1)
    # a second turn resending the first: no encode either
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "A "}, image]},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and now?"},
    ]
    again = chat(server, turns)
    assert vision_counts(server)[0] == encodes + 1
    assert (
        again.usage.prompt_tokens_details.model_dump()["image_tokens"]
        == first.usage.prompt_tokens_details.model_dump()["image_tokens"]
    )


def test_streamed_chat_with_an_image(server):
    stream = server.client.chat.completions.create(
        model=MODEL,
        messages=user(image_part(data_url(PNG))),
        max_tokens=8,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=FAST,
    )
    chunks = list(stream)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens_details.model_dump()["image_tokens"] > 0


def test_file_and_remote_urls_within_the_limits(server, dirs, media_host):
    """A file below the allowed dir and a remote image behind a redirect, in one request."""
    parts = [image_part((dirs[0] / "cat.png").as_uri()), image_part(media_host + "/redirect")]
    r = chat(server, user(*parts))
    one = chat(server, user(image_part(data_url(PNG)))).usage.prompt_tokens_details.model_dump()["image_tokens"]
    assert r.usage.prompt_tokens_details.model_dump()["image_tokens"] == 2 * one


def test_video_url(model, server):
    r = chat(server, user({"type": "video_url", "video_url": {"url": data_url(mp4_bytes(3), "video/mp4")}}))
    frame_tokens = model.processor.video(mp4_bytes(3))[0][0].num_soft_tokens
    assert r.usage.prompt_tokens_details.model_dump()["image_tokens"] == 3 * frame_tokens


def test_media_work_is_off_the_event_loop(server, media_host):
    """While one request waits on a slow remote image, another request is answered."""
    done = {}

    def slow():
        with pytest.raises(openai.BadRequestError):
            chat(server, user(image_part(media_host + "/slow")))
        done["slow"] = time.monotonic()

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.1)
    assert httpx.get(server.url + "/health").status_code == 200
    done["health"] = time.monotonic()
    thread.join()
    assert done["health"] < done["slow"]


# ------------------------------------------------------------------------------------ bad media
def one(url):
    return lambda ctx: user(image_part(url(ctx) if callable(url) else url))


def video(url):
    return lambda ctx: user({"type": "video_url", "video_url": {"url": url}})


def parts(*content, text="what is this?"):
    return lambda ctx: user(*content, text=text)


C0 = "messages[0].content[0]"
# (name, server fixture, messages(ctx), extra body, words the message must hold, param); ctx has
# `allowed`, `outside` (directories) and `host` (the local media host's URL)
BAD = [
    ("not an image", "server", one(data_url(b"hello, I am text")), {}, "not an image", C0),
    ("truncated PNG", "server", one(data_url(PNG[: len(PNG) // 2])), {}, "truncated", C0),
    ("empty data URL", "server", one("data:image/png;base64,"), {}, "no data", C0),
    ("invalid base64", "server", one("data:image/png;base64,@@not*base64@@"), {}, "base64", C0),
    ("data URL not base64", "server", one("data:image/png,rawbytes"), {}, "base64", C0),
    ("unsupported mime type", "server", one(data_url(b"hi", "text/plain")), {}, "mime type", C0),
    ("video mime in image_url", "server", one(data_url(b"x", "video/mp4")), {}, "mime type", C0),
    ("TIFF is not taken", "server", one(data_url(b"II*\0", "image/tiff")), {}, "mime type", C0),
    ("unsupported scheme", "server", one("ftp://127.0.0.1/cat.png"), {}, "scheme", C0),
    ("no scheme", "server", one("cat.png"), {}, "scheme", C0),
    ("decompression bomb", "server", one(data_url(bomb_png())), {}, "megapixels", C0),
    ("over the byte limit", "server", one(data_url(b"\0" * (MAX_BYTES + 10))), {}, "limit of", C0),
    ("not a video", "server", video(data_url(b"not a video at all" * 8, "video/mp4")), {}, "cannot decode video", C0),
    ("more images than allowed", "server", parts(*[image_part(data_url(PNG))] * 4), {}, "at most 3", "messages"),
    (
        "file outside the allowed dir",
        "server",
        one(lambda c: (c.outside / "secret.png").as_uri()),
        {},
        "outside the allowed",
        C0,
    ),
    (
        "symlink out of the allowed dir",
        "server",
        one(lambda c: (c.allowed / "link.png").as_uri()),
        {},
        "outside the allowed",
        C0,
    ),
    (
        "'..' out of the allowed dir",
        "server",
        one(lambda c: f"file://{c.allowed}/../outside/secret.png"),
        {},
        "outside the allowed",
        C0,
    ),
    ("relative file URL", "server", one("file:cat.png"), {}, "absolute path", C0),
    ("missing file", "server", one(lambda c: (c.allowed / "nope.png").as_uri()), {}, "does not exist", C0),
    (
        "file:// with no allowed dir",
        "default_server",
        one(lambda c: (c.allowed / "cat.png").as_uri()),
        {},
        "file:// URLs are off",
        C0,
    ),
    ("remote with remote media off", "default_server", one(lambda c: c.host + "/img.png"), {}, "remote media", C0),
    ("remote over the size limit", "server", one(lambda c: c.host + "/big"), {}, "limit of", C0),
    ("remote declaring too many bytes", "server", one(lambda c: c.host + "/big-declared"), {}, "limit of", C0),
    ("remote answers too late", "server", one(lambda c: c.host + "/slow"), {}, "could not fetch", C0),
    ("remote body past the deadline", "server", one(lambda c: c.host + "/drip"), {}, "timed out", C0),
    ("remote redirect to file://", "server", one(lambda c: c.host + "/to-file"), {}, "could not fetch", C0),
    ("remote 404", "server", one(lambda c: c.host + "/missing.png"), {}, "not an HTTP 200 answer", C0),
    (
        "more soft tokens than the context",
        "server",
        one(data_url(PNG)),
        {"max_soft_tokens": 1120},
        "image tokens",
        "messages",
    ),
    ("bad max_soft_tokens", "server", one(data_url(PNG)), {"max_soft_tokens": 100}, "70, 140, 280", "max_soft_tokens"),
    (
        "bad video_max_soft_tokens",
        "server",
        one(data_url(PNG)),
        {"video_max_soft_tokens": 0},
        "70, 140, 280",
        "video_max_soft_tokens",
    ),
    ("image to the text-only model", "text_server", one(data_url(PNG)), {}, "no vision tower", C0),
    (
        "unknown part type",
        "server",
        parts({"type": "audio_url", "audio_url": {"url": "x"}}),
        {},
        "unsupported content part",
        C0,
    ),
    ("image_url without a url", "server", parts({"type": "image_url", "image_url": {}}), {}, "image_url", C0),
    (
        "placeholder typed in the text",
        "server",
        parts(image_part(data_url(PNG)), text="<|image|> twice"),
        {},
        "placeholder",
        "messages",
    ),
]


@pytest.fixture(scope="module")
def ctx(dirs, media_host):
    return SimpleNamespace(allowed=dirs[0], outside=dirs[1], host=media_host)


@pytest.mark.slow
@pytest.mark.parametrize("fixture, messages, body, words, param", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_media_gets_a_400_naming_the_problem(request, ctx, fixture, messages, body, words, param):
    srv = request.getfixturevalue(fixture)
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.chat.completions.create(
            model=MODEL, messages=messages(ctx), max_tokens=8, extra_body={**FAST, **body}
        )
    error = e.value.body
    assert words in error["message"], error
    assert error["param"] == param, error


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["server", "default_server", "text_server"])
def test_servers_answer_after_bad_media(request, fixture):
    srv = request.getfixturevalue(fixture)
    r = srv.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, extra_body=FAST
    )
    assert r.choices[0].finish_reason == "length"
    text = httpx.get(srv.url + "/metrics").text
    assert not re.search(r'^dgemma_http_responses_total\{code="5\d\d"\}', text, re.M)

"""Hostile media against `dgemma serve`: remote URLs aimed at the server's own network (loopback in
all its spellings, cloud metadata, redirects, DNS rebinding), an FFmpeg concat script sent as a
video, file URLs with NUL bytes, FIFOs and existence probes, and a request whose images would all
be decoded at once. Each gets a 400 naming the problem, and the server answers normally afterwards.

Servers run in-process (`ServerThread`): none of this can crash them. Every connection stays on
127.0.0.1: the addresses that are not local are refused before any connection (which the
`connections` fixture checks), and DNS is simulated by patching `socket.getaddrinfo`.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import av
import httpcore
import openai
import pytest

import dgemma
from dgemma.cli.serve import add_media_flags, media_policy, media_summary
from dgemma.inputs.decode import open_video
from dgemma.inputs.model_inputs import MediaError
from dgemma.serve.media.policy import MediaPolicy, MediaRef, PartError
from dgemma.serve.media.remote import GuardedBackend, address_allowed, fetch, host_allowed
from dgemma.serve.media.sources import file_bytes
from media_samples import PNG, data_url, image_part, mp4_bytes, png_bytes, user
from servers import VISION_FAST as FAST
from servers import VISION_MODEL as MODEL
from servers import serve_vision as serve

C0 = "messages[0].content[0]"
UNFETCHABLE = "(unreachable, not allowed on this server, or not an HTTP 200 answer)"


# ------------------------------------------------------------------------------------ a local host
class Handler(BaseHTTPRequestHandler):
    """/img.png, /to-loopback and /to-metadata (redirects to a loopback IP and to 169.254.169.254)."""

    def do_GET(self):
        self.server.requests += 1
        port = self.server.server_address[1]
        targets = {
            "/to-loopback": f"http://127.0.0.1:{port}/img.png",
            "/to-metadata": "http://169.254.169.254/latest/meta-data/",
        }
        if self.path == "/slow.png":  # a slow remote image: 2 s before its answer
            time.sleep(2)
            self.path = "/img.png"
        if self.path in targets:
            self.send_response(302)
            self.send_header("Location", targets[self.path])
            self.end_headers()
            return
        if self.path != "/img.png":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args):
        pass


class CountingHost(ThreadingHTTPServer):
    """An HTTP host on 127.0.0.1 that counts the connections it accepts and the requests it reads."""

    daemon_threads = True
    accepted = requests = 0

    def verify_request(self, request, client_address) -> bool:
        self.accepted += 1
        return True

    def handle_error(self, request, client_address):
        """A fetch refused after connecting hangs up: no traceback for that."""


@pytest.fixture(scope="module")
def host():
    server = CountingHost(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.port = server.server_address[1]
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def closed_port() -> int:
    """A port of 127.0.0.1 that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def connections(monkeypatch):
    """The (host, port) of every TCP connection this process opens during the test."""
    seen, real = [], socket.create_connection

    def recording(address, *args, **kwargs):
        seen.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", recording)
    return seen


# ------------------------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def model(vision_checkpoint):
    return dgemma.load(vision_checkpoint)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


@pytest.fixture(scope="module")
def rss_start():
    """This process's resident bytes once the module's model is loaded, its peak reset to now
    (/proc/self/clear_refs): the in-process servers' cases are measured from here."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


@pytest.fixture(autouse=True)
def within_memory(model, rss_start):
    yield
    assert _status("VmHWM") < rss_start + 300 * 2**20


@pytest.fixture(scope="module")
def allowed(tmp_path_factory):
    """The allowed media dir (an image, a FIFO, a directory, a symlink to /dev/zero) beside `outside`."""
    root = tmp_path_factory.mktemp("hostile-media")
    (root / "allowed").mkdir()
    (root / "outside").mkdir()
    (root / "allowed" / "cat.png").write_bytes(PNG)
    (root / "allowed" / "sub.png").mkdir()
    os.mkfifo(root / "allowed" / "pipe.png")
    (root / "allowed" / "zero.png").symlink_to("/dev/zero")
    (root / "outside" / "secret.png").write_bytes(PNG)
    return root / "allowed"


@pytest.fixture(scope="module")
def remote(model, allowed):
    """Remote media on (the default 10 s timeout), files below `allowed`, no host named."""
    with serve(model, media_policy=MediaPolicy(allowed_dir=allowed, allow_remote=True)) as s:
        yield s


@pytest.fixture(scope="module")
def named(model):
    """Remote media on, `localhost` named by the operator (--allowed-media-domains localhost)."""
    with serve(model, media_policy=MediaPolicy(allow_remote=True, allowed_domains=("localhost",), timeout=5)) as s:
        yield s


@pytest.fixture(scope="module")
def default(model):
    """No media flags: data URLs only."""
    with serve(model) as s:
        yield s


def chat(server, messages):
    return server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=1, extra_body=FAST)


def refused(server, messages, words: str, param: str = C0) -> str:
    """The 400's message for `messages` (it must hold `words` and name `param`), after which the
    server still answers a normal request."""
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, messages)
    error = e.value.body
    assert words in error["message"] and error["param"] == param, error
    assert chat(server, [{"role": "user", "content": "hi"}]).choices[0].finish_reason == "length"
    return error["message"]


def refused_url(server, url: str) -> str:
    """The message for an image at `url`, with the URL replaced by URL (to compare causes)."""
    message = refused(server, user(image_part(url)), "could not fetch")
    assert message == f"{C0}: could not fetch {url!r} {UNFETCHABLE}"
    return message.replace(repr(url), "URL")


# ------------------------------------------------------------------------------------ the address rule
LOOPBACK = [
    "http://127.0.0.1:{port}/img.png",
    "http://localhost:{port}/img.png",
    "http://[::1]:{port}/img.png",
    "http://[::ffff:127.0.0.1]:{port}/img.png",
    "http://0.0.0.0:{port}/img.png",
    "http://127.1:{port}/img.png",
    "http://2130706433:{port}/img.png",
    "http://[::ffff:7f00:1]:{port}/img.png",
]


@pytest.mark.slow
@pytest.mark.parametrize("template", LOOPBACK)
def test_loopback_is_refused_before_connecting(remote, host, closed_port, connections, template):
    """Every spelling of loopback: refused without a connection, with one message for an open and
    a closed port."""
    accepted = host.accepted
    open_message = refused_url(remote, template.format(port=host.port))
    closed_message = refused_url(remote, template.format(port=closed_port))
    assert open_message == closed_message
    assert host.accepted == accepted
    assert not [a for a in connections if a[1] in (host.port, closed_port)]


def test_metadata_address_is_refused_at_once(remote, connections):
    """169.254.169.254 is refused before any connection: no wait for the 10 s timeout."""
    started = time.monotonic()
    refused_url(remote, "http://169.254.169.254/latest/meta-data/")
    assert time.monotonic() - started < 5
    assert not [a for a in connections if a[0] == "169.254.169.254"]


def test_unreachable_and_disallowed_get_the_same_message(remote, named, host, closed_port, monkeypatch):
    """A name that does not resolve, a refused connection to a named host and a disallowed address:
    one message, whatever the cause."""
    real = socket.getaddrinfo

    def no_such_name(name, *args, **kwargs):
        if name == "nowhere.test":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    messages = {
        refused_url(remote, "http://nowhere.test/img.png"),
        refused_url(named, f"http://localhost:{closed_port}/img.png"),
        refused_url(named, f"http://localhost:{host.port}/missing.png"),  # a 404
        refused_url(remote, f"http://127.0.0.1:{host.port}/img.png"),
    }
    assert len(messages) == 1


def test_a_named_host_is_fetched_whatever_its_address(named, host):
    """--allowed-media-domains localhost lets the local host through."""
    r = chat(named, user(image_part(f"http://localhost:{host.port}/img.png")))
    assert r.usage.prompt_tokens_details.model_dump()["image_tokens"] > 0


@pytest.mark.parametrize("path", ["/to-loopback", "/to-metadata"])
def test_a_redirect_from_a_named_host_to_a_disallowed_address(named, host, connections, path):
    """The address rule holds on every hop: a named host cannot redirect to an address that is not."""
    accepted, requests = host.accepted, host.requests
    started = time.monotonic()
    refused_url(named, f"http://localhost:{host.port}{path}")
    assert time.monotonic() - started < 4
    # the redirect's connection and request only: the second hop never connected
    assert (host.accepted, host.requests) == (accepted + 1, requests + 1)
    assert not [a for a in connections if a[0] == "169.254.169.254"]


@pytest.fixture
def rebinding(monkeypatch, host):
    """DNS that answers a public address for rebind.test, then (when the socket connects to that
    address) loopback: what a rebinding attacker's DNS does between check and use."""
    real = socket.getaddrinfo

    def rebound(name, port, *args, **kwargs):
        if name == "rebind.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("8.8.8.8", port))]
        if name == "8.8.8.8":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", host.port))]
        return real(name, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebound)


def test_dns_rebinding_is_caught_at_the_connected_address(remote, host, rebinding):
    """The connection lands on loopback although the name resolved to a public address: refused
    by the address actually connected to, before a byte is sent."""
    accepted, requests = host.accepted, host.requests
    refused_url(remote, f"http://rebind.test:{host.port}/img.png")
    assert host.accepted == accepted + 1 and host.requests == requests


def test_the_backend_checks_the_peer(host, rebinding):
    backend = GuardedBackend()
    with pytest.raises(httpcore.ConnectError, match="connected to 127.0.0.1"):
        backend.connect_tcp("rebind.test", host.port, timeout=2)
    GuardedBackend(("rebind.test",)).connect_tcp("rebind.test", host.port, timeout=2).close()  # named: allowed


ADDRESSES = [
    ("8.8.8.8", True),
    ("2606:4700:4700::1111", True),
    ("::ffff:8.8.8.8", True),
    ("2002:808:808::1", True),
    ("64:ff9b::808:808", True),
    ("127.0.0.1", False),
    ("10.1.2.3", False),
    ("172.16.0.1", False),
    ("192.168.0.1", False),
    ("100.64.0.1", False),
    ("169.254.169.254", False),
    ("0.0.0.0", False),
    ("224.0.0.1", False),
    ("240.0.0.1", False),
    ("255.255.255.255", False),
    ("192.0.2.1", False),
    ("::1", False),
    ("::", False),
    ("fe80::1%lo", False),
    ("fc00::1", False),
    ("fec0::1", False),
    ("ff02::1", False),
    ("::ffff:127.0.0.1", False),
    ("::ffff:10.0.0.1", False),
    ("::127.0.0.1", False),
    ("2002:7f00:1::1", False),
    ("2002:a9fe:a9fe::1", False),
    ("64:ff9b::a9fe:a9fe", False),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False),
    ("64:ff9b:1::808:808", False),
    ("not an address", False),
]


@pytest.mark.parametrize("address, allowed", ADDRESSES)
def test_address_rule(address, allowed):
    assert address_allowed(address) is allowed


def test_host_names():
    domains = ("media.internal", "*.example.com")
    assert host_allowed("MEDIA.internal.", domains) and host_allowed("a.b.example.com", domains)
    assert not host_allowed("example.com", domains) and not host_allowed("badexample.com", domains)
    assert not host_allowed("media.internal.evil.com", domains) and not host_allowed("x.media.internal", domains)


def test_the_flag(allowed):
    p = argparse.ArgumentParser()
    add_media_flags(p)
    assert "--allowed-media-domains" in p.format_help()
    args = p.parse_args(["--allow-remote-media", "--allowed-media-domains", "Media.Internal, *.example.com,"])
    policy = media_policy(args)
    assert policy.allowed_domains == ("media.internal", "*.example.com")
    assert "media.internal" in media_summary(SimpleNamespace(supports_images=True), policy)
    with pytest.raises(ValueError, match="needs --allow-remote-media"):
        media_policy(p.parse_args(["--allowed-media-domains", "media.internal"]))
    with pytest.raises(ValueError, match="not a host name"):
        MediaPolicy(allow_remote=True, allowed_domains=("http://media.internal/",))


# ------------------------------------------------------------------------------------ TLS
@pytest.fixture(scope="module")
def tls_host(tmp_path_factory):
    """An HTTPS host on 127.0.0.1 with a self-signed certificate for the name localhost, recording
    the server names (SNI) clients ask for."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    root = tmp_path_factory.mktemp("tls")
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
        ],
        check=True,
        capture_output=True,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    names = []
    context.sni_callback = lambda sock, name, ctx: names.append(name)
    server = CountingHost(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield SimpleNamespace(port=server.server_address[1], cert=cert, names=names, server=server)
    server.shutdown()
    server.server_close()


def test_tls_verifies_the_host_name(tls_host, monkeypatch):
    """The connection goes to an address, yet TLS asks for (SNI) and verifies the URL's host name:
    with the certificate trusted, localhost is fetched and 127.0.0.1 (not in the certificate) is not."""
    policy = MediaPolicy(allow_remote=True, allowed_domains=("localhost", "127.0.0.1"), timeout=5)
    url = f"https://localhost:{tls_host.port}/img.png"
    with pytest.raises(PartError, match="could not fetch"):  # not trusted yet
        fetch(MediaRef("image", url, C0), policy)
    assert tls_host.names[-1] == "localhost"
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_host.cert))
    assert fetch(MediaRef("image", url, C0), policy) == PNG
    with pytest.raises(PartError, match="could not fetch"):
        fetch(MediaRef("image", f"https://127.0.0.1:{tls_host.port}/img.png", C0), policy)


# ------------------------------------------------------------------------------------ video containers
CONCAT = b"ffconcat version 1.0\nfile beside.mp4\n"


def test_plain_pyav_follows_a_concat_script(tmp_path, monkeypatch):
    """The attack is real: PyAV without a whitelist reads the file the script names."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "beside.mp4").write_bytes(mp4_bytes(3))
    with av.open(io.BytesIO(CONCAT)) as container:
        assert container.format.name == "concat" and len(list(container.decode(video=0))) == 3


@pytest.mark.parametrize("mime", [None, "video/mpeg", "video/mp4"])
def test_a_concat_script_never_opens_what_it_names(tmp_path, monkeypatch, mime):
    """The whitelist refuses the concat demuxer before it reads its header: the file it names is a
    FIFO here, which would block any reader that opened it, and open_video returns at once."""
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "beside.mp4")
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(_error(lambda: open_video(CONCAT, mime=mime))), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # it opened the FIFO: let it go before failing
        os.close(os.open(tmp_path / "beside.mp4", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("open_video opened the file the concat script names")
    words = "not a container format this server reads" if mime != "video/mp4" else "not a valid mp4 file"
    assert words in outcome[0]


def _error(fn) -> str:
    try:
        fn()
    except MediaError as e:
        return str(e)
    return "no error"


def test_real_containers_still_open(tmp_path):
    clip = mp4_bytes(3)
    assert open_video(clip).frames.shape[0] == 3
    assert open_video(clip, mime="video/mp4").frames.shape[0] == 3
    (tmp_path / "clip.mp4").write_bytes(clip)
    assert open_video(tmp_path / "clip.mp4").frames.shape[0] == 3
    with pytest.raises(MediaError, match="not a valid webm file"):
        open_video(clip, mime="video/webm")


@pytest.mark.parametrize(
    "mime, words", [("video/mp4", "not a valid mp4 file"), ("video/mpeg", "not a container format this server reads")]
)
def test_a_concat_data_url_gets_a_400(default, tmp_path, monkeypatch, mime, words):
    """With no media flags at all, an ffconcat data URL naming a real video beside the server."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "beside.mp4").write_bytes(mp4_bytes(3))
    refused(default, user({"type": "video_url", "video_url": {"url": data_url(CONCAT, mime)}}), words)


# ------------------------------------------------------------------------------------ file URLs
@pytest.mark.parametrize("suffix", ["%00.png", "\0.png"], ids=["%00", "raw NUL"])
def test_a_nul_byte_in_a_file_url(remote, allowed, suffix):
    refused(remote, user(image_part(f"file://{allowed}/cat.png{suffix}")), "NUL byte")


def test_a_path_no_file_system_takes(allowed):
    with pytest.raises(PartError, match="not a valid file path"):
        file_bytes(MediaRef("image", f"file://{allowed}/\ud800.png", C0), MediaPolicy(allowed_dir=allowed))


def test_a_fifo_is_refused_without_opening_it(remote, allowed):
    started = time.monotonic()
    refused(remote, user(image_part((allowed / "pipe.png").as_uri())), "not a regular file")
    assert time.monotonic() - started < 5


def test_a_directory_is_not_a_regular_file(remote, allowed):
    refused(remote, user(image_part((allowed / "sub.png").as_uri())), "not a regular file")


def test_a_device_behind_a_symlink_is_outside(remote, allowed):
    refused(remote, user(image_part((allowed / "zero.png").as_uri())), "outside the allowed")


def test_outside_is_one_answer_whether_the_path_exists_or_not(remote, allowed):
    """No existence oracle: a file outside that exists, one that does not, and one behind '..'."""
    outside = allowed.parent / "outside"
    urls = [
        (outside / "secret.png").as_uri(),
        (outside / "nope.png").as_uri(),
        f"file://{allowed}/../outside/nope.png",
        f"file://{allowed}/nope/../../outside/secret.png",
    ]
    messages = {
        re.sub(r"'[^']*'", "URL", refused(remote, user(image_part(url)), "outside the allowed"), count=1)
        for url in urls
    }
    assert len(messages) == 1


# ------------------------------------------------------------------------------------ memory
@pytest.mark.slow
def test_images_are_decoded_one_at_a_time(default, monkeypatch):
    """Each image is decoded and reduced to its patches before the next is decoded: when one is
    decoded, no earlier decoded image is alive."""
    from dgemma.inputs import decode

    real, decoded, alive_before = decode.open_image, [], []

    def tracking(*args, **kwargs):
        gc.collect()
        alive_before.append(sum(ref() is not None for ref in decoded))
        image = real(*args, **kwargs)
        decoded.append(weakref.ref(image))
        return image

    monkeypatch.setattr(decode, "open_image", tracking)  # the processor calls decode.open_image
    images = [image_part(data_url(png_bytes(200, 150, seed=i))) for i in range(3)]
    assert chat(default, user(*images)).usage.prompt_tokens_details.model_dump()["image_tokens"] > 0
    assert alive_before == [0, 0, 0]


# ------------------------------------------------------------------------------------ slow media
@pytest.mark.slow
def test_slow_remote_images_do_not_starve_text_requests(named, host):
    """Twelve requests wait on slow images (more than the default thread pool of a machine with
    up to 8 cores holds): they fetch on the media pool, so a text request still answers at once."""
    url = f"http://localhost:{host.port}/slow.png"
    results = []

    def slow():
        results.append(chat(named, user(image_part(url))).choices[0].finish_reason)

    threads = [threading.Thread(target=slow) for _ in range(12)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the slow requests are all waiting on their images now
    started = time.monotonic()
    assert chat(named, [{"role": "user", "content": "hi"}]).choices[0].finish_reason == "length"
    assert time.monotonic() - started < 1.5
    for t in threads:
        t.join(60)
    assert results == ["length"] * 12  # and every slow one was answered in the end

"""The tests are laid out like the package: tests/engine/ tests dgemma/engine/, tests/serve/
dgemma/serve/, ... (tests/api/: the Python API and loading; here: the tree's layout, the scripts
and the memory plans). This file holds the session fixtures that tests of several folders share
(each built once per session) and the markers that follow from what a test uses; a fixture one
folder alone uses is in that folder's conftest.py. Helpers that several folders import live here
(servers.py, serve_process.py, checkpoints.py, media_samples.py, oracle.py, ...), a folder's own
beside its tests (serve/tool_fakes.py, hub/fake_hub.py, ...): test files import helpers by name
(this folder is on sys.path; pytest puts each test's own folder there), never one another
(tests/test_layout.py checks)."""

import os
import sys
from pathlib import Path

# Triton runs its kernels on the CPU when this is set before triton is first imported (by
# tests/kernels/test_triton_quant.py, or by compressed-tensors, which imports triton itself).
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import EOS, write_vision_with_processor  # noqa: E402
from oracle import build_reference  # noqa: E402

# Markers that follow from a fixture a test uses (the rest are set in the test files).
FIXTURE_MARKERS = {
    "browser": "browser",  # test_playground.py: Debian's chromium
    "tls_host": "subprocess",  # serve/hostile/test_hostile_media.py: openssl writes its certificate
    "tiny_server": "subprocess",  # serve/hostile/conftest.py: `dgemma serve` in a subprocess
}


def pytest_collection_modifyitems(items):
    for item in items:
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)


@pytest.fixture(autouse=True)
def _threads():
    """One intra-op thread a test: the tiny models' ops are too small to share, so a second thread
    only spins (measured: the same wall time, twice the CPU), and the README's `-n 2` runs two
    test processes on the 2-core host. `two_threads` (kernels/conftest.py) gives a test two."""
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session", autouse=True)
def _native_kernels_built():
    """Build the native CPU kernels (where they run) in this process first, not inside the startup
    timeout of a server subprocess that a test launches: every test's subprocess (dgemma chat,
    serve, scripts) then imports the built libraries."""
    from dgemma.kernels import avx2, native

    native.amx(wait=True)  # (in the foreground, whatever DGEMMA_NATIVE says: the tests need them now)
    avx2.extension(wait=True)
    yield


# ------------------------------------------------------------------------------------ reference checkpoints
@pytest.fixture(scope="session")
def ref_gqa(tmp_path_factory):
    path = tmp_path_factory.mktemp("gqa")
    model = build_reference(path, "gqa", generation={"eos_token_id": EOS, "pad_token_id": 0})
    return path, model


@pytest.fixture(scope="session")
def ref_wide(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide")
    model = build_reference(path, "wide", seed=1, generation={"eos_token_id": EOS, "pad_token_id": 0})
    return path, model


@pytest.fixture(scope="session")
def vision_checkpoint(tmp_path_factory) -> Path:
    """The tiny vision checkpoint with its processor (tests/vision_checkpoint.py), written once;
    each module loads its own model from it, so no module sees another's vision cache."""
    return write_vision_with_processor(tmp_path_factory.mktemp("vision") / "ckpt")


# ------------------------------------------------------------------------------------ the tiny random model's server
@pytest.fixture(scope="session")
def model(tmp_path_factory):
    """The tiny random model (seed 0) that `server` serves, shared by the server, structured output,
    tools, n/logprobs, infill and client tests (their prompts differ, so no test meets another's
    prefix cache). Modules with a `model` fixture of their own override it."""
    import dgemma
    from dgemma.model.checkpoint import make_tiny_random

    return dgemma.load(make_tiny_random(tmp_path_factory.mktemp("srv") / "ckpt", seed=0))


@pytest.fixture(scope="session")
def server(model):
    """`model` served in-process as servers.MODEL; `server.app` is its app."""
    from dgemma.serve.http.listener import ServerThread
    from servers import tiny_random_app

    app = tiny_random_app(model)
    with ServerThread(app) as s:
        s.app = app
        yield s


@pytest.fixture(scope="session")
def client(server):
    from servers import openai_client

    return openai_client(server.url)

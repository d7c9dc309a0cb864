import os
import sys
from pathlib import Path

# Triton runs its kernels on the CPU when this is set before triton is first imported (by
# tests/test_triton_quant.py, or by compressed-tensors, which imports triton itself).
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from oracle import build_reference  # noqa: E402

EOS = list(range(40, 52))  # a dozen EOS ids, so that EOS turns up inside canvases


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)
    yield


@pytest.fixture(scope="session", autouse=True)
def _native_kernels_built():
    """Build the native CPU kernels (where they run) in this process first, not inside the startup
    timeout of a server subprocess that a test launches: every test's subprocess (dgemma chat,
    serve, scripts) then imports the built libraries."""
    from dgemma.kernels import avx2, native

    native.amx()
    avx2.extension()
    yield


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

import pytest

from serve_process import ServeProcess

MODEL = "dgemma-tiny"


@pytest.fixture(scope="session")
def tiny_server():
    """The shipped dgemma-tiny served by a subprocess (defaults otherwise), shared by the hostile tests
    that do not need flags of their own. Tests that might crash it run against it on purpose."""
    with ServeProcess(["--served-model-name", MODEL, "--max-active", "4"]) as server:
        yield server

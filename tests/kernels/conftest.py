"""What the kernels' tests share: two intra-op threads for the native kernels (they split their work
across threads)."""

import pytest
import torch


@pytest.fixture
def two_threads(_threads):
    """Two intra-op threads, as on a 2-core host. Only here: under `-n 2` a second thread waits on a
    busy core, and a test of the whole engine ran 10-30x slower (engine/test_engine.py, 0.15 s -> 5 s)."""
    torch.set_num_threads(2)
    yield

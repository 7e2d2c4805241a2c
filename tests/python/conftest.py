import os
import uuid

import pytest


@pytest.fixture
def store_dir(tmp_path):
    """A fresh store directory on the same filesystem as the test's temp dir."""
    return str(tmp_path / f"store-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def shm_dir():
    """A store directory on tmpfs (buffered I/O path)."""
    d = f"/dev/shm/statepager-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield d
    os.system(f"rm -rf {d}")

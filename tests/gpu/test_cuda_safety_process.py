"""On CUDA: a forked child of a process with a Pager on the GPU touches neither CUDA nor
the parent's store (its exit, its tensors dying, close() and paging refused), and a
closed Pager's tensors and non-resident storages never reach the device: the cases of
tests/python/test_safety_process.py, on cuda."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from test_safety_process import (  # noqa: E402
    CHILD_EXITS, CHILD_PAGING, forked, read_after_close, storage_repr)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("child", list(CHILD_EXITS))
def test_forked_child_of_a_cuda_process_exits_cleanly(store_dir, child):
    r = forked(store_dir, CHILD_EXITS[child], "cuda")
    assert "child exit 0" in r.stdout, r.stdout + r.stderr
    assert r.stderr == "", r.stderr


def test_paging_in_forked_child_of_a_cuda_process_is_refused_at_once(store_dir):
    r = forked(store_dir, CHILD_PAGING, "cuda")
    assert "child refused all" in r.stdout and "child exit 0" in r.stdout, r.stdout + r.stderr


def test_reading_a_cuda_tensor_after_close_raises(store_dir):
    r = read_after_close(store_dir, "cuda")
    assert r.returncode == 0 and r.stdout == "ok\n", (r.returncode, r.stdout, r.stderr)


def test_repr_of_a_cuda_storage_not_resident_is_a_placeholder(store_dir):
    r = storage_repr(store_dir, "cuda")
    assert r.returncode == 0 and r.stdout == "ok\n", (r.returncode, r.stdout, r.stderr)

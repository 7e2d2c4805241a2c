"""tests/python/test_safety_steps.py on CUDA memory: another thread's save, state_dict()
or pause waits for the step, and opt.state read between steps gives its values; where
either went wrong the device would fault on an illegal address and lose its context,
so each path runs in its own process (exit code and "ok" checked)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import test_safety_steps as safety  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("what", safety.THREADS + safety.READS)
def test_on_the_gpu(tmp_path, what):
    safety.run_child(what, "cuda", str(tmp_path / "store"))

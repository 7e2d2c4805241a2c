"""The GIL is released by every call into the core that can wait (python/module.cc), and
releasing a tensor whose bucket is in flight never waits: paging that waits for a
background save's copy completes while other Python threads (the save's, and one spinning
in a busy loop) run. Each case runs tests/python/gil_run.py in its own process: a
deadlock fails by the timeout instead of hanging the suite."""
import os
import subprocess
import sys

import pytest

RUNNER = os.path.join(os.path.dirname(__file__), "gil_run.py")


@pytest.mark.parametrize("case", ["page-in-at-budget", "release-while-paging",
                                  "background-save"])
def test_waits_release_the_gil(case, tmp_path):
    try:
        proc = subprocess.run([sys.executable, RUNNER, case, str(tmp_path / "store")],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{case}: no progress in 120 s (a call waited holding the GIL?)\n"
                    f"{(e.stderr or b'')[-4000:]}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), out[-4000:]

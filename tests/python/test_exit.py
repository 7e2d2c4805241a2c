"""A script that fails while a Pager is live exits with its traceback and exit status,
never an abort, and its stores are closed (deleted) at exit. Each case runs
tests/python/exit_run.py in a fresh process on the host backend; tests/gpu/test_cuda_exit.py
runs them on CUDA."""
import os
import re
import subprocess
import sys

import pytest
from ports import free_port

RUNNER = os.path.join(os.path.dirname(__file__), "exit_run.py")

# case -> (exit status, text the traceback must end with). An uncaught KeyboardInterrupt
# is Python's death by SIGINT (-2), but once torch._dynamo is imported (torch.optim's
# step imports it) Python 3.12 with torch 2.11 exits with 1 instead. So an interrupted
# step must end as the same interrupt after a torch optimizer's step does: the control
# case named in place of the status.
CASES = {
    "attach-usage-error": (1, "UsageError: hbm_budget"),
    "raise-after-step": (1, "AssertionError: user code failed after a step"),
    "bucket-in-flight": (1, "RuntimeError: user code failed with a bucket in flight"),
    "save-in-flight": (1, "RuntimeError: user code failed with a background save in flight"),
    "scope-open": (1, "RuntimeError: user code failed inside scope()"),
    "paused": (1, "RuntimeError: user code failed while paused"),
    "with-block": (1, "RuntimeError: user code failed inside `with Pager()`"),
    "oom-in-step": (1, "OutOfMemoryError: the pager's page budget"),
    "io-error-in-step": (1, "CorruptStoreError: store file"),
    "hook-in-step": (1, "RuntimeError: user hook failed inside a step"),
    "interrupt-in-step": ("interrupt-unpaged", "KeyboardInterrupt"),
    "sys-exit": (3, None),
    "clean": (0, None),
}


def run_case(case: str, store: str, device: str = "cpu", timeout: float = 300):
    # A port of its own for the Megatron cases' process group: the one an earlier test
    # of this pytest process left in os.environ is taken by that process's store.
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, RUNNER, case, store, "--device", device],
                          capture_output=True, text=True, timeout=timeout, env=env)
    return proc


def check_exit(proc, status: int | str, last_line: str | None, store: str) -> None:
    """status: the exit status, or the control case whose status the script's must be."""
    out = proc.stdout + proc.stderr
    if isinstance(status, str):
        control = run_case(status, store + "-control", proc.args[-1])
        assert last_line in control.stderr, control.stderr[-4000:]
        status = control.returncode
    assert proc.returncode == status, f"exit status {proc.returncode}, not {status}:\n{out[-4000:]}"
    assert "terminate called" not in out and "Fatal Python error" not in out, out[-4000:]
    if last_line is not None:
        assert "Traceback (most recent call last)" in proc.stderr, proc.stderr[-4000:]
        # torch prints its own warnings at exit, after the traceback (with distributed:
        # "[rank0]:[W... ProcessGroupNCCL.cpp...] Warning: destroy_process_group() ...").
        lines = [line for line in proc.stderr.strip().splitlines()
                 if not re.match(r"(\[rank\d+\]:)?\[W\d{4} ", line)]
        assert last_line in lines[-1], proc.stderr[-4000:]
    else:
        assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    # Every Pager the script made was closed at exit: its store directory is gone.
    parent, name = os.path.split(store)
    left = [f for f in os.listdir(parent) if f.startswith(name) and not f.endswith("-ckpt")]
    assert left == [], f"store directories left behind: {left}"


@pytest.mark.parametrize("case", list(CASES))
def test_failing_script_exits_with_its_traceback_and_status(case, tmp_path):
    status, last_line = CASES[case]
    store = str(tmp_path / "store")
    check_exit(run_case(case, store), status, last_line, store)

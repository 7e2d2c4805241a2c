"""What every bench shares besides its report (bench/report.py): a work directory of its
own, and fio as the floor of the store bench."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile

from statepager.tools.bench.floor import find_fio


@contextlib.contextmanager
def bench_directory(parent: str):
    """A new directory for one bench run, made inside `parent` (created when missing) and
    deleted afterwards with what the run wrote into it: a bench touches nothing else."""
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix="statepager-bench-", dir=parent)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fio(directory: str, rw: str, size: int, block: int, depth: int) -> float | None:
    """GB/s that fio measures for sequential `rw` (write|read) with O_DIRECT on io_uring;
    None without a fio (bench.floor.find_fio). fio moves `size` rounded up to 4 KiB (what
    O_DIRECT moves) in requests of `block` bytes, or of all of it when it is less (fio
    refuses a size below one request). ChildProcessError, with fio's message, if it fails."""
    tool, _ = find_fio()
    if tool is None:
        return None
    path = os.path.join(directory, "fio.dat")
    size = -(-size // 4096) * 4096
    cmd = [
        tool.path, "--name=raw", f"--filename={path}", f"--rw={rw}", f"--bs={min(block, size)}",
        f"--iodepth={depth}", "--ioengine=io_uring", "--direct=1", f"--size={size}",
        "--output-format=json",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, env=tool.env)
    if run.returncode != 0:
        raise ChildProcessError(f"fio {rw} of {size} bytes failed (exit status "
                                f"{run.returncode}): {(run.stderr or run.stdout).strip()}")
    out = json.loads(run.stdout)
    job = out["jobs"][0]["write" if rw == "write" else "read"]
    return job["bw_bytes"] / 1e9

"""What every bench shares besides its report (bench/report.py): a work directory of its
own, and fio as the floor of the store bench."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile

from statepager.bench.floor import find_fio


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
    None without a fio (bench.floor.find_fio)."""
    tool, _ = find_fio()
    if tool is None:
        return None
    path = os.path.join(directory, "fio.dat")
    cmd = [
        tool.path, "--name=raw", f"--filename={path}", f"--rw={rw}", f"--bs={block}",
        f"--iodepth={depth}", "--ioengine=io_uring", "--direct=1", f"--size={size}",
        "--output-format=json",
    ]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                    env=tool.env).stdout)
    job = out["jobs"][0]["write" if rw == "write" else "read"]
    return job["bw_bytes"] / 1e9

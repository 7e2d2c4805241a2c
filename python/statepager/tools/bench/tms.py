"""torch-memory-saver's pause/resume on the tensors bench sleep pauses, for `bench sleep
--compare-tms`: the same sizes, dtypes and bytes (tensor_spec and fill), with CPU backup
in pinned memory (or, for --saver, disk backup or none), its allocator hooked through
torch (hook_mode "torch": a pluggable allocator).

It runs in a process of its own (this file run as a script, importing torch and
torch_memory_saver only): the hook is process-wide, and statepager's own allocator must
not meet it. run() starts that process and returns its figures, or {"skipped": why} when
the package or CUDA is missing.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import torch

PACKAGE = "torch_memory_saver"
WHEEL = "torch_memory_saver==0.0.10"


def tensor_spec(size: int, seed: int = 0) -> list[tuple[int, torch.dtype]]:
    """(numel, dtype) of tensors of mixed sizes and dtypes adding up to about `size`
    bytes: what bench sleep pauses."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.int64]
    out, total, i = [], 0, 0
    while total < size:
        dt = dtypes[i % len(dtypes)]
        item = torch.empty((), dtype=dt).element_size()
        n = max(1, min(int(torch.randint(1 << 10, 96 << 20, (1,), generator=gen)),
                       size - total) // item)
        out.append((n, dt))
        total += n * item
        i += 1
    return out


def fill(tensors: list, device: torch.device) -> list[int]:
    """Random bytes into the tensors (the same for the same spec and device); returns the
    byte sums that check them after a round trip."""
    g = torch.Generator(device=device).manual_seed(1)
    for t in tensors:
        t.view(torch.uint8).random_(generator=g)
    return sums(tensors)


def sums(tensors: list) -> list[int]:
    return [int(t.view(torch.uint8).sum(dtype=torch.int64)) for t in tensors]


BACKUPS = ("cpu", "disk", "none")


def run(size: int, repeat: int, device: torch.device, timeout_s: int = 600,
        backup: str = "cpu", disk_dir: str | None = None) -> dict:
    """torch-memory-saver's pause/resume of tensor_spec(size) in a child process:
    {"pause_s": [...], "resume_s": [...], "bytes", "data_intact", "version"}, round 0
    first (data_intact None without backup: its bytes are dropped); or {"skipped": why}.
    backup: "cpu" (pinned), "disk" (files in disk_dir) or "none"."""
    if device.type != "cuda":
        return {"skipped": f"{PACKAGE} needs a CUDA device (this run is on {device})"}
    if importlib.util.find_spec(PACKAGE) is None:
        return {"skipped": f"{PACKAGE} is not installed (pip install {WHEEL}) for the "
                           "side-by-side figure"}
    argv = [sys.executable, os.path.abspath(__file__), "--size", str(size),
            "--repeat", str(repeat), "--device", str(device), "--backup", backup]
    if disk_dir is not None:
        argv += ["--disk-dir", disk_dir]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                         env=dict(os.environ))
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"failed": f"{' '.join(argv)} exited {out.returncode}: "
                          f"{(out.stderr or out.stdout).strip()[-800:]}"}
    return json.loads(lines[-1])


def _child(size: int, repeat: int, device: torch.device, backup: str,
           disk_dir: str | None) -> dict:
    from importlib.metadata import version

    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = "torch"
    index = torch.device(device).index  # "cuda" names none: the current device
    torch.cuda.set_device(torch.cuda.current_device() if index is None else index)
    if backup == "disk":
        tms.set_disk_backup_dir(disk_dir)
    region = {"cpu": dict(enable_cpu_backup=True, cpu_backup_backend="pinned"),
              "disk": dict(enable_disk_backup=True), "none": {}}[backup]
    with tms.region(**region):
        ts = [torch.empty(n, dtype=dt, device=device) for n, dt in tensor_spec(size)]
    want = fill(ts, device)
    pause_s, resume_s = [], []
    for _ in range(1 + repeat):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        tms.pause()
        torch.cuda.synchronize(device)
        pause_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tms.resume()
        torch.cuda.synchronize(device)
        resume_s.append(time.perf_counter() - t0)
    return {"pause_s": pause_s, "resume_s": resume_s,
            "bytes": sum(t.numel() * t.element_size() for t in ts),
            "data_intact": sums(ts) == want if backup != "none" else None,
            "version": version(PACKAGE)}


def main() -> None:
    p = argparse.ArgumentParser(prog="tms.py")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--repeat", type=int, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backup", choices=BACKUPS, default="cpu")
    p.add_argument("--disk-dir")
    a = p.parse_args()
    print(json.dumps(_child(a.size, a.repeat, torch.device(a.device), a.backup, a.disk_dir)),
          flush=True)
    # No interpreter teardown: torch-memory-saver's hooked free asserts that it runs
    # inside a region ("only support interesting region"), and at exit its pool's
    # blocks are freed outside one, which would abort this process after its figures.
    os._exit(0)


if __name__ == "__main__":
    main()

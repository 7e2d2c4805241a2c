"""The floor of a step that reads R bytes of state and writes W bytes: the least time
the hardware needs to move them, measured in the same run as the step, by tools that
are not statepager (a floor the pager can beat is no floor):

  pcie  R bytes host -> device and W bytes device -> host at once, pinned host buffers,
        one CUDA stream each way (CUDA only);
  fio   R bytes read and W bytes written in the store's directory by fio with the pager's
        request size and depth, O_DIRECT when the pager uses it: read alone, write alone,
        and both at once. Its floor is the faster of "both at once" and "one after the
        other", at the best of several job counts (4, 8 and 16 each way by default): on
        the H200's /dev/shm 8 jobs moved twice what 4 did, and a floor measured with too
        few jobs is one the pager beats.

Bytes that cross no file system take PCIe alone: a host tier's, and those of store files
in RAM that the pager maps (map_ram: device copies to and from the files' pages, no
kernel copy), for which fio's floor, a kernel copy on the CPU, is no floor (the pager
beats it).

The floor is the larger of the two. Either may be missing (a CPU device has no PCIe;
fio may not be installed): the result says which and why, and the floor is the one left.

fio is found as $STATEPAGER_FIO, `fio` on the PATH, or unpacked from Debian packages into
.deps/fio (scripts/fetch_fio.sh) in the working directory or the source tree; an unpacked
one runs with its own libraries on LD_LIBRARY_PATH.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

import torch

from statepager.tools.bench.report import spread
from statepager.tools.cli_args import FIO_JOBS
from statepager.util.units import MiB

FIO_VARIABLE = "STATEPAGER_FIO"
_UNPACKED = os.path.join(".deps", "fio", "usr", "bin", "fio")


@dataclass
class Fio:
    """A fio binary that ran `fio --version`, and the environment it runs in."""

    path: str
    env: dict
    version: str


def source_root() -> str | None:
    """The source checkout this package runs from (the folder above python/statepager
    with pyproject.toml), or None when it runs installed."""
    d = os.path.dirname(os.path.abspath(__file__))
    while os.path.dirname(d) != d:
        d = os.path.dirname(d)
        if os.path.isfile(os.path.join(d, "pyproject.toml")) and \
                os.path.isdir(os.path.join(d, "python", "statepager")):
            return d
    return None


def fio_candidates() -> list[str]:
    """Where fio is looked for, in order (see the module doc)."""
    root = source_root()
    return [p for p in (os.environ.get(FIO_VARIABLE), shutil.which("fio"),
                        os.path.join(os.getcwd(), _UNPACKED),
                        root and os.path.join(root, _UNPACKED)) if p]


def find_fio(candidates: list[str] | None = None) -> tuple[Fio | None, str]:
    """(the first candidate that runs, "") or (None, why none does and how to get one)."""
    candidates = fio_candidates() if candidates is None else candidates
    failures, seen = [], set()
    for path in candidates:
        if path in seen or not os.path.isfile(path):
            if path == os.environ.get(FIO_VARIABLE):
                failures.append(f"${FIO_VARIABLE}={path} is not a file")
            continue
        seen.add(path)
        env = _environment(path)
        try:
            out = subprocess.run([path, "--version"], env=env, capture_output=True, text=True,
                                 timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            failures.append(f"{path}: {e}")
            continue
        if out.returncode == 0:
            return Fio(path, env, out.stdout.strip()), ""
        failures.append(f"{path}: {(out.stderr or out.stdout).strip()[:300]}")
    how = (f"install fio (apt-get install fio), set ${FIO_VARIABLE} to a fio binary, or "
           "unpack one with scripts/fetch_fio.sh into .deps/fio")
    if failures:
        return None, "fio does not run (" + "; ".join(failures) + "): " + how
    return None, "fio not found: " + how


def _environment(path: str) -> dict:
    """os.environ, plus the library folders of an unpacked tree (ROOT/usr/bin/fio, ROOT
    not "/": the system's fio uses the system's libraries)."""
    env = dict(os.environ)
    tail = os.sep + os.path.join("usr", "bin", "fio")
    root = path[:-len(tail)] if path.endswith(tail) else ""
    if not root:
        return env
    dirs = sorted(d for top in ("usr/lib", "lib")
                  for d, _, files in os.walk(os.path.join(root, top))
                  if any(".so" in f for f in files))
    if dirs:  # no empty entry: that would mean the working directory
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            dirs + [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d])
    return env


def _fio_groups(fio: Fio, directory: str, jobs: list[tuple[str, str, int, int]], block: int,
                depth: int, direct: bool) -> list[dict]:
    """Runs fio once with every job at the same time: each (name, rw, numjobs, bytes per
    job) is `numjobs` files NAME.<i>.0 in `directory`. Returns per job {"gbps",
    "seconds", "bytes"}: its bytes over the time its slowest clone took (fio counts
    milliseconds: at least 1)."""
    argv = [fio.path, f"--directory={directory}", "--ioengine=io_uring",
            f"--direct={int(direct)}", f"--bs={block}", f"--iodepth={depth}",
            "--group_reporting", "--output-format=json"]
    for i, (name, rw, numjobs, per_job) in enumerate(jobs):
        argv += [f"--name={name}", f"--rw={rw}", f"--numjobs={numjobs}", f"--size={per_job}"]
        if i:
            argv.append("--new_group")
    out = subprocess.run(argv, env=fio.env, capture_output=True, text=True)
    if out.returncode != 0:
        raise OSError(f"fio failed ({' '.join(argv)}): {(out.stderr or out.stdout).strip()[:500]}")
    # The JSON document, without notes fio may print before or after it.
    groups = json.JSONDecoder().raw_decode(out.stdout, out.stdout.index("{"))[0]["jobs"]
    result = []
    for (_, rw, _, _), g in zip(jobs, groups):
        side = g["write" if rw == "write" else "read"]
        seconds = max(side["runtime"], 1) / 1e3
        result.append({"gbps": side["io_bytes"] / seconds / 1e9,
                       "seconds": seconds, "bytes": side["io_bytes"]})
    return result


def fio_floor(fio: Fio, directory: str, read_bytes: int, write_bytes: int, *, block: int,
              depth: int, jobs: int, direct: bool) -> dict:
    """fio reading `read_bytes` and writing `write_bytes` in `directory`: `jobs` jobs each
    way with `depth` // `jobs` requests of `block` bytes in flight; read alone, write
    alone, both at once. "seconds": min(both at once, read + write alone)."""
    per_depth = max(1, depth // jobs)

    def share(nbytes: int) -> int:
        per_job = -(-nbytes // jobs)
        return max(block, -(-per_job // block) * block)

    # In a directory of its own: the write lays out files a.*, the reads read them, and
    # at once b.* are written fresh.
    work = tempfile.mkdtemp(prefix="fio-", dir=directory)
    try:
        write, = _fio_groups(fio, work, [("a", "write", jobs, share(write_bytes))], block,
                             per_depth, direct)
        read, = _fio_groups(fio, work, [("a", "read", jobs, share(read_bytes))], block,
                            per_depth, direct)
        both_read, both_write = _fio_groups(
            fio, work, [("a", "read", jobs, share(read_bytes)),
                        ("b", "write", jobs, share(write_bytes))], block, per_depth, direct)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    both_s = max(both_read["seconds"], both_write["seconds"])
    return {"version": fio.version, "jobs": jobs, "iodepth": per_depth, "block": block,
            "direct": direct, "read": read, "write": write,
            "both": {"read": both_read, "write": both_write, "seconds": both_s},
            "seconds": min(both_s, read["seconds"] + write["seconds"])}


def pcie_floor(device: torch.device, read_bytes: int, write_bytes: int, *, rounds: int = 3,
               chunk: int = 256 * MiB) -> dict:
    """`read_bytes` host -> device on one stream while `write_bytes` go device -> host on
    another, pinned host buffers of `chunk` bytes, after one warm-up round. "seconds":
    the spread of the wall time over `rounds`; GB/s each way from the median round."""
    h2d_host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    d2h_host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    h2d_dev = torch.empty(chunk, dtype=torch.uint8, device=device)
    d2h_dev = torch.empty(chunk, dtype=torch.uint8, device=device)
    streams = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def copies(stream, dst, src, nbytes):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            for at in range(0, nbytes, chunk):
                k = min(chunk, nbytes - at)
                dst[:k].copy_(src[:k], non_blocking=True)
            end.record()
        return start, end

    walls, ways = [], []
    for r in range(rounds + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        h2d = copies(streams[0], h2d_dev, h2d_host, read_bytes)
        d2h = copies(streams[1], d2h_host, d2h_dev, write_bytes)
        torch.cuda.synchronize(device)
        if r:  # round 0 warms up
            walls.append(time.perf_counter() - t0)
            ways.append((h2d[0].elapsed_time(h2d[1]) / 1e3, d2h[0].elapsed_time(d2h[1]) / 1e3))
    seconds = spread(walls)
    h2d_s, d2h_s = sorted(ways, key=sum)[len(ways) // 2]
    return {"seconds": seconds, "chunk": chunk,
            "h2d_gbps": read_bytes / h2d_s / 1e9 if h2d_s else 0.0,
            "d2h_gbps": write_bytes / d2h_s / 1e9 if d2h_s else 0.0}


def fio_best(fio: Fio, directory: str, read_bytes: int, write_bytes: int, *, block: int,
             depth: int, jobs: tuple[int, ...], direct: bool) -> dict:
    """fio_floor at each job count of `jobs` up to `depth` (more jobs would keep more
    requests in flight than the pager may; `depth` jobs when none is that small): the
    fastest one's result, with "tried": [(jobs, seconds)] for every count that ran, in
    the order run, and "fastest": {"read": ..., "write": ...}, the fastest read alone and
    write alone of any count, each with its "jobs" (the floor of a transfer one way, as
    a pause or a resume is). A count fio fails at is left out; OSError when every one
    fails."""
    counts = [n for n in jobs if n <= depth] or [depth]
    runs, failures = [], []
    for n in counts:
        try:
            runs.append(fio_floor(fio, directory, read_bytes, write_bytes, block=block,
                                  depth=depth, jobs=n, direct=direct))
        except OSError as e:
            failures.append(e)
    if not runs:
        raise failures[0]
    best = min(runs, key=lambda r: r["seconds"])
    fastest = {way: max(runs, key=lambda r: r[way]["gbps"]) for way in ("read", "write")}
    return dict(best, tried=[(r["jobs"], r["seconds"]) for r in runs],
                fastest={way: dict(r[way], jobs=r["jobs"]) for way, r in fastest.items()})


def measure(directory: str, device: torch.device, read_bytes: int, write_bytes: int, *,
            block: int, depth: int, direct: bool, jobs: tuple[int, ...] = FIO_JOBS,
            host_in: int = 0, host_out: int = 0, mapped_in: int = 0,
            mapped_out: int = 0) -> dict:
    """Both floors and the larger one ("seconds", set by "bound_by"); a floor that could
    not be measured is None with its reason in "pcie_note" / "fio_note". read_bytes and
    write_bytes are the store files', mapped_in and mapped_out of them through mappings
    (PCIe only, see the module doc), the rest through the file system; host_in and
    host_out (a host tier's) cross PCIe too."""
    r = {"read_bytes": read_bytes, "write_bytes": write_bytes, "host_in": host_in,
         "host_out": host_out, "mapped_in": mapped_in, "mapped_out": mapped_out,
         "pcie": None, "fio": None, "pcie_note": "", "fio_note": ""}
    if device.type == "cuda":
        r["pcie"] = pcie_floor(device, read_bytes + host_in, write_bytes + host_out)
    else:
        r["pcie_note"] = "no PCIe floor: the device is the CPU"
    fio, r["fio_note"] = find_fio()
    fs_read, fs_write = read_bytes - mapped_in, write_bytes - mapped_out
    if fio is not None and not (fs_read or fs_write):
        fio, r["fio_note"] = None, ("no fio floor: no byte went through the file system (the "
                                    "store files were mapped)" if mapped_in or mapped_out
                                    else "no fio floor: nothing went through the store's files")
    if fio is not None:
        try:
            r["fio"] = fio_best(fio, directory, fs_read, fs_write, block=block,
                                depth=depth, jobs=tuple(jobs), direct=direct)
        except OSError as e:
            r["fio_note"] = str(e)
    candidates = []
    if r["pcie"] is not None:
        candidates.append((r["pcie"]["seconds"]["median"], "pcie"))
    if r["fio"] is not None:
        candidates.append((r["fio"]["seconds"], "fio"))
    r["seconds"], r["bound_by"] = max(candidates) if candidates else (None, None)
    return r


def describe(r: dict) -> list[str]:
    """The floor's lines for a report: what each floor measured, or why it is missing."""
    gb = 1e9
    mapped = (f" ({r['mapped_in'] / gb:.2f} and {r['mapped_out'] / gb:.2f} GB of them mapped: "
              "PCIe only)" if r.get("mapped_in") or r.get("mapped_out") else "")
    host = (f" and {r['host_in'] / gb:.2f} GB from and {r['host_out'] / gb:.2f} GB to the "
            "host tier (PCIe only)" if r.get("host_in") or r.get("host_out") else "")
    files = " through the files" if mapped or host else ""
    lines = [f"floor: {r['read_bytes'] / gb:.2f} GB read and {r['write_bytes'] / gb:.2f} GB "
             f"written{files}{mapped}{host}, measured in this run by tools that are not "
             "statepager:"]
    p = r["pcie"]
    if p is None:
        lines.append(f"  PCIe: {r['pcie_note']}")
    else:
        s = p["seconds"]
        lines.append(f"  PCIe, both ways at once (pinned, 2 streams): {s['median']:.3f} s "
                     f"(median of {s['n']}, {s['min']:.3f}-{s['max']:.3f}); "
                     f"h2d {p['h2d_gbps']:.1f} GB/s + d2h {p['d2h_gbps']:.1f} GB/s")
    f = r["fio"]
    if f is None:
        lines.append(f"  fio: {r['fio_note']}")
    else:
        b = f["both"]
        tried = f.get("tried", [])
        if len(tried) > 1:
            lines.append("  fio, the fastest of " + ", ".join(
                f"{n} jobs {s:.3f} s" for n, s in tried) + ":")
        lines.append(f"  fio ({f['version']}, {f['jobs']} jobs each way x {f['iodepth']} x "
                     f"{f['block'] // 1024} KiB, direct={int(f['direct'])}, 1 run each): read "
                     f"alone {f['read']['gbps']:.2f} GB/s, write alone {f['write']['gbps']:.2f} "
                     f"GB/s, at once {b['read']['gbps']:.2f} + {b['write']['gbps']:.2f} GB/s; "
                     f"{f['seconds']:.3f} s (the faster of at once, {b['seconds']:.3f} s, and "
                     f"one after the other, {f['read']['seconds'] + f['write']['seconds']:.3f} s)")
    if r["seconds"] is None:
        lines.append("  no floor: neither could be measured here")
    else:
        lines.append(f"  floor = the larger: {r['seconds']:.3f} s, set by {r['bound_by']}"
                     f"{_alone(r)}")
    return lines


def _alone(r: dict) -> str:
    """Why one floor stands alone, or "" when both were measured."""
    if r["pcie"] is not None and r["fio"] is not None:
        return ""
    if r["pcie"] is None:
        return " (no PCIe on this device: fio alone)"
    if not (r["read_bytes"] or r["write_bytes"]):
        return " (no file bytes: PCIe alone)"
    if (r["read_bytes"], r["write_bytes"]) == (r.get("mapped_in"), r.get("mapped_out")):
        return " (every file byte mapped: PCIe alone)"
    return " (fio missing: PCIe alone)"

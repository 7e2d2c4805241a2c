"""statepager inspect PATH [--verify] [--json]: what a checkpoint or a store holds.

PATH may be
  a checkpoint (statepager.checkpoint.save's directory, holding manifest.json): per
      optimizer its class, parameters, formats, tensors by state name (count, dtypes,
      bytes, ZERO ones), data file and its size, hyperparameters; --verify reads the
      data and checks every checksum (statepager.checkpoint), else the checksums are
      reported as not verified;
  a rank_directory() base (a training loop's checkpoint directory): every rank's checkpoint
      under statepager/rank*/; in a Megatron-LM iteration's directory, or in its --save
      directory (every iter_*/), also what Megatron's own checkpoint there holds of the
      optimizer state (statepager.tools.inspect_megatron);
  a store directory (a Pager's, holding .lock): whether a process holds it now, and its
      store files. A store is not a checkpoint: it holds state only while its Pager runs.
Exit status: 0, or 1 when --verify found a bad checksum or PATH is neither.
"""
from __future__ import annotations

import glob
import json
import os
import time

from statepager import _C
from statepager.checkpoint import checksums
from statepager.checkpoint.manifest import read_manifest
from statepager.tools import inspect_megatron
from statepager.util.names import MANIFEST

_LOCK = ".lock"


def main(path: str, *, verify: bool, as_json: bool) -> int:
    report = inspect(path, verify=verify)
    print(json.dumps(report, indent=1)) if as_json else _print(report)
    return 1 if report["kind"] == "unknown" or report.get("failed") else 0


def inspect(path: str, *, verify: bool) -> dict:
    """What `path` holds, as a JSON-ready dict whose "kind" is "checkpoints", "store" or
    "unknown"."""
    path = os.path.abspath(path)
    manifests, megatron = _manifests(path), _megatron(path)
    if manifests or megatron:
        found = [_checkpoint(os.path.dirname(m), verify) for m in manifests]
        return {"kind": "checkpoints", "path": path, "checkpoints": found, "megatron": megatron,
                "failed": any(c.get("error") for c in found + (megatron or {}).get(
                    "checkpoints", []))}
    if os.path.isfile(os.path.join(path, _LOCK)):
        return _store(path)
    if not os.path.exists(path):
        return {"kind": "unknown", "path": path, "error": f"{path} does not exist"}
    return {"kind": "unknown", "path": path,
            "error": f"{path} holds neither a statepager checkpoint ({MANIFEST}, or "
                     f"statepager/rank*/{MANIFEST} under a rank_directory() base) nor a store "
                     f"directory ({_LOCK})"}


def _manifests(path: str) -> list:
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return [os.path.join(path, MANIFEST)]
    for pattern in ("statepager/rank*/", "rank*/", "iter_*/statepager/rank*/"):
        found = sorted(glob.glob(os.path.join(path, pattern + MANIFEST)))
        if found:
            return found
    return []


def _megatron(path: str) -> dict | None:
    """Megatron-LM's tracker and checkpoints in `path` (an iteration's directory, or the
    --save directory of several), or None where there is neither."""
    dirs = inspect_megatron.iterations(path) or [path]
    found = [c for c in map(inspect_megatron.checkpoint, dirs) if c is not None]
    tracker = inspect_megatron.tracker(path)
    if not found and tracker is None:
        return None
    return {"tracker": tracker, "checkpoints": found}


def _checkpoint(path: str, verify: bool) -> dict:
    out = {"path": path}
    try:
        manifest = read_manifest(path)
    except _C.Error as e:
        return {**out, "error": f"{type(e).__name__}: {e}"}
    out.update(format=manifest["format"], version=manifest["version"],
               checksum=f"{manifest['checksum']} per {_size(manifest['chunk_bytes'])}",
               optimizers=[_optimizer(path, e) for e in manifest["optimizers"]])
    if not verify:
        out["checksums"] = "not verified (--verify reads the data and checks them)"
        return out
    t0 = time.perf_counter()
    try:
        checksums.verify(path, manifest)
    except _C.Error as e:
        return {**out, "checksums": "FAILED", "error": f"{type(e).__name__}: {e}"}
    nbytes = sum(o["data_bytes"] for o in out["optimizers"])
    out["checksums"] = (f"verified: every tensor's {manifest['checksum']}s match "
                        f"({_size(nbytes)} of data read in {time.perf_counter() - t0:.1f} s)")
    return out


def _optimizer(path: str, entry: dict) -> dict:
    states = {}
    for t in entry["tensors"]:
        s = states.setdefault(t["name"], {"tensors": 0, "zero": 0, "bytes": 0, "dtypes": []})
        s["tensors"] += 1
        s["zero"] += t["zero"]
        s["bytes"] += t["bytes"]
        if t["dtype"] not in s["dtypes"]:
            s["dtypes"].append(t["dtype"])
    data = os.path.join(path, entry["data"])
    return {"name": entry["name"], "class": entry["class"], "params": entry["params"],
            "formats": entry.get("formats"), "tensors": len(entry["tensors"]),
            "zero_tensors": sum(t["zero"] for t in entry["tensors"]),
            "tensor_bytes": sum(t["bytes"] for t in entry["tensors"]),
            "data": entry["data"], "data_bytes": entry["data_bytes"],
            "file_bytes": os.path.getsize(data) if os.path.exists(data) else None,
            "states": states, "param_groups": entry["param_groups"]}


def _store(path: str) -> dict:
    lock = os.path.join(path, _LOCK)
    holder = _lock_holder(lock)
    files = []
    for root, _, names in os.walk(path):
        for name in sorted(names):
            p = os.path.join(root, name)
            st = os.stat(p)
            if p != lock:
                files.append({"file": os.path.relpath(p, path), "bytes": st.st_size,
                              "allocated_bytes": st.st_blocks * 512})
    return {"kind": "store", "path": path, "in_use_by_pid": holder, "files": files}


def _lock_holder(lock: str) -> int | None:
    """The pid holding the store's flock (from /proc/locks), or None."""
    st = os.stat(lock)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == device:
                    return int(fields[4])
    except OSError:
        pass
    return None


def _print(r: dict) -> None:
    if r["kind"] == "unknown":
        print(r["error"])
        return
    if r["kind"] == "store":
        who = (f"in use by process {r['in_use_by_pid']}" if r["in_use_by_pid"] is not None
               else "not in use: left by a Pager that ended without close(); the next Pager "
                    "on it wipes it")
        print(f"store directory {r['path']}: {who}")
        print("  a store holds paged state only while its Pager runs; it is not a checkpoint "
              "(statepager.checkpoint.save() writes those)")
        for f in r["files"]:
            print(f"  {f['file']}: {_size(f['bytes'])} ({_size(f['allocated_bytes'])} allocated)")
        return
    megatron = r.get("megatron")
    if megatron and megatron["tracker"] is not None:
        print(f"Megatron-LM --save directory {r['path']}: its tracker names iteration "
              f"{megatron['tracker']}")
    for c in (megatron or {}).get("checkpoints", []):
        print("\n".join(inspect_megatron.lines(c, _size)))
    for c in r["checkpoints"]:
        _print_checkpoint(c)


def _print_checkpoint(c: dict) -> None:
    if "format" not in c:
        print(f"checkpoint {c['path']}: unreadable: {c['error']}")
        return
    print(f"checkpoint {c['path']}: {c['format']} version {c['version']}, checksums "
          f"{c['checksum']}")
    for o in c["optimizers"]:
        formats = ", ".join(f"{k} {v}" for k, v in (o["formats"] or {}).items())
        size = "missing" if o["file_bytes"] is None else _size(o["file_bytes"])
        zero = f" ({o['zero_tensors']} zero: not stored)" if o["zero_tensors"] else ""
        print(f"  optimizer {o['name']!r}: {o['class']}, {o['params']} parameters, formats "
              f"{formats or '?'}; {o['tensors']} tensors{zero}, {_size(o['tensor_bytes'])} in "
              f"{o['data']} ({size})")
        for name, s in o["states"].items():
            zero = f", {s['zero']} zero" if s["zero"] else ""
            dtypes = "/".join(d.removeprefix("torch.") for d in s["dtypes"])
            print(f"    {name:24s} {s['tensors']:4d} tensors{zero}, {dtypes}, {_size(s['bytes'])}")
        for i, g in enumerate(o["param_groups"]):
            shown = ", ".join(f"{k}={v}" for k, v in g.items() if not isinstance(v, dict))
            print(f"    param group {i}: {shown}")
    print(f"  checksums: {c['checksums']}")
    if c.get("error"):
        print(f"  {c['error']}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"

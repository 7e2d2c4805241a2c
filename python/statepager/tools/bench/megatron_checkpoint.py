"""`bench megatron --checkpoint`: Megatron's own checkpoint of a configuration's model and
optimizer, saved and loaded back after its timed steps, with what each costs in memory.

The model and optimizer in Megatron's dist_checkpointing format (torch_dist, the
optimizer's sharding type dp_reshardable, as `--ckpt-format torch_dist` saves them) are
saved into a directory and loaded back into the same model and optimizer, as a resume
does (a load that statepager refuses, into residual mains, is reported so). For each: its
seconds, and the peaks above what was in use just before, of device memory (the driver's,
sampled; torch's allocated; the pager's pool mapped) and of this process's resident host
memory (VmHWM, reset through /proc/self/clear_refs). A paged optimizer reads its state through the
pager's window (Note [Megatron's checkpoint formats] in docs/design.md), so its device
peaks are set by the window, not by the state. A paged configuration also saves and
loads the same state with statepager.checkpoint, which copies files and host memory.
"""
from __future__ import annotations

import os
import shutil
import time

import torch

from statepager import checkpoint
from statepager.util.units import GiB

FORMAT = "dp_reshardable"


def measure(model, optimizer, pager, driver, directory: str) -> dict:
    """Saves the Megatron checkpoint of `model` (Megatron's DDP) and `optimizer` into
    `directory` (made, then deleted) and loads it back. pager: the configuration's Pager,
    or None; driver: a DriverMemory."""
    from megatron.core import dist_checkpointing

    def sharded(is_loading: bool) -> dict:
        model_sd = model.module.sharded_state_dict()
        metadata = {"distrib_optim_sharding_type": FORMAT}
        return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=metadata)}

    os.makedirs(directory)
    try:
        save = _peaks(pager, driver, lambda: dist_checkpointing.save(sharded(False), directory))
        written = _size(directory)

        def load():
            loaded = dist_checkpointing.load(sharded(True), directory)
            model.module.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])
        load_peaks = _peaks(pager, driver, load)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {"format": FORMAT, "files_bytes": written, "save": save, "load": load_peaks}
    if pager is not None:
        result["statepager"] = _statepager_checkpoint(pager, driver, directory + "-statepager")
    return result


def _statepager_checkpoint(pager, driver, path: str) -> dict:
    """statepager.checkpoint's save and load of the same state (the Megatron-LM flags'
    default, --statepager-optimizer-checkpoint statepager): copies of the store's files
    and the host tier, never through the device."""
    try:
        save = _peaks(pager, driver, lambda: checkpoint.save(pager, path))
        return {"files_bytes": _size(path), "save": save,
                "load": _peaks(pager, driver, lambda: checkpoint.load(pager, path))}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _size(directory: str) -> int:
    """Bytes in the files under `directory`."""
    return sum(os.path.getsize(os.path.join(root, n))
               for root, _, names in os.walk(directory) for n in names)


def _peaks(pager, driver, run) -> dict:
    """run()'s seconds and the rise of each peak over what was in use before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    allocated = torch.cuda.memory_allocated()
    mapped = pager.stats()["mapped_bytes"] if pager is not None else 0
    if pager is not None:
        pager.reset_peak()
    host = _reset_host_peak()
    used = driver.used()
    with driver.sampler() as sampler:
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return {"seconds": seconds,
            "driver": max(0, sampler.peak - used),
            "torch": torch.cuda.max_memory_allocated() - allocated,
            "pool": (pager.stats()["peak_mapped_bytes"] - mapped) if pager is not None else None,
            "host": _host_peak() - host if host is not None else None}


def _reset_host_peak() -> int | None:
    """Resets this process's resident-memory peak (VmHWM) to what it uses now and returns
    that; None where Linux's /proc does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _host_peak()
    except OSError:
        return None


def _host_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def line(c: dict, state_bytes: int | None) -> str:
    """The report's line for a configuration's result `c["checkpoint"]`; state_bytes: the
    pager's stored state, None unpaged."""
    k = c["checkpoint"]
    if "error" in k:
        return f"Megatron's checkpoint (--checkpoint) failed: {k['error']}"

    def part(name: str, k: dict = k) -> str:
        p = k[name]
        pool = "" if p["pool"] is None else f", pool {p['pool'] / GiB:.2f}"
        host = "" if p["host"] is None else f"; host {p['host'] / GiB:.2f} GiB"
        return (f"{name} {p['seconds']:.2f} s, peaks above before: device {p['driver'] / GiB:.2f} "
                f"GiB (torch {p['torch'] / GiB:.2f}{pool}){host}")
    of = "" if state_bytes is None else f" of {state_bytes / GiB:.2f} GiB stored"
    text = (f"Megatron's checkpoint ({k['format']}, {k['files_bytes'] / GiB:.2f} GiB in its "
            f"files{of}): {part('save')}; {part('load')}")
    own = k.get("statepager")
    if own:
        text += (f"; statepager's ({own['files_bytes'] / GiB:.2f} GiB): {part('save', own)}; "
                 f"{part('load', own)}")
    return text

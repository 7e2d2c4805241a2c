"""`bench sleep --saver`: pause() and resume() through statepager.memory_saver, SIZE
bytes of mixed tensors (bench_tms.tensor_spec) allocated inside region(tag), once per
backup, one after the other in one run:
  cpu   enable_cpu_backup: the tag's store in RAM (/dev/shm);
  disk  enable_disk_backup: the store under --dir;
  none  no backup: pause() drops the bytes (a discard), resume() maps zeros;
each for a first round (the store's ranges written for the first time) and --repeat
rounds after it (the steady state), beside torch-memory-saver's same three (with
--compare-tms; CUDA, each in a process of its own). The disk backup's floor follows: fio
writing and reading SIZE bytes in --dir with the disk store's I/O shape (its request size
and requests in flight, O_DIRECT where it uses it), at the best of --fio-jobs: what a pause
(a write) and a resume (a read) can reach on that disk (statepager.tools.bench.floor).
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from statepager.memory_saver import TorchMemorySaver
from statepager.tools.bench import floor as bench_floor
from statepager.tools.bench import tms as bench_tms
from statepager.tools.bench.report import show, spread
from statepager.util.units import GiB, MiB

TAG = "bench"


def bench(args, work: str, bar) -> dict:
    """{backup: rounds} for each of bench_tms.BACKUPS, and "tms" {backup: its figures}
    with args.compare_tms; data_intact: the backed-up bytes came back and the others as
    zeros."""
    device = torch.device(args.device)
    result = {"saver": True, "device": str(device), "dir": args.dir, "repeat": args.repeat}
    for backup in bench_tms.BACKUPS:
        result[backup] = _rounds(args, work, device, backup, bar)
    result["data_intact"] = all(result[b]["data_intact"] is not False and
                                result[b]["zeros_after_resume"] is not False
                                for b in bench_tms.BACKUPS)
    result["disk_floor"] = _disk_floor(args, work, result["disk"])
    if args.compare_tms:
        result["tms"] = {}
        for backup in bench_tms.BACKUPS:
            bar.phase(f"torch-memory-saver, backup {backup} (its own process)")
            disk = os.path.join(work, "tms-disk")
            os.makedirs(disk, exist_ok=True)
            result["tms"][backup] = bench_tms.run(args.size, args.repeat, device,
                                                  backup=backup, disk_dir=disk)
    return result


def _disk_floor(args, work: str, disk: dict) -> dict:
    """fio's write and read of SIZE bytes in the disk store's directory, in its I/O shape
    (bench_floor.fio_best); {"skipped": why} without fio or when fio fails."""
    fio, why = bench_floor.find_fio()
    if fio is None:
        return {"skipped": why}
    shape = disk["io"]
    try:
        return bench_floor.fio_best(fio, os.path.join(work, "saver-disk"), disk["bytes"],
                                    disk["bytes"], block=shape["io_block"],
                                    depth=shape["io_depth"], jobs=args.fio_jobs,
                                    direct=shape["direct_io"])
    except OSError as e:
        return {"skipped": f"fio failed: {e}"}


def _alloc(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of n elements made inside a region. On the host backend a region holds
    the fp32 copies Pager.scope() captures, so there it is one of the same bytes."""
    if device.type == "cuda":
        return torch.empty(n, dtype=dtype, device=device)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    return torch.empty(-(-nbytes // 4), dtype=torch.float32).clone()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rounds(args, work: str, device: torch.device, backup: str, bar) -> dict:
    saver = TorchMemorySaver(device=device)
    try:
        if backup == "disk":
            saver.set_disk_backup_dir(os.path.join(work, "saver-disk"))
        bar.phase(f"backup {backup}: allocating inside region({TAG!r})")
        with saver.region(tag=TAG, enable_cpu_backup=backup == "cpu",
                          enable_disk_backup=backup == "disk"):
            ts = [_alloc(n, dt, device) for n, dt in bench_tms.tensor_spec(args.size)]
        want = bench_tms.fill(ts, device)
        pager = saver.pager(TAG, backup)
        _synchronize(device)
        free_resident, freed, times = pager.free_device_memory(), 0, []
        for r in range(1 + args.repeat):
            bar.phase(f"backup {backup}: round {r + 1}/{1 + args.repeat}")
            t0 = time.perf_counter()
            saver.pause(TAG)
            _synchronize(device)
            pause_s = time.perf_counter() - t0
            freed = pager.free_device_memory() - free_resident
            t0 = time.perf_counter()
            saver.resume(TAG)
            _synchronize(device)
            times.append((pause_s, time.perf_counter() - t0))
        got = bench_tms.sums(ts)
        stats = pager.stats()
        return {"bytes": sum(t.numel() * t.element_size() for t in ts), "tensors": len(ts),
                "io": {k: stats[k] for k in ("io_block", "io_depth", "direct_io")},
                "store": pager.directory, "pause_s": [p for p, _ in times],
                "resume_s": [r for _, r in times], "freed_bytes": freed,
                "data_intact": got == want if backup != "none" else None,
                "zeros_after_resume": not any(got) if backup == "none" else None}
    finally:
        _synchronize(device)
        saver.close()


def rates(r: dict) -> str:
    """The first round and the rounds after it: GB/s with a backup, ms without."""
    out = []
    for way in ("pause", "resume"):
        seconds = r[way + "_s"]
        if r.get("data_intact") is None:  # no backup: nothing moves, a time says it
            first, again = 1e3 * seconds[0], spread(1e3 * s for s in seconds[1:])
            out.append(f"{way} first {first:.1f} ms, again {show(again, 'ms', 1)}")
        else:
            gbps = [r["bytes"] / s / 1e9 for s in seconds]
            out.append(f"{way} first {gbps[0]:.2f} GB/s, again {show(spread(gbps[1:]), 'GB/s')}")
    return "; ".join(out)


def print_saver(r: dict) -> None:
    first = r["cpu"]
    print(f"sleep bench through memory_saver on {r['device']}: {first['bytes'] / GiB:.2f} GiB "
          f"in {first['tensors']} tensors allocated inside region({TAG!r}), per backup; "
          f"a first round, then {r['repeat']} more")
    names = {"cpu": "cpu backup (RAM store)", "disk": "disk backup (store in --dir)",
             "none": "no backup (discard)"}
    for backup in bench_tms.BACKUPS:
        b = r[backup]
        check = (f"data intact: {b['data_intact']}" if b["data_intact"] is not None else
                 f"zeros after resume: {b['zeros_after_resume']}")
        print(f"  statepager {names[backup]:29s} {rates(b)}; device memory freed "
              f"{b['freed_bytes'] / GiB:.2f} GiB; {check}")
    floor = r.get("disk_floor", {})
    if "skipped" in floor:
        print(f"  disk floor not measured: {floor['skipped']}")
    elif floor:
        disk = r["disk"]
        pause, resume = (statistics.median(disk["bytes"] / s / 1e9 for s in disk[way][1:])
                         for way in ("pause_s", "resume_s"))
        write, read = floor["fastest"]["write"], floor["fastest"]["read"]
        print(f"  disk floor (fio {floor['version']}, {floor['block'] // MiB} MiB "
              f"requests, {'O_DIRECT' if floor['direct'] else 'buffered'}, the fastest of "
              f"{', '.join(str(j) for j, _ in floor['tried'])} jobs each way): write "
              f"{write['gbps']:.2f} GB/s ({write['jobs']} jobs), read {read['gbps']:.2f} "
              f"GB/s ({read['jobs']} jobs); pause again {pause / write['gbps']:.2f} x the "
              f"write, resume {resume / read['gbps']:.2f} x the read")
    for backup, t in r.get("tms", {}).items():
        label = f"torch-memory-saver {names[backup]:21s}"
        if "skipped" in t or "failed" in t:
            print(f"  {label} {'skipped' if 'skipped' in t else 'FAILED'}: "
                  f"{t.get('skipped') or t.get('failed')}")
            continue
        check = "" if t["data_intact"] is None else f"; data intact: {t['data_intact']}"
        print(f"  {label} {rates(t)} ({t['version']}, hook_mode torch){check}")

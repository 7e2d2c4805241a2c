"""python -m statepager bench store|sleep|map: the pager against the raw device.

store  page-out then page-in of SIZE bytes of tensors, beside fio and the raw io_uring
       loop on the same directory;
sleep  pause()/resume() of SIZE bytes of mixed tensors, beside the raw loop; through the
       host tier with --host-budget, beside torch-memory-saver with --compare-tms; with
       --saver through memory_saver's regions, per backup (bench.sleep_saver);
map    the cost of mapping and unmapping pages, per GiB, and its share of a transfer.
"""
from __future__ import annotations

import os
import time

import torch

from statepager import _C
from statepager.tools.bench import sleep_saver
from statepager.tools.bench import tms as bench_tms
from statepager.tools.bench.common import bench_directory, fio
from statepager.tools.bench.report import faster, show, spread
from statepager.core.pager import Pager
from statepager.tools.progress import Progress
from statepager.util.units import GiB, MiB


def bench_store(args) -> dict:
    with bench_directory(args.dir) as work:
        return _bench_store(args, work)


def _bench_store(args, work: str) -> dict:
    size = args.size
    result = {"repeat": args.repeat, "size_bytes": size, "cold_pages": args.cold}
    # The pool keeps its physical pages (steady state: no page creation in the timed part,
    # as in a training loop), unless --cold asks for fresh pages on every page-in.
    keep = 0 if args.cold else size + 64 * MiB
    with Progress("bench store", phases=2 + 4 * args.repeat) as bar, \
            Pager(os.path.join(work, "store"), device=args.device, io_depth=args.io_depth,
                  io_block=args.io_block, keep=keep) as pager:
        bar.phase("filling the tensors")
        # fio and the raw loop run with the pager's I/O shape.
        depth, block = pager.stats()["io_depth"], pager.stats()["io_block"]
        result.update(io_depth=depth, io_block=block)
        # Buckets of tensors of mixed sizes (not multiples of 4 KiB), as optimizer state is.
        gen = torch.Generator().manual_seed(0)
        buckets, total = [], 0
        while total < size:
            bucket, in_bucket = [], 0
            while in_bucket < args.bucket_size and total < size:
                n = int(torch.randint(1 << 18, 16 << 20, (1,), generator=gen)) // 4
                n = min(n, (size - total + 3) // 4)
                bucket.append(pager.empty(n, dtype=torch.float32))
                in_bucket += n * 4
                total += n * 4
            buckets.append(bucket)
        for i, bucket in enumerate(buckets):
            pager.page_in(bucket)
            for j, t in enumerate(bucket):
                t.fill_(float(i * 1000 + j))
        sums = [[float(t[:: 1 + t.numel() // 97].sum()) for t in b] for b in buckets]

        # Alternate with fio so both see the same disk conditions.
        rates = {"write": [], "read": [], "fio_write": [], "fio_read": []}
        for r in range(args.repeat):
            round_ = f"round {r + 1}/{args.repeat}"
            bar.phase(f"{round_}: fio write")
            w = fio(work, "write", size, block, depth)
            bar.phase(f"{round_}: page-out")
            rates["write"].append(_timed(pager, buckets, out=True))
            bar.phase(f"{round_}: page-in")
            rates["read"].append(_timed(pager, buckets, out=False))
            bar.phase(f"{round_}: fio read")
            rd = fio(work, "read", size, block, depth)
            if w is not None:
                rates["fio_write"].append(w)
                rates["fio_read"].append(rd)
        bar.phase("raw io_uring loop")
        raw_read = _C.measure_raw_io(work, size, block, depth, True, False)
        raw_write = _C.measure_raw_io(work, size, block, depth, False, True)

        ok = sums == [[float(t[:: 1 + t.numel() // 97].sum()) for t in b] for b in buckets]
        result.update(
            tensors=sum(len(b) for b in buckets),
            buckets=len(buckets),
            direct_io=pager.stats()["direct_io"],
            write_gbps=spread(rates["write"]),
            read_gbps=spread(rates["read"]),
            fio_write_gbps=spread(rates["fio_write"]) if rates["fio_write"] else None,
            fio_read_gbps=spread(rates["fio_read"]) if rates["fio_read"] else None,
            raw_write_gbps=raw_write["write_gbps"],
            raw_read_gbps=raw_read["read_gbps"],
            data_intact=ok,
        )
    return result


def _timed(pager: Pager, buckets: list, out: bool) -> float:
    """GB/s of paging every bucket out (or in), all in flight at once."""
    key = "bytes_written" if out else "bytes_read"
    before = pager.stats()[key]
    t0 = time.perf_counter()
    move = pager.page_out_async if out else pager.page_in_async
    for h in [move(b) for b in buckets]:
        h.wait()
    seconds = time.perf_counter() - t0
    return (pager.stats()[key] - before) / seconds / 1e9


def print_store(r: dict) -> None:
    print(f"store bench: {r['size_bytes'] / 2**30:.2f} GiB in {r['tensors']} tensors, "
          f"{r['buckets']} buckets, io_depth {r['io_depth']}, block {r['io_block'] // MiB} MiB, "
          f"direct_io={r['direct_io']}, {r['repeat']} rounds alternating with fio, "
          f"{'fresh pages on every page-in' if r['cold_pages'] else 'pages recycled by the pool'}")
    for way in ("write", "read"):
        ours = r[way + "_gbps"]
        print(f"  {way:5s} statepager    {show(ours, 'GB/s')}")
        if r.get("fio_" + way + "_gbps"):
            fio_ = r["fio_" + way + "_gbps"]
            print(f"        fio           {show(fio_, 'GB/s')}: statepager is "
                  f"{faster(ours['median'], fio_['median'], higher_is_better=True)}")
        raw = r["raw_" + way + "_gbps"]
        print(f"        raw io_uring  {raw:.2f} GB/s (1 run): statepager is "
              f"{faster(ours['median'], raw, higher_is_better=True)}")
    print(f"  data intact after the round trips: {r['data_intact']}")
    if r.get("fio_write_gbps") is None:
        print("  (no fio: apt-get install fio, or scripts/fetch_fio.sh, for the side-by-side "
              "figure)")


def _mixed_tensors(pager: Pager, size: int, seed: int = 0) -> list:
    """Tensors of mixed sizes and dtypes adding up to about `size` bytes."""
    return [pager.empty(n, dtype=dt) for n, dt in bench_tms.tensor_spec(size, seed)]


def bench_sleep(args) -> dict:
    with bench_directory(args.dir) as work:
        if not args.saver:
            return _bench_sleep(args, work)
        backups = len(bench_tms.BACKUPS)
        with Progress("bench sleep --saver", phases=backups * (3 + args.repeat)
                      + backups * args.compare_tms) as bar:
            return sleep_saver.bench(args, work, bar)


def _bench_sleep(args, work: str) -> dict:
    size = args.size
    with Progress("bench sleep", phases=3 + 2 * (1 + args.repeat) + args.compare_tms) as bar:
        with Pager(os.path.join(work, "store"), device=args.device, io_depth=args.io_depth,
                   io_block=args.io_block, host_budget=args.host_budget) as pager:
            result = _pager_sleep(args, work, pager, size, bar)
        if args.compare_tms:
            bar.phase("torch-memory-saver (its own process)")
            result["tms"] = bench_tms.run(size, args.repeat, pager.device)
    return result


def _pager_sleep(args, work: str, pager: Pager, size: int, bar) -> dict:
    bar.phase("filling the tensors")
    ts = _mixed_tensors(pager, size)
    pager.page_in(ts)
    sums = bench_tms.fill(ts, pager.device)
    free_resident = pager.free_device_memory()
    # Round 1 writes store ranges never written before (on tmpfs the kernel allocates
    # and zeroes their pages); the rounds after it are the steady state of a job that
    # sleeps and wakes every iteration.
    rounds, freed = [], 0
    for r in range(1 + args.repeat):
        bar.phase(f"round {r + 1}/{1 + args.repeat}: pause")
        t0 = time.perf_counter()
        pager.pause()
        pause_s = time.perf_counter() - t0
        freed = pager.free_device_memory() - free_resident
        bar.phase(f"round {r + 1}/{1 + args.repeat}: resume")
        t0 = time.perf_counter()
        pager.resume()
        rounds.append((pause_s, time.perf_counter() - t0))
    ok = sums == bench_tms.sums(ts)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    stats = pager.stats()
    # The raw loop with the pager's I/O shape.
    bar.phase("raw io_uring loop")
    depth, block = stats["io_depth"], stats["io_block"]
    raw_r = _C.measure_raw_io(work, nbytes, block, depth, True, False)
    raw_w = _C.measure_raw_io(work, nbytes, block, depth, False, True)
    pause = [nbytes / p / 1e9 for p, _ in rounds]
    resume = [nbytes / r / 1e9 for _, r in rounds]
    return {"device": str(pager.device), "dir": args.dir, "bytes": nbytes, "tensors": len(ts),
            "direct_io": stats["direct_io"], "io_depth": depth, "io_block": block,
            "host_budget": args.host_budget, "file_bytes_written": stats["bytes_written"],
            "file_bytes_read": stats["bytes_read"],
            "raw_write_gbps": raw_w["write_gbps"],
            "raw_read_gbps": raw_r["read_gbps"], "freed_bytes": freed, "data_intact": ok,
            "first": {"pause_gbps": pause[0], "resume_gbps": resume[0]},
            "again": {"pause_gbps": spread(pause[1:]), "resume_gbps": spread(resume[1:])}}


def print_sleep(r: dict) -> None:
    if r.get("saver"):
        sleep_saver.print_saver(r)
        return
    tier = (f", host tier {r['host_budget'] / GiB:.2f} GiB" if r["host_budget"] else "")
    print(f"sleep bench: {r['bytes'] / GiB:.2f} GiB in {r['tensors']} tensors on {r['device']}, "
          f"dir {r['dir']}, direct_io={r['direct_io']}, io {r['io_depth']} x "
          f"{r['io_block'] // MiB} MiB{tier}")
    first, again = r["first"], r["again"]
    for way, raw_key, raw_name in (("pause", "raw_write_gbps", "raw write"),
                                   ("resume", "raw_read_gbps", "raw read")):
        raw = r[raw_key]
        f, a = first[way + "_gbps"], again[way + "_gbps"]
        print(f"  {way:6s} first {show(spread([f]), 'GB/s')}: "
              f"{faster(f, raw, higher_is_better=True)} than the {raw_name} ({raw:.2f} GB/s, 1 run)")
        print(f"  {way:6s} again {show(a, 'GB/s')}: "
              f"{faster(a['median'], raw, higher_is_better=True)} than the {raw_name}")
    print(f"  device memory freed while paused: {r['freed_bytes'] / GiB:.2f} GiB; "
          f"store file bytes written {r['file_bytes_written']}, read {r['file_bytes_read']}; "
          f"data intact: {r['data_intact']}")
    if "tms" in r:
        _print_tms(r)


def _print_tms(r: dict) -> None:
    t = r["tms"]
    if "skipped" in t:
        print(f"  torch-memory-saver: skipped: {t['skipped']}")
        return
    if "failed" in t:
        print(f"  torch-memory-saver: FAILED: {t['failed']}")
        return
    pause = [t["bytes"] / s / 1e9 for s in t["pause_s"]]
    resume = [t["bytes"] / s / 1e9 for s in t["resume_s"]]
    tp, tr = spread(pause[1:]), spread(resume[1:])
    print(f"  torch-memory-saver {t['version']} (hook_mode torch, CPU backup pinned, own "
          f"process, the same {t['bytes'] / GiB:.2f} GiB): first pause {pause[0]:.2f} GB/s, "
          f"resume {resume[0]:.2f} GB/s; again pause {show(tp, 'GB/s')}, resume "
          f"{show(tr, 'GB/s')}; data intact: {t['data_intact']}")
    rp = r["again"]["pause_gbps"]["median"] / tp["median"]
    rr = r["again"]["resume_gbps"]["median"] / tr["median"]
    print(f"  statepager vs torch-memory-saver (steady medians): pause {rp:.1f} x, "
          f"resume {rr:.1f} x")


def bench_map(args) -> dict:
    with Progress("bench map", phases=args.repeat) as bar:
        runs = []
        for i in range(args.repeat):
            bar.phase(f"round {i + 1}/{args.repeat}")
            runs.append(_C.measure_mapping(args.device, args.page_size, args.size, 1))
    map_s = spread(r["map_s_per_gib"] for r in runs)
    unmap_s = spread(r["unmap_s_per_gib"] for r in runs)
    per_gib = map_s["median"] + unmap_s["median"]
    transfer = GiB / 25e9  # one GiB in and out at 25 GB/s
    return {"map_s_per_gib": map_s, "unmap_s_per_gib": unmap_s, "device": args.device,
            "page_size": args.page_size, "share_at_25gbps": per_gib / (transfer + per_gib)}


def print_map(r: dict) -> None:
    ms = {k: {**r[k], **{x: 1e3 * r[k][x] for x in ("median", "min", "max")}}
          for k in ("map_s_per_gib", "unmap_s_per_gib")}
    print(f"map bench on {r['device']}, pages of {r['page_size'] // MiB} MiB: "
          f"map {show(ms['map_s_per_gib'], 'ms/GiB')}, unmap "
          f"{show(ms['unmap_s_per_gib'], 'ms/GiB')}; {100 * r['share_at_25gbps']:.1f}% of a "
          "page-in/page-out at 25 GB/s (medians)")

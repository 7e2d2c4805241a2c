"""python -m statepager bench store|sleep|map: the pager against the raw device.

store  page-out then page-in of SIZE bytes of tensors, beside fio and the raw io_uring
       loop on the same directory;
sleep  pause()/resume() of SIZE bytes of mixed tensors, beside the raw loop;
map    the cost of mapping and unmapping pages, per GiB, and its share of a transfer.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import torch

from statepager import _C
from statepager.pager import GiB, MiB, Pager

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'4G', '512M', '1048576' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    return int(float(t[: len(t) - len(unit)]) * _UNITS[unit])


def fio(directory: str, rw: str, size: int, block: int, depth: int) -> float | None:
    """GB/s that fio measures for sequential `rw` (write|read) with O_DIRECT on io_uring."""
    if shutil.which("fio") is None:
        return None
    path = os.path.join(directory, "fio.dat")
    cmd = [
        "fio", "--name=raw", f"--filename={path}", f"--rw={rw}", f"--bs={block}",
        f"--iodepth={depth}", "--ioengine=io_uring", "--direct=1", f"--size={size}",
        "--output-format=json",
    ]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    job = out["jobs"][0]["write" if rw == "write" else "read"]
    return job["bw_bytes"] / 1e9


def bench_store(args) -> dict:
    size = parse_size(args.size)
    bucket_bytes = parse_size(args.bucket)
    os.makedirs(args.dir, exist_ok=True)
    store = os.path.join(args.dir, "statepager-bench")
    result = {"repeat": args.repeat, "size_bytes": size, "cold_pages": args.cold}
    # The pool keeps its physical pages (steady state: no page creation in the timed part,
    # as in a training loop), unless --cold asks for fresh pages on every page-in.
    keep = 0 if args.cold else size + 64 * MiB
    with Pager(store, device=args.device, io_depth=args.io_depth, io_block=args.io_block,
               keep=keep) as pager:
        # fio and the raw loop run with the pager's I/O shape.
        depth, block = pager.stats()["io_depth"], pager.stats()["io_block_bytes"]
        result.update(io_depth=depth, io_block=block)
        # Buckets of tensors of mixed sizes (not multiples of 4 KiB), as optimizer state is.
        gen = torch.Generator().manual_seed(0)
        buckets, total = [], 0
        while total < size:
            bucket, in_bucket = [], 0
            while in_bucket < bucket_bytes and total < size:
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
        moved = pager.stats()["bytes_written"]

        # Alternate with fio so both see the same disk conditions; keep the best of each.
        fio_write = fio_read = None
        write_s = read_s = float("inf")
        for _ in range(args.repeat):
            w = fio(args.dir, "write", size, block, depth)
            t0 = time.perf_counter()
            for h in [pager.page_out_async(b) for b in buckets]:
                h.wait()
            write_s = min(write_s, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for h in [pager.page_in_async(b) for b in buckets]:
                h.wait()
            read_s = min(read_s, time.perf_counter() - t0)
            r = fio(args.dir, "read", size, block, depth)
            if w is not None:
                fio_write, fio_read = max(fio_write or 0, w), max(fio_read or 0, r)
        raw_read = _C.measure_raw_io(args.dir, size, block, depth, True, False)
        raw_write = _C.measure_raw_io(args.dir, size, block, depth, False, True)

        ok = sums == [[float(t[:: 1 + t.numel() // 97].sum()) for t in b] for b in buckets]
        stats = pager.stats()
        moved = (stats["bytes_written"] - moved) // args.repeat
        result.update(
            tensors=sum(len(b) for b in buckets),
            buckets=len(buckets),
            direct_io=stats["direct_io"],
            write_gbps=moved / write_s / 1e9,
            read_gbps=stats["bytes_read"] / args.repeat / read_s / 1e9,
            raw_write_gbps=raw_write["write_gbps"],
            raw_read_gbps=raw_read["read_gbps"],
            fio_write_gbps=fio_write,
            fio_read_gbps=fio_read,
            data_intact=ok,
        )
    if fio_write:
        result["write_ratio"] = result["write_gbps"] / fio_write
        result["read_ratio"] = result["read_gbps"] / fio_read
    result["write_ratio_raw"] = result["write_gbps"] / result["raw_write_gbps"]
    result["read_ratio_raw"] = result["read_gbps"] / result["raw_read_gbps"]
    try:
        os.remove(os.path.join(args.dir, "fio.dat"))
    except FileNotFoundError:
        pass
    return result


def print_store(r: dict) -> None:
    print(f"store bench: {r['size_bytes'] / 2**30:.2f} GiB in {r['tensors']} tensors, "
          f"{r['buckets']} buckets, io_depth {r['io_depth']}, block {r['io_block'] // MiB} MiB, "
          f"direct_io={r['direct_io']}, best of {r['repeat']} alternating rounds, "
          f"{'fresh pages on every page-in' if r['cold_pages'] else 'pages recycled by the pool'}")
    for way in ("write", "read"):
        line = f"  {way:5s} statepager {r[way + '_gbps']:6.2f} GB/s"
        if r.get("fio_" + way + "_gbps"):
            line += (f"   fio {r['fio_' + way + '_gbps']:6.2f} GB/s"
                     f"   ratio {r[way + '_ratio']:.2f}")
        line += (f"   raw io_uring {r['raw_' + way + '_gbps']:6.2f} GB/s"
                 f"   ratio {r[way + '_ratio_raw']:.2f}")
        print(line)
    print(f"  data intact after the round trip: {r['data_intact']}")
    if r.get("fio_write_gbps") is None:
        print("  (fio not installed: apt-get install fio for the side-by-side figure)")


def _mixed_tensors(pager: Pager, size: int, seed: int = 0) -> list:
    """Tensors of mixed sizes and dtypes adding up to about `size` bytes."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.int64]
    out, total, i = [], 0, 0
    while total < size:
        dt = dtypes[i % len(dtypes)]
        item = torch.empty((), dtype=dt).element_size()
        n = min(int(torch.randint(1 << 10, 96 << 20, (1,), generator=gen)), size - total) // item
        out.append(pager.empty(max(n, 1), dtype=dt))
        total += max(n, 1) * item
        i += 1
    return out


def bench_sleep(args) -> dict:
    size = parse_size(args.size)
    os.makedirs(args.dir, exist_ok=True)
    store = os.path.join(args.dir, "statepager-bench-sleep")
    with Pager(store, device=args.device, io_depth=args.io_depth,
               io_block=args.io_block) as pager:
        ts = _mixed_tensors(pager, size)
        pager.page_in(ts)
        g = torch.Generator(device=pager.device).manual_seed(1)
        for t in ts:
            t.view(torch.uint8).random_(generator=g)
        sums = [int(t.view(torch.uint8).sum(dtype=torch.int64)) for t in ts]
        free_resident = pager._core.free_device_memory()
        # Round 1 writes store ranges never written before (on tmpfs the kernel allocates
        # and zeroes their pages); round 2 is the steady state of a job that sleeps and
        # wakes every iteration.
        rounds, freed = [], 0
        for _ in range(2):
            t0 = time.perf_counter()
            pager.pause()
            pause_s = time.perf_counter() - t0
            freed = pager._core.free_device_memory() - free_resident
            t0 = time.perf_counter()
            pager.resume()
            rounds.append((pause_s, time.perf_counter() - t0))
        ok = sums == [int(t.view(torch.uint8).sum(dtype=torch.int64)) for t in ts]
        nbytes = sum(t.numel() * t.element_size() for t in ts)
        stats = pager.stats()
    # The raw loop with the pager's I/O shape.
    depth, block = stats["io_depth"], stats["io_block_bytes"]
    raw_r = _C.measure_raw_io(args.dir, nbytes, block, depth, True, False)
    raw_w = _C.measure_raw_io(args.dir, nbytes, block, depth, False, True)
    return {"device": args.device, "dir": args.dir, "bytes": nbytes, "tensors": len(ts),
            "direct_io": stats["direct_io"], "io_depth": depth, "io_block": block,
            "raw_write_gbps": raw_w["write_gbps"],
            "raw_read_gbps": raw_r["read_gbps"], "freed_bytes": freed, "data_intact": ok,
            "rounds": [{"pause_gbps": nbytes / p / 1e9, "resume_gbps": nbytes / r / 1e9}
                       for p, r in rounds]}


def print_sleep(r: dict) -> None:
    print(f"sleep bench: {r['bytes'] / GiB:.2f} GiB in {r['tensors']} tensors on {r['device']}, "
          f"dir {r['dir']}, direct_io={r['direct_io']}, io {r['io_depth']} x "
          f"{r['io_block'] // MiB} MiB")
    for i, rnd in enumerate(r["rounds"]):
        when = "first" if i == 0 else "again"
        print(f"  {when}: pause  {rnd['pause_gbps']:6.2f} GB/s   raw write "
              f"{r['raw_write_gbps']:6.2f} GB/s   ratio {rnd['pause_gbps'] / r['raw_write_gbps']:.2f}")
        print(f"  {when}: resume {rnd['resume_gbps']:6.2f} GB/s   raw read  "
              f"{r['raw_read_gbps']:6.2f} GB/s   ratio {rnd['resume_gbps'] / r['raw_read_gbps']:.2f}")
    print(f"  device memory freed while paused: {r['freed_bytes'] / GiB:.2f} GiB; "
          f"data intact: {r['data_intact']}")


def bench_map(args) -> dict:
    r = _C.measure_mapping(args.device, parse_size(args.page_size), parse_size(args.size))
    per_gib = r["map_s_per_gib"] + r["unmap_s_per_gib"]
    transfer = GiB / 25e9  # one GiB in and out at 25 GB/s
    return {**r, "device": args.device, "page_size": parse_size(args.page_size),
            "share_at_25gbps": per_gib / (transfer + per_gib)}


def print_map(r: dict) -> None:
    print(f"map bench on {r['device']}, pages of {r['page_size'] // MiB} MiB: "
          f"map {1e3 * r['map_s_per_gib']:.2f} ms/GiB, unmap {1e3 * r['unmap_s_per_gib']:.2f} "
          f"ms/GiB; {100 * r['share_at_25gbps']:.1f}% of a page-in/page-out at 25 GB/s")



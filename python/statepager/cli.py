"""Command line: python -m statepager bench store|... (see --help)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time

import torch

from statepager import _C
from statepager.pager import MiB, Pager

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
    block = parse_size(args.io_block)
    os.makedirs(args.dir, exist_ok=True)
    store = os.path.join(args.dir, "statepager-bench")
    result = {"repeat": args.repeat, "size_bytes": size, "io_depth": args.io_depth, "io_block": block,
              "cold_pages": args.cold}
    # The pool keeps its physical pages (steady state: no page creation in the timed part,
    # as in a training loop), unless --cold asks for fresh pages on every page-in.
    keep = 0 if args.cold else size + 64 * MiB
    with Pager(store, device=args.device, io_depth=args.io_depth, io_block=block,
               keep=keep) as pager:
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
            w = fio(args.dir, "write", size, block, args.io_depth)
            t0 = time.perf_counter()
            for h in [pager.page_out_async(b) for b in buckets]:
                h.wait()
            write_s = min(write_s, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for h in [pager.page_in_async(b) for b in buckets]:
                h.wait()
            read_s = min(read_s, time.perf_counter() - t0)
            r = fio(args.dir, "read", size, block, args.io_depth)
            if w is not None:
                fio_write, fio_read = max(fio_write or 0, w), max(fio_read or 0, r)
        raw_read = _C.measure_raw_io(args.dir, size, block, args.io_depth, True, False)
        raw_write = _C.measure_raw_io(args.dir, size, block, args.io_depth, False, True)

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m statepager")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="what", required=True)
    store = bench.add_parser("store", help="page-out then page-in of SIZE bytes vs fio")
    store.add_argument("--dir", required=True)
    store.add_argument("--size", default="2G")
    store.add_argument("--bucket", default="256M")
    store.add_argument("--io-depth", type=int, default=32)
    store.add_argument("--io-block", default="1M")
    store.add_argument("--device", default="cpu")
    store.add_argument("--repeat", type=int, default=3,
                       help="rounds, alternating with fio; the best of each side is kept")
    store.add_argument("--cold", action="store_true",
                       help="release physical pages on page-out (measures page creation too)")
    store.add_argument("--json", action="store_true")
    step = bench.add_parser("step", help="streamed AdamW step vs the storage floor and the "
                                         "synchronous per-bucket baseline")
    step.add_argument("--dir", required=True)
    step.add_argument("--params", type=float, default=2.5e8)
    step.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    step.add_argument("--bucket", type=parse_size, default=parse_size("256M"))
    step.add_argument("--depth", type=int, default=3)
    step.add_argument("--steps", type=int, default=4)
    step.add_argument("--page-size", type=parse_size, default=parse_size("32M"))
    step.add_argument("--io-depth", type=int, default=32)
    step.add_argument("--io-block", type=parse_size, default=parse_size("1M"))
    step.add_argument("--no-baseline", action="store_true")
    step.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "bench" and args.what == "store":
        r = bench_store(args)
        print(json.dumps(r)) if args.json else print_store(r)
        return 0 if r["data_intact"] else 1
    if args.command == "bench" and args.what == "step":
        from statepager.bench_step import bench_step, print_step

        r = bench_step(args)
        print(json.dumps(r)) if args.json else print_step(r)
        return 0
    return 2

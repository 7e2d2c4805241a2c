"""Command line: python -m statepager bench store|sleep|map|step|formats|ckpt (see --help)."""
from __future__ import annotations

import argparse
import json

import torch

from statepager.bench_pager import (bench_map, bench_sleep, bench_store, parse_size,
                                    print_map, print_sleep, print_store)


def _bench(bench, name: str, help: str, *, dir: bool = True, device: str | None = None):
    """A bench subcommand with the options every bench shares."""
    p = bench.add_parser(name, help=help)
    if dir:
        p.add_argument("--dir", required=True, help="directory of the store (the device measured)")
    p.add_argument("--device", default=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    p.add_argument("--json", action="store_true")
    return p


def _io_arguments(p) -> None:
    """--io-depth / --io-block of the Pager; by default chosen for the store's medium."""
    p.add_argument("--io-depth", type=int, default=None, help="requests in flight")
    p.add_argument("--io-block", type=parse_size, default=None, help="bytes per request")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m statepager")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="what", required=True)
    store = _bench(bench, "store", "page-out then page-in of SIZE bytes vs fio", device="cpu")
    store.add_argument("--size", default="2G")
    store.add_argument("--bucket", default="256M")
    _io_arguments(store)
    store.add_argument("--repeat", type=int, default=3,
                       help="rounds, alternating with fio; the best of each side is kept")
    store.add_argument("--cold", action="store_true",
                       help="release physical pages on page-out (measures page creation too)")
    step = _bench(bench, "step", "streamed AdamW step vs the storage floor and the "
                                 "synchronous per-bucket baseline")
    step.add_argument("--params", type=float, default=2.5e8)
    step.add_argument("--bucket", type=parse_size, default=parse_size("256M"))
    step.add_argument("--depth", type=int, default=3)
    step.add_argument("--steps", type=int, default=4)
    step.add_argument("--page-size", type=parse_size, default=parse_size("32M"))
    _io_arguments(step)
    step.add_argument("--no-baseline", action="store_true")
    sleep = _bench(bench, "sleep", "pause()/resume() of SIZE bytes vs the raw device")
    sleep.add_argument("--size", default="4G")
    _io_arguments(sleep)
    mapping = _bench(bench, "map", "page map + unmap cost per GiB", dir=False)
    mapping.add_argument("--page-size", default="32M")
    mapping.add_argument("--size", default="8G")
    formats = _bench(bench, "formats", "bytes per parameter and step time for each "
                                       "combination of on-disk formats")
    formats.add_argument("--params", type=float, default=1e8)
    formats.add_argument("--bucket", type=parse_size, default=parse_size("256M"))
    formats.add_argument("--steps", type=int, default=4)
    ckpt = _bench(bench, "ckpt", "checkpoint save (sync and background) and load of SIZE "
                                 "bytes of optimizer state vs the raw disk")
    ckpt.add_argument("--size", default="2G")
    ckpt.add_argument("--bucket", type=parse_size, default=parse_size("256M"))
    ckpt.add_argument("--repeat", type=int, default=3,
                      help="rounds of save, load and file copy; the best of each is kept")
    args = parser.parse_args(argv)

    if args.what == "step":
        from statepager.bench_step import bench_step, print_step

        run, show = bench_step, print_step
    elif args.what == "ckpt":
        from statepager.bench_ckpt import bench_ckpt, print_ckpt

        run, show = bench_ckpt, print_ckpt
    elif args.what == "formats":
        from statepager.bench_formats import bench_formats, print_formats

        run, show = bench_formats, print_formats
    else:
        run, show = {"store": (bench_store, print_store), "sleep": (bench_sleep, print_sleep),
                     "map": (bench_map, print_map)}[args.what]
    r = run(args)
    print(json.dumps(r)) if args.json else show(r)
    return 0 if r.get("data_intact", True) else 1

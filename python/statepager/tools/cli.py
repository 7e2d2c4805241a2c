"""Command line: `statepager` (or `python -m statepager`) doctor | inspect | autoload |
bench ... (see --help). Bad values are refused by argparse (status 2); errors while running print
their message, not a traceback (status 1)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from statepager import _C
from statepager.tools.cli_args import (FIO_JOBS, at_least, count, dash_values_joined, device,
                                 device_name, directory, io_block, job_counts, output_file,
                                 plot_file, size)


def _bench(bench, name: str, help: str, *, dir: bool = True, default_device: str | None = None):
    """A bench subcommand with the options every bench shares."""
    p = bench.add_parser(name, help=help)
    if dir:
        p.add_argument("--dir", required=True, type=directory,
                       help="where to measure (the device measured): the bench makes a new "
                            "directory in it for its store and files, and deletes that "
                            "directory afterwards; nothing else in DIR is touched")
    p.add_argument("--device", type=device,
                   default=default_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    p.add_argument("--json", action="store_true")
    return p


def _io_arguments(p) -> None:
    """--io-depth / --io-block of the Pager; by default chosen for the store's medium."""
    p.add_argument("--io-depth", type=at_least(1, "requests in flight"), default=None,
                   help="requests in flight")
    p.add_argument("--io-block", type=io_block, default=None, help="bytes per request")


def _repeat(p, what: str) -> None:
    p.add_argument("--repeat", type=at_least(1, "rounds"), default=3, help=what)


def parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="check what the pager needs here; names each fix")
    doctor.add_argument("--dir", help="the directory the Pager will store to")
    doctor.add_argument("--device", type=device_name,
                        default="cuda" if torch.cuda.is_available() else "cpu")
    doctor.add_argument("--size", type=size, default=None,
                        help="bytes of state the store must hold (checks free space)")
    doctor.add_argument("--probe-size", type=size, default=size("256M"),
                        help="bytes each bandwidth check moves")
    doctor.add_argument("--json", action="store_true")

    inspect = sub.add_parser("inspect", help="what a checkpoint or a store directory holds")
    inspect.add_argument("path")
    inspect.add_argument("--verify", action="store_true",
                         help="read the checkpoint's data and check every checksum")
    inspect.add_argument("--json", action="store_true")

    autoload = sub.add_parser("autoload", help="the opt-in start-up hook that pages "
                              "Megatron-LM's optimizer wherever STATEPAGER_DIR is set")
    autoload.add_argument("action", choices=("on", "off", "status"))
    autoload.add_argument("--site-dir", default=None,
                          help="the site-packages directory (default: where statepager's "
                               "hook module is installed)")
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="what", required=True)
    store = _bench(bench, "store", "page-out then page-in of SIZE bytes vs fio",
                   default_device="cpu")
    store.add_argument("--size", type=size, default=size("2G"))
    store.add_argument("--bucket-size", type=size, default=size("256M"))
    _io_arguments(store)
    _repeat(store, "rounds, alternating with fio")
    store.add_argument("--cold", action="store_true",
                       help="release physical pages on page-out (measures page creation too)")
    step = _bench(bench, "step", "streamed AdamW step vs the floor (PCIe and fio) and the "
                                 "synchronous per-bucket baseline")
    step.add_argument("--params", type=count, default=count("2.5e8"))
    step.add_argument("--bucket-size", type=size, default=size("256M"))
    step.add_argument("--depth", type=at_least(2, "buckets in flight: one stepping, one "
                                                 "moving"), default=3)
    step.add_argument("--warmup", type=at_least(1, "the first step reads no moments, so it "
                                                  "is not timed"), default=2,
                      help="steps run first and not timed: the first reads no moments, the "
                           "second writes them into fresh store ranges and host pages "
                           "(default 2)")
    step.add_argument("--steps", type=at_least(1, "a step must be timed"), default=3,
                      help="timed steps, after the warm-up ones (default 3)")
    step.add_argument("--page-size", type=size, default=size("32M"))
    step.add_argument("--host-budget", type=size, default=0,
                      help="host tier bytes (Pager host_budget; default: none); on CUDA the "
                           "bench also measures concurrent PCIe, the host tier's floor")
    _io_arguments(step)
    step.add_argument("--no-map-ram", action="store_true",
                      help="Pager(map_ram=False): a store in RAM read and written through "
                           "io_uring (the kernel copies on the CPU) instead of mapped")
    step.add_argument("--no-baseline", action="store_true")
    step.add_argument("--no-in-place", action="store_true",
                      help="skip the comparison run with atomic=False")
    step.add_argument("--unowned", action="store_true",
                      help="params as ordinary tensors: the pager holds the moments (and, in "
                           "atomic steps, the params' undo copies)")
    step.add_argument("--fio-jobs", type=job_counts, default=FIO_JOBS,
                      help="fio jobs each way for the floor, comma-separated: the fastest "
                           "count sets it (default 4,8,16); each job gets io-depth / jobs "
                           "requests in flight")
    step.add_argument("--trace", type=output_file, metavar="FILE.json",
                      help="write the last paged step's buckets as a Chrome trace (open in "
                           "chrome://tracing or ui.perfetto.dev)")
    step.add_argument("--plot", type=plot_file, metavar="FILE.png",
                      help="draw the last paged step's timeline: page-in, step, page-out "
                           "per bucket (needs matplotlib: statepager[plot])")
    sleep = _bench(bench, "sleep", "pause()/resume() of SIZE bytes vs the raw device")
    sleep.add_argument("--size", type=size, default=size("4G"))
    sleep.add_argument("--host-budget", type=size, default=0,
                       help="pinned host memory of the Pager's host tier (0: none, pause "
                            "writes the store); SIZE plus 1%% holds everything")
    sleep.add_argument("--compare-tms", action="store_true",
                       help="also pause/resume the same tensors with torch-memory-saver "
                            "(CUDA; in a process of its own; skipped, saying why, when the "
                            "package is missing)")
    sleep.add_argument("--saver", action="store_true",
                       help="pause/resume through memory_saver: SIZE allocated inside a "
                            "region, with cpu backup, disk backup (in --dir) and none "
                            "(discard), first round and the rest")
    sleep.add_argument("--fio-jobs", type=job_counts, default=FIO_JOBS,
                       help="--saver: fio jobs each way for the disk backup's floor, "
                            "comma-separated: the fastest count sets it (default 4,8,16)")
    _io_arguments(sleep)
    _repeat(sleep, "pause/resume rounds after the first (the steady state)")
    mapping = _bench(bench, "map", "page map + unmap cost per GiB", dir=False)
    mapping.add_argument("--page-size", type=size, default=size("32M"))
    mapping.add_argument("--size", type=size, default=size("8G"))
    _repeat(mapping, "rounds of mapping and unmapping SIZE")
    formats = _bench(bench, "formats", "bytes per parameter and step time for each "
                                       "combination of on-disk formats")
    formats.add_argument("--params", type=count, default=count("1e8"))
    formats.add_argument("--bucket-size", type=size, default=size("256M"))
    formats.add_argument("--steps", type=at_least(2, "the first step reads no moments, so it "
                                                    "is not counted"), default=4)
    ckpt = _bench(bench, "ckpt", "checkpoint save (sync and background) and load of SIZE "
                                 "bytes of optimizer state vs the raw disk")
    ckpt.add_argument("--size", type=size, default=size("2G"))
    ckpt.add_argument("--bucket-size", type=size, default=size("256M"))
    _repeat(ckpt, "rounds of save, load and file copy")
    from statepager.tools.bench import megatron as bench_megatron

    bench_megatron.add_arguments(bench.add_parser(
        "megatron", help="a Megatron GPT: unpaged, Megatron's CPU offload and statepager's "
                         "formats, each in its own process (needs megatron-core)"))
    from statepager.tools.bench import megatron_lm as bench_megatron_lm

    bench_megatron_lm.add_arguments(bench.add_parser(
        "megatron-lm", help="Megatron-LM's pretrain_gpt.py: unpaged, Megatron's CPU offload "
                            "and statepager by its flags, its elapsed time per iteration"))
    return parser


def main(argv=None, prog: str = "statepager") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser(prog).parse_args(dash_values_joined(argv))
    try:
        if args.command == "doctor":
            from statepager.tools import doctor

            checks = doctor.run(args.dir, args.device, args.size, args.probe_size)
            return doctor.report(checks, args.json)
        if args.command == "inspect":
            from statepager.tools import inspect_cmd

            return inspect_cmd.main(args.path, verify=args.verify, as_json=args.json)
        if args.command == "autoload":
            from statepager.tools import autoload_cmd

            return autoload_cmd.main(args.action, args.site_dir)
        return _run_bench(args)
    except BrokenPipeError:  # the reader went away (| head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (_C.Error, OSError) as e:
        print(f"{prog} {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _run_bench(args) -> int:
    if args.what == "step":
        from statepager.tools.bench.step import bench_step as run, print_step as show
    elif args.what == "ckpt":
        from statepager.tools.bench.ckpt import bench_ckpt as run, print_ckpt as show
    elif args.what == "megatron":
        # bench_megatron prints each configuration as it ends; the summary follows.
        from statepager.tools.bench.megatron import bench_megatron as run, print_summary as show
    elif args.what == "megatron-lm":
        from statepager.tools.bench.megatron_lm import (bench_megatron_lm as run,
                                                        print_megatron_lm as show)
    elif args.what == "formats":
        from statepager.tools.bench.formats import bench_formats as run, print_formats as show
    else:
        from statepager.tools.bench import pager as bench_pager

        run, show = {"store": (bench_pager.bench_store, bench_pager.print_store),
                     "sleep": (bench_pager.bench_sleep, bench_pager.print_sleep),
                     "map": (bench_pager.bench_map, bench_pager.print_map)}[args.what]
    r = run(args)
    print(json.dumps(r)) if args.json else show(r)
    return 0 if r.get("data_intact", True) and not r.get("failed") else 1

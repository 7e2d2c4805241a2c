"""python -m statepager bench megatron: a Megatron GPT trained a few steps, unpaged, with
Megatron's own optimizer CPU offload, and with statepager in each on-disk format, its state
on the store (--dir) or in a pinned host tier, side by side in one run.

Each configuration runs in its own process (`python -m statepager.bench.megatron
--worker SPEC OUT`), so that each starts from clean device memory and the driver's view
of the device is that configuration's alone; its lines are printed as soon as it ends
(a run cut short keeps what finished), then a summary. The GPT is
examples/megatron_gpt.py's (a source checkout is needed), bf16 params in Megatron's DDP
and DistributedOptimizer (torch AdamW when neither TransformerEngine nor apex is
installed), on one GPU.

Per configuration, over the timed steps (after the warm-up steps, whose first creates the
moments): the step time (a whole training iteration) and optimizer.step()'s share, the
pager's bytes read and written per step (store files and host tier), and device memory
at the steps' peak as the driver sees it (NVML, sampled every millisecond by a child
process, which takes no GIL from the step; cudaMemGetInfo by a thread when NVML is
missing: statepager.bench.driver_memory) beside torch's own counters and the page pool's,
and what of the peak is none of them, and the process's CPU time in cores busy
(statepager.bench.cpu_use: io_uring's workers, the pager's I/O thread, the rest). A
paged configuration's process then measures the floor of its bytes
(statepager.bench.floor: PCIe both ways with pinned buffers, fio on --dir; the larger),
and its step is printed as a multiple of it. With --device-time, one more step's
optimizer.step() runs under torch.profiler (statepager.bench.device_time): the device's
time in statepager's kernels and the copy engines' busy time. The summary compares each
with Megatron's offload and with its floor, the narrow formats with fp32, and gives the
kernels' device time (--device-time).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback

import torch

from statepager import _C
from statepager.bench import device_time
from statepager.bench import floor as bench_floor
from statepager.bench.common import bench_directory
from statepager.bench.cpu_use import CpuUse
from statepager.bench.driver_memory import DriverMemory
from statepager.bench.report import faster, multiple, show, spread
from statepager.cli_args import (FIO_JOBS, at_least, directory, job_counts, output_file,
                                 plot_file, size)
from statepager.progress import Progress

GiB, MiB = 1 << 30, 1 << 20
_EXAMPLE = os.path.join("examples", "megatron_gpt.py")

# Megatron's own offload, as users configure it: Adam on the CPU for all of the state,
# copies overlapped with it (HybridDeviceOptimizer).
OFFLOAD = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
               overlap_cpu_optimizer_d2h_h2d=True)
# host: the Pager's host tier (host_budget) holds the whole paged state in pinned host
# memory; the store on --dir is then only where a spill would go.
CONFIGS = {
    "unpaged": dict(pager=False, what="unpaged (state in device memory)"),
    "offload": dict(pager=False, optimizer_options=OFFLOAD,
                    what="Megatron optimizer_cpu_offload (fraction 1.0, overlapped d2h/h2d)"),
    "fp32": dict(pager=True, moments="fp32", mains="fp32", what="statepager, fp32, store on --dir"),
    "bf16": dict(pager=True, moments="bf16", mains="fp32",
                 what="statepager, bf16 moments, fp32 mains, store on --dir"),
    "q8": dict(pager=True, moments="q8", mains="residual",
               what="statepager, q8 moments, residual mains, store on --dir"),
    "host-fp32": dict(pager=True, host=True, moments="fp32", mains="fp32",
                      what="statepager, fp32, state in the pinned host tier"),
    "host-q8": dict(pager=True, host=True, moments="q8", mains="residual",
                    what="statepager, q8 moments, residual mains, state in the pinned host tier"),
}
DEFAULT_CONFIGS = ["unpaged", "offload", "fp32", "q8", "host-fp32", "host-q8"]


def configs(text: str) -> list[str]:
    """A comma-separated subset of CONFIGS, in the order given."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: configurations are {', '.join(CONFIGS)} (comma-separated)")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} names a configuration twice")
    return names


def paged_config(text: str) -> str:
    """One configuration that runs statepager (whose step has a timeline)."""
    paged = [n for n, c in CONFIGS.items() if c["pager"]]
    if text not in paged:
        raise argparse.ArgumentTypeError(f"{text!r}: the timeline is a paged configuration's: "
                                         f"one of {', '.join(paged)}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `bench megatron`; the defaults are a 1.34 B GPT."""
    p.add_argument("--dir", required=True, type=directory,
                   help="where the pager's stores and the fio floor's files go (e.g. "
                        "/dev/shm/sp): the bench makes a new directory in it and deletes it "
                        "afterwards")
    p.add_argument("--configs", type=configs, default=list(DEFAULT_CONFIGS),
                   help=f"which to run, comma-separated, of {','.join(CONFIGS)} (default "
                        f"{','.join(DEFAULT_CONFIGS)})")
    p.add_argument("--layers", type=at_least(1, "transformer layers"), default=24)
    p.add_argument("--hidden", type=at_least(1, "hidden size"), default=2048)
    p.add_argument("--heads", type=at_least(1, "attention heads"), default=16)
    p.add_argument("--vocab", type=at_least(2, "vocabulary size"), default=32000)
    p.add_argument("--seq", type=at_least(1, "sequence length"), default=512)
    p.add_argument("--micro-batch", type=at_least(1, "sequences per step"), default=4)
    p.add_argument("--bf16-grads", action="store_true",
                   help="reduce grads in bf16 (default: fp32 grads, grad_reduce_in_fp32)")
    p.add_argument("--warmup", type=at_least(1, "the first step creates the moments, so "
                                                "it is not timed"), default=3)
    p.add_argument("--steps", type=at_least(1, "timed steps"), default=5)
    p.add_argument("--bucket", type=size, default=size("512M"),
                   help="the pager's bucket_size (default 512M: half the buckets of 256M, so "
                        "half the stepping thread's per-bucket work per byte moved: "
                        "docs/design.md, Note [Buckets and the window])")
    p.add_argument("--depth", type=at_least(2, "buckets in the step's pipeline"), default=4,
                   help="the pager's depth (attach(depth=...)); the default 4 keeps two "
                        "page-ins in flight, so that a bucket's page mapping overlaps another's "
                        "copies (attach's own default is 3: one bucket less of HBM)")
    p.add_argument("--page-size", type=size, default=None,
                   help="the pager's page_size (default: the bucket size, at most 256M; "
                        "smaller pages map less memory but cost the step about 1 ms per page "
                        "mapped while a page-out copies: docs/design.md, Note [Mapping costs "
                        "per call, not per byte])")
    p.add_argument("--hbm-budget", type=size, default=None, help="the pager's hbm_budget")
    p.add_argument("--host-budget", type=size, default=None,
                   help="the host-* configurations' host_budget (default: what holds their "
                        "state through atomic steps, from the model's parameters)")
    p.add_argument("--no-map-ram", action="store_true",
                   help="Pager(map_ram=False): a store in RAM read and written through "
                        "io_uring (the kernel copies on the CPU) instead of mapped")
    p.add_argument("--fio-jobs", type=job_counts, default=FIO_JOBS,
                   help="fio jobs each way for the floor, comma-separated: the fastest count "
                        "sets it (default 4,8,16)")
    p.add_argument("--timeout", type=at_least(1, "seconds"), default=900,
                   help="seconds each configuration may take (its floor included)")
    p.add_argument("--device-time", action="store_true",
                   help="after the timed steps, one more whose optimizer.step() runs under "
                        "torch.profiler: the device's time in statepager's kernels (the "
                        "codecs' and the optimizer's compute of a step) and the copy engines' "
                        "busy time")
    p.add_argument("--timeline", type=paged_config, default=None,
                   help="the paged configuration whose last timed step --trace and --plot "
                        "draw (default: the first paged one of --configs)")
    p.add_argument("--trace", type=output_file, metavar="FILE.json",
                   help="write that step's buckets (page-in, step, page-out) as a Chrome "
                        "trace (chrome://tracing, ui.perfetto.dev)")
    p.add_argument("--plot", type=plot_file, metavar="FILE.png",
                   help="draw that step's timeline (needs matplotlib: statepager[plot])")
    p.add_argument("--json", action="store_true")


def page_for(bucket: int) -> int:
    """The page size the bench streams with by default: the bucket size, in whole CUDA
    pages (2 MiB), at most 256 MiB (the largest measured: a 512 MiB bucket maps two)."""
    granularity = 2 * MiB
    return min(256 * MiB, -(-bucket // granularity) * granularity)


def require_megatron() -> None:
    """UsageError unless megatron-core and the example GPT are here."""
    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise _C.UsageError(
            "bench megatron needs megatron-core, which is not installed: pip install "
            "'statepager[megatron]' (megatron-core 0.19.2, Python >= 3.12)")
    if example() is None:
        raise _C.UsageError(
            "bench megatron trains the GPT of examples/megatron_gpt.py, found neither in "
            "the source checkout this package runs from nor in the working directory: run "
            "it from a source checkout of statepager")


def example() -> str | None:
    """examples/megatron_gpt.py of the source tree this package is in, else of the
    working directory; None when neither has it."""
    for root in (bench_floor.source_root(), os.getcwd()):
        if root and os.path.isfile(os.path.join(root, _EXAMPLE)):
            return os.path.join(root, _EXAMPLE)
    return None


def timeline_config(args) -> str | None:
    """The configuration whose step --trace / --plot draw (None when neither is asked
    for); UsageError when it is not a paged one of --configs."""
    if not (args.trace or args.plot):
        return None
    paged = [n for n in args.configs if CONFIGS[n]["pager"]]
    name = args.timeline or (paged[0] if paged else None)
    if name is None:
        raise _C.UsageError(f"--trace and --plot draw a paged configuration's step, and "
                            f"--configs {','.join(args.configs)} has none: add one (e.g. fp32)")
    if name not in paged:
        raise _C.UsageError(f"--trace and --plot draw a paged configuration's step: --timeline "
                            f"{name!r} is not in --configs {','.join(args.configs)}: add it "
                            "there or choose another")
    return name


def bench_megatron(args) -> dict:
    """Runs each configuration (see the module doc). Unless --json, prints the header and
    each configuration's lines as they come; print_summary() prints the rest."""
    require_megatron()
    drawn = timeline_config(args)
    model = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq",
                                           "micro_batch", "warmup", "steps", "bucket",
                                           "depth", "page_size", "hbm_budget", "host_budget",
                                           "no_map_ram", "fio_jobs", "device_time")}
    model["grads"] = "bf16" if args.bf16_grads else "fp32"
    model["page_size"] = args.page_size or page_for(args.bucket)
    r = {"model": model, "dir": args.dir, "configs": []}
    live = not args.json
    if live:
        _print(header_lines(r))
    with bench_directory(args.dir) as work, \
            Progress("bench megatron", len(args.configs)) as bar:
        for name in args.configs:
            bar.phase(f"{name}: {CONFIGS[name]['what']}")
            spec = dict(model, config=name, store=os.path.join(work, name), example=example())
            if name == drawn:
                spec.update(trace=args.trace and os.path.abspath(args.trace),
                            plot=args.plot and os.path.abspath(args.plot))
            c = run_worker(spec, work, args.timeout)
            r["configs"].append(c)
            if live:
                _print(config_lines(c))
    r["failed"] = [c["config"] for c in r["configs"] if "error" in c]
    return r


def _print(lines: list[str]) -> None:
    print("\n".join(lines), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(spec: dict, work: str, timeout: int) -> dict:
    """Runs one configuration in its own process; its result, or {"error": ...}."""
    out = os.path.join(work, spec["config"] + ".json")
    log = os.path.join(work, spec["config"] + ".log")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0")
    cmd = [sys.executable, "-m", "statepager.bench.megatron", "--worker", json.dumps(spec), out]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout).returncode
            error = f"exit status {rc}"
        except subprocess.TimeoutExpired:
            rc, error = None, f"timed out after {timeout} s"
    result = None
    if os.path.isfile(out):
        with open(out) as f:
            result = json.load(f)
    # Its result, or the error it stopped at (_worker_main); not a result it wrote before
    # dying at exit.
    if result is not None and (rc == 0 or "error" in result):
        return dict(result, seconds=time.perf_counter() - t0)
    with open(log) as f:
        tail = f.read().splitlines()[-25:]
    return {"config": spec["config"], "error": error, "log_tail": tail,
            "seconds": time.perf_counter() - t0}


# -- the worker: one configuration, in its own process ---------------------------------

def _load_example(path: str):
    """examples/megatron_gpt.py as the module megatron_gpt (its dataclass needs it in
    sys.modules)."""
    spec = importlib.util.spec_from_file_location("megatron_gpt", path)
    module = sys.modules["megatron_gpt"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timed(optimizer, times: list) -> None:
    """optimizer.step (this instance's) records its wall time, device work included."""
    step = optimizer.step

    def timed_step(*args, **kwargs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = step(*args, **kwargs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        return result
    optimizer.step = timed_step


def _profiled_opt_step(optimizer, train_step) -> dict:
    """Runs train_step() once, its optimizer.step() under torch.profiler: what
    device_time.profile() saw of it."""
    step, seen = optimizer.step, {}

    def profiled(*args, **kwargs):
        result = []
        seen.update(device_time.profile(lambda: result.append(step(*args, **kwargs))))
        return result[0]
    optimizer.step = profiled
    try:
        train_step()
    finally:
        optimizer.step = step
    return seen


def opt_step_parts(opt_times: list, parts: list) -> dict:
    """The host's time in each timed opt.step's parts (StepStats: the pager's set-up, its
    bucket loop, its commit) and the rest (Megatron's own work, the pager's bookkeeping
    after the loop), as spreads."""
    rest = [t - sum(p) for t, p in zip(opt_times, parts)]
    keys = ("setup", "loop", "commit")
    return dict({k: spread([p[i] for p in parts]) for i, k in enumerate(keys)},
                rest=spread(rest))


def _scope_pool_bytes() -> int:
    """Bytes torch reserved in MemPools other than its default pool (Pager.scope()'s,
    backed by the page pool: counted both in torch's reserved and in the pool's mapped)."""
    return sum(s.get("total_size", 0) for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))


def _bytes(binding, kind: str) -> int:
    """Bytes of the buckets' `kind` tensors ("stored": the state at rest; "undo": the
    atomic steps' host copies of what a step overwrites outside the pager)."""
    return sum(t.numel() * t.element_size() for s in binding.streams for b in s.buckets
               for t in getattr(b, kind))


def _moment_bytes(fmt: str, n: int) -> int:
    from statepager.formats import codecs

    return {"fp32": 4 * n, "bf16": 2 * n, "q8": n + 4 * codecs.q8_num_blocks(n)}[fmt]


def host_budget_for(params, moments: str, mains: str) -> int:
    """Host tier bytes that hold the paged state of `params` (the trained ones; one rank,
    so each is one main) through atomic steps: the state twice (a step's old bytes stay
    until it commits), and 3% + 256 MiB for the tier's 4 KiB rounding."""
    state = sum((4 if mains == "fp32" else 2) * p.numel() + 2 * _moment_bytes(moments, p.numel())
                for p in params if p.requires_grad)
    return int(2 * state * 1.03) + 256 * MiB


def _median(values: list) -> int:
    return int(statistics.median(values))


def run_config(spec: dict) -> dict:
    """Trains the GPT of `spec` in this process and measures it, then the floor of a
    paged configuration's bytes (see the module doc)."""
    from statepager import Pager, trace

    config = CONFIGS[spec["config"]]
    driver = DriverMemory()
    baseline = driver.used() if driver.without_context else None
    gpt = _load_example(spec["example"])
    gpt.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    with_context = driver.used()
    # The GPT as users train it: without the example's native fp32 test parameter, which
    # Megatron's offload cannot step (megatron_gpt.build says why); the same in every
    # configuration.
    setup = gpt.Setup(layers=spec["layers"], hidden=spec["hidden"], heads=spec["heads"],
                      vocab=spec["vocab"], seq=spec["seq"], batch=spec["micro_batch"],
                      grad_fp32=spec["grads"] == "fp32", steps=spec["warmup"] + spec["steps"],
                      ddp_bucket=40_000_000, fp32_param=False)
    model = gpt.build_model(setup)
    host_budget = 0
    if config.get("host"):
        host_budget = spec.get("host_budget") or host_budget_for(
            model.parameters(), config["moments"], config["mains"])
    pager = (Pager(spec["store"], "cuda", page_size=spec["page_size"],
                   hbm_budget=spec["hbm_budget"], host_budget=host_budget,
                   map_ram=not spec["no_map_ram"])
             if config["pager"] else None)
    try:
        model, optimizer, scheduler, binding = gpt.build(
            setup, pager, model=model, bucket_size=spec["bucket"], depth=spec["depth"],
            moments=config.get("moments", "fp32"), mains=config.get("mains", "fp32"),
            optimizer_options=config.get("optimizer_options"))
        opt_times = []
        _timed(optimizer, opt_times)
        torch.cuda.synchronize()
        built = {"driver": driver.used(),
                 "pool_mapped": pager.stats()["mapped_bytes"] if pager else None}
        with driver.sampler() as warmup:
            losses = [gpt.train_step(setup, model, optimizer, scheduler, i)
                      for i in range(spec["warmup"])]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        del opt_times[:]
        steps, moved, pool, compute, streams, parts = [], [], [], [], [], []
        skipped = 0
        counters = ("bytes_read", "bytes_written", "bytes_from_host", "bytes_to_host",
                    "spilled_bytes", "mapped_read_bytes", "mapped_written_bytes")
        with driver.sampler() as sampler, CpuUse() as cpu:
            for i in range(spec["warmup"], spec["warmup"] + spec["steps"]):
                before = pager.stats() if pager else None
                last_before = binding.last if pager else None
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                losses.append(gpt.train_step(setup, model, optimizer, scheduler, i))
                torch.cuda.synchronize()
                steps.append(time.perf_counter() - t0)
                if pager is not None:
                    after = pager.stats()
                    if any(a is b for a, b in zip(binding.last, last_before)):
                        # Skipped by Megatron (inf or nan in the grads): nothing streamed,
                        # and `last` holds an older step. Left out of every figure.
                        skipped += 1
                        steps.pop()
                        opt_times.pop()
                        continue
                    moved.append({k: after[k] - before[k] for k in counters})
                    pool.append((after["peak_mapped_bytes"], after["mapped_bytes"],
                                 after["cached_bytes"]))
                    compute.append(sum(s.compute_seconds for s in binding.last))
                    streams.append(sum(s.seconds for s in binding.last))
                    parts.append([sum(getattr(s, k) for s in binding.last)
                                  for k in ("setup_seconds", "loop_seconds", "commit_seconds")])
        if not steps:
            raise _C.UsageError(
                f"Megatron skipped every timed step of {spec['config']} (inf or nan in the "
                "grads), so no step streamed: raise --warmup, or lower the learning rate")
        result = {
            "config": spec["config"], "what": config["what"],
            "params": sum(p.numel() for p in model.parameters()),
            "losses": losses, "step_s": spread(steps), "opt_step_s": spread(opt_times),
            "driver": {"source": driver.source, "baseline": baseline,
                       "with_context": with_context, "built": built["driver"],
                       "warmup_peak": warmup.peak, "peak": sampler.peak,
                       "samples": sampler.samples},
            "torch": {"max_allocated": torch.cuda.max_memory_allocated(),
                      "max_reserved": torch.cuda.max_memory_reserved(),
                      "reserved": torch.cuda.memory_reserved(),
                      "scope_pool": _scope_pool_bytes()},
            "pager": None, "floor": None, "timeline_files": [],
            "cpu_cores": cpu.cores(), "cpus": os.cpu_count(),
        }
        if pager is not None:
            stats = pager.stats()
            result["pager"] = dict(
                {k: [m[k] for m in moved] for k in counters},
                skipped_steps=skipped,
                stored_bytes=_bytes(binding, "stored"), undo_bytes=_bytes(binding, "undo"),
                host_budget=host_budget, host_used=stats["host_used_bytes"],
                direct_io=stats["direct_io"], io_depth=stats["io_depth"],
                io_block=stats["io_block_bytes"],
                compute_s=spread(compute), stream_s=spread(streams),
                parts_s=opt_step_parts(opt_times, parts),
                peak_mapped=max(p[0] for p in pool),
                held=max(max(p[0], p[1] + p[2]) for p in pool),
                buckets=sum(s.buckets for s in binding.last),
                largest_bucket=max(b.nbytes for s in binding.streams for b in s.buckets),
                # The members step one after another: the largest one's window.
                window=max(s.window_bytes for s in binding.streams),
                # What scope() built and left mapped (no hbm_budget: every main) until
                # the first step pages it out.
                mapped_before_first_step=built["pool_mapped"])
            if spec.get("trace") or spec.get("plot"):
                last = max(binding.last, key=lambda s: s.bytes_read + s.bytes_written)
                result["timeline_files"] = trace.write_outputs(
                    last, spec.get("trace"), spec.get("plot"),
                    f"bench megatron {spec['config']}: GPT {result['params'] / 1e9:.2f} B, "
                    f"buckets of {spec['bucket'] // MiB} MiB, step {last.step}")
        if spec.get("device_time"):  # past the schedule's steps: at its last rate
            n = spec["warmup"] + spec["steps"]
            try:
                result["device_time"] = _profiled_opt_step(
                    optimizer, lambda: gpt.train_step(setup, model, optimizer, scheduler, n))
            except Exception as error:  # the timed steps' figures stand without it
                result["device_time"] = {"error": f"{type(error).__name__}: {error}"}
        gpt.finish(model)
    finally:
        if pager is not None:
            pager.close()  # its store and host tier go before the floor's turn
        torch.distributed.destroy_process_group()
    if result["pager"] is not None:
        result["floor"] = floor_of(result["pager"], os.path.dirname(spec["store"]),
                                   spec["fio_jobs"])
    return result


def floor_of(p: dict, directory: str, jobs: tuple[int, ...]) -> dict:
    """The floor (statepager.bench.floor) of the median step's bytes: those of the store
    through fio in `directory` with the pager's I/O shape, and all of them (host tier's
    too) through PCIe."""
    return bench_floor.measure(
        directory, torch.device("cuda", torch.cuda.current_device()),
        _median(p["bytes_read"]), _median(p["bytes_written"]), block=p["io_block"],
        depth=p["io_depth"], direct=p["direct_io"], jobs=jobs,
        host_in=_median(p["bytes_from_host"]), host_out=_median(p["bytes_to_host"]),
        mapped_in=_median(p["mapped_read_bytes"]), mapped_out=_median(p["mapped_written_bytes"]))


def _worker_main(argv: list[str]) -> int:
    spec, out = json.loads(argv[0]), argv[1]
    try:
        result = run_config(spec)
    except Exception as error:
        # The error the configuration stopped at, kept for the report. The process then
        # ends without the interpreter's teardown: after a device error (a kernel's
        # illegal address) CUDA stays broken, and torch's teardown aborts on it, so the
        # last lines of the log, all the report showed, were torch's abort, not this.
        traceback.print_exc()
        lines = traceback.format_exception(error)
        with open(out, "w") as f:
            json.dump({"config": spec["config"], "error": f"{type(error).__name__}: {error}",
                       "log_tail": "".join(lines).splitlines()[-25:]}, f)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


# -- the report ------------------------------------------------------------------------

def breakdown(r: dict) -> dict | None:
    """What the driver's peak holds beyond torch's peak allocation, in pieces (bytes):
    the CUDA context, torch's cache (reserved - allocated at their peaks), the page pool
    (mapped or kept, less what torch counted as scope() reservations), and the rest
    (NCCL, library workspaces outside torch, timing skew). None without a baseline."""
    d, t, p = r["driver"], r["torch"], r.get("pager")
    if d["baseline"] is None:
        return None
    above = d["peak"] - d["baseline"] - t["max_allocated"]
    context = d["with_context"] - d["baseline"]
    cache = t["max_reserved"] - t["max_allocated"]
    pool = (p["held"] - t["scope_pool"]) if p else 0
    return {"above_torch_peak": above, "context": context, "torch_cache": cache, "pool": pool,
            "other": above - context - cache - pool}


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _gb(values: list | None) -> str:
    return "-" if values is None else f"{_median(values) / 1e9:.2f}"


def _range(s: dict) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}, n={s['n']})"


def _used(c: dict) -> int:
    """The driver's peak over the timed steps, less the device's use before the process."""
    d = c["driver"]
    return d["peak"] - (d["baseline"] or 0)


def _step(c: dict, key: str = "step_s") -> float:
    return c[key]["median"]


_COLUMNS = (("config", 9, "<"), ("step, s (median, min-max)", 26, "<"),
            ("opt.step, s", 26, "<"), ("store rd GB", 11, ">"), ("store wr GB", 11, ">"),
            ("host in GB", 10, ">"), ("host out GB", 11, ">"), ("driver peak GiB", 15, ">"),
            ("torch max alloc", 15, ">"), ("torch max resv", 14, ">"), ("pool held", 9, ">"))


def _row(cells) -> str:
    return "  " + " ".join(f"{c:{align}{width}}"
                           for c, (_, width, align) in zip(cells, _COLUMNS)).rstrip()


def header_lines(r: dict) -> list[str]:
    """What runs, and the table's header."""
    m = r["model"]
    return [f"megatron bench: GPT, {m['layers']} layers, hidden {m['hidden']}, {m['heads']} "
            f"heads, vocab {m['vocab']}, seq {m['seq']}, micro-batch {m['micro_batch']}, "
            f"{m['grads']} grads; {m['warmup']} warm-up + {m['steps']} timed steps; stores in "
            f"{r['dir']}, buckets of {m['bucket'] // MiB} MiB x depth {m['depth']}, pages of "
            f"{m['page_size'] // MiB} MiB"
            + ("; map_ram off (a store in RAM goes through io_uring)"
               if m.get("no_map_ram") else "")
            + "; each configuration in its own process, printed as it ends (per step: "
            "medians; GB = 1e9 bytes, GiB = 2^30)",
            _row(name for name, _, _ in _COLUMNS)]


def config_lines(c: dict) -> list[str]:
    """One configuration's row of the table and its notes (with its floor, if paged)."""
    name = c["config"]
    if "error" in c:
        return [f"  {name:9s} failed ({c['error']}):"] + [f"      {line}" for line in c["log_tail"]]
    p, t = c["pager"], c["torch"]
    lines = [_row([name, _range(c["step_s"]), _range(c["opt_step_s"]),
                   *(_gb(p and p[k]) for k in ("bytes_read", "bytes_written", "bytes_from_host",
                                               "bytes_to_host")),
                   _gib(_used(c)), _gib(t["max_allocated"]), _gib(t["max_reserved"]),
                   _gib(p and p["held"])])]
    notes = [f"{CONFIGS[name]['what']}: {c['params'] / 1e9:.3f} B params; {c['seconds']:.0f} s "
             "in all (build, steps, floor)"]
    if p:
        reads = [a + b for a, b in zip(p["bytes_read"], p["bytes_from_host"])]
        one_pass = all(x == p["stored_bytes"] for x in reads)
        writes = [a + b for a, b in zip(p["bytes_written"], p["bytes_to_host"])]
        written = all(x == p["stored_bytes"] for x in writes)
        notes.append(f"stored state {p['stored_bytes'] / 1e9:.2f} GB; per step read = stored: "
                     f"{one_pass}, written = stored: {written}")
        if p.get("skipped_steps"):
            notes.append(f"{p['skipped_steps']} timed steps skipped by Megatron (inf or nan in "
                         "the grads): left out, the figures are of the others")
        if any(p["mapped_read_bytes"]) or any(p["mapped_written_bytes"]):
            notes.append(f"through the mapped store files (map_ram): "
                         f"{_median(p['mapped_read_bytes']) / 1e9:.2f} GB of the read and "
                         f"{_median(p['mapped_written_bytes']) / 1e9:.2f} GB of the written per "
                         "step")
        if p["undo_bytes"]:  # statepager.core.atomic
            notes.append(f"atomic steps' undo copies: {p['undo_bytes'] / 1e9:.2f} GB of pinned "
                         "host memory (the bf16 params residual mains are stored against, "
                         "copied from the device each step at zero_grad(), while forward and "
                         "backward run; only a failed step reads them)")
        if p["host_budget"]:
            notes.append(f"host tier {p['host_budget'] / 1e9:.2f} GB pinned, "
                         f"{p['host_used'] / 1e9:.2f} GB in use after the steps; spilled to "
                         f"the store over the timed steps: {sum(p['spilled_bytes']) / 1e9:.2f} GB")
        notes.append(f"{p['buckets']} buckets, largest {p['largest_bucket'] / MiB:.0f} MiB; pool "
                     f"peak mapped {p['peak_mapped'] / GiB:.2f} GiB of a window of "
                     f"{p['window'] / GiB:.2f} GiB; pager compute (codecs + optimizer math) "
                     f"{show(p['compute_s'], 's', 3)}")
        if p.get("parts_s"):
            ms = {k: 1e3 * v["median"] for k, v in p["parts_s"].items()}
            notes.append(f"opt.step's host time (medians): the pager's set-up {ms['setup']:.1f} "
                         f"ms (the epoch, the first page-ins, the snapshot), its bucket loop "
                         f"{ms['loop']:.1f} ms, commit {ms['commit']:.1f} ms; the rest, "
                         f"Megatron's own (grad copies, norm, clip, the params' sync) and the "
                         f"pager's bookkeeping after the loop, {ms['rest']:.1f} ms")
    if c.get("cpu_cores"):
        notes.append("CPU over the timed steps, in cores busy: " + ", ".join(
            f"{kind} {cores:.1f}" for kind, cores in c["cpu_cores"].items())
            + f" (of {c['cpus']})")
    b = breakdown(c)
    if b:
        notes.append(f"driver peak - torch max allocated = {_gib(b['above_torch_peak'])} GiB: "
                     f"CUDA context {_gib(b['context'])} + torch cache {_gib(b['torch_cache'])}"
                     f" + page pool {_gib(b['pool'])} + other {_gib(b['other'])} (driver: "
                     f"{c['driver']['source']}, sampled every ms)")
    first = (f"; pool mapped before the first step {_gib(p['mapped_before_first_step'])} GiB"
             if p else "")
    d = c["driver"]
    notes.append(f"warm-up steps: driver peak {_gib(d['warmup_peak'] - (d['baseline'] or 0))} "
                 f"GiB{first}; loss {c['losses'][0]:.4f} -> {c['losses'][-1]:.4f}")
    f = c.get("floor")
    if f:
        notes.append((f"step {multiple(c['step_s']['median'], f['seconds'], 'the floor')}, "
                      f"opt.step {multiple(c['opt_step_s']['median'], f['seconds'], 'the floor')}"
                      f", of which the pager's stream {_stream_share(p, f)}"
                      if f["seconds"] else "no floor") +
                     "; the floor of its median step's bytes, measured after its steps:")
        notes += ["  " + line for line in bench_floor.describe(f)]
    if c.get("device_time"):
        notes.append(_device_time_line(c["device_time"]))
    if c["timeline_files"]:
        notes.append(f"last timed step's timeline: {', '.join(c['timeline_files'])}")
    return lines + [f"  {'':9s} {note}" for note in notes]


def _device_time_line(t: dict) -> str:
    """One more step's optimizer.step() under torch.profiler (--device-time)."""
    if "error" in t:
        return f"one more step's optimizer.step() under torch.profiler failed: {t['error']}"
    if not t["kernels_s"]:
        return ("one more step's optimizer.step() under torch.profiler: the profiler saw no "
                "kernel (no CUDA activity from CUPTI)")

    def ms(seconds: float) -> str:
        return f"{1e3 * seconds:.1f} ms"

    kernels = ", ".join(f"{name} {ms(s)}" for name, s in list(t["by_kernel"].items())[:4])
    return (f"one more step's optimizer.step() under torch.profiler, on the device: "
            f"statepager's kernels {ms(t['statepager_kernels_s'])}"
            f"{f' ({kernels})' if kernels else ''} of all kernels' {ms(t['kernels_s'])}, "
            f"{t['statepager_launches']} of {t['launches']} launches; "
            f"copies busy host to device {ms(t['h2d_busy_s'])}, device to host "
            f"{ms(t['d2h_busy_s'])}, both at once {ms(t['both_busy_s'])}")


def _stream_share(p: dict, f: dict) -> str:
    """The pager's stream (its buckets' page-ins, steps and page-outs: the part of opt.step
    the floor's bytes bound; the rest is the optimizer's own work around it, but for the
    grad norm its first page-ins overlap, from Megatron's prepare_grads) against the
    floor."""
    s = p["stream_s"]["median"]
    beaten = (" (below the floor: that floor was none, its PCIe copies slower than the "
              "stream's own)" if s < f["seconds"] else "")
    return f"{s:.3f} s = {multiple(s, f['seconds'], 'the floor')}{beaten}"


def _done(configs: list) -> dict:
    return {c["config"]: c for c in configs if "error" not in c}


def summary_lines(r: dict) -> list[str]:
    """The comparisons between configurations: with Megatron's offload, with each one's
    floor, the narrow formats with fp32, and the kernels' device time."""
    done = _done(r["configs"])
    lines = ["summary (medians of the timed steps):"]
    lines += _offload_lines(done)
    floored = [(n, c, c["floor"]) for n, c in done.items()
               if c.get("floor") and c["floor"]["seconds"]]
    if floored:
        lines.append("  against each one's floor (the larger of PCIe and fio, for its bytes):")
        lines += [f"    {n:9s} {_floor_comparison(c, f)}" for n, c, f in floored]
    for narrow, wide in (("q8", "fp32"), ("host-q8", "host-fp32")):
        if narrow in done and wide in done:
            a, b = done[narrow], done[wide]
            lines.append(f"  {narrow} / {wide}: step {_step(a) / _step(b):.2f}, opt.step "
                         f"{_step(a, 'opt_step_s') / _step(b, 'opt_step_s'):.2f} ({narrow}'s "
                         f"step is {faster(_step(a), _step(b), higher_is_better=False)})")
    kernels = [f"{n} {1e3 * t['statepager_kernels_s']:.1f} ms = "
               f"{t['statepager_kernels_s'] / _step(c, 'opt_step_s'):.2f} x its opt.step"
               for n, c in done.items() if c["pager"]
               for t in [c.get("device_time") or {}] if t.get("kernels_s")]
    if kernels:
        lines.append("  statepager's kernels on the device in one more optimizer.step() "
                     f"(--device-time): {', '.join(kernels)}")
    if r["failed"]:
        lines.append(f"  failed: {', '.join(r['failed'])} (their logs above)")
    return lines


def _offload_lines(done: dict) -> list[str]:
    """Each configuration's step, opt.step and driver peak against Megatron's offload."""
    offload = done.get("offload")
    if not offload:
        return ["  Megatron's offload: not measured (not in --configs, or failed)"]
    step, opt_step, peak = _step(offload), _step(offload, "opt_step_s"), _used(offload)
    offloads = "the offload's"
    lines = [f"  step against Megatron's offload ({step:.3f} s; opt.step {opt_step:.3f} s; "
             f"driver peak {_gib(peak)} GiB):"]
    for n, c in done.items():
        if n == "offload":
            continue
        ours, used = _step(c, "opt_step_s"), _used(c)
        lines.append(f"    {n:9s} {_step(c):.3f} s: "
                     f"{faster(_step(c), step, higher_is_better=False)}; opt.step {ours:.3f} s: "
                     f"{faster(ours, opt_step, higher_is_better=False)}; driver peak "
                     f"{_gib(used)} GiB = {multiple(used, peak, offloads)}")
    return lines


def _floor_comparison(c: dict, f: dict) -> str:
    """A configuration's step, opt.step and stream as multiples of its floor; a stream
    below the floor shows that the floor was none (see Note [The floor of a step])."""
    stream = c["pager"]["stream_s"]["median"]
    if stream < f["seconds"]:
        return (f"not shown: the pager's stream ({stream:.3f} s) beat its floor "
                f"({f['seconds']:.3f} s, set by {f['bound_by']}), so that floor was none (its "
                "PCIe copies ran slower than the stream's own); run again")
    return (f"step {multiple(_step(c), f['seconds'], 'its floor')}, opt.step "
            f"{multiple(_step(c, 'opt_step_s'), f['seconds'], 'its floor')}, the pager's "
            f"stream {multiple(stream, f['seconds'], 'its floor')} ({f['seconds']:.3f} s, set "
            f"by {f['bound_by']})")


def print_megatron(r: dict) -> None:
    """The whole report of a finished run (e.g. from --json)."""
    _print(header_lines(r))
    for c in r["configs"]:
        _print(config_lines(c))
    print_summary(r)


def print_summary(r: dict) -> None:
    """What follows the lines bench_megatron printed as it ran."""
    _print(summary_lines(r))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 4:
        sys.exit("usage: python -m statepager.bench.megatron --worker SPEC_JSON OUT_JSON "
                 "(run by `statepager bench megatron`)")
    sys.exit(_worker_main(sys.argv[2:]))

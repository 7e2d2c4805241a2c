"""python -m statepager bench megatron: a Megatron GPT trained a few steps, unpaged, with
Megatron's own optimizer CPU offload, and with statepager in each on-disk format, its state
on the store (--dir) or in a pinned host tier, side by side in one run.

Each configuration runs in its own process (statepager.tools.bench.megatron_worker), so
that each starts from clean device memory and the driver's view of the device is that
configuration's alone; its lines are printed as soon as it ends (a run cut short keeps
what finished), then a summary (statepager.tools.bench.megatron_report). The
configurations and options are statepager.tools.bench.megatron_configs'. The GPT is
examples/megatron_gpt.py's (a source checkout is needed), bf16 params in Megatron's DDP
and DistributedOptimizer (torch AdamW when neither TransformerEngine nor apex is
installed), on one GPU.

Per configuration, over the timed steps (after the warm-up steps, whose first creates the
moments): the step time (a whole training iteration) and optimizer.step()'s share, the
pager's bytes read and written per step (store files and host tier), and device memory
at the steps' peak as the driver sees it (NVML, sampled every millisecond by a child
process, which takes no GIL from the step; cudaMemGetInfo by a thread when NVML is
missing: statepager.tools.bench.driver_memory) beside torch's own counters and the page pool's,
and what of the peak is none of them, and the process's CPU time in cores busy
(statepager.tools.bench.cpu_use: io_uring's workers, the pager's I/O thread, the rest). A
paged configuration's process then measures the floor of its bytes
(statepager.tools.bench.floor: PCIe both ways with pinned buffers, fio on --dir; the larger),
and its step is printed as a multiple of it. With --device-time, one more step's
optimizer.step() runs under torch.profiler (statepager.tools.bench.device_time): the device's
time in statepager's kernels and the copy engines' busy time. With --iteration-trace or
--iteration-plot, one more whole iteration of the --timeline configuration does
(statepager.tools.bench.iteration): the host's phases and the device's lanes, and how much
of the copies ran under the model's kernels. The summary compares each
with Megatron's offload and with its floor, the narrow formats with fp32, and gives the
kernels' device time (--device-time).
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

from statepager import _C
from statepager.tools.bench import floor as bench_floor
from statepager.tools.bench.common import bench_directory
from statepager.tools.bench.megatron_configs import (CONFIGS, add_arguments, streaming,
                                                     timeline_config)
from statepager.tools.bench.megatron_report import (config_lines, header_lines, print_lines,
                                                    print_megatron, print_summary)
from statepager.tools.progress import Progress

# The command's entry points (statepager.tools.cli; print_megatron for a --json result).
__all__ = ["add_arguments", "bench_megatron", "print_megatron", "print_summary"]

_EXAMPLE = os.path.join("examples", "megatron_gpt.py")


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


def bench_megatron(args) -> dict:
    """Runs each configuration (see the module doc). Unless --json, prints the header and
    each configuration's lines as they come; print_summary() prints the rest."""
    require_megatron()
    drawn = timeline_config(args)
    model = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq",
                                           "micro_batch", "warmup", "steps",
                                           "bucket_size", "depth", "stationary_bytes", "page_size", "hbm_budget",
                                           "host_budget", "no_map_ram", "fio_jobs",
                                           "device_time", "checkpoint")}
    model["bucket"] = model.pop("bucket_size")  # the results' key, read by the reports
    model["grads"] = "bf16" if args.bf16_grads else "fp32"
    model["overlap_grad_reduce"] = not args.no_overlap_grad_reduce
    r = {"model": model, "dir": args.dir, "configs": []}
    live = not args.json
    if live:
        print_lines(header_lines(r))
    with bench_directory(args.dir) as work, \
            Progress("bench megatron", len(args.configs)) as bar:
        for name in args.configs:
            bar.phase(f"{name}: {CONFIGS[name]['what']}")
            spec = dict(model, config=name, store=os.path.join(work, name), example=example())
            spec["page_size"], spec["depth"] = streaming(
                CONFIGS[name].get("moments"), args.bucket_size, args.page_size, args.depth,
                CONFIGS[name].get("stationary", False))
            if name == drawn:
                spec.update({k: getattr(args, k) and os.path.abspath(getattr(args, k))
                             for k in ("trace", "plot", "iteration_trace", "iteration_plot")})
            c = run_worker(spec, work, args.timeout)
            r["configs"].append(c)
            if live:
                print_lines(config_lines(c))
    r["failed"] = [c["config"] for c in r["configs"] if "error" in c]
    return r


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
    cmd = [sys.executable, "-m", "statepager.tools.bench.megatron_worker", json.dumps(spec), out]
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
    # Its result, or the error it stopped at (megatron_worker); not a result it wrote before
    # dying at exit.
    if result is not None and (rc == 0 or "error" in result):
        return dict(result, seconds=time.perf_counter() - t0)
    with open(log) as f:
        tail = f.read().splitlines()[-25:]
    return {"config": spec["config"], "error": error, "log_tail": tail,
            "seconds": time.perf_counter() - t0}


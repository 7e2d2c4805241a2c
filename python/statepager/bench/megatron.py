"""python -m statepager bench megatron: a Megatron GPT trained a few steps, unpaged, with
Megatron's own optimizer CPU offload, and with statepager in each on-disk format, side by
side in one run.

Each configuration runs in its own process (`python -m statepager.bench.megatron
--worker SPEC OUT`), so that each starts from clean device memory and the driver's view
of the device is that configuration's alone. The GPT is examples/megatron_gpt.py's (a
source checkout is needed), bf16 params in Megatron's DDP and DistributedOptimizer
(torch AdamW when neither TransformerEngine nor apex is installed), on one GPU.

Per configuration, over the timed steps (after the warm-up steps, whose first creates the
moments): the step time (a whole training iteration) and optimizer.step()'s share, the
pager's bytes read and written per step, and device memory at the steps' peak as the
driver sees it (NVML, sampled by a thread every millisecond; cudaMemGetInfo when NVML is
missing) beside torch's own counters and the page pool's, and what of the peak is none
of them.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time

import torch

from statepager import _C
from statepager.bench.floor import source_root
from statepager.bench.common import bench_directory
from statepager.bench.report import show, spread
from statepager.cli_args import at_least, directory, size
from statepager.progress import Progress

GiB, MiB = 1 << 30, 1 << 20
_EXAMPLE = os.path.join("examples", "megatron_gpt.py")

# Megatron's own offload, as users configure it: Adam on the CPU for all of the state,
# copies overlapped with it (HybridDeviceOptimizer).
OFFLOAD = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
               overlap_cpu_optimizer_d2h_h2d=True)
CONFIGS = {
    "unpaged": dict(pager=False, what="unpaged (state in device memory)"),
    "offload": dict(pager=False, optimizer_options=OFFLOAD,
                    what="Megatron optimizer_cpu_offload (fraction 1.0, overlapped d2h/h2d)"),
    "fp32": dict(pager=True, moments="fp32", mains="fp32", what="statepager, fp32"),
    "bf16": dict(pager=True, moments="bf16", mains="fp32",
                 what="statepager, bf16 moments, fp32 mains"),
    "q8": dict(pager=True, moments="q8", mains="residual",
               what="statepager, q8 moments, residual mains"),
}


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `bench megatron`; the defaults are the 1.34 B GPT of issue 13."""
    p.add_argument("--dir", required=True, type=directory,
                   help="where the pager's stores go (e.g. /dev/shm/sp): the bench makes a "
                        "new directory in it and deletes it afterwards")
    p.add_argument("--configs", type=configs, default=list(CONFIGS),
                   help=f"which to run, comma-separated: {','.join(CONFIGS)} (default all)")
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
    p.add_argument("--bucket", type=size, default=size("256M"), help="the pager's bucket_size")
    p.add_argument("--hbm-budget", type=size, default=None, help="the pager's hbm_budget")
    p.add_argument("--timeout", type=at_least(1, "seconds"), default=900,
                   help="seconds each configuration may take")
    p.add_argument("--json", action="store_true")


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
    for root in (source_root(), os.getcwd()):
        if root and os.path.isfile(os.path.join(root, _EXAMPLE)):
            return os.path.join(root, _EXAMPLE)
    return None


def bench_megatron(args) -> dict:
    require_megatron()
    model = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq",
                                           "micro_batch", "warmup", "steps", "bucket",
                                           "hbm_budget")}
    model["grads"] = "bf16" if args.bf16_grads else "fp32"
    results = []
    with bench_directory(args.dir) as work, \
            Progress("bench megatron", len(args.configs)) as bar:
        for name in args.configs:
            bar.phase(f"{name}: {CONFIGS[name]['what']}")
            spec = dict(model, config=name, store=os.path.join(work, name), example=example())
            results.append(run_worker(spec, work, args.timeout))
    return {"model": model, "dir": args.dir, "configs": results,
            "failed": [c["config"] for c in results if "error" in c]}


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
    if rc == 0 and os.path.isfile(out):
        with open(out) as f:
            return json.load(f)
    with open(log) as f:
        tail = f.read().splitlines()[-25:]
    return {"config": spec["config"], "error": error, "log_tail": tail,
            "seconds": time.perf_counter() - t0}


# -- the worker: one configuration, in its own process ---------------------------------

class DriverMemory:
    """Device memory in use as the driver reports it: NVML (libnvidia-ml, no CUDA context
    needed, so the baseline before this process's context is known), else
    cudaMemGetInfo (total - free; needs the context)."""

    class _Info(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                    ("used", ctypes.c_ulonglong)]

    def __init__(self):
        self._nvml, self._handle = None, ctypes.c_void_p()
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if nvml.nvmlInit_v2() == 0 and self._find(nvml):
                self._nvml = nvml
        except OSError:
            pass
        self.source = ("NVML (device-wide used)" if self._nvml is not None
                       else "cudaMemGetInfo (total - free)")

    def _find(self, nvml) -> bool:
        """The handle of CUDA device 0: the first of CUDA_VISIBLE_DEVICES (an index or
        a UUID), else NVML's device 0."""
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        if first.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex_v2(int(first),
                                                      ctypes.byref(self._handle)) == 0
        return nvml.nvmlDeviceGetHandleByUUID(first.encode(), ctypes.byref(self._handle)) == 0

    @property
    def without_context(self) -> bool:
        return self._nvml is not None

    def used(self) -> int:
        if self._nvml is not None:
            info = self._Info()
            if self._nvml.nvmlDeviceGetMemoryInfo(self._handle, ctypes.byref(info)) == 0:
                return int(info.used)
        free, total = torch.cuda.mem_get_info(0)
        return int(total - free)


class PeakSampler:
    """The largest of `read()` seen by a thread sampling every `interval` seconds while
    the `with` block runs."""

    def __init__(self, read, interval: float = 1e-3):
        self._read, self._interval = read, interval
        self._stop = threading.Event()
        self.peak, self.samples = 0, 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._read())
            self.samples += 1
            self._stop.wait(self._interval)

    def __enter__(self):
        self.peak = self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())


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


def _scope_pool_bytes() -> int:
    """Bytes torch reserved in MemPools other than its default pool (Pager.scope()'s,
    backed by the page pool: counted both in torch's reserved and in the pool's mapped)."""
    return sum(s.get("total_size", 0) for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))


def _stored_bytes(binding) -> int:
    return sum(t.numel() * t.element_size() for s in binding.streams for b in s.buckets
               for t in b.stored)


def run_config(spec: dict) -> dict:
    """Trains the GPT of `spec` in this process and measures it (see the module doc)."""
    from statepager import Pager

    config = CONFIGS[spec["config"]]
    driver = DriverMemory()
    baseline = driver.used() if driver.without_context else None
    gpt = _load_example(spec["example"])
    gpt.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    with_context = driver.used()
    setup = gpt.Setup(layers=spec["layers"], hidden=spec["hidden"], heads=spec["heads"],
                      vocab=spec["vocab"], seq=spec["seq"], batch=spec["micro_batch"],
                      grad_fp32=spec["grads"] == "fp32", steps=spec["warmup"] + spec["steps"],
                      ddp_bucket=40_000_000)
    pager = (Pager(spec["store"], "cuda", hbm_budget=spec["hbm_budget"]) if config["pager"]
             else None)
    try:
        model, optimizer, scheduler, binding = gpt.build(
            setup, pager, bucket_size=spec["bucket"], moments=config.get("moments", "fp32"),
            mains=config.get("mains", "fp32"), optimizer_options=config.get("optimizer_options"))
        opt_times = []
        _timed(optimizer, opt_times)
        torch.cuda.synchronize()
        built = {"driver": driver.used(),
                 "pool_mapped": pager.stats()["mapped_bytes"] if pager else None}
        with PeakSampler(driver.used) as warmup:
            losses = [gpt.train_step(setup, model, optimizer, scheduler, i)
                      for i in range(spec["warmup"])]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        del opt_times[:]
        steps, read, written, pool = [], [], [], []
        compute = []
        with PeakSampler(driver.used) as sampler:
            for i in range(spec["warmup"], spec["warmup"] + spec["steps"]):
                before = pager.stats() if pager else None
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                losses.append(gpt.train_step(setup, model, optimizer, scheduler, i))
                torch.cuda.synchronize()
                steps.append(time.perf_counter() - t0)
                if pager is not None:
                    after = pager.stats()
                    read.append(after["bytes_read"] - before["bytes_read"])
                    written.append(after["bytes_written"] - before["bytes_written"])
                    pool.append((after["peak_mapped_bytes"], after["mapped_bytes"],
                                 after["cached_bytes"]))
                    compute.append(sum(s.compute_seconds for s in binding.last))
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
            "pager": None,
        }
        if pager is not None:
            result["pager"] = {
                "bytes_read": read, "bytes_written": written,
                "stored_bytes": _stored_bytes(binding),
                "compute_s": spread(compute),
                "peak_mapped": max(p[0] for p in pool),
                "held": max(max(p[0], p[1] + p[2]) for p in pool),
                "buckets": sum(s.buckets for s in binding.last),
                "largest_bucket": max(b.nbytes for s in binding.streams for b in s.buckets),
                # The members step one after another: the largest one's window.
                "window": max(s.window_bytes for s in binding.streams),
                # What scope() built and left mapped (no hbm_budget: every main) until
                # the first step pages it out.
                "mapped_before_first_step": built["pool_mapped"],
            }
        gpt.finish(model)
        return result
    finally:
        if pager is not None:
            pager.close()
        torch.distributed.destroy_process_group()


def _worker_main(argv: list[str]) -> int:
    spec, out = json.loads(argv[0]), argv[1]
    result = run_config(spec)
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


def print_megatron(r: dict) -> None:
    m = r["model"]
    done = [c for c in r["configs"] if "error" not in c]
    params = f"{done[0]['params'] / 1e9:.2f} B params, " if done else ""
    print(f"megatron bench: GPT {params}{m['layers']} layers, hidden {m['hidden']}, "
          f"{m['heads']} heads, vocab {m['vocab']}, seq {m['seq']}, micro-batch "
          f"{m['micro_batch']}, {m['grads']} grads; {m['warmup']} warm-up + {m['steps']} "
          f"timed steps; stores in {r['dir']}, buckets of {m['bucket'] // MiB} MiB")
    head = (f"  {'config':8s} {'step, s (median, min-max)':26s} {'opt.step, s':26s} "
            f"{'read GB/step':>12s} {'written GB':>11s} {'driver peak GiB':>15s} "
            f"{'torch max alloc':>15s} {'torch max resv':>14s} {'pool held':>9s}")
    print(head)
    for c in r["configs"]:
        if "error" in c:
            print(f"  {c['config']:8s} failed ({c['error']}):")
            for line in c["log_tail"]:
                print(f"      {line}")
            continue
        s, o, p, d, t = c["step_s"], c["opt_step_s"], c["pager"], c["driver"], c["torch"]
        rd = f"{spread(p['bytes_read'])['median'] / 1e9:.2f}" if p else "-"
        wr = f"{spread(p['bytes_written'])['median'] / 1e9:.2f}" if p else "-"
        used = d["peak"] - (d["baseline"] or 0)
        print(f"  {c['config']:8s} {_range(s):26s} {_range(o):26s} {rd:>12s} {wr:>11s} "
              f"{_gib(used):>15s} {_gib(t['max_allocated']):>15s} "
              f"{_gib(t['max_reserved']):>14s} {_gib(p['held'] if p else None):>9s}")
    if done:
        print(f"  driver peak: {done[0]['driver']['source']}, sampled every ms over the timed "
              "steps, less the device's use before this process (all GiB)")
    for c in done:
        p, b = c["pager"], breakdown(c)
        notes = []
        if p:
            one_pass = all(x == p["stored_bytes"] for x in p["bytes_read"])
            notes.append(f"stored state {p['stored_bytes'] / 1e9:.2f} GB, read per step = "
                         f"stored: {one_pass}; {p['buckets']} buckets, largest "
                         f"{p['largest_bucket'] / MiB:.0f} MiB; pool peak mapped "
                         f"{p['peak_mapped'] / GiB:.2f} GiB of a window of "
                         f"{p['window'] / GiB:.2f} GiB; pager compute (codecs + "
                         f"optimizer math) {show(p['compute_s'], 's', 3)}")
        if b:
            notes.append(f"driver peak - torch max allocated = {_gib(b['above_torch_peak'])} "
                         f"GiB: CUDA context {_gib(b['context'])} + torch cache "
                         f"{_gib(b['torch_cache'])} + page pool {_gib(b['pool'])} + other "
                         f"{_gib(b['other'])}")
        for i, note in enumerate(notes):
            print(f"  {c['config'] if i == 0 else '':8s} {note}")
        d = c["driver"]
        first = (f"; pool mapped before the first step {_gib(p['mapped_before_first_step'])} "
                 "GiB" if p else "")
        warm = d["warmup_peak"] - (d["baseline"] or 0)
        print(f"  {'':8s} warm-up steps: driver peak {_gib(warm)} GiB{first}; loss "
              f"{c['losses'][0]:.4f} -> {c['losses'][-1]:.4f}")


def _range(s: dict) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}, n={s['n']})"


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 4:
        sys.exit("usage: python -m statepager.bench.megatron --worker SPEC_JSON OUT_JSON "
                 "(run by `statepager bench megatron`)")
    sys.exit(_worker_main(sys.argv[2:]))

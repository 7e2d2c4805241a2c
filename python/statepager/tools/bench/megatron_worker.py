"""One configuration of `bench megatron`, built and timed in a process of its own:

    python -m statepager.tools.bench.megatron_worker SPEC_JSON OUT_JSON

(run by statepager.tools.bench.megatron.run_worker). It trains the example GPT of SPEC
for the warm-up and timed steps, measures them (step and optimizer.step() times, the
pager's bytes, device memory as the driver and torch see it, CPU use), with --checkpoint
Megatron's own checkpoint of the optimizer (statepager.tools.bench.megatron_checkpoint),
then the floor of
a paged configuration's bytes, and writes the result, or the error it stopped at, to
OUT as JSON."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback

import torch

from statepager import _C
from statepager.tools.bench import device_time
from statepager.tools.bench import floor as bench_floor
from statepager.tools.bench import iteration
from statepager.tools.bench import megatron_checkpoint
from statepager.tools.bench.cpu_use import CpuUse
from statepager.tools.bench.driver_memory import DriverMemory
from statepager.tools.bench.megatron_configs import CONFIGS, host_budget
from statepager.tools.bench.megatron_report import median_bytes
from statepager.tools.bench.report import spread
from statepager.util.units import MiB


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


def opt_step_parts(opt_times: list, parts: list, under_forward: bool = False) -> dict:
    """The host's time in each timed opt.step's parts (StepStats: the pager's set-up, its
    bucket loop, its commit) and the rest (Megatron's own work, the pager's bookkeeping
    after the loop), as spreads. under_forward: the loop runs in the next forward's
    hooks, outside opt.step."""
    rest = [t - sum(p) + (p[1] if under_forward else 0.0) for t, p in zip(opt_times, parts)]
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
    return sum(t.numel() * t.element_size() for s in binding.bindings for b in s.buckets
               for t in getattr(b, kind))


def host_budget_for(params, moments: str, mains: str, copies: int = 2) -> int:
    """megatron_configs.host_budget of the trained `params` (one rank: each is one main)."""
    return host_budget([p.numel() for p in params if p.requires_grad], moments, mains, copies)


def run_config(spec: dict) -> dict:
    """Trains the GPT of `spec` in this process and measures it, then the floor of a
    paged configuration's bytes (see the module doc)."""
    from statepager import Pager
    from statepager.tools import trace

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
                      ddp_bucket=40_000_000, fp32_param=False,
                      overlap_grad_reduce=spec["overlap_grad_reduce"],
                      **config.get("setup", {}))
    model = gpt.build_model(setup)
    host_budget = 0
    if config.get("host"):
        host_budget = spec.get("host_budget") or host_budget_for(
            model.parameters(), config["moments"], config["mains"], config.get("host_copies", 2))
    defaults = config.get("defaults", False)
    pager = (Pager(spec["store"], "cuda", page_size=None if defaults else spec["page_size"],
                   hbm_budget=spec["hbm_budget"], host_budget=host_budget,
                   map_ram=not spec["no_map_ram"])
             if config["pager"] else None)
    try:
        model, optimizer, scheduler, binding = gpt.build(
            setup, pager, model=model, bucket_size=None if defaults else spec["bucket"],
            depth=None if defaults else spec["depth"],
            moments=config.get("moments", "fp32"), mains=config.get("mains", "fp32"),
            optimizer_options=config.get("optimizer_options"),
            attach_options={**{k: config[k] for k in ("atomic",) if k in config},
                            **({"stationary_bytes": spec["stationary_bytes"]}
                               if config.get("stationary") else {})})
        overlaps = []  # the members' ForwardOverlaps
        if config.get("overlap"):
            overlaps = binding.overlap_forward(
                model, page_in_during_backward=config.get("early", True),
                step_thread=config.get("thread", False))
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
        steps, moved, pool, loop_host, pipelines, parts = [], [], [], [], [], []
        in_hooks = []  # per timed iteration, the training thread's time in the forward's hooks
        skipped = 0
        counters = ("bytes_read", "bytes_written", "bytes_from_host", "bytes_to_host",
                    "spilled_bytes", "mapped_read_bytes", "mapped_written_bytes")
        with driver.sampler() as sampler, CpuUse() as cpu:
            for i in range(spec["warmup"], spec["warmup"] + spec["steps"]):
                before = pager.stats() if pager else None
                last_before = binding.last if pager else None
                hooks_before = sum(o.hook_seconds for o in overlaps)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                losses.append(gpt.train_step(setup, model, optimizer, scheduler, i))
                torch.cuda.synchronize()
                steps.append(time.perf_counter() - t0)
                in_hooks.append(sum(o.hook_seconds for o in overlaps) - hooks_before)
                if pager is not None:
                    after = pager.stats()
                    if any(a is b for a, b in zip(binding.last, last_before)):
                        # Skipped by Megatron (inf or nan in the grads): nothing streamed,
                        # and `last` holds an older step. Left out of every figure.
                        skipped += 1
                        steps.pop()
                        opt_times.pop()
                        in_hooks.pop()
                        continue
                    moved.append({k: after[k] - before[k] for k in counters})
                    # The step's own peak: one under the forward ends in the next
                    # train_step, after the pager's peak was last read here.
                    pool.append((max(s.peak_mapped_bytes for s in binding.last),
                                 after["mapped_bytes"], after["cached_bytes"]))
                    loop_host.append([sum(getattr(s, k) for s in binding.last) for k in
                                      ("compute_seconds", "wait_in_seconds",
                                       "wait_device_seconds", "wait_out_seconds",
                                       "thread_start_seconds", "thread_cpu_seconds")])
                    pipelines.append(sum(s.seconds for s in binding.last))
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
            under_forward = bool(config.get("overlap"))  # the loop runs in the forward's hooks
            result["pager"] = dict(
                {k: [m[k] for m in moved] for k in counters},
                skipped_steps=skipped,
                stored_bytes=_bytes(binding, "stored"), undo_bytes=_bytes(binding, "undo"),
                host_budget=host_budget, host_used=stats["host_used_bytes"],
                direct_io=stats["direct_io"], io_depth=stats["io_depth"],
                io_block=stats["io_block"],
                loop_host_s={k: spread([x[i] for x in loop_host])
                             for i, k in enumerate(("stepping", "page_ins", "device", "page_outs",
                                                    "thread_start", "thread_cpu"))},
                pipeline_s=spread(pipelines),
                parts_s=opt_step_parts(opt_times, parts, under_forward),
                under_forward=under_forward, step_thread=bool(config.get("thread")),
                in_hooks_s=spread(in_hooks),
                begun_in_backward=binding.early.steps_begun if binding.early else 0,
                held_back=dict(binding.early.held_back) if binding.early else {},
                peak_mapped=max(p[0] for p in pool),
                held=max(max(p[0], p[1] + p[2]) for p in pool),
                buckets=sum(s.buckets for s in binding.last),
                page_size=pager.page_size, bucket_size=binding.bindings[0].bucket_size,
                depth=binding.bindings[0].depth, atomic=binding.bindings[0].atomic,
                stationary_bytes=spec["stationary_bytes"] if config.get("stationary") else 0,
                largest_bucket=max(b.nbytes for s in binding.bindings for b in s.buckets),
                # The members step one after another: the largest one's window.
                window=max(s.window_bytes for s in binding.bindings),
                # What scope() built and left mapped (no hbm_budget: every main) until
                # the first step pages it out.
                mapped_before_first_step=built["pool_mapped"])
            if spec.get("trace") or spec.get("plot"):
                last = max(binding.last, key=lambda s: s.bytes_read + s.bytes_written)
                result["timeline_files"] = trace.write_outputs(
                    last, spec.get("trace"), spec.get("plot"),
                    f"bench megatron {spec['config']}: GPT {result['params'] / 1e9:.2f} B, "
                    f"buckets of {binding.bindings[0].bucket_size // MiB} MiB, step {last.step}")
        if spec.get("checkpoint"):
            try:
                result["checkpoint"] = megatron_checkpoint.measure(
                    model, optimizer, pager, driver, spec["store"] + "-checkpoint")
            except Exception as error:  # the timed steps' figures stand without it
                result["checkpoint"] = {"error": f"{type(error).__name__}: {error}"}
        n = spec["warmup"] + spec["steps"]  # past the schedule's steps: at its last rate
        if spec.get("iteration_trace") or spec.get("iteration_plot"):
            try:
                timeline = iteration.profile(
                    lambda: gpt.train_step(setup, model, optimizer, scheduler, n))
                result["iteration"] = iteration.summary(timeline)
                result["timeline_files"] += iteration.write_outputs(
                    timeline, spec.get("iteration_trace"), spec.get("iteration_plot"),
                    f"bench megatron {spec['config']}: one iteration")
            except Exception as error:  # the timed steps' figures stand without it
                result["iteration"] = {"error": f"{type(error).__name__}: {error}"}
            n += 1
        if spec.get("device_time"):
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
    """The floor (statepager.tools.bench.floor) of the median step's bytes: those of the store
    through fio in `directory` with the pager's I/O shape, and all of them (host tier's
    too) through PCIe."""
    return bench_floor.measure(
        directory, torch.device("cuda", torch.cuda.current_device()),
        median_bytes(p["bytes_read"]), median_bytes(p["bytes_written"]),
        block=p["io_block"], depth=p["io_depth"], direct=p["direct_io"], jobs=jobs,
        host_in=median_bytes(p["bytes_from_host"]), host_out=median_bytes(p["bytes_to_host"]),
        mapped_in=median_bytes(p["mapped_read_bytes"]),
        mapped_out=median_bytes(p["mapped_written_bytes"]))


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


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m statepager.tools.bench.megatron_worker SPEC_JSON OUT_JSON "
                 "(run by `statepager bench megatron`)")
    sys.exit(_worker_main(sys.argv[1:]))

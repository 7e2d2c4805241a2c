"""Where the streamed step's time goes on CUDA, per stored format.

A GPT-shaped model (bf16 params, fp32 grads, as `bench megatron` runs it) under a plain
torch AdamW whose fp32 masters the pager owns, attached as the Megatron adapter attaches
Megatron's inner optimizer (before_bucket: the fp32 grad; after_bucket: the bf16 param
from the master), store in --dir. Per configuration (fp32: fp32 moments and mains; q8:
q8 moments, residual mains): warm-up steps, timed steps (wall time, the pager's own
StepStats), then one step under torch.profiler, of which it prints
  - host time per phase of the bucket loop (record_function ranges put around the
    StreamedOptimizer's methods by this script),
  - the top CPU ops and CUDA kernels,
  - host<->device synchronizations: calls of cudaStreamSynchronize, cudaEventSynchronize,
    cudaDeviceSynchronize (and their cu* driver forms) and device-to-pageable copies
    (what .item() / .tolist() / bool() do), per step,
  - codec compute: CUDA time of the codec kernels per step (q8_encode/q8_decode,
    residual_encode/residual_rebuild/scatter_exceptions, checksum_rows/checksum_total),
    and beside it the optimizer math (the fused adamw kernel, or torch's foreach
    kernels), both scaled to 1.34 B params (the 1.34 B GPT of `bench megatron`).

    python3 scripts/profile_step.py --dir /dev/shm [--layers 24] [--configs fp32,q8]
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

import statepager
from statepager.core import (atomic, bucket_step, fused_adamw, late_reads, page_ins, pipeline,
                             residency, resumable)
from statepager.core import pager as pager_module

MiB = 1 << 20
CODEC_KERNELS = ("q8_encode_kernel", "q8_decode_kernel", "residual_encode_kernel",
                 "residual_rebuild_kernel", "scatter_exceptions_kernel", "checksum_rows_kernel",
                 "checksum_total_kernel")
OPTIMIZER_KERNELS = ("adamw_kernel", "multi_tensor_apply", "foreach")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
              "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize")
CONFIGS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "fp32"), "q8": ("q8", "residual")}
# Phases of the bucket loop, as record_function ranges (host time) around these methods.
PHASES = [(pipeline.Pipeline, "advance"), (page_ins.PageIns, "_page_in"),
          (bucket_step.BucketStepper, "step"), (fused_adamw.FusedStep, "step"),
          (fused_adamw.FusedStep, "moment_forms"), (atomic.AtomicStep, "__init__"),
          (atomic.AtomicStep, "take_ahead"), (atomic.AtomicStep, "commit"),
          (late_reads.ExceptionCounts, "read"), (late_reads.ExceptionCounts, "hold"),
          (residency, "decode"), (residency, "encode"), (residency, "release"),
          (page_ins.PageIns, "issue"), (pipeline.Pipeline, "_hold_until_landed"),
          (resumable.ResumableStep, "save"), (resumable.ResumableStep, "stepped"),
          (pager_module.Pager, "page_in"), (pager_module.Pager, "page_in_async"),
          (pager_module.Pager, "page_out_async"), (pager_module.Pager, "discard_async")]
LABEL = "sp::"


def gpt_shapes(layers: int, hidden: int, vocab: int) -> list:
    """The parameter shapes of a GPT (Megatron's: fused qkv, 4x MLP, untied output)."""
    per_layer = [(3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,),
                 (4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,),
                 (hidden,), (hidden,), (hidden,), (hidden,)]
    return [(vocab, hidden)] + per_layer * layers + [(hidden,), (hidden,), (vocab, hidden)]


def instrument() -> None:
    """Host-time ranges around the bucket loop's phases (once)."""
    for cls, name in PHASES:
        fn = getattr(cls, name)  # a phase renamed in the package fails here, loudly

        def wrapped(*a, _fn=fn, _label=f"{LABEL}{cls.__name__}.{name}", **k):
            with record_function(_label):
                return _fn(*a, **k)
        functools.update_wrapper(wrapped, fn)
        setattr(cls, name, wrapped)


def labelled(label: str, fn):
    """fn inside a record_function range named LABEL + label."""
    def wrapped(*a, **k):
        with record_function(LABEL + label):
            return fn(*a, **k)
    return wrapped


def run_config(name: str, args) -> dict:
    moments, mains = CONFIGS[name]
    torch.manual_seed(0)
    shapes = gpt_shapes(args.layers, args.hidden, args.vocab)
    dev = args.device
    model = [torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.02 for s in shapes]
    grads = [torch.randn(s, device=dev) * 1e-3 for s in shapes]
    n = sum(p.numel() for p in model)
    store = tempfile.mkdtemp(prefix=f"profile-{name}-", dir=args.dir)
    counts = collections.Counter()
    try:
        with statepager.Pager(os.path.join(store, "pager"), device=dev) as pager:
            masters, model_of, grad_of = [], {}, {}
            for p, g in zip(model, grads):
                m = pager.empty_like(p, dtype=torch.float32)
                pager.page_in(m)
                m.copy_(p)
                pager.page_out(m)
                model_of[id(m)], grad_of[id(m)] = p, g
                masters.append(m)
            opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01)

            def grads_in(ms):
                for m in ms:
                    m.grad = grad_of[id(m)]

            @torch.no_grad()
            def mains_out(ms):
                for m in ms:
                    model_of[id(m)].copy_(m)

            binding = pager.attach(opt, bucket_size=args.bucket_size, depth=3, moments=moments,
                                   mains=mains, hooks=statepager.Hooks(
                                       before_bucket=labelled("before_bucket", grads_in),
                                       after_bucket=labelled("after_bucket", mains_out),
                                       model_param=lambda m: model_of[id(m)]))
            stepper = bucket_step.BucketStepper
            fused_step, raw_step = fused_adamw.FusedStep.step, stepper._raw_step_bucket
            times, stats = [], []
            sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
            for k in range(args.warmup + args.steps):
                sync()
                t0 = time.perf_counter()
                opt.step()
                sync()
                if k >= args.warmup:
                    times.append(time.perf_counter() - t0)
                    stats.append(binding.last)
            # Which buckets the fused step took, in the profiled step.
            fused_adamw.FusedStep.step = lambda self, b, f: (counts.update(["fused"]),
                                                             fused_step(self, b, f))[1]
            stepper._raw_step_bucket = lambda self, b: (counts.update(["unfused"]),
                                                        raw_step(self, b))[1]
            sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
            with profile(activities=activities) as prof:
                t0 = time.perf_counter()
                opt.step()
                sync()
                profiled = time.perf_counter() - t0
            fused_adamw.FusedStep.step, stepper._raw_step_bucket = fused_step, raw_step
            last = binding.last
            return dict(name=name, n=n, tensors=len(shapes), times=times, stats=stats,
                        profiled=profiled, last=last, prof=prof, counts=counts,
                        buckets=len(binding.buckets))
    finally:
        shutil.rmtree(store, ignore_errors=True)


def ms(us: float) -> str:
    return f"{us / 1e3:9.2f}"


def report(r: dict, scale_to: float, top: int) -> None:
    st, times = r["stats"], r["times"]
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    print(f"\n===== {r['name']}: {r['n'] / 1e9:.3f} B params in {r['tensors']} tensors, "
          f"{r['buckets']} buckets; fused buckets in the profiled step: "
          f"{r['counts']['fused']}, unfused: {r['counts']['unfused']}")
    print(f"step wall (median of {len(times)}): {med(times):.3f} s  "
          f"[{', '.join(f'{t:.3f}' for t in times)}]")
    print(f"pager: step {med([s.seconds for s in st]):.3f} s, compute {med([s.compute_seconds for s in st]):.3f} s, "
          f"stalled on reads {med([s.wait_in_seconds for s in st]):.3f} s, on writes "
          f"{med([s.wait_out_seconds for s in st]):.3f} s; reads busy "
          f"{med([s.read_busy_seconds for s in st]):.3f} s, writes busy "
          f"{med([s.write_busy_seconds for s in st]):.3f} s; read "
          f"{st[-1].bytes_read / 1e9:.2f} GB, written {st[-1].bytes_written / 1e9:.2f} GB")
    last = r["last"]
    print(f"profiled step: wall {r['profiled']:.3f} s (profiler on), pager compute "
          f"{last.compute_seconds:.3f} s")
    events = r["prof"].key_averages()
    # Host time per phase.
    print("host time per phase of the profiled step (record_function ranges; nested "
          "ranges are inside their parents):")
    for e in sorted((e for e in events if e.key.startswith(LABEL)),
                    key=lambda e: -e.cpu_time_total):
        print(f"  {e.key[len(LABEL):]:40s} calls {e.count:6d}  total {ms(e.cpu_time_total)} ms")
    # Syncs and device-to-pageable copies.
    syncs = {e.key: (e.count, e.cpu_time_total) for e in events
             if any(e.key.startswith(s) for s in SYNC_CALLS)}
    print("host<->device synchronizations in the step: " + (", ".join(
        f"{k} x{c} ({ms(t).strip()} ms)" for k, (c, t) in sorted(syncs.items())) or "none"))
    d2h = [(e.key, e.count) for e in events if "DtoH" in e.key or "Device -> Pageable" in e.key]
    print("device-to-host copies: " + (", ".join(f"{k} x{c}" for k, c in d2h) or "none"))
    # Kernels.
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = lambda e: e.self_device_time_total
    codec = sum(device_us(e) for e in kernels if any(k in e.key for k in CODEC_KERNELS))
    math = sum(device_us(e) for e in kernels if any(k in e.key for k in OPTIMIZER_KERNELS)
               and not any(k in e.key for k in CODEC_KERNELS))
    total = sum(device_us(e) for e in kernels)
    scale = scale_to / r["n"]
    print(f"CODEC COMPUTE (CUDA time of the codec kernels: q8 encode/decode, residual "
          f"encode/rebuild/exceptions, checksums) per step: {codec / 1e3:.2f} ms; scaled to "
          f"{scale_to / 1e9:.2f} B params: {codec * scale / 1e3:.2f} ms")
    print(f"optimizer math (fused adamw / torch foreach kernels) per step: {math / 1e3:.2f} ms "
          f"(scaled: {math * scale / 1e3:.2f} ms); all CUDA activity in the step (kernels, "
          f"memsets, copies, the pager's too): {total / 1e3:.2f} ms")
    print(f"top {top} CUDA ops by device time:")
    for e in sorted(kernels, key=lambda e: -device_us(e))[:top]:
        print(f"  {ms(device_us(e))} ms  x{e.count:6d}  {e.key[:110]}")
    print(f"top {top} CPU ops by self host time:")
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {ms(e.self_cpu_time_total)} ms  x{e.count:6d}  {e.key[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="where the stores go (e.g. /dev/shm)")
    p.add_argument("--configs", default="fp32,q8")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bucket-size", type=int, default=256 * MiB)
    p.add_argument("--warmup", type=int, default=2, help="the first step creates the moments")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    args = p.parse_args()
    if args.device == "cuda":
        assert torch.cuda.is_available(), "no CUDA device"
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {name}; kernels built {statepager._C.KERNELS_BUILT}; torch {torch.__version__}")
    instrument()
    results = {}
    for name in args.configs.split(","):
        r = run_config(name, args)
        report(r, 1.34e9, args.top)
        results[name] = r
        del r["prof"]
    if "fp32" in results and "q8" in results:
        f, q = (statistics.median(results[k]["times"]) for k in ("fp32", "q8"))
        print(f"\nq8 step / fp32 step: {q / f:.3f}")


if __name__ == "__main__":
    main()

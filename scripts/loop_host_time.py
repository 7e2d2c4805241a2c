"""The host time a step under the forward costs the training thread, per call of the
bucket loop's phases: a GPT-shaped model (24 layers of layer norms, fused qkv, projection
and 4x MLP, bf16 params), fp32 masters in the pager under torch's AdamW, attached as
the Megatron adapter attaches Megatron's inner optimizer (before_bucket: the fp32 grad;
after_bucket: the bf16 param from the master), binding.overlap_forward(model): each
forward's pre-hooks step the buckets (Note [Steps under the forward] in docs/design.md).

Every call of the phases below is timed (time.perf_counter around it; calls nest, so
a phase's time includes those it calls); it prints, per phase, the calls per step and
the median and total milliseconds per step over the timed steps. On the host backend
(--device cpu) the codecs are the reference ones: compare the pipeline's bookkeeping
there (a bucket's advance less its step, the set-up), not the step's compute.

    python3 scripts/loop_host_time.py --device cpu --dir /dev/shm --page-size 65536
    python3 scripts/loop_host_time.py --device cuda --dir /dev/shm --hidden 2048
"""
from __future__ import annotations

import argparse
import collections
import functools
import shutil
import statistics
import tempfile
import time

import torch

import statepager
from statepager.core import (bucket_step, late_reads, overlap, page_ins, pipeline, residency,
                             resumable, steps)

# (owner, name) of the phases timed: the step's set-up in step(), then the bucket loop.
PHASES = [(steps.Steps, "_defer"), (pipeline.Pipeline, "__init__"), (pipeline.Pipeline, "start"),
          (overlap.ForwardOverlap, "before_reading"), (pipeline.Pipeline, "advance"),
          (bucket_step.BucketStepper, "step"), (resumable.ResumableStep, "save"),
          (resumable, "undo_copies"), (residency, "decode"), (residency, "encode"),
          (residency, "release"), (late_reads.ExceptionCounts, "read"),
          (page_ins.PageIns, "issue"), (pipeline.Pipeline, "_hold_until_landed")]


class Layer(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        x = x + self.proj(self.qkv(self.ln1(x))[..., :self.hidden])
        return x + self.fc2(self.fc1(self.ln2(x)))


def timed(times: dict) -> None:
    """Wraps each phase to append its call's seconds to times[its name]."""
    for owner, name in PHASES:
        fn = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner).rsplit('.', 1)[-1]}.{name}"

        def wrapped(*a, _fn=fn, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                times[_label].append(time.perf_counter() - t0)
        functools.update_wrapper(wrapped, fn)
        setattr(owner, name, wrapped)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="where the store goes (e.g. /dev/shm)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--bucket-size", type=int, default=None,
                   help="bytes (default: about a 26th of the state, as the 1.34 B GPT's)")
    p.add_argument("--page-size", type=int, default=None,
                   help="the Pager's (default: its own; a small model wants small pages)")
    p.add_argument("--moments", default="q8")
    p.add_argument("--mains", default="residual")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    torch.manual_seed(0)
    dev, h = args.device, args.hidden
    model = torch.nn.Sequential(torch.nn.Linear(h, h), *[Layer(h) for _ in range(args.layers)],
                                torch.nn.Linear(h, h)).to(dev, torch.bfloat16)
    x = torch.randn(8, h, device=dev, dtype=torch.bfloat16)
    n = sum(q.numel() for q in model.parameters())
    bucket = args.bucket_size or 16 * n // 26  # fp32 master and moments: ~16 B a param
    store = tempfile.mkdtemp(prefix="loop-host-time-", dir=args.dir)
    times = collections.defaultdict(list)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    try:
        with statepager.Pager(f"{store}/pager", device=dev, page_size=args.page_size) as pager:
            mains, model_of = [], {}
            for q in model.parameters():
                m = pager.empty_like(q.detach(), dtype=torch.float32)
                pager.page_in(m)
                m.copy_(q.detach())
                pager.page_out(m)
                model_of[id(m)] = q
                mains.append(m)

            def grads_in(ms):
                for m in ms:
                    g = model_of[id(m)].grad
                    m.grad = None if g is None else g.float()

            @torch.no_grad()
            def mains_out(ms):
                for m in ms:
                    model_of[id(m)].copy_(m)

            opt = torch.optim.AdamW(mains, lr=1e-3)
            binding = pager.attach(opt, bucket_size=bucket, moments=args.moments,
                                   mains=args.mains, hooks=statepager.Hooks(
                                       before_bucket=grads_in, after_bucket=mains_out,
                                       model_param=lambda m: model_of[id(m)]))
            binding.overlap_forward(model)

            def iteration():
                model.zero_grad(set_to_none=True)
                model(x).float().square().mean().backward()
                opt.step()

            for _ in range(args.warmup):
                iteration()
            model(x)  # the last warm-up step's buckets, so that each forward timed steps one
            sync()
            timed(times)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                iteration()
            model(x)  # the last step's buckets
            sync()
            wall = (time.perf_counter() - t0) / args.steps
            buckets = len(binding.buckets)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    print(f"device {dev}; {n / 1e6:.1f} M params, {buckets} buckets of {bucket / 2**20:.1f} MiB, "
          f"{args.moments} moments, {args.mains} mains; {args.steps} steps: "
          f"{wall * 1e3:.1f} ms per iteration")
    print(f"{'phase':34s} {'calls/step':>10s} {'median ms':>10s} {'ms/step':>9s}")
    for label, ts in times.items():
        print(f"{label:34s} {len(ts) / args.steps:10.1f} {statistics.median(ts) * 1e3:10.3f} "
              f"{sum(ts) / args.steps * 1e3:9.2f}")


if __name__ == "__main__":
    main()

"""python -m statepager bench formats: bytes moved per parameter and step time for each
combination of on-disk formats, with PagedAdamW over a bf16 model, in one run."""
from __future__ import annotations

import os
import time

import torch

from statepager.tools.bench.common import bench_directory
from statepager.tools.bench.report import faster, show, spread
from statepager.core.optim import PagedAdamW
from statepager.core.pager import Pager
from statepager.tools.progress import Progress
from statepager.util.units import MiB

COMBINATIONS = [("fp32", "fp32"), ("fp32", "residual"), ("bf16", "fp32"), ("bf16", "residual"),
                ("q8", "fp32"), ("q8", "residual")]


def _model(n: int, device) -> list[torch.nn.Parameter]:
    g = torch.Generator(device=device).manual_seed(0)
    sizes, left = [], n
    while left > 0:
        sizes.append(min(left, (4 << 20) + len(sizes) % 5 * (1 << 20) + 4097))
        left -= sizes[-1]
    return [torch.nn.Parameter(torch.randn(s, device=device, generator=g).bfloat16())
            for s in sizes]


def bench_formats(args) -> dict:
    device = torch.device(args.device)
    n = args.params
    rows = []
    with Progress("bench formats", phases=len(COMBINATIONS) * args.steps) as bar, \
            bench_directory(args.dir) as work:
        for moments, mains in COMBINATIONS:
            rows.append(_combination(args, work, device, n, moments, mains, bar))
    base = rows[0]
    for r in rows:
        r["bytes_ratio"] = (r["read_per_param"] + r["written_per_param"]) / (
            base["read_per_param"] + base["written_per_param"])
    return {"device": str(device), "params": n, "dir": args.dir, "rows": rows}


def _combination(args, work: str, device, n: int, moments: str, mains: str, bar) -> dict:
    params = _model(n, device)
    for p in params:
        p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3).bfloat16()
    store = os.path.join(work, f"store-{moments}-{mains}")
    with Pager(store, device=device, page_size=2 * MiB) as pager:
        opt = PagedAdamW(params, pager=pager, lr=1e-4, bucket_size=args.bucket_size,
                         moments=moments, mains=mains, fused=True)
        times = []
        for step in range(args.steps):
            bar.phase(f"{moments}/{mains} step {step + 1}/{args.steps}")
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        s = opt.binding.last
    # Step 1 creates the moments: not counted.
    return {"moments": moments, "mains": mains, "step_s": spread(times[1:]),
            "read_per_param": s.bytes_read / n, "written_per_param": s.bytes_written / n}


def print_formats(r: dict) -> None:
    print(f"formats bench: {r['params'] / 1e6:.0f} M params (bf16 model, PagedAdamW) on "
          f"{r['device']}, dir {r['dir']}")
    base = r["rows"][0]["step_s"]["median"]
    print(f"  {'moments':8s} {'mains':9s} {'read B/p':>9s} {'write B/p':>9s} {'bytes':>6s}  "
          "step time; against fp32/fp32")
    for row in r["rows"]:
        print(f"  {row['moments']:8s} {row['mains']:9s} {row['read_per_param']:9.2f} "
              f"{row['written_per_param']:9.2f} {row['bytes_ratio']:6.2f}  "
              f"{show(row['step_s'], 's', 3)}; "
              f"{faster(row['step_s']['median'], base, higher_is_better=False)}")
    print("  (bytes: moved per step as a fraction of fp32/fp32's)")

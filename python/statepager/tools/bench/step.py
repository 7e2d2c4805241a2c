"""python -m statepager bench step: the streamed optimizer step against the floor.

One run measures, side by side on the same directory:
  floor    the least time the step's bytes take through PCIe and through fio
           (statepager.tools.bench.floor); the step is printed as a multiple of it
           (with --host-budget, the host tier's bytes cross PCIe in its floor too, those
           read ahead into it or spilled from it go through fio only, and the state moved
           is compared with that PCIe figure); its bytes are the mean of the timed steps
           (atomic steps with part of the state in the host tier alternate which part);
  paged    AdamW attached to a Pager: pipelined page-in, fused step, page-out; atomic
           (copy-on-write into fresh store ranges, undo copies of unowned params), and
           again with atomic=False (in place) for what all-or-nothing steps cost, and
           whether both end bit-exact (the same parameters, bit for bit);
  sync     the public per-bucket NVMe store's method: per bucket read, step, write, through
           one 256 MiB pinned staging buffer with pread/pwrite (O_DIRECT), no overlap.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import time

import torch

from statepager.tools import trace
from statepager.tools.bench import floor as bench_floor
from statepager.tools.bench.common import bench_directory
from statepager.tools.bench.report import faster, multiple, show, spread
from statepager.core.pager import Pager
from statepager.tools.progress import Progress
from statepager.util.units import MiB

STATE_BYTES = 12  # fp32 main + exp_avg + exp_avg_sq, per parameter, each way
# Counters of Pager.stats() a step moves (bench/floor.py's inputs).
MOVED = ("bytes_read", "bytes_written", "bytes_to_host", "bytes_from_host", "read_ahead_bytes",
         "spilled_bytes", "mapped_read_bytes", "mapped_written_bytes")


def _params(pager: Pager, n: int, device: torch.device, gen_seed: int = 0) -> list:
    """n fp32 masters in the pager (paged out), in tensors of mixed sizes (4-10 M
    elements, so that buckets hold several)."""
    sizes, left, i = [], n, 0
    while left > 0:
        s = min(left, (4 << 20) + (i % 7) * (1 << 20) + 12345)
        sizes.append(s)
        left -= s
        i += 1
    params = [pager.empty(s) for s in sizes]
    g = torch.Generator(device=device).manual_seed(gen_seed)
    for p in params:
        pager.page_in(p)
        p.normal_(generator=g)
        pager.page_out(p)
    return params


def _grads(params, device) -> list:
    g = torch.Generator(device=device).manual_seed(1)
    return [torch.randn(p.shape, device=device, generator=g) * 1e-3 for p in params]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _unowned_params(pager: Pager, n: int, device: torch.device) -> list:
    """The same parameters as _params, as ordinary tensors (the pager holds the moments)."""
    out = []
    for p in _params(pager, n, device):
        pager.page_in(p)
        out.append(p.clone())
        pager.page_out(p)
    return out


def _store_bytes(directory: str) -> int:
    """Apparent size of a store's files (a RAM store may stripe over several)."""
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))


def paged_steps(args, work: str, device, n, bar, atomic: bool = True) -> dict:
    store = os.path.join(work, "store")
    bucket = args.bucket_size
    with Pager(store, device=device, page_size=args.page_size, io_depth=args.io_depth,
               io_block=args.io_block, host_budget=args.host_budget,
               map_ram=not args.no_map_ram) as pager:
        params = (_unowned_params if args.unowned else _params)(pager, n, device)
        grads = _grads(params, device)
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
        binding = pager.attach(opt, bucket_size=bucket, depth=args.depth, atomic=atomic)
        for p, g in zip(params, grads):
            p.grad = g
        times, last = [], None
        moved = {k: 0 for k in MOVED}  # summed over the timed steps
        kind = "paged step" if atomic else "paged step in place"
        total = args.warmup + args.steps
        for step in range(total):
            bar.phase(f"{kind} {step + 1}/{total}")
            _sync(device)
            before = pager.stats()
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            times.append(time.perf_counter() - t0)
            last = binding.last
            after = pager.stats()
            if step >= args.warmup:
                for k in MOVED:
                    moved[k] += after[k] - before[k]
        digest = _digest(pager, params)
        files = trace.write_outputs(last, getattr(args, "trace", None), getattr(args, "plot", None),
                                    f"bench step: {n / 1e9:.2f} B params on {device}, buckets of "
                                    f"{bucket // MiB} MiB x depth {args.depth}, step "
                                    f"{last.step}") if atomic else []
        return {
            "timeline_files": files,
            "first_step_s": times[0],  # reads mains only (moments are ZERO)
            "warmup_s": times[1:args.warmup],
            "step_s": spread(times[args.warmup:]),
            "step_mean_s": sum(times[args.warmup:]) / args.steps,
            # Per timed step, on average: with part of the state in the host tier, atomic
            # steps alternate which part (each kept bucket needs room for two copies).
            # read_ahead_bytes are of bytes_read (store -> host tier), spilled_bytes of
            # bytes_written (host tier -> store).
            **{k: v // args.steps for k, v in moved.items()},
            "digest": digest,
            "host_budget": args.host_budget,
            "buckets": last.buckets,
            "overlap": last.overlap,
            "read_busy_s": last.read_busy_seconds,
            "write_busy_s": last.write_busy_seconds,
            "wait_in_s": last.wait_in_seconds,
            "wait_out_s": last.wait_out_seconds,
            "compute_s": last.compute_seconds,
            "peak_mapped_bytes": last.peak_mapped_bytes,
            "bound_bytes": args.depth * (max(b.nbytes for b in binding.buckets) + 2 * args.page_size),
            "direct_io": pager.stats()["direct_io"],
            "io_depth": pager.stats()["io_depth"],
            "io_block": pager.stats()["io_block"],
            "store_bytes": _store_bytes(os.path.join(store, binding.name)),
        }


def _digest(pager: Pager, params: list) -> list:
    """Two int64 sums per parameter over its bits: steps that differ in any bit of a
    parameter (in practice) differ here."""
    out = []
    for p in params:
        pager.page_in(p)
        bits = p.detach().view(torch.int32)
        out.append([int(bits.sum(dtype=torch.int64)), int(bits[1::2].sum(dtype=torch.int64))])
        pager.page_out(p)
    return out


def _pinned(nbytes: int, device) -> torch.Tensor:
    """Page-aligned host memory (pinned when the device is a GPU), for O_DIRECT."""
    buf = mmap.mmap(-1, nbytes)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t._statepager_mmap = buf
    if device.type == "cuda":
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        assert err == 0, f"cudaHostRegister failed: {err}"
    return t


def _io(fd: int, t: torch.Tensor, nbytes: int, offset: int, write: bool) -> None:
    view = memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        chunk = view[done:]
        n = os.pwrite(fd, chunk, offset + done) if write else os.preadv(fd, [chunk], offset + done)
        if n <= 0:
            raise OSError(f"short {'write' if write else 'read'} at {offset + done}")
        done += n


def sync_steps(args, work: str, device, n, bar) -> dict:
    """The public per-bucket store, reproduced: each bucket a [main | m | v] range of one
    file; step = for each bucket: pread -> H2D, fused AdamW, D2H -> pwrite; no overlap."""
    staging_bytes = 256 * MiB
    bucket_numel = max(1, args.bucket_size // STATE_BYTES) // 1024 * 1024
    path = os.path.join(work, "sync-baseline.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0))
    staging = _pinned(staging_bytes, device)
    try:
        buckets = [(s, min(bucket_numel, n - s)) for s in range(0, n, bucket_numel)]
        dev_buf = torch.empty(3 * bucket_numel, dtype=torch.float32, device=device)
        grad = torch.randn(bucket_numel, device=device) * 1e-3
        step_t = torch.zeros((), dtype=torch.float32, device=device)

        def move(nbytes: int, offset: int, write: bool) -> None:
            raw = dev_buf.view(torch.uint8)
            for at in range(0, nbytes, staging_bytes):
                k = min(staging_bytes, nbytes - at)
                k_io = (k + 4095) // 4096 * 4096
                if write:
                    staging[:k].copy_(raw[at:at + k])
                    _sync(device)
                    _io(fd, staging, k_io, offset + at, True)
                else:
                    _io(fd, staging, k_io, offset + at, False)
                    raw[at:at + k].copy_(staging[:k])
                    _sync(device)

        def bucket_offset(i: int) -> int:
            return i * ((3 * bucket_numel * 4 + 4095) // 4096 * 4096)

        os.ftruncate(fd, bucket_offset(len(buckets)))
        for i, (_, k) in enumerate(buckets):  # initial state on disk
            dev_buf.normal_()
            move(3 * k * 4, bucket_offset(i), True)
        times = []
        for step in range(args.steps):
            bar.phase(f"synchronous baseline step {step + 1}/{args.steps}")
            _sync(device)
            t0 = time.perf_counter()
            for i, (_, k) in enumerate(buckets):
                move(3 * k * 4, bucket_offset(i), False)
                main, m, v = dev_buf[:k], dev_buf[k:2 * k], dev_buf[2 * k:3 * k]
                step_t.add_(1)
                torch._fused_adamw_([main], [grad[:k]], [m], [v], [], [step_t], lr=1e-4,
                                    beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                                    amsgrad=False, maximize=False)
                move(3 * k * 4, bucket_offset(i), True)
            _sync(device)
            times.append(time.perf_counter() - t0)
        return {"step_s": spread(times), "buckets": len(buckets)}
    finally:
        os.close(fd)
        os.remove(path)


def bench_step(args) -> dict:
    with bench_directory(args.dir) as work:
        return _bench_step(args, work)


def _bench_step(args, work: str) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    n = args.params
    state = (STATE_BYTES - 4 if args.unowned else STATE_BYTES) * n  # read and written
    phases = ((args.warmup + args.steps) * (1 if args.no_in_place else 2) + 1 +
              (0 if args.no_baseline else args.steps))
    with Progress("bench step", phases) as bar:
        paged = paged_steps(args, work, device, n, bar)
        in_place = (None if args.no_in_place
                    else paged_steps(args, work, device, n, bar, atomic=False))
        bar.phase("floor: PCIe and fio")
        # The store's bytes through fio; PCIe carries the host tier's bytes and the store's
        # but those that moved between the store and the host tier (read-ahead, spills).
        floor = bench_floor.measure(work, device, paged["bytes_read"], paged["bytes_written"],
                                    block=paged["io_block"], depth=paged["io_depth"],
                                    direct=paged["direct_io"], jobs=args.fio_jobs,
                                    host_in=paged["bytes_from_host"] - paged["read_ahead_bytes"],
                                    host_out=paged["bytes_to_host"] - paged["spilled_bytes"],
                                    mapped_in=paged["mapped_read_bytes"],
                                    mapped_out=paged["mapped_written_bytes"])
        sync = None if args.no_baseline else sync_steps(args, work, device, n, bar)
    # Bytes over PCIe: read-ahead and spilled bytes cross it as host-tier bytes only.
    moved = (paged["bytes_read"] - paged["read_ahead_bytes"] + paged["bytes_written"] -
             paged["spilled_bytes"] + paged["bytes_to_host"] + paged["bytes_from_host"])
    result = {
        "device": str(device), "params": n, "unowned": args.unowned, "state_bytes": state,
        "dir": args.dir,
        "bucket_size": args.bucket_size, "depth": args.depth,
        "floor": floor, "floor_s": floor["seconds"], "paged": paged,
        "paged_gbps": moved / paged["step_s"]["median"] / 1e9,
    }
    if in_place is not None:
        result["in_place"] = in_place
        result["bit_exact"] = result["data_intact"] = in_place["digest"] == paged["digest"]
    if sync is not None:
        result["sync"] = sync
    return result


def print_step(r: dict) -> None:
    p = r["paged"]
    step = p["step_s"]["median"]
    print(f"step bench: {r['params'] / 1e9:.2f} B params "
          f"{'(ordinary tensors; moments paged) ' if r['unowned'] else ''}on {r['device']}, "
          f"{r['state_bytes'] / 1e9:.1f} GB of state each way, dir {r['dir']}, "
          f"buckets of {r['bucket_size'] // MiB} MiB x depth {r['depth']}, "
          f"direct_io={p['direct_io']}, io {p['io_depth']} x {p['io_block'] // MiB} MiB")
    for line in bench_floor.describe(r["floor"]):
        print("  " + line)
    if p["timeline_files"]:
        print(f"  last paged step's timeline: {', '.join(p['timeline_files'])}")
    print(f"  paged step: {show(p['step_s'], 's', 3)} = "
          f"{multiple(step, r['floor_s'], 'the floor')}; "
          f"{r['paged_gbps']:.2f} GB/s of state moved (read {p['bytes_read'] / 1e9:.1f} GB + "
          f"write {p['bytes_written'] / 1e9:.1f} GB); untimed: first step "
          f"{p['first_step_s']:.3f} s (reads the mains only)"
          + "".join(f", {t:.3f} s" for t in p["warmup_s"]))
    if p["mapped_read_bytes"] or p["mapped_written_bytes"]:
        print(f"    through the mapped store files (map_ram): {p['mapped_read_bytes'] / 1e9:.2f} "
              f"GB of the read and {p['mapped_written_bytes'] / 1e9:.2f} GB of the written "
              "per step")
    print(f"    last step: reads busy {p['read_busy_s']:.3f} s, writes busy "
          f"{p['write_busy_s']:.3f} s, overlap {100 * p['overlap']:.0f}%; stalled on reads "
          f"{p['wait_in_s']:.3f} s, for writes {p['wait_out_s']:.3f} s, compute "
          f"{p['compute_s']:.3f} s, peak mapped {p['peak_mapped_bytes'] / MiB:.0f} MiB "
          f"(bound {p['bound_bytes'] / MiB:.0f})")
    if p["host_budget"]:
        line = (f"  host tier ({p['host_budget'] / 1e9:.1f} GB): per step (mean) "
                f"{p['bytes_from_host'] / 1e9:.2f} GB from host + "
                f"{p['bytes_to_host'] / 1e9:.2f} GB to host; store "
                f"{p['bytes_read'] / 1e9:.2f} GB read ({p['read_ahead_bytes'] / 1e9:.2f} read "
                f"ahead into the host tier) + {p['bytes_written'] / 1e9:.2f} GB written "
                f"({p['spilled_bytes'] / 1e9:.2f} spilled from it); state moved over PCIe "
                f"{r['paged_gbps']:.2f} GB/s")
        pcie = r["floor"]["pcie"]
        if pcie is not None:  # the same bytes each way, pinned, two streams, this run
            both = pcie["h2d_gbps"] + pcie["d2h_gbps"]
            line += (f" vs concurrent PCIe {both:.2f} GB/s (the floor's copies):"
                     f" {100 * r['paged_gbps'] / both:.0f}%")
        print(line)
        if p["bytes_read"] + p["bytes_written"] and r["floor_s"]:
            # Part of the state in the store: atomic steps alternate which part, so the
            # bytes (and the floor) are of the timed steps' mean.
            k = p["step_mean_s"] / r["floor_s"]
            print(f"  host tier holding part of the state: mean step {k:.2f} x the floor of "
                  f"the mean step's bytes (set by {r['floor']['bound_by']})")
    if "bit_exact" in r:
        print(f"  atomic and in-place steps bit-exact: {r['bit_exact']}")
    if "in_place" in r:
        q = r["in_place"]
        print(f"  in place (atomic=False): {show(q['step_s'], 's', 3)}: atomic steps are "
              f"{faster(step, q['step_s']['median'], higher_is_better=False)}; written per "
              f"step {p['bytes_written'] / 1e9:.2f} vs {q['bytes_written'] / 1e9:.2f} GB, store "
              f"{p['store_bytes'] / 1e9:.2f} vs {q['store_bytes'] / 1e9:.2f} GB")
    if "sync" in r:
        sync = r["sync"]["step_s"]
        print(f"  synchronous per-bucket baseline: {show(sync, 's', 3)}: paged is "
              f"{faster(step, sync['median'], higher_is_better=False)}")

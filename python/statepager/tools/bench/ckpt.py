"""python -m statepager bench ckpt: checkpoint save and load beside the raw disk.

Builds SIZE bytes of AdamW state in a Pager (fp32 parameters the pager owns and their two
moments, attached through a plain torch AdamW) and steps once, so that all of it is at
rest in the store. Then, from one run, on the same directory:
  raw    the directory's sequential read and write bandwidth (the store's io_uring loop)
         and the copy of a SIZE-byte file by the means a save uses (backing/file_copy.h);
  save   statepager.checkpoint.save() right after a step: GB/s of state and the copy
         method, with the crc32c computed while copying, the store's files dropped from
         the page cache first;
  async  save(background=True) with steps running until it is done: the seconds training
         was blocked (the call, plus what steps took beyond a step without a save) against
         the save's total;
  load   statepager.checkpoint.load() (checksums verified, then ranges copied into the
         store), with the checkpoint's files dropped from the page cache first; the state
         is compared with what was saved.
Save, load and the file copy are measured in REPEAT rounds, each reported as the median
with its range: on the VMs we measure on, the same copy varies severalfold from run to run.
"""
from __future__ import annotations

import os
import shutil
import time

import torch

from statepager import checkpoint
from statepager import _C
from statepager.tools.bench.common import bench_directory
from statepager.tools.bench.report import faster, show, spread
from statepager.core.pager import Pager
from statepager.tools.progress import Progress
from statepager.util.units import GiB, MiB

_TENSOR = 64 * MiB  # bytes per parameter tensor


def _drop_cache(files) -> None:
    """Drops the files' pages from the page cache, so they are read from the disk, and
    waits for every write the system still has pending (os.sync): the timed copy that
    follows starts on a quiet disk, not under the write-back of what came before it."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    os.sync()


def _files(directory: str) -> list:
    return [os.path.join(root, n) for root, _, names in os.walk(directory) for n in names]


def _raw_copy(work: str, size: int) -> dict:
    src, dst = os.path.join(work, "raw-src"), os.path.join(work, "raw-dst")
    block = os.urandom(MiB) * 64
    with open(src, "wb") as f:
        for left in range(size, 0, -len(block)):
            f.write(block[:left])
    _drop_cache([src])
    t0 = time.perf_counter()
    method = _C.copy_file(src, dst)
    seconds = time.perf_counter() - t0
    os.remove(src)
    os.remove(dst)
    return {"raw_copy_gbps": size / seconds / 1e9, "raw_copy_method": method}


def _fingerprint(binding) -> list:
    out = []
    for b in binding.stored_in_buckets():
        out += [float(t.detach().view(-1)[:: 4097].double().sum()) for t in b.stored]
    return out


def bench_ckpt(args) -> dict:
    with bench_directory(args.dir) as work, \
            Progress("bench ckpt", phases=3 + 3 * args.repeat) as bar:
        return _run(args, args.size, work, bar)


def _run(args, size: int, work: str, bar) -> dict:
    result = {"device": args.device, "dir": args.dir, "size_bytes": size, "repeat": args.repeat}
    bar.phase("raw read and write")
    raw_r = _C.measure_raw_io(work, size, MiB, 32, True, False)
    raw_w = _C.measure_raw_io(work, size, MiB, 32, False, True)
    result.update(raw_read_gbps=raw_r["read_gbps"], raw_write_gbps=raw_w["write_gbps"])

    bar.phase("building the state")
    with Pager(os.path.join(work, "store"), device=args.device) as pager:
        # Parameters of _TENSOR bytes (the last one shorter): a third of SIZE, moments the rest.
        numels, left = [], size // 3 // 4
        while left > 0:
            numels.append(min(left, _TENSOR // 4))
            left -= numels[-1]
        params = [pager.empty(n) for n in numels]
        for i, p in enumerate(params):
            pager.page_in(p)
            p.uniform_(-1, 1)
            pager.page_out(p)
            p.requires_grad_(True)
            p.grad = torch.full_like(p, 1e-3 * (i + 1), device=pager.device)
        opt = torch.optim.AdamW(params, lr=1e-3)
        binding = pager.attach(opt, bucket_size=args.bucket_size)

        def step() -> float:
            t0 = time.perf_counter()
            opt.step()
            if pager.device.type == "cuda":
                torch.cuda.synchronize(pager.device)
            return time.perf_counter() - t0

        step()  # the moments exist from here on: everything is at rest in the store
        step_alone = min(step(), step())
        result.update(tensors=sum(len(b.stored) for b in binding.buckets),
                      buckets=len(binding.buckets), params=sum(numels),
                      direct_io=pager.stats()["direct_io"], step_seconds=step_alone)

        # Rounds after a step each, as saves come in training (the store just written);
        # the raw copy beside them.
        ckpt, intact, rounds = os.path.join(work, "ckpt"), True, []
        store_files = _files(pager.directory)
        # One untimed save first: the first save after the state was built pays one-off
        # costs (0.4-1 s on a virtio disk) that are no save's of a training run.
        _drop_cache(store_files)
        checkpoint.save(pager, ckpt + "-warm")
        shutil.rmtree(ckpt + "-warm")
        for r in range(args.repeat):
            round_ = f"round {r + 1}/{args.repeat}"
            bar.phase(f"{round_}: file copy")
            step()
            raw = _raw_copy(work, size)
            bar.phase(f"{round_}: save")
            saved = _fingerprint(binding)
            _drop_cache(store_files)  # the copy reads the store from the disk
            h = checkpoint.save(pager, ckpt)
            bar.phase(f"{round_}: load")
            _drop_cache(_files(ckpt))
            t0 = time.perf_counter()
            checkpoint.load(pager, ckpt)
            rounds.append((raw, h, time.perf_counter() - t0))
            intact &= _fingerprint(binding) == saved
            shutil.rmtree(ckpt)
        nbytes = rounds[0][1].bytes
        result.update(
            raw_copy_gbps=spread(x[0]["raw_copy_gbps"] for x in rounds),
            raw_copy_method=rounds[0][0]["raw_copy_method"],
            save_gbps=spread(nbytes / x[1].seconds / 1e9 for x in rounds),
            method=rounds[0][1].method, state_bytes=nbytes,
            save_seconds=spread(x[1].seconds for x in rounds),
            save_copy_seconds=spread(x[1].copy_seconds for x in rounds),
            crc32c_engine=_C.CRC32C_ENGINE,
            load_gbps=spread(nbytes / x[2] / 1e9 for x in rounds),
            load_seconds=spread(x[2] for x in rounds), data_intact=intact)

        bar.phase("background save while stepping")
        held = pager.stats()["buckets_held"]
        a = checkpoint.save(pager, ckpt, background=True)
        stepped = []
        while not a.done() or not stepped:
            stepped.append(step())
        a.wait()
        result.update(async_seconds=a.seconds, async_call_seconds=a.call_seconds,
                      async_copy_seconds=a.copy_seconds, async_steps=len(stepped),
                      async_blocked_seconds=a.call_seconds + sum(max(0.0, s - step_alone)
                                                                 for s in stepped),
                      async_held_page_outs=pager.stats()["buckets_held"] - held)
    return result


def print_ckpt(r: dict) -> None:
    print(f"ckpt bench: {r['state_bytes'] / GiB:.2f} GiB of AdamW state ({r['params'] / 1e6:.0f} M "
          f"params, {r['tensors']} tensors, {r['buckets']} buckets) on {r['device']}, dir "
          f"{r['dir']}, direct_io={r['direct_io']}")
    print(f"  raw          read {r['raw_read_gbps']:6.2f} GB/s, write {r['raw_write_gbps']:6.2f} "
          f"GB/s (1 run each)")
    print(f"  file copy    {show(r['raw_copy_gbps'], 'GB/s')} ({r['raw_copy_method']})")
    save = r["save_gbps"]
    versus = ("" if r["raw_copy_method"] == "reflink"  # a reflinked file copy moves no bytes
              else f": {faster(save['median'], r['raw_copy_gbps']['median'], higher_is_better=True)}"
                   " than the file copy")
    print(f"  save         {show(save, 'GB/s')}{versus} ({r['method']}, crc32c by "
          f"{r['crc32c_engine']} in the same pass; median copy "
          f"{r['save_copy_seconds']['median']:.2f} s of {r['save_seconds']['median']:.2f} s)")
    print(f"  load         {show(r['load_gbps'], 'GB/s')} (checksums, then copy into the store; "
          f"checkpoint not in the page cache)")
    print(f"  async save   (1 run) training blocked {r['async_blocked_seconds']:.3f} s of the "
          f"save's {r['async_seconds']:.2f} s (call {r['async_call_seconds']:.3f} s; "
          f"{r['async_steps']} steps ran during it, {r['step_seconds']:.2f} s each without a "
          f"save; {r['async_held_page_outs']} page-outs waited for the copy)")
    print(f"  (save, load and file copy over {r['repeat']} rounds, each after a step; data "
          f"intact after every save and load: {r['data_intact']})")

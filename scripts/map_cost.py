"""What mapping a bucket costs: cuMemMap + cuMemSetAccess and cuMemUnmap per physical page,
for a 192 MiB bucket made of pages of PAGE_MIB (ctypes on libcuda, no statepager), first
with the device idle and while other work runs on a side stream (a device-to-host copy of
COPY_MIB, a host-to-device copy, kernels), then per-page against one cuMemSetAccess.

    python3 scripts/map_cost.py 2     # MiB per page; try 2 8 32 64 192
    COPY_MIB=200 python3 scripts/map_cost.py 32

What it decided, and the figures it gives on an H200: Note [Mapping costs per call, not
per byte] in docs/design.md, and docs/benchmarks.md.
"""
import ctypes
import os
import sys
import time

import torch

BUCKET = 192 << 20
COPY = int(os.environ.get("COPY_MIB", "2048")) << 20  # the copy in flight in "busy" runs
DEVICE, READ_WRITE, PINNED = 1, 3, 1  # CU_MEM_LOCATION_TYPE_DEVICE, ..._PROT_READWRITE, ...


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed: CUresult {result}")


def main(page_mib: int) -> None:
    torch.zeros(1, device="cuda")  # the primary context, current
    cu = ctypes.CDLL("libcuda.so.1")
    page, count = page_mib << 20, BUCKET // (page_mib << 20)
    prop = AllocationProp(type=PINNED, location=Location(DEVICE, 0))
    access = AccessDesc(Location(DEVICE, 0), READ_WRITE)
    handles = []
    for _ in range(count):
        h = ctypes.c_ulonglong()
        check(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(page), ctypes.byref(prop),
                             ctypes.c_ulonglong(0)), "cuMemCreate")
        handles.append(h)
    base = ctypes.c_ulonglong()
    check(cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(BUCKET), ctypes.c_size_t(0),
                                 ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)),
          "cuMemAddressReserve")

    def set_access(addr: int, nbytes: int) -> None:
        check(cu.cuMemSetAccess(ctypes.c_ulonglong(addr), ctypes.c_size_t(nbytes),
                                ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")

    def map_pages(access_per_page: bool) -> None:
        for i, h in enumerate(handles):
            addr = base.value + i * page
            check(cu.cuMemMap(ctypes.c_ulonglong(addr), ctypes.c_size_t(page), ctypes.c_size_t(0),
                              h, ctypes.c_ulonglong(0)), "cuMemMap")
            if access_per_page:
                set_access(addr, page)

    def unmap_pages() -> None:
        for i in range(count):
            check(cu.cuMemUnmap(ctypes.c_ulonglong(base.value + i * page), ctypes.c_size_t(page)),
                  "cuMemUnmap")

    def busy(kind: str):
        """Starts a copy of COPY bytes on a side stream (kind 'd2h', 'h2d' or a kernel,
        'kernel'), returns the event that marks its end."""
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            if kind == "d2h":
                host_buf.copy_(dev_buf, non_blocking=True)
            elif kind == "h2d":
                dev_buf.copy_(host_buf, non_blocking=True)
            else:
                for _ in range(40):
                    dev_buf.view(torch.float32).mul_(1.0000001)
        done = torch.cuda.Event(enable_timing=False)
        done.record(side)
        return done

    dev_buf = torch.empty(COPY, dtype=torch.uint8, device="cuda")
    host_buf = torch.empty(COPY, dtype=torch.uint8, pin_memory=True)
    for work in ("idle", "d2h", "h2d", "kernel", "idle"):
        torch.cuda.synchronize()
        t_busy = time.perf_counter()
        done = None if work == "idle" else busy(work)
        t0 = time.perf_counter()
        map_pages(access_per_page=False)
        tm = time.perf_counter()
        set_access(base.value, BUCKET)
        t1 = time.perf_counter()
        unmap_pages()
        t2 = time.perf_counter()
        pending = done is not None and not done.query()
        if done is not None:
            done.synchronize()
        t3 = time.perf_counter()
        print(f"{page_mib} MiB pages, device {work:6}: map {(tm - t0) * 1e3:7.2f} + access "
              f"{(t1 - tm) * 1e3:7.2f} ms, unmap "
              f"{(t2 - t1) * 1e3:7.2f} ms for the bucket; the work took {(t3 - t_busy) * 1e3:7.2f}"
              f" ms, {'still running' if pending else 'done'} after the unmap")
    for one_access in (False, True, False, True):
        t0 = time.perf_counter()
        map_pages(access_per_page=not one_access)
        if one_access:
            set_access(base.value, BUCKET)
        t1 = time.perf_counter()
        unmap_pages()
        t2 = time.perf_counter()
        how = "one cuMemSetAccess per bucket" if one_access else "cuMemSetAccess per page  "
        print(f"{page_mib} MiB pages, {how}: map {(t1 - t0) * 1e6 / count:6.1f} us/page, unmap "
              f"{(t2 - t1) * 1e6 / count:6.1f} us/page; the 192 MiB bucket "
              f"{(t2 - t0) * 1e3:.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)

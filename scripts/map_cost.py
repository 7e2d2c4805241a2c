"""What mapping a bucket costs: cuMemMap + cuMemSetAccess and cuMemUnmap per physical page,
for a 192 MiB bucket made of pages of PAGE_MIB (ctypes on libcuda, no statepager).

    python3 scripts/map_cost.py 2     # MiB per page; try 2 8 32 64

On the H200 (2026-12-01) each call costs about the same whatever the page's size (map
25-45 us, unmap 15-23 us), so 2 MiB pages cost a 192 MiB bucket 4-7 ms of map and unmap,
32 MiB pages (the Pager's default) 0.26 ms; one cuMemSetAccess over the whole run instead
of one per page saves little (5.2-5.3 against 5.3-6.7 ms at 2 MiB).
"""
import ctypes
import sys
import time

import torch

BUCKET = 192 << 20
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

    for one_access in (False, True, False, True):
        t0 = time.perf_counter()
        for i, h in enumerate(handles):
            addr = base.value + i * page
            check(cu.cuMemMap(ctypes.c_ulonglong(addr), ctypes.c_size_t(page), ctypes.c_size_t(0),
                              h, ctypes.c_ulonglong(0)), "cuMemMap")
            if not one_access:
                set_access(addr, page)
        if one_access:
            set_access(base.value, BUCKET)
        t1 = time.perf_counter()
        for i in range(count):
            check(cu.cuMemUnmap(ctypes.c_ulonglong(base.value + i * page), ctypes.c_size_t(page)),
                  "cuMemUnmap")
        t2 = time.perf_counter()
        how = "one cuMemSetAccess per bucket" if one_access else "cuMemSetAccess per page  "
        print(f"{page_mib} MiB pages, {how}: map {(t1 - t0) * 1e6 / count:6.1f} us/page, unmap "
              f"{(t2 - t1) * 1e6 / count:6.1f} us/page; the 192 MiB bucket "
              f"{(t2 - t0) * 1e3:.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)

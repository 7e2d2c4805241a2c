"""A checkpoint's checksums: crc32c of each CHUNK bytes of
each tensor's data, computed while copying (allocator/store_snapshot.h) or by reading the
files back on several threads (sums_of), and checked against the manifest (verify,
verify_data)."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from statepager import _C
from statepager.checkpoint import dirs as checkpoint_dirs
from statepager.checkpoint.manifest import CHECKSUM, CHUNK, DataFile

_READ = 4 << 20       # bytes per read while checksumming


def sums_of(ranges: list) -> list:
    """The crc32c of each CHUNK bytes of each (path, offset, nbytes) range: one list per
    range. The chunks are read and summed on several threads (the sums and reads release
    the GIL)."""
    chunks = [(i, path, offset + k, min(CHUNK, n - k))
              for i, (path, offset, n) in enumerate(ranges) for k in range(0, n, CHUNK)]
    fds = {}
    local = threading.local()

    def crc(chunk) -> int:
        _, path, offset, left = chunk
        if not hasattr(local, "buf"):
            local.buf = memoryview(bytearray(_READ))
        value = 0
        while left:
            got = os.preadv(fds[path], [local.buf[:min(left, _READ)]], offset)
            if got == 0:
                raise _C.CorruptStoreError(f"{path} ends at byte {offset}, before its data "
                                           "does: the checkpoint is truncated")
            value = _C.crc32c(local.buf[:got], value)
            offset += got
            left -= got
        return value

    try:
        for path in {r[0] for r in ranges}:
            fds[path] = checkpoint_dirs.open_file(path)
        # Disks need several reads in flight even where cores are few.
        threads = max(1, min(len(chunks), 16, max(4, os.cpu_count() or 1)))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            values = list(pool.map(crc, chunks))
    finally:
        for fd in fds.values():
            os.close(fd)
    out = [[] for _ in ranges]
    for (i, *_), v in zip(chunks, values):
        out[i].append(v)
    return out


def verify(path: str, manifest: dict) -> None:
    """Every tensor's bytes in checkpoint `path` against the checksums in its manifest
    (read_manifest), with the data files' places and ranges checked as a load checks them:
    CorruptStoreError naming the first that fails."""
    verify_data([DataFile(entry, path) for entry in manifest["optimizers"]])


def verify_data(data: list) -> None:
    """Every tensor's bytes against its checksums (data: manifest.DataFile per optimizer)."""
    ranges = [(d.path, offset, nbytes) for d in data for offset, nbytes, *_ in d.ranges]
    owners = [(d, r) for d in data for r in d.ranges]
    for (path, *_), (d, (offset, nbytes, crcs, param, name)), found in zip(
            ranges, owners, sums_of(ranges)):
        if found == crcs:
            continue
        k = next((k for k, (a, b) in enumerate(zip(found, crcs)) if a != b),
                 min(len(found), len(crcs)))
        at = offset + k * CHUNK
        raise _C.CorruptStoreError(
            f"{path}: optimizer {d.name!r} parameter {param} {name} fails its checksum in "
            f"bytes {at}..{min(at + CHUNK, offset + nbytes)} (chunk {k}: {CHECKSUM} "
            f"{found[k:k + 1]}, the manifest records {crcs[k:k + 1]}): the checkpoint is "
            "corrupt; nothing was loaded")

"""What shows a read wrote nothing to a store: store_files(pager), every file of its
directory with its bytes' digest and modification time, and writes(pager), the stats()
counters of its writes (to the store files and to the host tier); and
file_size_limit(nbytes), under which writes past nbytes fail (EFBIG, as on a full disk);
flip_store_bytes(directory), which changes the store's bytes as another process writing
into its files would; and changed_store_is_refused(pager, model, opt, train), which shows
a trained pager refusing them, changing nothing, and going on once they are back."""
import contextlib
import hashlib
import os
import resource

import pytest
import torch

import statepager
from compare import same

WRITES = ("bytes_written", "write_requests", "bytes_to_host", "spills")


def store_files(pager):
    """Every file of the store directory: its bytes' digest and modification time."""
    out = {}
    for d, _, names in os.walk(pager.directory):
        for n in names:
            path = os.path.join(d, n)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            out[path] = (digest, os.stat(path).st_mtime_ns)
    return out


def writes(pager):
    s = pager.stats()
    return {k: s[k] for k in WRITES}


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """RLIMIT_FSIZE: writes past nbytes fail with EFBIG (NoSpaceError); the Pager ignores
    SIGXFSZ, so the process lives on."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def flip_store_bytes(directory):
    """Flips one byte in every 4 KiB block past the first of every store file, as another
    process writing into them would; returns what puts them back."""
    saved = {}
    for d, _, names in os.walk(directory):
        for n in names:
            path = os.path.join(d, n)
            with open(path, "r+b") as f:
                data = f.read()
                if len(data) <= 4096:
                    continue
                saved[path] = data
                changed = bytearray(data)
                for at in range(4096 + 100, len(changed), 4096):
                    changed[at] ^= 0x5A
                f.seek(0)
                f.write(changed)

    def restore():
        for path, data in saved.items():
            with open(path, "r+b") as f:
                f.write(data)
    assert saved, "no store file holds paged-out bytes"
    return restore


def changed_store_is_refused(pager, model, opt, train):
    """After train(model, opt, 0, 2): with the store's bytes flipped, opt.state_dict() and
    the next step raise CorruptStoreError naming a file and offset and change no parameter
    and no counter; with them back, the state is as it was and steps go on."""
    state = opt.state_dict()
    weights = [p.detach().clone() for p in model.parameters()]
    counted = pager.stats()
    restore = flip_store_bytes(pager.directory)
    with pytest.raises(statepager.CorruptStoreError, match=r"store file .* offset \d+"):
        opt.state_dict()
    with pytest.raises(statepager.CorruptStoreError, match=r"store file .* offset \d+"):
        train(model, opt, 2, 1)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    for k in ("bytes_written", "bytes_read", "buckets_in", "buckets_out"):
        assert pager.stats()[k] == counted[k], k
    restore()
    assert same(opt.state_dict(), state)
    train(model, opt, 2, 1)

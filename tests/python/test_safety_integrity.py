"""Bytes of the store changed from outside under a live pager (another process writing
into its files between a page-out and the next page-in) are refused: every range a
page-out writes is checksummed (crc32c), and a page-in that reads back other bytes fails
with statepager.CorruptStoreError naming the file and offset, before anything changes.
opt.state_dict() and the next step both refuse; with the bytes put back, the state and
the parameters are as before. On a disk store and on a RAM store that is not mapped (a
mapped RAM store's copies pass through no buffer of ours: not checked)."""
import os

import pytest
import torch

import statepager
from statepager import Pager

from compare import same

KiB, MiB = 1 << 10, 1 << 20


def model_of():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(37, 600), torch.nn.GELU(),
                               torch.nn.Linear(600, 600), torch.nn.Linear(600, 7))


def train(model, opt, first, count):
    for i in range(first, first + count):
        x = torch.randn(8, 37, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


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


@pytest.fixture(params=["disk", "ram"])
def root(request, tmp_path, shm_dir):
    return str(tmp_path) if request.param == "disk" else shm_dir


def test_changed_store_bytes_are_refused(root):
    pager = Pager(os.path.join(root, "store"), page_size=64 * KiB, hbm_budget=16 * MiB,
                  keep=16 * MiB, map_ram=False)
    with pager:
        model = model_of()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        pager.attach(opt, bucket_size=256 * KiB)
        train(model, opt, 0, 2)
        state = opt.state_dict()
        weights = [p.detach().clone() for p in model.parameters()]
        stats = pager.stats()
        restore = flip_store_bytes(pager.directory)
        with pytest.raises(statepager.CorruptStoreError, match=r"store file .* offset \d+"):
            opt.state_dict()
        with pytest.raises(statepager.CorruptStoreError, match=r"store file .* offset \d+"):
            train(model, opt, 2, 1)
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
        for k in ("bytes_written", "bytes_read", "buckets_in", "buckets_out"):
            assert pager.stats()[k] == stats[k], k
        restore()
        assert same(opt.state_dict(), state)
        train(model, opt, 2, 1)  # steps go on from the state as it was

"""Bytes of the store changed from outside under a live pager (another process writing
into its files between a page-out and the next page-in) are refused: every range a
page-out writes is checksummed (crc32c), and a page-in that reads back other bytes fails
with statepager.CorruptStoreError naming the file and offset, before anything changes.
opt.state_dict() and the next step both refuse; with the bytes put back, the state and
the parameters are as before. On a disk store, a RAM store read through io_uring and a
RAM store mapped for the device's copies (map_ram)."""
import os

import pytest
import torch

from statepager import Pager

from store_writes import changed_store_is_refused

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


@pytest.fixture(params=["disk", "ram", "mapped-ram"])
def store(request, tmp_path, shm_dir):
    """(the store's root, map_ram)"""
    return (str(tmp_path) if request.param == "disk" else shm_dir,
            request.param == "mapped-ram")


def test_changed_store_bytes_are_refused(store):
    root, map_ram = store
    pager = Pager(os.path.join(root, "store"), page_size=64 * KiB, hbm_budget=16 * MiB,
                  keep=16 * MiB, map_ram=map_ram)
    with pager:
        model = model_of()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        pager.attach(opt, bucket_size=256 * KiB)
        train(model, opt, 0, 2)
        changed_store_is_refused(pager, model, opt, train)

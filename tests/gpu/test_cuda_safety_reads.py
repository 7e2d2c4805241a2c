"""On the GPU, opt.state_dict() and a save write nothing to the store
(Pager.release_unchanged_async: the state goes back to its bytes at rest), on an
io_uring store, a store in RAM mapped for the device's copies and with a host tier (its
copies kept for the read); it works on a store that can no longer be written (a
file-size limit, as on a full disk); steps after it are as without it. Store bytes changed
from outside are refused on page-in (CorruptStoreError), on io_uring and mapped stores
alike, and the state and parameters stay as they were."""
import os
import sys

import pytest
import torch

from statepager import checkpoint
from statepager import PagedAdamW, Pager

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from compare import same  # noqa: E402
from store_writes import (changed_store_is_refused, file_size_limit, store_files,  # noqa: E402
                          writes)

KiB, MiB = 1 << 10, 1 << 20
pytestmark = pytest.mark.gpu

# name: (Pager options, store on tmpfs)
CONFIGS = {
    "disk": ({"map_ram": False}, False),
    "mapped-ram": ({}, True),
    "host-tier": ({"host_budget": 64 * MiB, "map_ram": False}, False),
}


def make(config, root, name, moments="fp32", mains="fp32"):
    options, ram = CONFIGS[config]
    pager = Pager(os.path.join(root[ram], name), device="cuda", page_size=2 * MiB,
                  hbm_budget=64 * MiB, **options)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 1024)).cuda().to(torch.bfloat16)
    opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-3, bucket_size=2 * MiB,
                     moments=moments, mains=mains)
    return pager, model, opt


def train(model, opt, first, count):
    for i in range(first, first + count):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i)).cuda()
        opt.zero_grad()
        model(x.to(torch.bfloat16)).float().square().mean().backward()
        opt.step()


@pytest.fixture
def root(tmp_path, shm_dir):
    return {False: str(tmp_path), True: shm_dir}


@pytest.mark.parametrize("formats", [("fp32", "fp32"), ("q8", "residual")], ids=["fp32", "q8"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_cuda_state_dict_and_save_write_nothing(root, tmp_path, config, formats):
    pager, model, opt = make(config, root, "unread", *formats)
    with pager:
        train(model, opt, 0, 4)
        unread = [p.detach().clone() for p in model.parameters()]
    pager, model, opt = make(config, root, "read", *formats)
    with pager:
        train(model, opt, 0, 2)
        files, counted = store_files(pager), writes(pager)
        first = opt.state_dict()
        checkpoint.save(pager, str(tmp_path / "ckpt"))
        assert same(first, opt.state_dict())
        assert writes(pager) == counted
        assert store_files(pager) == files
        assert pager.stats()["unchanged_bytes"] > 0
        train(model, opt, 2, 2)
        assert same([p.detach() for p in model.parameters()], unread)


def test_cuda_state_dict_on_an_unwritable_store(root):
    pager, model, opt = make("disk", root, "store")
    with pager:
        train(model, opt, 0, 2)
        before = opt.state_dict()
        with file_size_limit(4096):
            sd = opt.state_dict()
        assert same(sd, before)


@pytest.mark.parametrize("config", ["disk", "mapped-ram"])
def test_cuda_changed_store_bytes_are_refused(root, config):
    pager, model, opt = make(config, root, "flipped")
    with pager:
        train(model, opt, 0, 2)
        changed_store_is_refused(pager, model, opt, train)

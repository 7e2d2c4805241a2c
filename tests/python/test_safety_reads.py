"""Reads of an attached optimizer's state write nothing to the store: opt.state_dict(),
a save through the device and stored_in_buckets() page the state in for a read and hand
it back to its bytes at rest (Pager.release_unchanged_async): the store's files keep
their bytes and modification times and stats() counts no write, so they work on a store
that can no longer be written (a file-size limit: every write fails, as on a full disk).
Steps, pause/resume and checkpoints after them are as without them."""
import os

import pytest
import torch

import statepager
from statepager import checkpoint
from statepager import PagedAdamW, Pager

from compare import same
from store_writes import store_files, file_size_limit, writes

KiB, MiB = 1 << 10, 1 << 20


def model_of(dtype=torch.float32):
    torch.manual_seed(0)
    # 600 x 600 weights: more than a bucket, and more than a chunk's 262144 elements, so
    # that they step in chunks (pieces).
    return torch.nn.Sequential(torch.nn.Linear(37, 600), torch.nn.GELU(),
                               torch.nn.Linear(600, 600), torch.nn.Linear(600, 7)).to(dtype)


def adamw(pager):
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    pager.attach(opt, bucket_size=256 * KiB)
    return model, opt


def q8_residual(pager):
    model = model_of(torch.bfloat16)
    opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-3, bucket_size=256 * KiB,
                     mains="residual", moments="q8")
    return model, opt


# name: (setup, Pager options, store on tmpfs)
CONFIGS = {
    "adamw-disk": (adamw, {"map_ram": False}, False),
    "adamw-mapped-ram": (adamw, {}, True),
    "adamw-host-tier": (adamw, {"host_budget": 16 * MiB}, False),
    "q8-residual-disk": (q8_residual, {"map_ram": False}, False),
}


@pytest.fixture
def root(tmp_path, shm_dir):
    return {False: str(tmp_path), True: shm_dir}


def make(config, root, name="store"):
    setup, options, ram = CONFIGS[config]
    # keep: the pool keeps every page it made (a CPU pager's pages are memfd ranges, which
    # a file-size limit limits too).
    pager = Pager(os.path.join(root[ram], name), page_size=64 * KiB, hbm_budget=16 * MiB,
                  keep=16 * MiB, **options)
    model, opt = setup(pager)
    return pager, model, opt


def train(model, opt, first, count):
    for i in range(first, first + count):
        x = torch.randn(8, 37, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
        opt.step()


def params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per config: the state_dict after 2 steps, and the params after 4 steps of a run
    that reads nothing in between."""
    out = {}
    for config in CONFIGS:
        base = str(tmp_path_factory.mktemp(config))
        pager, model, opt = make(config, {False: base, True: base}, "read")
        with pager:
            train(model, opt, 0, 2)
            sd = opt.state_dict()
        pager, model, opt = make(config, {False: base, True: base}, "unread")
        with pager:
            train(model, opt, 0, 4)
            out[config] = (sd, params(model))
    return out


@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_dict_writes_nothing(root, config, reference):
    pager, model, opt = make(config, root)
    with pager:
        train(model, opt, 0, 2)
        files, counted = store_files(pager), writes(pager)
        first = opt.state_dict()
        second = opt.state_dict()
        assert writes(pager) == counted
        assert store_files(pager) == files
        assert pager.stats()["unchanged_bytes"] > 0
        assert pager.stats()["resident_bytes"] == 0
        assert same(first, second) and same(first, reference[config][0])
        train(model, opt, 2, 2)  # steps after the reads are as without them
        assert same(params(model), reference[config][1])


@pytest.mark.parametrize("config", ["adamw-disk", "q8-residual-disk"])
def test_state_dict_on_an_unwritable_store(root, config, reference):
    """RLIMIT_FSIZE below every store range: each write to the store fails (EFBIG, a
    NoSpaceError), as on a full disk; the read does not need one. A read before makes
    the pages the pool then keeps."""
    pager, model, opt = make(config, root)
    with pager:
        train(model, opt, 0, 2)
        opt.state_dict()
        with file_size_limit(4096):
            sd = opt.state_dict()
        assert same(sd, reference[config][0])
        train(model, opt, 2, 2)
        assert same(params(model), reference[config][1])


def test_a_write_fails_on_that_store(root):
    """The fault above is real: a page-out of the same state fails under it."""
    pager, model, opt = make("adamw-disk", root)
    with pager:
        train(model, opt, 0, 1)
        t = pager.bindings[0].buckets[0].stored[0]
        pager.page_in(t)
        with file_size_limit(4096), pytest.raises(statepager.NoSpaceError):
            pager.page_out(t)
        pager.page_out(t)


@pytest.mark.parametrize("config", ["adamw-disk", "adamw-host-tier", "q8-residual-disk"])
def test_save_and_stored_in_buckets_write_nothing(root, tmp_path, config,
                                                             reference):
    pager, model, opt = make(config, root)
    with pager:
        train(model, opt, 0, 2)
        files, counted = store_files(pager), writes(pager)
        checkpoint.save(pager, str(tmp_path / "ckpt"))
        saved = params(model)  # residual masters load against these
        binding = pager.bindings[0]
        seen = [t.clone() for b in binding.stored_in_buckets() for t in b.stored]
        assert seen and writes(pager) == counted
        assert store_files(pager) == files
        train(model, opt, 2, 2)
        assert same(params(model), reference[config][1])
    # The checkpoint holds the state of step 2.
    pager, model, opt = make(config, root, "loaded")
    with pager:
        with torch.no_grad():
            for p, v in zip(model.parameters(), saved):
                p.copy_(v)
        assert checkpoint.load(pager, str(tmp_path / "ckpt"))
        assert same(opt.state_dict()["state"], reference[config][0]["state"])


@pytest.mark.parametrize("config", ["adamw-disk", "adamw-host-tier", "adamw-mapped-ram"])
def test_pause_resume_and_save_after_a_read(root, tmp_path, config, reference):
    pager, model, opt = make(config, root)
    with pager:
        train(model, opt, 0, 2)
        opt.state_dict()
        pager.pause()
        pager.resume()
        checkpoint.save(pager, str(tmp_path / "ckpt"))
        assert same(opt.state_dict(), reference[config][0])
        train(model, opt, 2, 2)
        assert same(params(model), reference[config][1])
    pager, model, opt = make(config, root, "loaded")
    with pager:
        assert checkpoint.load(pager, str(tmp_path / "ckpt"))
        assert same(opt.state_dict()["state"], reference[config][0]["state"])

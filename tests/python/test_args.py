"""Every public numeric argument is checked: a UsageError naming the argument, the value
and what is allowed, before anything is created (no store directory, no process killed
by SIGFPE or the OOM killer, no tensor over its neighbours)."""
import os

import pytest
import torch

import statepager
from statepager import Pager

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize("kwargs, match", [
    (dict(page_size=0), r"page_size .*0 is not allowed.*multiple of cpu's granularity"),
    (dict(page_size=1 << 40), r"page_size .*1099511627776 .*at most 1073741824"),
    (dict(page_size=4097), r"page_size .*4097 .*multiple"),
    (dict(page_size=-1), r"page_size = -1 is out of range"),
    (dict(page_size="32M"), r"page_size must be an integer, not str '32M'"),
    (dict(page_size=32e6), r"page_size must be an integer, not float"),
    (dict(page_size=True), r"page_size must be an integer, not bool"),
    (dict(page_size=64 * KiB, hbm_budget=4 * KiB), r"hbm_budget .*4096 is less than one page"),
    (dict(hbm_budget=-5), r"hbm_budget = -5 is out of range"),
    (dict(keep=-1), r"keep = -1 is out of range"),
    (dict(keep=1 << 64), r"keep = 18446744073709551616 is out of range.*below 2\^64"),
    (dict(arena_size=0), r"arena_size .*0 is not allowed: it must be between one page"),
    (dict(arena_size=1 << 50), r"arena_size .*1125899906842624 .*and 140737488355328"),
    (dict(page_size=64 * KiB, arena_size=4 * KiB),
     r"arena_size .*4096 is not allowed: it must be between one page \(page_size 65536"),
    (dict(io_depth=0), r"io_depth = 0 is out of range"),
    (dict(io_depth=5000), r"io_depth .*5000 .*1 to 1024"),
    (dict(io_depth="8"), r"io_depth must be an integer, not str"),
    (dict(io_block=1000), r"io_block .*1000 .*multiple of 4096"),
    (dict(io_block=1 << 30), r"io_block .*1073741824 .*up to 268435456"),
])
def test_pager_options_out_of_range_are_refused_before_the_store_is_touched(store_dir, kwargs,
                                                                           match):
    with pytest.raises(statepager.UsageError, match=match):
        Pager(store_dir, **kwargs)
    assert not os.path.exists(store_dir)


def test_numpy_and_tensor_integers_are_accepted(store_dir):
    np = pytest.importorskip("numpy")
    with Pager(store_dir, page_size=np.int64(64 * KiB), io_depth=torch.tensor(4)) as p:
        assert p.stats()["page_size"] == 64 * KiB and p.stats()["io_depth"] == 4


@pytest.mark.parametrize("shape, dtype, match", [
    ((1 << 61,), torch.float64, r"shape \[2305843009213693952\] of Double needs 2\^63 bytes"),
    ((1 << 40, 1 << 40), torch.float32, r"needs 2\^63 bytes or more"),
    ((10, -1), torch.float32, r"shape \[10, -1\] of Float has a negative size"),
    ((1 << 33,), torch.float32, r"larger than the pager's whole address arena .*arena_size"),
    (("a",), torch.float32, r"shape must be integers, not tuple \('a',\)"),
    ((2.5,), torch.float32, r"shape must be integers"),
    ((10,), "float32", r"dtype must be a torch.dtype"),
])
def test_empty_refuses_shapes_that_cannot_be(store_dir, shape, dtype, match):
    with Pager(store_dir, page_size=64 * KiB, arena_size=1 << 32) as p:
        with pytest.raises(statepager.UsageError, match=match):
            p.empty(*shape, dtype=dtype)
        assert p.stats()["extents"] == 0
        t = p.empty(0, 1 << 62, dtype=torch.float64)  # no bytes: allowed
        assert t.numel() == 0


def test_empty_store_must_be_a_name(store_dir):
    with Pager(store_dir) as p:
        with pytest.raises(statepager.UsageError, match="store must be a str"):
            p.empty(10, store=3)


def test_paging_and_attach_sizes_are_checked(store_dir):
    model = torch.nn.Linear(4, 4)
    with Pager(store_dir, page_size=64 * KiB) as p:
        for call, match in [
            (lambda: p.pause(bucket_size=0), r"bucket_size = 0 is out of range.*at least 1"),
            (lambda: p.pause(bucket_size="1M"), r"bucket_size must be an integer"),
            (lambda: p.resume(bucket_size=-1), r"bucket_size = -1 is out of range"),
            (lambda: p.scope(min_bytes=-1).__enter__(), r"min_bytes = -1 is out of range"),
            (lambda: p.services.keep_at_least(-3), r"nbytes = -3 is out of range"),
            (lambda: p.attach(torch.optim.AdamW(model.parameters()), bucket_size=0),
             r"bucket_size = 0 is out of range"),
            (lambda: p.attach(torch.optim.AdamW(model.parameters()), depth=1),
             r"depth = 1 is out of range: it must be at least 2"),
            (lambda: p.attach(torch.optim.AdamW(model.parameters()), depth=2.0),
             r"depth must be an integer, not float"),
            (lambda: statepager.PagedAdamW(model.parameters(), pager=p, bucket_size=-5),
             r"bucket_size = -5 is out of range"),
        ]:
            with pytest.raises(statepager.UsageError, match=match):
                call()
        assert p.stats()["extents"] == 0  # PagedAdamW refused before making its masters


def test_measure_mapping_refuses_a_zero_page():
    with pytest.raises(statepager.UsageError, match="page_size"):
        statepager._C.measure_mapping("cpu", 0, 1 << 20)

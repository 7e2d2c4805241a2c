"""Pager(map_ram=True): a store in RAM mapped for the device's copies (allocator/ram_map.h),
on the host backend: the steps, checkpoints and pause/resume of a store through io_uring,
bit for bit, with every byte of the store moved through the mapping."""
import os
import shutil

import pytest
import torch

import statepager
from statepager import checkpoint

KiB = 1 << 10


@pytest.fixture
def shm_base():
    base = f"/dev/shm/statepager-map-ram-{os.getpid()}"
    yield base
    shutil.rmtree(base, ignore_errors=True)


def train(store, map_ram, steps=4, first=0, state=None):
    """A bf16 model's PagedAdamW (q8 moments, residual mains) stepped `steps` times; returns
    the pager (open), the optimizer and the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.GELU(),
                                torch.nn.Linear(300, 6)).bfloat16()
    if state is not None:
        model.load_state_dict(state)
    pager = statepager.Pager(store, page_size=64 * KiB, map_ram=map_ram)
    opt = statepager.PagedAdamW(model.parameters(), pager=pager, lr=1e-2, weight_decay=0.1,
                                bucket_size=64 * KiB, moments="q8", mains="residual")
    step(model, opt, first, steps)
    return pager, opt, model


def step(model, opt, first, count):
    for i in range(first, first + count):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 40, generator=g).bfloat16(), torch.randn(8, 6, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()


def same(a, b):
    (_, oa, ma), (_, ob, mb) = a, b
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16))
               for x, y in zip(ma.parameters(), mb.parameters()))
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k, v in sa[i].items():
            assert torch.equal(v, sb[i][k]), (i, k)


def test_steps_through_the_mapping_are_the_steps_through_io_uring(shm_base):
    plain, mapped = train(f"{shm_base}/a", False), train(f"{shm_base}/b", True)
    try:
        same(plain, mapped)
        s, m = plain[0].stats(), mapped[0].stats()
        assert s["mapped_read_bytes"] == s["mapped_written_bytes"] == s["store_mapped_bytes"] == 0
        assert m["bytes_read"] == s["bytes_read"] and m["bytes_written"] == s["bytes_written"]
        assert m["mapped_read_bytes"] == m["bytes_read"] > 0
        assert m["mapped_written_bytes"] == m["bytes_written"] > 0
        assert m["read_requests"] + m["write_requests"] == 0
        assert m["store_mapped_bytes"] > 0
    finally:
        plain[0].close()
        mapped[0].close()


def test_a_checkpoint_of_a_mapped_store_resumes_exactly(shm_base, tmp_path):
    pager, opt, model = train(f"{shm_base}/a", True, steps=3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint.save(pager, checkpoint.rank_directory(str(tmp_path / "iter3")))
    step(model, opt, 3, 2)
    resumed = train(f"{shm_base}/b", True, steps=0, state=weights)
    try:
        assert checkpoint.load(resumed[0], checkpoint.rank_directory(str(tmp_path / "iter3")))
        step(resumed[2], resumed[1], 3, 2)
        same((pager, opt, model), resumed)
        assert resumed[0].stats()["mapped_read_bytes"] > 0
    finally:
        pager.close()
        resumed[0].close()


def test_pause_and_resume_through_the_mapping(shm_base):
    pager = statepager.Pager(f"{shm_base}/a", map_ram=True)
    try:
        ts = [pager.empty(n) for n in (1000, 300_000, 2_000_000)]
        pager.page_in(ts)
        for i, t in enumerate(ts):
            t.copy_(torch.arange(t.numel(), dtype=torch.float32) * (i + 1))
        pager.pause()
        assert not any(pager.is_resident(t) for t in ts)
        pager.resume()
        for i, t in enumerate(ts):
            assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32) * (i + 1))
        s = pager.stats()
        assert s["mapped_read_bytes"] == s["bytes_read"] > 0
        assert s["mapped_written_bytes"] == s["bytes_written"] > 0
    finally:
        pager.close()


def test_a_full_tmpfs_fails_the_page_out_and_changes_nothing(sized_tmpfs):
    """ENOSPC on a mapped store: populating the new bytes fails, so they are not mapped,
    and the write through io_uring reports the full filesystem; the tensors stay resident
    with their bytes, the counters as they were, and what fit stays readable."""
    mnt = sized_tmpfs(4, "filling a mapped store")
    with statepager.Pager(os.path.join(mnt, "store"), page_size=64 * KiB, map_ram=True) as p:
        small, big = p.empty(256 * KiB), p.empty(1 << 20)  # 1 MiB fits; 4 MiB more does not
        p.page_in([small, big])
        small.fill_(3)
        big.fill_(7)
        p.page_out(small)
        before = p.stats()
        assert before["mapped_written_bytes"] == 1 << 20
        with pytest.raises(statepager.NoSpaceError):
            p.page_out(big)
        after = p.stats()
        assert p.is_resident(big) and bool((big == 7).all())
        assert {k: after[k] for k in ("bytes_written", "mapped_written_bytes", "buckets_out")} == \
            {k: before[k] for k in ("bytes_written", "mapped_written_bytes", "buckets_out")}
        p.page_in(small)
        assert bool((small == 3).all())

"""Pager on the host backend: CPU tensors with the same semantics CUDA ones get."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import statepager
from statepager import Pager

KiB, MiB = 1 << 10, 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_deferred_tensor_has_no_memory_until_page_in(store_dir):
    with Pager(store_dir, page_size=64 * KiB) as p:
        t = p.empty(1000, 3, dtype=torch.float32)
        assert t.shape == (1000, 3) and t.dtype == torch.float32 and t.device.type == "cpu"
        assert p.residency(t) == "zero"
        assert p.stats()["mapped_bytes"] == 0
        p.page_in(t)
        assert p.is_resident(t)
        assert torch.count_nonzero(t) == 0
        assert p.stats()["bytes_read"] == 0 and p.stats()["read_requests"] == 0


def test_overwrite_maps_scratch_without_a_zero_fill(store_dir):
    with Pager(store_dir, page_size=64 * KiB) as p:
        stored, scratch, written = (p.empty(10_000) for _ in range(3))
        p.page_in(written)
        written.fill_(3.0)
        p.page_out(written)
        h = p.page_in_async([stored], overwrite=[scratch, written])
        h.wait()
        assert all(p.is_resident(t) for t in (stored, scratch, written))
        assert p.stats()["zero_filled_bytes"] == 2 * 40_000  # stored's, and written's first
        assert torch.count_nonzero(stored) == 0
        assert bool((written == 3.0).all())  # bytes at rest are read, overwrite or not
        with pytest.raises(statepager.UsageError, match="not created by this Pager"):
            p.page_in_async([], overwrite=[torch.zeros(3)])


def test_arena_end_places_tensors_apart(store_dir):
    with Pager(store_dir, page_size=64 * KiB) as p:
        low = [p.empty(1000) for _ in range(2)]
        high = [p.empty(1000, arena_end="high") for _ in range(2)]
        assert low[1].data_ptr() == low[0].data_ptr() + 4 * KiB  # first fit, upwards
        assert high[1].data_ptr() == high[0].data_ptr() - 4 * KiB  # last fit, downwards
        assert high[1].data_ptr() - low[1].data_ptr() > (1 << 30)
        p.page_in(high)
        high[0].fill_(2.0)
        p.page_out(high)
        p.page_in(high[0])
        assert bool((high[0] == 2.0).all())  # paged as any other
        with pytest.raises(statepager.UsageError, match="arena_end"):
            p.empty(10, arena_end="top")


@pytest.mark.parametrize("page_size", [64 * KiB, 2 * MiB])
def test_round_trip_is_bit_exact_with_identity_kept(store_dir, page_size):
    gen = torch.Generator().manual_seed(1)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
    with Pager(store_dir, page_size=page_size, io_depth=8, io_block=64 * KiB) as p:
        buckets = []
        for b in range(10):
            bucket = []
            for i in range(1 + b % 5):
                n = int(torch.randint(1, 200_000, (1,), generator=gen))
                bucket.append(p.empty(n, dtype=dtypes[(b + i) % len(dtypes)]))
            buckets.append(bucket)
        refs, ptrs, ids = [], [], []
        for bucket in buckets:
            p.page_in(bucket)
            for t in bucket:
                raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8,
                                    generator=gen)
                t.view(torch.uint8).copy_(raw)
                refs.append(raw)
                ptrs.append(t.data_ptr())
                ids.append(id(t))
        handles = [p.page_out_async(b) for b in buckets]  # many buckets in flight
        for h in handles:
            h.wait()
            assert h.done()
        assert p.stats()["mapped_bytes"] == 0
        assert all(p.residency(t) == "file" for b in buckets for t in b)
        for h in [p.page_in_async(b) for b in reversed(buckets)]:
            h.wait()
        flat = [t for b in buckets for t in b]
        for t, ref, ptr, ident in zip(flat, refs, ptrs, ids):
            assert t.data_ptr() == ptr and id(t) == ident
            assert torch.equal(t.view(torch.uint8), ref)


def test_page_out_returns_memory(store_dir):
    with Pager(store_dir, page_size=2 * MiB, keep=0) as p:
        ts = [p.empty(8 * MiB // 4) for _ in range(16)]  # 128 MiB
        p.page_in(ts)
        for i, t in enumerate(ts):
            t.fill_(i)
        mapped, rss = p.stats()["mapped_bytes"], rss_bytes()
        assert mapped >= 128 * MiB
        p.page_out(ts)
        assert p.stats()["mapped_bytes"] == 0
        assert rss - rss_bytes() > 100 * MiB, "process RSS did not drop after page-out"
        p.page_in(ts)
        assert all(bool((t == i).all()) for i, t in enumerate(ts))


def test_keep_caches_pages_for_reuse(store_dir):
    with Pager(store_dir, page_size=2 * MiB, keep=8 * MiB) as p:
        t = p.empty(16 * MiB // 4)
        p.page_in(t)
        p.page_out(t)
        s = p.stats()
        assert s["mapped_bytes"] == 0 and s["cached_bytes"] == 8 * MiB


def test_budget_is_respected_and_excess_refused(store_dir):
    budget = 8 * 64 * KiB
    with Pager(store_dir, page_size=64 * KiB, hbm_budget=budget) as p:
        ts = [p.empty(40_000) for _ in range(20)]  # 160 KB each
        for i in range(0, 20, 2):
            p.page_in(ts[i:i + 2])
            ts[i].fill_(i)
            ts[i + 1].fill_(i + 1)
            p.page_out(ts[i:i + 2])
        assert 0 < p.stats()["peak_mapped_bytes"] <= budget
        with pytest.raises(statepager.OutOfMemoryError, match="budget"):
            p.page_in(ts)
        assert all(p.residency(t) == "file" for t in ts)
        p.page_in(ts[7])
        assert bool((ts[7] == 7).all())


@pytest.mark.parametrize("direct_io", [True, False])
def test_round_trip_on_tmpfs_direct_or_buffered(shm_dir, direct_io):
    # tmpfs takes O_DIRECT since Linux 6.6; older kernels refuse it and get buffered I/O.
    with Pager(shm_dir, page_size=64 * KiB, direct_io=direct_io) as p:
        if not direct_io:
            assert p.stats()["direct_io"] is False
        t = p.empty(12345, dtype=torch.float64)
        p.page_in(t)
        t.copy_(torch.arange(12345, dtype=torch.float64))
        p.page_out(t)
        p.page_in(t)
        assert torch.equal(t, torch.arange(12345, dtype=torch.float64))


def test_second_pager_on_same_directory_refused(store_dir):
    with Pager(store_dir):
        with pytest.raises(statepager.StoreBusyError, match="in use"):
            Pager(store_dir)


def test_second_process_on_same_directory_refused(store_dir):
    with Pager(store_dir):
        code = textwrap.dedent(f"""
            import statepager
            try:
                statepager.Pager({store_dir!r})
            except statepager.StoreBusyError as e:
                print("refused:", e)
                raise SystemExit(0)
            raise SystemExit(1)
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        assert str(os.getpid()) in r.stdout


def test_directory_with_other_files_is_refused_and_a_new_one_removed_on_close(store_dir,
                                                                             tmp_path):
    # More cases (a store left by a crash, links, chdir) in test_fault_store_dir.py.
    os.makedirs(store_dir)
    with open(os.path.join(store_dir, "leftover"), "w") as f:
        f.write("x")
    with pytest.raises(statepager.UsageError, match="not empty"):
        Pager(store_dir)
    assert os.listdir(store_dir) == ["leftover"]
    fresh = str(tmp_path / "fresh")
    p = Pager(fresh)
    assert sorted(os.listdir(fresh)) == [".lock", ".statepager-store", "state.bin"]
    p.close()
    assert not os.path.exists(fresh)


def test_full_disk_keeps_data_resident(store_dir):
    # RLIMIT_FSIZE stands in for a full disk; run in a child so the limit stays there.
    code = textwrap.dedent(f"""
        import resource, torch, statepager
        p = statepager.Pager({store_dir!r}, page_size=64 * 1024)
        t = p.empty(3 << 18)  # 3 MiB of fp32
        p.page_in(t)
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(3)))
        ref = t.clone()
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        try:
            p.page_out(t)
            raise SystemExit("page_out should have failed")
        except statepager.NoSpaceError as e:
            print("error:", e)
        assert p.is_resident(t), p.residency(t)
        assert torch.equal(t, ref)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        p.page_out(t)
        p.page_in(t)
        assert torch.equal(t, ref)
        p.close()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "state.bin" in r.stdout and "ulimit" in r.stdout and r.stdout.endswith("ok\n")


def test_small_tmpfs_full_keeps_data_resident(sized_tmpfs):
    mnt = sized_tmpfs(1, "filling a tmpfs")
    with Pager(os.path.join(mnt, "store"), page_size=64 * KiB) as p:
        t = p.empty(1 << 20)  # 4 MiB does not fit in 1 MiB
        p.page_in(t)
        t.fill_(7)
        with pytest.raises(statepager.NoSpaceError, match="full"):
            p.page_out(t)
        assert p.is_resident(t) and bool((t == 7).all())


def test_truncated_store_file_refused_at_page_in(store_dir):
    with Pager(store_dir, page_size=64 * KiB) as p:
        t = p.empty(100_000)
        p.page_in(t)
        t.fill_(1.5)
        p.page_out(t)
        os.truncate(p.file_path, 8192)
        with pytest.raises(statepager.CorruptStoreError, match="truncated"):
            p.page_in(t)
        assert p.residency(t) == "file"
        assert p.stats()["mapped_bytes"] == 0


def test_foreign_tensor_is_a_usage_error(store_dir):
    with Pager(store_dir) as p:
        with pytest.raises(statepager.UsageError, match="not created by this Pager"):
            p.page_out([torch.zeros(10)])


def test_tensor_outliving_close_can_be_freed(store_dir):
    p = Pager(store_dir, page_size=64 * KiB)
    t = p.empty(1000)
    p.page_in(t)
    p.close()
    with pytest.raises(statepager.UsageError, match="this Pager is closed"):
        p.residency(t)
    del t  # the deleter runs after close without error
    with pytest.raises(statepager.UsageError, match="closed"):
        p.empty(10)


def test_pause_resume_bit_exact_same_addresses(store_dir):
    with Pager(store_dir, page_size=64 * KiB, keep=1 * MiB) as p:
        ts = [p.empty(n) for n in (10, 70_000, 300_001, 5)]
        cold = p.empty(1000)  # never paged in: stays zero/deferred across pause
        p.page_in(ts)
        refs = [torch.randn(t.shape) for t in ts]
        for t, r in zip(ts, refs):
            t.copy_(r)
        ptrs = [t.data_ptr() for t in ts]
        p.pause()
        s = p.stats()
        assert s["mapped_bytes"] == 0 and s["cached_bytes"] == 0
        assert all(p.residency(t) == "file" for t in ts) and p.residency(cold) == "zero"
        with pytest.raises(statepager.UsageError, match="already paused"):
            p.pause()
        p.resume()
        assert [t.data_ptr() for t in ts] == ptrs
        assert all(torch.equal(t, r) for t, r in zip(ts, refs))
        assert p.residency(cold) == "zero"


def test_host_like_is_ordinary_memory_laid_out_as_its_model(store_dir):
    """Pager.host_like: a CPU tensor laid out as torch.empty_like(model) (the undo copies
    of atomic steps), outside the pager, that holds what is copied into it."""
    model = torch.randn(6, 8, 5, 7).contiguous(memory_format=torch.channels_last)
    with Pager(store_dir, page_size=64 * KiB) as p:
        copies = [p.services.host_like(t) for t in (model, model.to(torch.bfloat16), model[0, 0])]
        for copy, t in zip(copies, (model, model.to(torch.bfloat16), model[0, 0])):
            like = torch.empty_like(t)  # a gappy view (model[0, 0]) comes dense
            assert (copy.shape, copy.dtype, copy.stride()) == (t.shape, t.dtype, like.stride())
            assert copy.device.type == "cpu" and not p.owns(copy)
            copy.copy_(t)
            assert torch.equal(copy, t)
        assert p.stats()["extents"] == 0 and p.stats()["mapped_bytes"] == 0
        assert p.services.host_like(torch.empty(0, 3)).shape == (0, 3)
        before = rss_bytes()
        big = p.services.host_like(torch.empty(64 * MiB, dtype=torch.uint8))
        big.fill_(1)
        assert rss_bytes() - before >= 60 * MiB
        del big  # freed with the tensor
        assert rss_bytes() - before < 16 * MiB

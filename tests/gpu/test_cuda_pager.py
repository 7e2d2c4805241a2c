"""The CUDA backend: deferred CUDA tensors, page-out/in with identity kept, the driver's
free memory following the pool, stream ordering, pause/resume, bounded step memory."""
import pytest
import torch

import statepager
from statepager import Pager

pytestmark = pytest.mark.gpu
MiB, GiB = 1 << 20, 1 << 30


def test_deferred_cuda_tensor(store_dir, cuda_free):
    with Pager(store_dir, device="cuda", page_size=32 * MiB) as p:
        before = cuda_free()
        t = p.empty(256 * MiB // 4)
        assert t.is_cuda and p.residency(t) == "zero"
        assert abs(cuda_free() - before) < 8 * MiB, "a deferred tensor must not take memory"
        p.page_in(t)
        assert int(torch.count_nonzero(t)) == 0
        assert p.stats()["bytes_read"] == 0


def test_identity_bytes_and_free_memory_follow_paging(store_dir, cuda_free):
    size = 2 * GiB
    with Pager(store_dir, device="cuda", page_size=32 * MiB, keep=0) as p:
        ts = [p.empty(n) for n in (size // 8 // 4 + 13, size // 8 // 4 * 3 + 1, size // 2 // 4 - 7)]
        p.page_in(ts)
        g = torch.Generator(device="cuda").manual_seed(0)
        for t in ts:
            t.normal_(generator=g)
        refs = [t.cpu() for t in ts]
        ptrs, ids = [t.data_ptr() for t in ts], [id(t) for t in ts]
        resident_free = cuda_free()
        p.page_out(ts)
        out_free = cuda_free()
        assert p.stats()["mapped_bytes"] == 0
        assert out_free - resident_free >= size - 64 * MiB, (resident_free, out_free)
        p.page_in(ts)
        in_free = cuda_free()
        assert out_free - in_free >= size - 64 * MiB
        assert [t.data_ptr() for t in ts] == ptrs and [id(t) for t in ts] == ids
        for t, r in zip(ts, refs):
            assert torch.equal(t.cpu(), r)


def test_page_out_waits_for_work_queued_on_the_stream(store_dir):
    with Pager(store_dir, device="cuda", page_size=32 * MiB) as p:
        t = p.empty(64 * MiB // 4)
        p.page_in(t)
        t.zero_()
        for _ in range(200):  # a long queue of kernels still running at page_out time
            t.add_(1)
        p.page_out(t)
        p.page_in(t)
        assert bool((t == 200).all())


def test_page_out_on_a_side_stream(store_dir):
    with Pager(store_dir, device="cuda", page_size=32 * MiB) as p:
        t = p.empty(16 * MiB // 4)
        p.page_in(t)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            t.fill_(3.0)
            for _ in range(100):
                t.mul_(1.0)
            p.page_out(t)  # ordered after s's work, not the default stream's
        p.page_in(t)
        assert bool((t == 3.0).all())


def test_pause_resume_returns_memory_and_is_bit_exact(store_dir, cuda_free):
    with Pager(store_dir, device="cuda", page_size=32 * MiB, keep=256 * MiB) as p:
        ts = [p.empty(n) for n in (7, 100 * MiB // 4 + 3, 300 * MiB // 4)]
        p.page_in(ts)
        for i, t in enumerate(ts):
            t.copy_(torch.arange(t.numel(), device="cuda", dtype=torch.float32) * (i + 1))
        refs = [t.clone() for t in ts]
        ptrs = [t.data_ptr() for t in ts]
        resident = cuda_free()
        p.pause()
        assert p.stats()["mapped_bytes"] == 0 and p.stats()["cached_bytes"] == 0
        assert cuda_free() - resident >= 400 * MiB - 64 * MiB
        p.resume()
        assert [t.data_ptr() for t in ts] == ptrs
        assert all(torch.equal(t, r) for t, r in zip(ts, refs))


def test_budget_refused_cleanly_on_cuda(store_dir):
    with Pager(store_dir, device="cuda", page_size=32 * MiB, hbm_budget=128 * MiB) as p:
        t = p.empty(512 * MiB // 4)
        with pytest.raises(statepager.OutOfMemoryError, match="budget"):
            p.page_in(t)
        assert p.residency(t) == "zero" and p.stats()["mapped_bytes"] == 0


def test_step_memory_bounded_on_pool_and_driver(store_dir, cuda_free):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8 * MiB // 4, device="cuda")) for _ in range(48)]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    bucket = 64 * MiB  # 4 params: their two moments, 16 MiB each
    with Pager(store_dir, device="cuda", page_size=32 * MiB, keep=0) as p:
        binding = p.attach(opt, bucket_size=bucket, depth=3)
        lowest = []

        def probe(_):
            lowest.append(cuda_free())

        binding.before_bucket = probe
        for prm in params:
            prm.grad = torch.randn_like(prm) * 1e-3
        opt.step()
        opt.step()
        free_idle = cuda_free()
        largest = max(b.nbytes for b in binding.buckets)
        bound = 3 * (largest + 2 * 32 * MiB)
        total = sum(b.nbytes for b in binding.buckets)
        assert binding.last.peak_mapped_bytes <= bound < total
        assert free_idle - min(lowest) <= bound + 64 * MiB

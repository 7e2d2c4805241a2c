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


def test_the_stream_paging_orders_itself_after_is_the_current_one():
    """streams.current: torch.cuda.current_stream(device).cuda_stream, a side stream's
    inside `with torch.cuda.stream(...)`, for a device given with and without its index."""
    from statepager.util import streams
    index = torch.cuda.current_device()
    for device in (torch.device("cuda"), torch.device("cuda", index)):
        assert streams.current(device) == torch.cuda.current_stream(device).cuda_stream
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            assert streams.current(device) == side.cuda_stream != 0
    assert streams.current(torch.device("cpu")) == 0


def test_a_discard_waits_for_its_stream_not_for_page_outs_queued_before_it(store_dir):
    """A discard unmaps once the kernels queued before it on its stream are done, not
    behind a page-out's copies queued on the copy queue before it (a streamed step's
    scratch leaves while its stored forms still cross to the host)."""
    with Pager(store_dir, device="cuda", page_size=32 * MiB, host_budget=5 * GiB) as p:
        stored, scratch = p.empty(4 * GiB // 4), p.empty(64 * MiB // 4)
        p.page_in([stored, scratch])
        stored.fill_(1.0)
        scratch.zero_()
        for _ in range(200):  # kernels the discard must wait for
            scratch.add_(1)
        out = p.page_out_async(stored)  # one 4 GiB copy to the host tier: about 80 ms
        dropped = p.discard_async(scratch)
        dropped.wait()
        assert not out.done(), "the discard did not wait for the page-out's copy"
        assert p.residency(scratch) == "zero"
        out.wait()
        torch.cuda.synchronize()  # no kernel touched the scratch after its unmap
        p.page_in(stored)
        assert bool((stored == 1.0).all())


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


def test_a_mapped_ram_store_moves_bytes_by_the_copy_engines_alone(shm_dir):
    """map_ram on CUDA: the store's tmpfs files registered (cuMemHostRegister); every byte
    paged out and in goes between the device and their pages, bit-exact, and a step of
    PagedAdamW on it equals the step through io_uring."""
    with Pager(shm_dir, device="cuda", page_size=32 * MiB, map_ram=True) as p:
        ts = [p.empty(n) for n in (1000, 3 * MiB + 17, 40 * MiB)]
        p.page_in(ts)
        g = torch.Generator(device="cuda").manual_seed(0)
        for t in ts:
            t.normal_(generator=g)
        refs = [t.cpu() for t in ts]
        for _ in range(2):
            p.page_out(ts)
            p.page_in(ts)
        assert all(torch.equal(t.cpu(), r) for t, r in zip(ts, refs))
        s = p.stats()
        assert s["mapped_read_bytes"] == s["bytes_read"] > 0
        assert s["mapped_written_bytes"] == s["bytes_written"] > 0
        assert s["read_requests"] + s["write_requests"] == 0
    params = []
    for map_ram in (False, True):
        torch.manual_seed(0)
        w = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (5000, 3 * MiB)]
        with Pager(f"{shm_dir}-{map_ram}", device="cuda", map_ram=map_ram) as p:
            opt = statepager.PagedAdamW(w, pager=p, lr=1e-2, bucket_size=4 * MiB,
                                        moments="q8")
            for k in range(3):
                for i, x in enumerate(w):
                    x.grad = torch.randn(x.shape, device="cuda",
                                         generator=torch.Generator(device="cuda").manual_seed(k + i))
                opt.step()
            params.append([x.detach().cpu() for x in w])
            assert (p.stats()["mapped_written_bytes"] > 0) == map_ram
    assert all(torch.equal(a, b) for a, b in zip(*params))

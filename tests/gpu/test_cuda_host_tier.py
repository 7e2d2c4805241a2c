"""The host tier on CUDA: pinned memory moved by the copy engines, no file I/O when the
budget holds the state, steps bit-exact with the state in the host tier or half spilled."""
import time

import pytest
import torch

from statepager import checkpoint
from statepager import Pager

pytestmark = pytest.mark.gpu
MiB, GiB = 1 << 20, 1 << 30


def test_round_trip_through_pinned_host_memory(store_dir, cuda_free):
    with Pager(store_dir, device="cuda", page_size=32 * MiB, keep=0,
               host_budget=2 * GiB) as p:
        ts = [p.empty(n) for n in (64 * MiB // 4 + 13, 256 * MiB // 4 - 7, 3 * 1000 * 1000)]
        p.page_in(ts)
        g = torch.Generator(device="cuda").manual_seed(0)
        for t in ts:
            t.normal_(generator=g)
        refs = [t.cpu() for t in ts]
        resident_free = cuda_free()
        p.page_out(ts)
        assert all(p.residency(t) == "host" for t in ts)
        assert cuda_free() - resident_free >= 300 * MiB, "paged-out pages were not freed"
        p.page_in(ts)
        for t, r in zip(ts, refs):
            assert torch.equal(t.cpu(), r)
        s = p.stats()
        assert s["bytes_written"] == 0 and s["bytes_read"] == 0
        assert s["bytes_to_host"] == s["bytes_from_host"] == sum(t.nbytes for t in ts)


def test_host_tier_memory_is_pinned(store_dir):
    """1 GiB each way at copy-engine speed: pageable memory would go through the driver's
    bounce buffers at a fraction of it (pinned: about 55 GB/s per direction on the H200)."""
    with Pager(store_dir, device="cuda", page_size=64 * MiB, host_budget=1 * GiB + 64 * MiB) as p:
        t = p.empty(GiB // 4)
        p.page_in(t)
        t.fill_(1.5)
        p.page_out(t)  # first touch of the host memory, untimed
        p.page_in(t)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        p.page_out(t)
        out_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        p.page_in(t)
        in_s = time.perf_counter() - t0
        assert bool((t == 1.5).all())
        assert GiB / out_s > 20e9 and GiB / in_s > 20e9, (GiB / out_s / 1e9, GiB / in_s / 1e9)


def test_page_out_waits_for_the_stream_into_the_host_tier(store_dir):
    with Pager(store_dir, device="cuda", page_size=32 * MiB, host_budget=256 * MiB) as p:
        t = p.empty(64 * MiB // 4)
        p.page_in(t)
        t.zero_()
        for _ in range(200):
            t.add_(1)
        p.page_out(t)
        assert p.residency(t) == "host"
        p.page_in(t)
        assert bool((t == 200).all())


def _train(p, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    if p is not None:
        p.attach(opt, bucket_size=2 * MiB, depth=3)
    for i in range(steps):
        x = torch.randn(8, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [q.detach().cpu() for q in model.parameters()]


@pytest.mark.parametrize("share", [0.5, 4])
def test_steps_are_bit_exact_with_the_host_tier(store_dir, share):
    reference = _train(None)
    state = sum(2 * 4 * q.numel() for q in
                torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                    torch.nn.Linear(1024, 1024)).parameters())
    with Pager(store_dir, device="cuda", page_size=2 * MiB,
               host_budget=int(share * state)) as p:
        got = _train(p)
        s = p.stats()
        assert all(torch.equal(a, b) for a, b in zip(got, reference))
        if share == 4:
            assert s["bytes_written"] == 0 and s["bytes_read"] == 0
        else:
            assert s["bytes_to_host"] > 0 and s["bytes_written"] > 0


def test_pause_resume_through_the_host_tier(store_dir, cuda_free):
    with Pager(store_dir, device="cuda", page_size=32 * MiB, keep=0,
               host_budget=1 * GiB) as p:
        ts = [p.empty(128 * MiB // 4) for _ in range(4)]
        p.page_in(ts)
        for i, t in enumerate(ts):
            t.fill_(float(i))
        before = cuda_free()
        p.pause()
        assert cuda_free() - before >= 500 * MiB
        p.resume()
        assert all(bool((t == float(i)).all()) for i, t in enumerate(ts))
        assert p.stats()["bytes_written"] == 0


def _train_layers(p, steps, atomic=True, first=0, model_opt=None):
    """Eight 512 x 512 layers (1 MiB of weight each), AdamW in buckets of one layer."""
    if model_opt is None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False)
                                      for _ in range(8)]).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        if p is not None:
            p.attach(opt, bucket_size=3 * MiB, depth=3, atomic=atomic)
    else:
        model, opt = model_opt
    moved = []
    for i in range(first, first + steps):
        x = torch.randn(8, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        opt.zero_grad()
        model(x).square().mean().backward()
        before = p.stats() if p is not None else None
        opt.step()
        if p is not None:
            after = p.stats()
            moved.append(after["bytes_read"] - before["bytes_read"] +
                         after["bytes_written"] - before["bytes_written"])
    return model, opt, moved


def test_cyclic_steps_keep_half_the_state_in_the_host_tier(store_dir):
    """In place at half the state: the host tier keeps its half across steps (reuse
    hints), the store moves the other half each way, and the steps are bit-exact."""
    model, _, _ = _train_layers(None, 6)
    reference = [q.detach().cpu() for q in model.parameters()]
    state = 8 * 2 * MiB  # two moments per layer
    with Pager(store_dir, device="cuda", page_size=2 * MiB, host_budget=state // 2) as p:
        model, _, moved = _train_layers(p, 6, atomic=False)
        assert all(torch.equal(a.detach().cpu(), b) for a, b in zip(model.parameters(), reference))
        for m in moved[3:]:  # half each way, give or take a layer's moments
            assert abs(m - state) <= 2 * MiB, moved
        assert p.stats()["read_aheads"] > 0


def test_load_fills_the_host_tier_on_cuda(tmp_path):
    with Pager(str(tmp_path / "a"), device="cuda", page_size=2 * MiB) as p:
        model, opt, _ = _train_layers(p, 2)
        checkpoint.save(p, str(tmp_path / "ckpt"))
        with Pager(str(tmp_path / "b"), device="cuda", page_size=2 * MiB,
                   host_budget=64 * MiB) as p2:
            model2, opt2, _ = _train_layers(p2, 0)
            with torch.no_grad():
                for a, b in zip(model.parameters(), model2.parameters()):
                    b.copy_(a)
            assert checkpoint.load(p2, str(tmp_path / "ckpt"))
            assert p2.stats()["host_bytes"] == 8 * 2 * MiB
            _, _, moved = _train_layers(p2, 2, first=2, model_opt=(model2, opt2))
            _train_layers(p, 2, first=2, model_opt=(model, opt))
            assert moved[0] == 0  # the state came from the host tier
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_resumable_steps_at_a_budget_of_the_state_move_no_file_bytes(store_dir):
    """Resumable steps (the default) with the host tier exactly the state's size: after
    the first steps, a step reads and writes no file byte and spills nothing, bit-exact."""
    model, _, _ = _train_layers(None, 6)
    reference = [q.detach().cpu() for q in model.parameters()]
    state = 8 * 2 * MiB  # two moments per layer
    with Pager(store_dir, device="cuda", page_size=2 * MiB, host_budget=state) as p:
        model, opt, moved = _train_layers(p, 3, atomic="bucket")
        spills = p.stats()["spills"]
        model, _, moved = _train_layers(p, 3, first=3, model_opt=(model, opt))
        assert moved == [0, 0, 0] and p.stats()["spills"] == spills
        assert all(torch.equal(a.detach().cpu(), b) for a, b in zip(model.parameters(), reference))

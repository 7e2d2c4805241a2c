"""The host tier (Pager(host_budget=...)): steps are bit-exact with none, half or all of
the state in host memory; a budget that holds the state moves no file bytes; pause/resume
and save/load go through it."""
import os
import resource
import warnings

import pytest
import torch

import statepager
from statepager import checkpoint
from statepager import Pager

KiB, MiB = 1 << 10, 1 << 20


def build(p: Pager | None, atomic="bucket"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 96))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if p is not None:
        p.attach(opt, bucket_size=16 * KiB, atomic=atomic)
    return model, opt


def train(model, opt, first: int, count: int) -> None:
    for i in range(first, first + count):
        x = torch.randn(4, 96, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def moments_bytes(model) -> int:
    return sum(2 * 4 * p.numel() for p in model.parameters())


def params(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def reference():
    model, opt = build(None)
    train(model, opt, 0, 4)
    return params(model)


@pytest.mark.parametrize("share", [0, 0.5, 4])
def test_steps_are_bit_exact_at_any_budget(store_dir, reference, share):
    state = moments_bytes(build(None)[0])
    with Pager(store_dir, page_size=64 * KiB, host_budget=int(share * state)) as p:
        model, opt = build(p)
        train(model, opt, 0, 4)
        assert all(torch.equal(a, b) for a, b in zip(params(model), reference))
        s = p.stats()
        assert s["host_budget"] == int(share * state)
        if share == 0:
            assert s["bytes_to_host"] == 0 and s["host_bytes"] == 0
        elif share == 4:  # holds the state and a step's fresh copy: no file I/O at all
            assert s["bytes_written"] == 0 and s["bytes_read"] == 0
            assert s["host_bytes"] >= state and s["bytes_from_host"] > 0
        else:  # part in the host tier, the rest spilled to the store
            assert s["bytes_to_host"] > 0 and s["bytes_written"] > 0
            assert 0 < s["host_used_bytes"] <= s["host_budget"]


def test_half_in_the_host_tier_on_a_mapped_ram_store(shm_dir):
    """The host tier and the device's copies through the mapped store files (map_ram)
    share one store in RAM: the steps stay bit-exact, and read nothing ahead into host
    room (a page-in from a mapped file is a copy from host memory already); a read-ahead
    asked for (as a load's) goes through io_uring into host memory, which the next step
    reads."""
    model, opt = build(None)
    train(model, opt, 0, 5)
    reference = params(model)
    state = moments_bytes(model)
    with Pager(shm_dir, page_size=64 * KiB, host_budget=state // 2, map_ram=True) as p:
        model, opt = build(p, atomic=True)
        # Atomic steps at half the budget: a step's page-outs take the room its committed
        # host copies leave, so every other step starts with the host room free.
        train(model, opt, 0, 4)
        s = p.stats()
        assert s["read_ahead_bytes"] == 0 and s["mapped_read_bytes"] > 0
        assert s["bytes_to_host"] > 0
        stored = [t for b in p.bindings[0].buckets for t in b.stored]
        p.read_ahead_async(stored).wait()
        assert p.stats()["read_ahead_bytes"] > 0
        assert any(p.residency(t) == "host" for t in stored)
        train(model, opt, 4, 1)
        assert all(torch.equal(a, b) for a, b in zip(params(model), reference))


def test_residency_and_round_trip(store_dir):
    with Pager(store_dir, page_size=64 * KiB, host_budget=1 * MiB) as p:
        t = p.empty(1000)
        p.page_in(t)
        t.copy_(torch.arange(1000, dtype=torch.float32))
        p.page_out(t)
        assert p.residency(t) == "host"
        assert "residency 'host'" in repr(t)
        p.page_in(t)
        assert torch.equal(t, torch.arange(1000, dtype=torch.float32))
        assert p.stats()["bytes_written"] == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_host_budget_is_checked(store_dir, bad):
    with pytest.raises(statepager.UsageError, match="host_budget"):
        Pager(store_dir, host_budget=bad)


def test_host_budget_out_of_range_is_refused(store_dir):
    with pytest.raises(statepager.UsageError, match="host_budget"):
        Pager(store_dir, host_budget=1 << 50)


def test_pause_and_resume_go_through_the_host_tier(store_dir):
    with Pager(store_dir, page_size=64 * KiB, host_budget=4 * MiB) as p:
        t = p.empty(256 * KiB)
        p.page_in(t)
        t.copy_(torch.arange(256 * KiB, dtype=torch.float32))
        p.pause()
        assert p.residency(t) == "host" and p.stats()["mapped_bytes"] == 0
        p.resume()
        assert p.residency(t) == "resident"
        assert torch.equal(t, torch.arange(256 * KiB, dtype=torch.float32))
        s = p.stats()
        assert s["bytes_written"] == 0 and s["bytes_read"] == 0
        assert s["bytes_to_host"] == s["bytes_from_host"] == 1 * MiB


# Atomic steps write fresh ranges until they commit: at 1.5 x the moments the tier keeps
# part of them after a step, at 4 x all of them.
@pytest.mark.parametrize("share", [1.5, 4])
def test_save_and_load_with_the_state_in_the_host_tier(tmp_path, reference, share):
    state = moments_bytes(build(None)[0])
    budget = int(share * state)
    p = Pager(str(tmp_path / "s1"), page_size=64 * KiB, host_budget=budget)
    model, opt = build(p)
    train(model, opt, 0, 2)
    assert p.stats()["host_bytes"] > 0
    checkpoint.save(p, str(tmp_path / "ckpt"))
    p2 = Pager(str(tmp_path / "s2"), page_size=64 * KiB, host_budget=budget)
    model2, opt2 = build(p2)
    with torch.no_grad():
        for a, b in zip(model.parameters(), model2.parameters()):
            b.copy_(a)
    assert checkpoint.load(p2, str(tmp_path / "ckpt"))
    train(model2, opt2, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(params(model2), reference))
    train(model, opt, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(params(model), reference))
    p.close()
    p2.close()


def test_spills_and_read_ahead(store_dir):
    with Pager(store_dir, page_size=64 * KiB, host_budget=2 * 64 * KiB) as p:
        ts = [p.empty(16 * KiB) for _ in range(3)]  # 64 KiB each
        for i, t in enumerate(ts):
            p.page_in(t)
            t.fill_(float(i))
            p.page_out(t)
        # the third page-out wrote the least recently used back to the store
        assert [p.residency(t) for t in ts] == ["file", "host", "host"]
        assert p.stats()["spills"] == 1
        p.page_in(ts[1])
        p.read_ahead_async([ts[0]]).wait()
        assert p.residency(ts[0]) == "host" and p.stats()["read_aheads"] == 1
        read = p.stats()["bytes_read"]
        p.page_in(ts)
        assert p.stats()["bytes_read"] == read
        assert all(bool((t == float(i)).all()) for i, t in enumerate(ts))


def layers(p: Pager, atomic: bool, n: int = 12):
    """n bias-free 64 x 64 layers (each moment one 16 KiB extent: no 4 KiB rounding),
    AdamW attached in buckets of one layer; returns model, opt and the bytes the pager
    moves for them per step (the moments: the params' undo copies of atomic steps are in
    host memory, not in the pager)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    state = n * 64 * 64 * 4 * 2
    if p is not None:
        p.attach(opt, bucket_size=64 * 64 * 4 * 3, atomic=atomic)
    return model, opt, state


def steps(p, model, opt, first: int, count: int) -> list:
    """Trains; per step the store's (bytes read, bytes written)."""
    out = []
    for i in range(first, first + count):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x).square().mean().backward()
        before = p.stats() if p is not None else None
        opt.step()
        if p is not None:
            after = p.stats()
            out.append((after["bytes_read"] - before["bytes_read"],
                        after["bytes_written"] - before["bytes_written"]))
    return out


@pytest.fixture(scope="module")
def layers_reference():
    model, opt, _ = layers(None, False)
    steps(None, model, opt, 0, 8)
    return params(model)


def masters(p: Pager | None, n: int = 12):
    """n fp32 masters of 4096 elements (16 KiB: no 4 KiB rounding) with fixed gradients,
    in the pager when p is given (else ordinary tensors); AdamW over them, attached in
    buckets of one master and its two moments. Returns the masters, the optimizer and
    their state's bytes (masters and moments)."""
    ts = []
    for i in range(n):
        v = torch.randn(4096, generator=torch.Generator().manual_seed(i))
        if p is None:
            t = v
        else:
            t = p.empty(4096)
            p.page_in(t)
            t.copy_(v)
            p.page_out(t)
        t.grad = torch.randn(4096, generator=torch.Generator().manual_seed(100 + i)) * 1e-2
        ts.append(t)
    return ts, torch.optim.AdamW(ts, lr=1e-2, weight_decay=0.1), n * 3 * 16 * KiB


def store_per_step(p: Pager, opt, count: int) -> list:
    """Steps; per step the store's (bytes read, bytes written)."""
    out = []
    for _ in range(count):
        before = p.stats()
        opt.step()
        after = p.stats()
        out.append((after["bytes_read"] - before["bytes_read"],
                    after["bytes_written"] - before["bytes_written"]))
    return out


def values(p: Pager, ts: list) -> list:
    out = []
    for t in ts:
        p.page_in(t)
        out.append(t.clone())
        p.page_out(t)
    return out


@pytest.fixture(scope="module")
def masters_reference():
    ts, opt, _ = masters(None)
    for _ in range(8):
        opt.step()
    return ts


# A cyclic step keeps what fits in the host tier there across steps; only the rest goes
# through the store. In place and resumable ("bucket": its page-ins keep the host range,
# which its page-out lets go before it writes) the tier keeps its budget's worth: at a
# budget of the state, nothing at all; atomic steps keep the committed bytes until the
# step commits, so each bucket kept needs room for two copies and half the budget stays
# (the kept set alternates around it from step to step: count pairs of steps).
@pytest.mark.parametrize("atomic, share, kept", [(False, 0.5, 0.5), ("bucket", 1.0, 1.0),
                                                 ("bucket", 0.5, 0.5), (True, 1.0, 0.5),
                                                 (True, 0.5, 0.25)])
def test_cyclic_steps_keep_the_budget_in_the_host_tier(store_dir, masters_reference, atomic,
                                                       share, kept):
    state = masters(None)[2]
    with Pager(store_dir, page_size=64 * KiB, host_budget=int(share * state)) as p:
        ts, opt, _ = masters(p)
        p.attach(opt, bucket_size=48 * KiB, atomic=atomic)
        store_per_step(p, opt, 2)  # the first steps spill the masters' unhinted bytes
        spills = p.stats()["spills"]
        moved = store_per_step(p, opt, 6)
        assert p.stats()["spills"] == spills  # the cycle spills nothing
        assert all(torch.equal(a, b) for a, b in zip(values(p, ts), masters_reference))
        read = sum(r for r, _ in moved[2:]) / 4
        written = sum(w for _, w in moved[2:]) / 4
        bucket = state / 12
        assert abs(read - (1 - kept) * state) <= bucket, (moved, state)
        assert abs(written - (1 - kept) * state) <= bucket, (moved, state)
        if kept == 1.0:  # the state fits: no byte moves through the store files
            assert moved[2:] == [(0, 0)] * 4, moved


def test_without_reuse_hints_lru_moves_more(store_dir):
    """The same steps with every page-out unhinted (least recently used first): the
    comparison the step's spill order exists for."""
    state = masters(None)[2]
    with Pager(store_dir, page_size=64 * KiB, host_budget=state // 2) as p:
        ts, opt, _ = masters(p)
        p.attach(opt, bucket_size=48 * KiB, atomic=False)
        hinted = store_per_step(p, opt, 6)[2:]
        original = p.page_out_async  # from here on without hints
        p.page_out_async = lambda tensors, reuse_after=0: original(tensors)
        lru = store_per_step(p, opt, 6)[2:]
        assert p.stats()["spills"] > 12
    assert sum(map(sum, lru)) > 1.3 * sum(map(sum, hinted)), (hinted, lru)


def test_steps_read_ahead_into_free_room(store_dir, masters_reference):
    state = masters(None)[2]
    with Pager(store_dir, page_size=64 * KiB, host_budget=state // 2) as p:
        ts, opt, _ = masters(p)
        p.attach(opt, bucket_size=48 * KiB, atomic=False)
        store_per_step(p, opt, 8)
        s = p.stats()
        assert s["read_aheads"] > 0 and s["read_ahead_bytes"] > 0
        assert s["host_used_bytes"] <= s["host_budget"]
        assert all(torch.equal(a, b) for a, b in zip(values(p, ts), masters_reference))


@pytest.mark.parametrize("share", [0.5, 4])
def test_load_goes_into_the_host_tier(tmp_path, layers_reference, share):
    """A load writes the state into free host room (in bucket order) and the rest into
    the store; the store does not grow by what the host tier took."""
    _, _, state = layers(None, False)
    budget = int(share * state)
    with Pager(str(tmp_path / "s1"), page_size=64 * KiB) as p:
        model, opt, _ = layers(p, False)
        steps(p, model, opt, 0, 4)
        checkpoint.save(p, str(tmp_path / "ckpt"))
    with Pager(str(tmp_path / "s2"), page_size=64 * KiB, host_budget=budget) as p2:
        model2, opt2, _ = layers(p2, False)
        with torch.no_grad():
            for a, b in zip(model.parameters(), model2.parameters()):
                b.copy_(a)
        store = os.path.getsize(p2.file_path)
        assert checkpoint.load(p2, str(tmp_path / "ckpt"))
        s = p2.stats()
        assert s["host_bytes"] == min(budget, state)  # the first buckets first
        assert s["read_ahead_bytes"] == 0  # straight in, not through the store
        grown = os.path.getsize(p2.file_path) - store
        assert grown <= max(0, state - budget) + 4 * KiB * len(p2.bindings[0].buckets)
        first = p2.bindings[0].buckets[0].stored
        assert all(p2.residency(t) == "host" for t in first)
        moved = steps(p2, model2, opt2, 4, 4)
        if share > 1:
            assert moved[0] == (0, 0)  # the first step after the load reads no file
        assert all(torch.equal(a, b) for a, b in zip(params(model2), layers_reference))


def test_load_without_a_host_tier_leaves_the_state_in_the_store(tmp_path):
    with Pager(str(tmp_path / "s1"), page_size=64 * KiB) as p:
        model, opt, _ = layers(p, False)
        steps(p, model, opt, 0, 2)
        checkpoint.save(p, str(tmp_path / "ckpt"))
        assert checkpoint.load(p, str(tmp_path / "ckpt"))
        s = p.stats()
        assert s["host_bytes"] == 0 and s["read_aheads"] == 0


def test_a_step_failing_to_write_the_store_changes_nothing(store_dir, layers_reference):
    """At half the budget each step writes part of the state to the store (spills and
    page-outs); when those writes fail (a file-size limit: EFBIG, a NoSpaceError) the step
    raises and leaves every parameter and host copy as before, and a retry steps once.
    The limit holds for every file of the process, the host backend's pages (memfds)
    too: the pool keeps pages up to its budget, made before the limit, so that the
    failed step maps pages it has already."""
    _, _, state = layers(None, True)
    pool = 4 * MiB  # over what a step maps
    with Pager(store_dir, page_size=64 * KiB, host_budget=state // 2, hbm_budget=pool,
               keep=pool) as p:
        model, opt, _ = layers(p, True)
        steps(p, model, opt, 0, 4)
        before = params(model)
        host = p.stats()["host_bytes"]
        made = p.empty((pool - p.stats()["mapped_bytes"]) // 4)  # every page the budget allows
        p.page_in_async([made]).wait()
        del made  # its pages back to the pool's cache, unwritten
        assert p.stats()["cached_bytes"] + p.stats()["mapped_bytes"] == pool
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            with pytest.raises(statepager.NoSpaceError):
                steps(p, model, opt, 4, 1)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert all(torch.equal(a, b) for a, b in zip(params(model), before))
        assert p.stats()["host_bytes"] == host
        opt.zero_grad()  # the failed call's gradients are made again
        steps(p, model, opt, 4, 4)
        assert all(torch.equal(a, b) for a, b in zip(params(model), layers_reference))


@pytest.mark.parametrize("host_budget, atomic, warned", [
    (16 * MiB, True, True),   # under twice the state: every atomic step would spill
    (64 * MiB, True, False),
    (16 * MiB, "bucket", False),  # resumable: the state alone fits
    (16 * MiB, False, False),  # in place, likewise
    (4 * MiB, "bucket", True),  # ... and does not fit 4 MiB
    (4 * MiB, False, True),
])
def test_attach_says_when_steps_would_spill_the_host_tier(store_dir, host_budget, atomic,
                                                          warned):
    model = torch.nn.Linear(1024, 1024)  # 8 MiB of moments at rest
    opt = torch.optim.AdamW(model.parameters())
    with Pager(store_dir, page_size=64 * 1024, host_budget=host_budget) as p:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            binding = p.attach(opt, bucket_size=1 * MiB, atomic=atomic)
        said = [w for w in seen if "host tier" in str(w.message)]
        assert bool(said) == warned, said
        # It points at the attach() above, the user's line, not into statepager.
        assert all(w.filename == __file__ for w in said), [w.filename for w in said]
        said = [str(w.message) for w in said]
        assert binding.stored_bytes() == 2 * 4 * (1024 * 1024 + 1024)
        if warned:
            shown = "'step'" if atomic is True else repr(atomic)  # as attach names it
            assert f"its steps (atomic={shown}) need" in said[0]
            assert ("Raise host_budget, or attach(atomic='bucket')" if atomic is True
                    else "Raise host_budget.") in said[0]

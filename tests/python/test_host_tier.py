"""The host tier (Pager(host_budget=...)): steps are bit-exact with none, half or all of
the state in host memory; a budget that holds the state moves no file bytes; pause/resume
and save/load go through it."""
import pytest
import torch

import statepager
from statepager import Pager

KiB, MiB = 1 << 10, 1 << 20


def build(p: Pager | None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 96))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if p is not None:
        p.attach(opt, bucket_size=16 * KiB)
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
        assert s["host_budget_bytes"] == int(share * state)
        if share == 0:
            assert s["bytes_to_host"] == 0 and s["host_bytes"] == 0
        elif share == 4:  # holds the state and a step's fresh copy: no file I/O at all
            assert s["bytes_written"] == 0 and s["bytes_read"] == 0
            assert s["host_bytes"] >= state and s["bytes_from_host"] > 0
        else:  # part in the host tier, the rest spilled to the store
            assert s["bytes_to_host"] > 0 and s["bytes_written"] > 0
            assert 0 < s["host_used_bytes"] <= s["host_budget_bytes"]


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


@pytest.mark.parametrize("share", [0.5, 4])
def test_save_and_load_with_the_state_in_the_host_tier(tmp_path, reference, share):
    state = moments_bytes(build(None)[0])
    budget = int(share * state)
    p = Pager(str(tmp_path / "s1"), page_size=64 * KiB, host_budget=budget)
    model, opt = build(p)
    train(model, opt, 0, 2)
    assert p.stats()["host_bytes"] > 0
    p.save(str(tmp_path / "ckpt"))
    p2 = Pager(str(tmp_path / "s2"), page_size=64 * KiB, host_budget=budget)
    model2, opt2 = build(p2)
    with torch.no_grad():
        for a, b in zip(model.parameters(), model2.parameters()):
            b.copy_(a)
    assert p2.load(str(tmp_path / "ckpt"))
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

"""pause() / resume(): all or nothing, and nothing pages while paused."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import statepager
from statepager import checkpoint
from statepager import Pager

KiB, MiB = 1 << 10, 1 << 20
PAUSED = r"paused: call resume\(\) first"


def stepped(p: Pager):
    """A model whose attached AdamW has stepped once, and the binding."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    binding = p.attach(opt, bucket_size=16 * KiB)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return model, opt, binding


def snapshot(model, binding) -> list:
    """Copies of the params and of the optimizer's paged state."""
    state = [v.clone() for b in binding.state_in_buckets() for p in b.params
             for v in binding.optimizer.state[p].values() if v.dim() > 0]
    return [p.detach().clone() for p in model.parameters()] + state


def same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_while_paused_paging_is_refused_and_nothing_changes(store_dir, tmp_path):
    with Pager(store_dir, page_size=64 * KiB) as p:
        model, opt, binding = stepped(p)
        model(torch.randn(2, 64)).sum().backward()  # grads for the step to be refused
        before = snapshot(model, binding)
        t = p.empty(1000)
        p.page_in(t)
        t.fill_(3)
        checkpoint.save(p, str(tmp_path / "ckpt"))
        p.pause()
        assert p.paused and p.stats()["mapped_bytes"] == 0
        other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        refused = [
            lambda: p.page_in(t), lambda: p.page_in_async([t]), lambda: p.page_out(t),
            lambda: p.page_out_async([t]), lambda: p.discard_async([t]), opt.step,
            lambda: p.scope().__enter__(), lambda: checkpoint.save(p, str(tmp_path / "ckpt2")),
            lambda: checkpoint.load(p, str(tmp_path / "ckpt")), lambda: checkpoint.save(p, checkpoint.rank_directory(str(tmp_path / "run"))),
            lambda: checkpoint.load(p, checkpoint.rank_directory(str(tmp_path / "run"))), lambda: p.attach(other),
        ]
        for call in refused:
            with pytest.raises(statepager.UsageError, match=PAUSED):
                call()
        assert not os.path.exists(tmp_path / "ckpt2") and not os.path.exists(tmp_path / "run")
        assert p.residency(t) == "file" and p.stats()["mapped_bytes"] == 0
        p.resume()
        assert not p.paused
        assert bool((t == 3).all())
        assert same(snapshot(model, binding), before)  # the refused step() changed nothing
        opt.step()
        assert not same(snapshot(model, binding), before)


def test_pause_that_fails_midway_pages_back_in_and_raises(store_dir):
    # RLIMIT_FSIZE stands in for a full disk: the first two tensors fit under it, the
    # last two do not, so half of the pause's buckets fail. In a child process, so the
    # limit stays there.
    code = textwrap.dedent(f"""
        import resource, torch, statepager
        p = statepager.Pager({store_dir!r}, page_size=64 * 1024, hbm_budget=8 << 20)
        ts = [p.empty(1 << 18) for _ in range(4)]  # 1 MiB each, one after another
        p.page_in(ts)
        for i, t in enumerate(ts):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
        refs = [t.clone() for t in ts]
        mapped = p.stats()["mapped_bytes"]
        resource.setrlimit(resource.RLIMIT_FSIZE, (5 << 19, resource.RLIM_INFINITY))
        try:
            p.pause(bucket_size=1 << 20)
            raise SystemExit("pause should have failed")
        except statepager.NoSpaceError as e:
            print("error:", e)
        assert not p.paused
        assert all(p.is_resident(t) for t in ts), [p.residency(t) for t in ts]
        assert all(torch.equal(t, r) for t, r in zip(ts, refs))
        assert p.stats()["mapped_bytes"] == mapped
        assert p.stats()["bytes_read"] == 2 << 20  # the two tensors that had gone out
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        p.pause()
        assert p.stats()["mapped_bytes"] == 0
        p.resume()
        assert all(torch.equal(t, r) for t, r in zip(ts, refs))
        p.close()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ulimit" in r.stdout and r.stdout.endswith("ok\n")


def test_pause_on_a_full_tmpfs_pages_back_in(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
    try:
        with Pager(str(mnt / "store"), page_size=64 * KiB) as p:
            ts = [p.empty(1 << 18) for _ in range(6)]  # 6 MiB into 3 MiB
            p.page_in(ts)
            for i, t in enumerate(ts):
                t.fill_(i)
            with pytest.raises(statepager.NoSpaceError, match="full"):
                p.pause(bucket_size=1 << 20)
            assert not p.paused
            assert all(p.is_resident(t) and bool((t == i).all()) for i, t in enumerate(ts))
            p.page_in(ts)  # not paused: paging goes on
    finally:
        subprocess.run(["umount", str(mnt)])


class FailingUnwind:
    """The Pager's real core with failures injected into page_all(): a pause pages out the
    first half of its tensors and then fails (a full disk), and the first page-in after
    that fails too, before paging anything (a read error)."""

    def __init__(self, core):
        self.core = core
        self.failures = 1

    def __getattr__(self, name):
        return getattr(self.core, name)

    def page_all(self, ids, bucket_size, out):
        if out:
            self.core.page_all(ids[:len(ids) // 2], bucket_size, True)
            raise statepager.NoSpaceError("injected: the store's disk is full")
        if self.failures:
            self.failures -= 1
            raise statepager.StoreIOError("injected: a read error")
        return self.core.page_all(ids, bucket_size, False)


def test_pause_that_cannot_page_back_in_stays_paused_and_resume_finishes(store_dir):
    with Pager(store_dir, page_size=64 * KiB) as p:
        ts = [p.empty(50_000) for _ in range(6)]
        p.page_in(ts)
        for i, t in enumerate(ts):
            t.fill_(i)
        core, p._core = p._core, FailingUnwind(p._core)
        with pytest.raises(statepager.StoreIOError, match="the Pager stays paused"):
            p.pause(bucket_size=60_000)
        assert p.paused
        assert [p.residency(t) for t in ts] == ["file"] * 3 + ["resident"] * 3
        with pytest.raises(statepager.UsageError, match=PAUSED):
            p.page_in(ts)
        p._core = core
        p.resume()
        assert all(p.is_resident(t) and bool((t == i).all()) for i, t in enumerate(ts))
        p.pause()
        p.resume()
        assert all(bool((t == i).all()) for i, t in enumerate(ts))


def test_resume_after_a_tensor_died_while_paused(store_dir):
    with Pager(store_dir, page_size=64 * KiB) as p:
        ts = [p.empty(10_000) for _ in range(3)]
        p.page_in(ts)
        for i, t in enumerate(ts):
            t.fill_(i)
        p.pause()
        del ts[1]  # released while paused: resume skips it
        p.resume()
        assert bool((ts[0] == 0).all()) and bool((ts[1] == 2).all())

"""Paging that waits on a background save while other Python threads run, for
tests/python/test_gil.py (each case in its own process, so that a deadlock, which no
thread of the process could interrupt, fails by the test's timeout):
    gil_run.py CASE STORE
Prints "ok" when the case completed. A thread spins in a Python loop throughout, taking
the GIL whenever it can; the save's copy runs on another Python thread, which needs the
GIL to start it: a call that waited holding the GIL would never return."""
import os
import sys
import threading
import time

import torch

import statepager
from statepager import checkpoint

KiB, MiB = 1 << 10, 1 << 20


def spinning():
    """A thread in a busy Python loop until the returned event is set."""
    stop = threading.Event()

    def spin():
        n = 0
        while not stop.is_set():
            n += 1

    threading.Thread(target=spin, daemon=True).start()
    return stop


def held_page_out(pager, store):
    """A tensor at rest whose store range a snapshot holds, paged in, changed and paged out
    again: the page-out waits, unstarted, until a thread copies the range (0.5 s from
    now). Returns (tensor, page-out handle, copying thread)."""
    t = pager.empty(MiB // 4)
    pager.page_in(t)
    t.fill_(1.0)
    pager.page_out(t)
    snapshot = pager._core.snapshot([t])
    target = os.path.join(store + "-copy")
    open(target, "wb").close()

    def copy():
        time.sleep(0.5)  # the main thread is waiting by now
        try:
            snapshot.copy_to([target], [(0, 0)])
        finally:
            snapshot.release()

    pager.page_in(t)
    t.fill_(2.0)
    handle = pager.page_out_async([t])
    copier = threading.Thread(target=copy)
    copier.start()
    return t, handle, copier


def page_in_at_budget(store):
    """page_in() at the budget waits for the held page-out to return its pages."""
    with statepager.Pager(store, page_size=64 * KiB, hbm_budget=MiB) as pager:
        t, handle, copier = held_page_out(pager, store)
        u = pager.empty(MiB // 4)
        t0 = time.monotonic()
        pager.page_in(u)
        waited = time.monotonic() - t0
        handle.wait()
        copier.join()
        assert waited > 0.3, f"page_in did not wait for the held page-out ({waited:.3f} s)"
        assert pager.stats()["buckets_held"] >= 1
        pager.page_out(u)
        pager.page_in(t)  # the bytes of the page-out that waited
        assert bool((t == 2.0).all())


def release_while_paging(store):
    """A tensor dropped while its page-out waits for the save: freed when it completes."""
    with statepager.Pager(store, page_size=64 * KiB) as pager:
        t, handle, copier = held_page_out(pager, store)
        t0 = time.monotonic()
        del t  # its deleter must not wait for the bucket
        assert time.monotonic() - t0 < 0.3
        assert pager.stats()["extents"] == 1  # reserved until its bucket completes
        handle.wait()
        copier.join()
        assert pager.stats()["extents"] == 0
        assert pager.stats()["buckets_held"] >= 1


def background_save(store):
    """statepager.checkpoint.save(background=True), then steps whose page-outs may wait for its copy."""
    with statepager.Pager(store, page_size=64 * KiB) as pager:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        pager.attach(opt, bucket_size=256 * KiB)
        for i in range(4):
            model(torch.randn(4, 512)).sum().backward()
            opt.step()
            if i == 0:
                handle = checkpoint.save(pager, store + "-ckpt", background=True)
        handle.wait()
        assert os.path.exists(os.path.join(store + "-ckpt", "manifest.json"))


CASES = {"page-in-at-budget": page_in_at_budget, "release-while-paging": release_while_paging,
         "background-save": background_save}

if __name__ == "__main__":
    case, store = sys.argv[1], sys.argv[2]
    stop = spinning()
    CASES[case](store)
    stop.set()
    print("ok")

"""A Pager belongs to the process that made it and to the directory it created: forked
children, directories tampered with, closed Pagers and their tensors."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import statepager
from statepager import checkpoint
from statepager import Pager

KiB = 1 << 10
TIMEOUT = 60


def run(code: str, *args: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (a fork or a fault must not take pytest with it)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=TIMEOUT)


def snapshot(root) -> dict:
    """Every entry below `root` (links not followed): file contents, "/" for directories."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.isdir(path) and not os.path.islink(path):
                out[rel] = "/"
            else:
                with open(path, "rb") as f:
                    out[rel] = f.read()
    return out


# A parent with a tensor at rest in its store (bytes 0..n-1) and one resident, then a
# child forked; CHILD is the child's body. The parent waits for it, prints its exit code,
# checks that its store is as it was, that it still holds the lock and that both tensors
# page in with their bytes, then closes.
FORKED = """
import os, sys, warnings, torch, statepager
# Python 3.12 warns of any fork of a process with threads (the Pager's I/O thread is one);
# the child's own output is what the tests read.
warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
store, device = sys.argv[1], sys.argv[2]
p = statepager.Pager(store, device, page_size=2 << 20)
at_rest = p.empty(50_000)
resident = p.empty(50_000)
p.page_in([at_rest, resident])
at_rest.copy_(torch.arange(50_000, dtype=torch.float32))
resident.fill_(7)
p.page_out(at_rest)

def files():
    out = {}
    for d, _, names in os.walk(store):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), store)] = f.read()
    return out

before = files()
pid = os.fork()
if pid == 0:
{child}
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
assert files() == before, "the child changed the parent's store"
try:
    statepager.Pager(store)
    raise AssertionError("the child released the parent's lock")
except statepager.StoreBusyError:
    pass
p.page_in(at_rest)
assert torch.equal(at_rest.cpu(), torch.arange(50_000, dtype=torch.float32)), "bytes lost"
assert bool((resident == 7).all())
p.close()
assert not os.path.exists(store)
print("parent ok")
"""


def forked(store_dir, child: str, device: str = "cpu") -> subprocess.CompletedProcess:
    body = textwrap.indent(textwrap.dedent(child), "    ")
    r = run(FORKED.replace("{child}", body), store_dir, device)
    assert "parent ok" in r.stdout, r.stdout + r.stderr
    return r


# How a forked child lets go of the parent's Pager: sys.exit(0) (the atexit close), its
# tensors dying, leaving a with-block, the Pager object going.
CHILD_EXITS = {
    "exit": "pass",
    "tensors-die": "del at_rest, resident\nimport gc; gc.collect()",
    "with-block": "with p:\n    pass",
    "pager-dies": "del p\nimport gc; gc.collect()",
}


@pytest.mark.parametrize("child", list(CHILD_EXITS))
def test_forked_child_exit_touches_nothing_of_the_parent(store_dir, child):
    r = forked(store_dir, CHILD_EXITS[child])
    assert "child exit 0" in r.stdout, r.stdout + r.stderr
    assert r.stderr == "", r.stderr


def test_close_in_forked_child_is_refused(store_dir):
    r = forked(store_dir, """
        try:
            p.close()
            print("child closed")
        except statepager.UsageError as e:
            assert f"belongs to process {os.getppid()}" in str(e), e
            assert "forked child" in str(e) and "nothing was touched" in str(e), e
            print("child refused")
    """)
    assert "child refused" in r.stdout and "child exit 0" in r.stdout, r.stdout + r.stderr
    assert r.stderr == "", r.stderr


def test_paging_in_forked_child_is_refused_at_once(store_dir):
    r = forked(store_dir, CHILD_PAGING)
    assert "child refused all" in r.stdout and "child exit 0" in r.stdout, r.stdout + r.stderr


# Each call would wait for the parent's I/O thread, which the child does not have.
CHILD_PAGING = """
        import time
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        for name, call in [
                ("page_in", lambda: p.page_in(at_rest)),
                ("page_out", lambda: p.page_out(resident)),
                ("read_ahead", lambda: p.read_ahead_async([at_rest])),
                ("discard", lambda: p.discard_async([resident])),
                ("empty", lambda: p.empty(10)),
                ("pause", lambda: p.pause()),
                ("attach", lambda: p.attach(opt)),
                ("save", lambda: statepager.checkpoint.save(p, store + "-ckpt")),
                ("begin_epoch", lambda: p.begin_epoch([at_rest])),
                ("trim", lambda: p._core.trim())]:
            start = time.monotonic()
            try:
                call()
                print("child allowed", name)
            except statepager.UsageError as e:
                assert "forked child" in str(e), (name, e)
            assert time.monotonic() - start < 5, name
        print("child refused all")
"""


def leave_store(path: str) -> None:
    """A store statepager left (its process ended without close()), with the stores
    "" and "opt0" in it."""
    r = run("""
        import os, sys, statepager
        p = statepager.Pager(sys.argv[1], page_size=64 * 1024)
        p.empty(1000, store="opt0")
        os._exit(0)
    """, path)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("extra,named", [
    ("results/metrics.csv", "results"),
    ("results/", "results"),
    ("state.bin.7", "state.bin.7"),
    ("opt0/state.bin.5", "opt0/state.bin.5"),
    ("opt1/state.bin", "opt1"),
])
def test_leftover_store_with_user_entries_is_refused_untouched(tmp_path, extra, named):
    store = str(tmp_path / "store")
    leave_store(store)
    assert os.path.exists(os.path.join(store, "opt0", "state.bin"))
    os.makedirs(os.path.dirname(os.path.join(store, extra)), exist_ok=True)
    if not extra.endswith("/"):
        with open(os.path.join(store, extra), "w") as f:
            f.write("mine")
    before = snapshot(store)
    with pytest.raises(statepager.UsageError, match=f"'{named}', which statepager did not "
                                                    "create.*touched nothing"):
        Pager(store)
    assert snapshot(store) == before


def test_leftover_store_of_ours_is_cleared(tmp_path):
    store = str(tmp_path / "store")
    leave_store(store)
    p = Pager(store, page_size=64 * KiB)
    assert sorted(os.listdir(store)) == [".lock", ".statepager-store", "state.bin"]
    p.close()
    assert not os.path.exists(store)


def test_close_spares_user_files_named_like_store_files(store_dir):
    p = Pager(store_dir, page_size=64 * KiB)
    p.empty(1000, store="opt0")
    mine = {"state.bin.7": b"mine", "opt0/state.bin.5": b"mine too"}
    for rel, data in mine.items():
        with open(os.path.join(store_dir, rel), "wb") as f:
            f.write(data)
    p.close()
    assert snapshot(store_dir) == {"opt0": "/", **mine}


def test_close_leaves_a_directory_put_in_its_place(tmp_path):
    store = str(tmp_path / "store")
    p = Pager(store, page_size=64 * KiB)
    os.rename(store, str(tmp_path / "moved"))
    os.mkdir(store)  # the user's, empty
    p.close()
    assert os.path.isdir(store), "close() removed a directory it did not create"
    assert os.listdir(tmp_path / "moved") == []


def test_refused_pager_leaves_the_directory_as_it_was(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / ".statepager-store").write_text("another program's marker\n")
    before = snapshot(store)
    with pytest.raises(statepager.UsageError, match="nothing was touched"):
        Pager(str(store))
    assert snapshot(store) == before, "a refused Pager left a .lock"


def test_pager_failing_on_a_full_disk_leaves_nothing(sized_tmpfs):
    mnt = sized_tmpfs(1, "a Pager() on a full disk")
    filler = os.path.join(mnt, "filler")
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    store = os.path.join(mnt, "store")
    with pytest.raises(statepager.NoSpaceError):
        Pager(store, page_size=64 * KiB)
    assert sorted(os.listdir(mnt)) == ["filler"], "a failed Pager() left its store"
    os.unlink(filler)
    Pager(store, page_size=64 * KiB).close()  # the directory is usable once space is freed


CLOSED_CALLS = {
    "pause": lambda p, t: p.pause(),
    "resume": lambda p, t: p.resume(),
    "page_in": lambda p, t: p.page_in(t),
    "page_out": lambda p, t: p.page_out(t),
    "empty": lambda p, t: p.empty(10),
    "attach": lambda p, t: p.attach(torch.optim.SGD([torch.zeros(1, requires_grad=True)],
                                                    lr=0.1)),
    "save": lambda p, t: checkpoint.save(p, p.directory + "-ckpt"),
    "load": lambda p, t: checkpoint.load(p, p.directory + "-ckpt"),
    "scope": lambda p, t: p.scope().__enter__(),
    "begin_epoch": lambda p, t: p.begin_epoch([t]),
}


@pytest.mark.parametrize("name", sorted(CLOSED_CALLS))
def test_calls_on_a_closed_pager_are_refused(store_dir, name):
    p = Pager(store_dir, page_size=64 * KiB)
    t = p.empty(1000)
    p.close()
    with pytest.raises(statepager.UsageError, match="this Pager is closed"):
        CLOSED_CALLS[name](p, t)
    assert not p.paused
    assert p.stats()["extents"] >= 0  # counters stay readable
    p.close()  # idempotent


READS = ["t.sum()", "t.add_(1)", "t.tolist()", "t.clone()", "view.sum()", "t.double()",
         "t[3].item()", "torch.mm(t.view(10, 100), torch.ones(100, 1, device=t.device))",
         "t.copy_(t + 1)", "torch.ones_like(t).copy_(t)"]


def read_after_close(store_dir, device: str) -> subprocess.CompletedProcess:
    """Reads a closed Pager's tensor in the ways of READS: each must raise the closed
    Pager's error, never fault nor return values."""
    return run(f"""
        import sys, torch, statepager
        p = statepager.Pager(sys.argv[1], sys.argv[2], page_size=2 << 20)
        t = p.empty(1000)
        p.page_in(t)
        t.fill_(1)
        view = t[10:]
        p.close()
        for read in {READS!r}:
            try:
                eval(read)
                print("read", read)
            except RuntimeError as e:
                assert "Pager is closed" in str(e), (read, e)
        assert "residency 'closed'" in repr(t), repr(t)
        assert "residency 'closed'" in repr(t.untyped_storage())
        del t, view
        print("ok")
    """, store_dir, device)


def test_reading_a_tensor_after_close_raises(store_dir):
    r = read_after_close(store_dir, "cpu")
    assert r.returncode == 0 and r.stdout == "ok\n", (r.returncode, r.stdout, r.stderr)


def storage_repr(store_dir, device: str) -> subprocess.CompletedProcess:
    return run("""
        import sys, torch, statepager
        p = statepager.Pager(sys.argv[1], sys.argv[2], page_size=2 << 20)
        t = p.empty(1000)
        for text in (repr(t.untyped_storage()), str(t.untyped_storage()),
                     repr(t[5:].untyped_storage()), repr(t.storage()), str(t.storage())):
            assert "not resident" in text and "residency 'zero'" in text, text
        p.page_in(t)
        t.fill_(2)
        assert "2.0" in repr(t.storage()) and "not resident" not in repr(t.storage())
        assert "not resident" not in repr(torch.ones(3).untyped_storage())
        p.close()
        print("ok")
    """, store_dir, device)


def test_repr_of_a_storage_not_resident_is_a_placeholder(store_dir):
    r = storage_repr(store_dir, "cpu")
    assert r.returncode == 0 and r.stdout == "ok\n", (r.returncode, r.stdout, r.stderr)

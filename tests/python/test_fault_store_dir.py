"""The store directory through statepager.Pager (host backend): statepager takes only a
new or empty directory or a store it left, refuses anything else untouched, never follows
a planted symbolic link, and close() deletes only what it created."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import statepager
from statepager import Pager

KiB = 1 << 10
MARKER = ".statepager-store"


def snapshot(root) -> dict:
    """Every entry below `root`, links not followed: file contents, link targets, "/" for
    directories. What a refused Pager must leave exactly as it was."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "-> " + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = "/"
            else:
                with open(path, "rb") as f:
                    out[rel] = f.read()
    return out


def write(path, text="x") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def read(path) -> str:
    with open(path) as f:
        return f.read()


def round_trip(pager: Pager) -> None:
    """A tensor out to the store and back: the store works."""
    t = pager.empty(50_000)
    pager.page_in(t)
    t.copy_(torch.arange(50_000, dtype=torch.float32))
    pager.page_out(t)
    pager.page_in(t)
    assert torch.equal(t, torch.arange(50_000, dtype=torch.float32))


@pytest.fixture(scope="module")
def killed_stores(tmp_path_factory):
    """Stores left by a kill -9: a child process paged out into each and was killed."""
    root = tmp_path_factory.mktemp("killed")
    paths = [root / f"store{i}" for i in range(16)]
    code = textwrap.dedent(f"""
        import os, signal, statepager
        pagers = []
        for path in {[str(p) for p in paths]!r}:
            p = statepager.Pager(path, page_size=64 << 10)
            t = p.empty(100_000, store="0-dense")
            p.page_in(t); t.fill_(3.0); p.page_out(t)
            pagers.append(p)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    return paths


@pytest.fixture
def leave_store(killed_stores):
    """leave_store(path): one of the killed process's stores, moved to `path` (one child
    process for the module: starting one takes seconds). Moved, not copied: statepager
    recognizes its files by their inodes (backing/store_dir.h)."""
    return lambda path: os.rename(killed_stores.pop(), path)


def test_dot_in_a_project_folder_is_refused_and_its_files_survive(tmp_path, monkeypatch):
    project = tmp_path / "project"
    write(project / "src" / "main.py", "print('hello')")
    write(project / "README.md", "mine")
    write(project / "state.bin", "a file of mine with a store's name")
    before = snapshot(project)
    monkeypatch.chdir(project)
    for directory in (".", "./", str(project)):
        with pytest.raises(statepager.UsageError, match="not empty") as e:
            Pager(directory, page_size=64 * KiB)
        assert str(project) in str(e.value) and "choose a new or empty directory" in str(e.value)
    assert snapshot(project) == before  # no marker, no .lock, nothing deleted


def test_symlink_to_a_folder_is_refused(tmp_path):
    target = tmp_path / "data"
    write(target / "keep.txt", "mine")
    (tmp_path / "link").symlink_to(target)
    (tmp_path / "empty").mkdir()
    (tmp_path / "link-to-empty").symlink_to(tmp_path / "empty")
    before = snapshot(tmp_path)
    for link, to in (("link", target), ("link-to-empty", tmp_path / "empty")):
        with pytest.raises(statepager.UsageError, match="symbolic link") as e:
            Pager(str(tmp_path / link), page_size=64 * KiB)
        assert str(tmp_path / link) in str(e.value) and str(to) in str(e.value)
    assert snapshot(tmp_path) == before


def test_symlinked_ancestor_is_resolved_once(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    with Pager(str(tmp_path / "alias" / "store"), page_size=64 * KiB) as p:
        assert p.directory == str(tmp_path / "real" / "store")
        round_trip(p)
    assert not (tmp_path / "real" / "store").exists()


def test_relative_path_then_chdir_deletes_nothing_elsewhere(tmp_path, monkeypatch):
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    # What the store would hold, in the other folder: none of it may be touched.
    write(there / "store" / "state.bin", "other")
    write(there / "store" / "opt0" / "state.bin", "other")
    write(there / "store" / ".lock", "other")
    write(there / "store" / MARKER, "statepager-store 1\n")
    before = snapshot(there)
    monkeypatch.chdir(here)
    p = Pager("store", page_size=64 * KiB)
    assert p.directory == str(here / "store")
    p.empty(10_000, store="opt0")
    assert (here / "store" / "opt0" / "state.bin").exists()
    round_trip(p)
    monkeypatch.chdir(there)
    p.close()
    assert not (here / "store").exists()
    assert snapshot(there) == before


def test_parent_of_a_live_store_is_refused_and_the_store_keeps_working(tmp_path):
    runs = tmp_path / "runs"
    with Pager(str(runs / "rank0"), page_size=64 * KiB) as live:
        t = live.empty(100_000)
        live.page_in(t)
        t.fill_(2.5)
        live.page_out(t)
        before = snapshot(runs)
        for parent in (runs, tmp_path):
            with pytest.raises(statepager.UsageError) as e:
                Pager(str(parent), page_size=64 * KiB)
            assert str(parent) in str(e.value) and str(runs / "rank0") in str(e.value)
        assert snapshot(runs) == before
        live.page_in(t)
        assert bool((t == 2.5).all())
        round_trip(live)


def test_store_inside_a_live_or_left_store_is_refused(tmp_path, leave_store):
    outer = tmp_path / "outer"
    with Pager(str(outer), page_size=64 * KiB) as live:
        round_trip(live)
        for inner in (outer / "inner", outer / "a" / "b"):
            with pytest.raises(statepager.UsageError, match="inside") as e:
                Pager(str(inner), page_size=64 * KiB)
            assert str(inner) in str(e.value) and str(outer) in str(e.value)
        assert sorted(os.listdir(outer)) == [".lock", MARKER, "state.bin"]
    leave_store(outer)
    with pytest.raises(statepager.UsageError, match="inside"):
        Pager(str(outer / "inner"), page_size=64 * KiB)
    assert not (outer / "inner").exists()


@pytest.mark.parametrize("planted", [".lock", "state.bin", "0-dense"])
def test_planted_symlink_in_a_left_store_is_refused_and_its_target_unchanged(tmp_path, planted,
                                                                             leave_store):
    write(tmp_path / "victim.txt", "precious")
    write(tmp_path / "victim" / "state.bin", "precious")
    store = tmp_path / "store"
    leave_store(store)
    if (store / planted).is_dir():
        shutil.rmtree(store / planted)
    elif (store / planted).exists():
        os.remove(store / planted)
    (store / planted).symlink_to(tmp_path / ("victim" if planted == "0-dense" else "victim.txt"))
    before = snapshot(tmp_path)
    with pytest.raises(statepager.UsageError) as e:
        Pager(str(store), page_size=64 * KiB)
    assert planted in str(e.value) and str(store) in str(e.value)
    assert snapshot(tmp_path) == before


def test_left_store_is_reused_and_removed(tmp_path, leave_store):
    store = tmp_path / "store"
    leave_store(store)
    assert (store / "0-dense" / "state.bin").exists()
    with Pager(str(store), page_size=64 * KiB) as p:
        assert sorted(os.listdir(store)) == [".lock", MARKER, "state.bin"]  # 0-dense went
        t = p.empty(100_000)
        p.page_in(t)
        assert torch.count_nonzero(t) == 0  # a new store: nothing resumed
        round_trip(p)
    assert not store.exists()  # statepager made it, so close() removes it


def test_left_store_with_a_file_of_yours_is_refused_untouched(tmp_path, leave_store):
    store = tmp_path / "store"
    leave_store(store)
    write(store / "notes.txt", "mine")
    before = snapshot(store)
    with pytest.raises(statepager.UsageError, match="notes.txt"):
        Pager(str(store), page_size=64 * KiB)
    assert snapshot(store) == before


def test_empty_directory_given_stays_and_new_one_goes(tmp_path):
    given = tmp_path / "given"
    given.mkdir()
    with Pager(str(given), page_size=64 * KiB) as p:
        p.empty(10_000, store="opt0")
        round_trip(p)
        assert (given / "opt0" / "state.bin").exists()
    assert given.is_dir() and os.listdir(given) == []
    with Pager(str(tmp_path / "new"), page_size=64 * KiB) as p:
        round_trip(p)
    assert not (tmp_path / "new").exists()


def test_files_added_by_others_survive_close(tmp_path):
    store = tmp_path / "store"
    with Pager(str(store), page_size=64 * KiB) as p:
        round_trip(p)
        write(store / "notes.txt", "mine")
    assert read(store / "notes.txt") == "mine"
    assert sorted(os.listdir(store)) == ["notes.txt"]

"""Where checkpoints live on disk (statepager.checkpoint): never inside a store, written
into a temporary directory beside their path, and read only from inside themselves.

A load reads only regular files of the checkpoint, none of them reached through a symlink
(open_file: a link could lead out of it, a FIFO would block the read forever), and refuses
a path that holds no checkpoint, naming what is missing (require_checkpoint).

A save writes into `<path>.tmp-<pid>-<8 hex digits>/`, which holds LOCK: the saving
process keeps an exclusive flock on it until the directory is renamed to `path` or
removed. The kernel drops a flock with its process, so a temporary whose LOCK can be
locked belongs to a save that was killed (-9, a crash, a lost node): the next save or
load beside it removes it, and only when it holds nothing but what a save writes (LOCK,
manifest.json, <name>/state.bin). Anything else, and any temporary whose lock cannot be
tested (a filesystem without flock), is left alone.

Thread-safety: none needed; every function works on the paths it is given.
Errors: UsageError for a save into a store and for a load of a path that holds no
checkpoint, CorruptStoreError for a checkpoint file that is a link, not a regular file, or
not inside its checkpoint, OSError from the filesystem otherwise.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import uuid

from statepager import _C
from statepager.util.names import MANIFEST

log = logging.getLogger("statepager")

# The file StoreDir keeps in every store directory (StoreDir::kMarker, backing/store_dir.h).
STORE_MARKER = ".statepager-store"
LOCK = ".statepager-save"
DATA = "state.bin"
_TEMPORARY = re.compile(r".+\.tmp-\d+-[0-9a-f]{8}")


def refuse_store_target(path: str, store_directory: str) -> None:
    """UsageError when `path` lies inside a store directory: the Pager's own
    (`store_directory`, compared by real path, marker or not) or any directory holding
    STORE_MARKER. A store directory is statepager's alone (backing/store_dir.h): a
    checkpoint there would stop the next Pager from taking the directory."""
    target = os.path.realpath(path)
    store = os.path.realpath(store_directory)
    inside = store if os.path.commonpath([target, store]) == store else None
    at = os.path.dirname(target)
    while inside is None:
        if os.path.lexists(os.path.join(at, STORE_MARKER)):
            inside = at
        elif at == os.path.dirname(at):
            return
        at = os.path.dirname(at)
    raise _C.UsageError(f"checkpoint {path} would be written inside the statepager store "
                        f"{inside}, which holds statepager's working files alone: save it "
                        "outside every store directory")


class Temporary:
    """The directory a save writes into, locked (see the module docstring) until commit()
    renames it to its path or discard() removes it. Owned by one save."""

    def __init__(self, path: str):
        self.target = path
        self.path = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.mkdir(self.path)
        try:
            self._lock = os.open(os.path.join(self.path, LOCK),
                                 os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except BaseException:
            os.rmdir(self.path)
            raise
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            # No flock here (some network filesystems): without LOCK the temporary is never
            # taken for a dead one, and if this save is killed, it is left to the user.
            os.unlink(os.path.join(self.path, LOCK))
            log.info("statepager: no flock on %s (%s); if this save is killed, remove its "
                     "temporary directory by hand", self.path, e)

    def commit(self) -> None:
        """Renames the complete directory to its path, durably. LOCK stays inside until the
        rename is done, so the temporary is recognisable to the very end (a crash right
        after the rename leaves a harmless LOCK in the checkpoint)."""
        fsync_dir(self.path)
        os.rename(self.path, self.target)
        fsync_dir(os.path.dirname(self.target))
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.target, LOCK))
        self._close()

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._close()

    def _close(self) -> None:
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1


def remove_dead_temporaries(path: str) -> None:
    """Removes the temporaries of killed saves beside `path` (in its directory)."""
    parent = os.path.dirname(path)
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return
    for name in names:
        if not _TEMPORARY.fullmatch(name):
            continue
        tmp = os.path.join(parent, name)
        try:
            _remove_if_dead(tmp)
        except FileNotFoundError:
            pass  # removed by another process meanwhile
        except OSError as e:  # tidying up never fails the save or load that does it
            log.warning("statepager: could not remove %s: %s", tmp, e)


def _remove_if_dead(tmp: str) -> None:
    if not stat.S_ISDIR(os.lstat(tmp).st_mode):
        return  # a save's temporary is a directory, never a symlink
    try:
        fd = os.open(os.path.join(tmp, LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # no LOCK (not a save's, or a save that just finished) or not ours to open
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                log.info("statepager: cannot test whether the save writing %s is alive "
                         "(%s); left in place", tmp, e)
            return  # a live save holds it
        foreign = _foreign_entry(tmp)
        if foreign is not None:
            log.warning("statepager: %s looks like the temporary directory of a killed "
                        "save, but holds %s, which a save does not write; left in place",
                        tmp, foreign)
            return
        shutil.rmtree(tmp)
        log.warning("statepager: removed %s, left by a save that was killed before it "
                    "finished", tmp)
    finally:
        os.close(fd)


def _foreign_entry(tmp: str) -> str | None:
    """The first entry of `tmp` that a save does not write (by name and kind), or None."""
    for name in os.listdir(tmp):
        mode = os.lstat(os.path.join(tmp, name)).st_mode
        if name in (LOCK, MANIFEST) and stat.S_ISREG(mode):
            continue
        if not stat.S_ISDIR(mode) or name.startswith("."):
            return name
        for inner in os.listdir(os.path.join(tmp, name)):
            if inner != DATA or not stat.S_ISREG(os.lstat(os.path.join(tmp, name, inner)).st_mode):
                return os.path.join(name, inner)
    return None


def require_checkpoint(path: str) -> None:
    """UsageError unless `path` is a directory holding a manifest, naming what is missing:
    a mistyped path is an error, never an empty checkpoint."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise _C.UsageError(f"no checkpoint at {path}: nothing exists there. Check the path "
                            "(statepager.checkpoint.load(pager, path, missing_ok=True) "
                            "loads a checkpoint only where one exists)") from None
    if not stat.S_ISDIR(mode):
        raise _C.UsageError(f"{path} is not a checkpoint: it is {_kind(mode)}, a checkpoint "
                            "is the directory statepager.checkpoint.save() wrote")
    if not os.path.lexists(os.path.join(path, MANIFEST)):
        raise _C.UsageError(f"{path} is not a checkpoint: it holds no {MANIFEST} (a checkpoint "
                            "is the directory statepager.checkpoint.save() wrote, which "
                            "has one from the moment it exists)")


def open_file(path: str) -> int:
    """A read-only file descriptor of `path`, a file of a checkpoint, once it is known to be
    a regular file that is not a symlink: CorruptStoreError naming it otherwise, without
    reading from it (O_NONBLOCK: opening a FIFO does not wait for a writer). The caller
    closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise _C.CorruptStoreError(
            f"{path} is a symlink (to {_link_target(path)}): statepager reads a checkpoint's "
            "files only from inside it, never through a link. Nothing was loaded") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _C.CorruptStoreError(f"{path} is {_kind(mode)}, not a regular file: a "
                                       "checkpoint holds regular files only. Nothing was loaded")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return kind
    return "not a file"


def _link_target(path: str) -> str:
    try:
        return repr(os.readlink(path))
    except OSError:
        return "?"


def data_file(root: str, recorded, name: str, manifest_path: str) -> str:
    """The path of optimizer `name`'s data file in checkpoint `root`, whose manifest
    records it as `recorded`: it must be <name>/state.bin, a regular file in a directory
    of the checkpoint, neither of them a symlink. CorruptStoreError otherwise."""
    expected = f"{name}/{DATA}"

    def refuse(why: str):
        raise _C.CorruptStoreError(
            f"{manifest_path}: optimizer {name!r}'s data file {recorded!r} {why}; a "
            f"checkpoint's data files are <optimizer>/{DATA} inside it. Nothing was loaded")

    if recorded != expected:
        refuse(f"is not {expected!r}")
    directory = os.path.join(root, name)
    path = os.path.join(directory, DATA)
    for p, is_kind in ((directory, stat.S_ISDIR), (path, stat.S_ISREG)):
        try:
            mode = os.lstat(p).st_mode
        except OSError as e:
            refuse(f"cannot be read ({e})")
        if stat.S_ISLNK(mode):
            refuse(f"goes through the symlink {p}")
        if not is_kind(mode):
            refuse(f"is not a regular file in a directory ({p})")
    real_root = os.path.realpath(root)
    if os.path.realpath(path) != os.path.join(real_root, name, DATA):
        refuse(f"resolves outside {real_root}")
    return path


def make_parents(path: str) -> None:
    """mkdir -p, with each new directory's entry made durable in its parent."""
    if os.path.isdir(path):
        return
    make_parents(os.path.dirname(path))
    try:
        os.mkdir(path)
    except FileExistsError:
        return
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

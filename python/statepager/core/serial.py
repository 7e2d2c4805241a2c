"""One operation at a time per Pager.

A step pages its buckets in and out while it runs; a save, a pause, a state_dict() or
another step on another thread would page the same tensors under it, and what reads
them then reads unmapped memory. So every entry point that pages tensors or reads or
changes the state holds the Pager's re-entrant lock (lock_of) for its whole run:
calls from other threads wait for it, calls from within it (the step's hooks, its own
page-ins) go on. Waiting for the lock releases the GIL, as the pager's own waits do.

A forked child gets each Pager's lock anew: a thread of the parent holding one does not
exist there (and the child's calls raise at once: Pager.close).

holding(pager) tells code that serves users (statepager.core.state_access) whether it
runs inside such an entry point on this thread, where statepager's own code reads the
optimizer's state as it is.
"""
from __future__ import annotations

import functools
import os
import threading
import weakref

_locks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Pager -> its lock


def add(pager) -> None:
    """Gives a new Pager its lock (Pager.__init__, before anything can take it)."""
    _locks[pager] = threading.RLock()


def _new_locks_in_child() -> None:
    for pager in list(_locks.keys()):
        _locks[pager] = threading.RLock()


os.register_at_fork(after_in_child=_new_locks_in_child)


def lock_of(owner) -> threading.RLock:
    """The lock of `owner`'s Pager: owner is a Pager, or has one as .pager. A plain
    RLock, entered with `with` (its acquire cannot be split from the `with` by a Ctrl-C,
    as a Python-level __enter__ could)."""
    return _locks[getattr(owner, "pager", owner)]


def serialized(method):
    """method(self, ...) run holding the lock of self's Pager (lock_of)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with lock_of(self):
            return method(self, *args, **kwargs)
    return locked


def holding(pager) -> bool:
    """True when this thread is inside one of the pager's entry points."""
    return lock_of(pager)._is_owned()

"""Pagers closed at interpreter exit: their I/O threads joined and their stores deleted
while torch, CUDA and Python are whole."""
from __future__ import annotations

import atexit
import itertools
import os
import sys
import weakref

# Pagers not yet garbage-collected, by creation order; closed at interpreter exit. A forked
# child starts with none: those it inherits are its parent's (see Pager.close()).
_live: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_serials = itertools.count()
os.register_at_fork(after_in_child=_live.clear)


def track(pager) -> None:
    """Closes `pager` at interpreter exit if it is still open then."""
    serial = next(_serials)
    if serial == 0:
        atexit.register(_close_at_exit)
    _live[serial] = pager


def _close_at_exit() -> None:
    """Closes the Pagers still open when the interpreter exits, newest first: their I/O
    threads are joined and their stores deleted while torch, CUDA and Python are whole,
    before Python tears down its objects (in no set order) and C++ its statics. Registered
    when the first Pager is made, so it runs before the atexit handlers of torch and of
    anything set up before that, and after those registered later."""
    for serial in sorted(_live.keys(), reverse=True):
        pager = _live.get(serial)
        if pager is None:
            continue
        try:
            pager.close()
        except Exception as e:  # an exit status or traceback of the program's own matters more
            print(f"statepager: closing the Pager on {pager.directory} at exit failed: {e}",
                  file=sys.stderr)

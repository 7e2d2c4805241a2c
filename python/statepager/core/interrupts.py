"""Sections that a Ctrl-C (SIGINT, KeyboardInterrupt) cannot split.

Python raises KeyboardInterrupt between any two bytecodes of the main thread. An
all-or-nothing operation has windows where that would leave it neither: a pager epoch
opened and not yet owned by the `try` that ends it, a commit and the bookkeeping that goes
with it, a roll-back half done. Inside such a window SIGINT is recorded instead, and
delivered (KeyboardInterrupt raised, or the program's own handler called) once the window
closes, where the operation can take it as any other failure or has finished.

Only on the main thread (the only one Python delivers signals to) and only while SIGINT has
a Python handler; SIG_IGN, SIG_DFL and handlers installed outside Python are left alone.
"""
from __future__ import annotations

import contextlib
import signal
import threading


class Deferral:
    """SIGINT recorded from construction until release(), which restores the handler
    and delivers what came and poll() did not (at most once). poll() delivers it at a
    point the caller chose (where a failure is undone: a step between buckets).
    release() is idempotent."""

    def __init__(self):
        self._previous = None
        self._received = []
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        if callable(previous):
            signal.signal(signal.SIGINT, self._record)
            self._previous = previous

    def _record(self, signum, frame) -> None:
        self._received.append(frame)

    def poll(self) -> None:
        """Delivers a SIGINT that came since the last poll() (the default handler raises
        KeyboardInterrupt here); the section stays deferred."""
        if self._received and self._previous is not None:
            frame, self._received = self._received[-1], []
            self._previous(signal.SIGINT, frame)

    def release(self) -> None:
        """Restores the handler; then, if SIGINT came since the last poll(), calls it."""
        previous, self._previous = self._previous, None
        if previous is None:
            return
        signal.signal(signal.SIGINT, previous)
        if self._received:
            previous(signal.SIGINT, self._received[-1])


@contextlib.contextmanager
def deferred():
    """A block SIGINT cannot interrupt: one that came is delivered as the block ends (after
    an exception leaving it, too: the interrupt is then raised with it as its context)."""
    deferral = Deferral()
    try:
        yield
    finally:
        deferral.release()

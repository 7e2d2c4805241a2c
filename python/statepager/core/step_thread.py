"""A step in flight's buckets stepped on a thread of their own, while the training thread
runs the forward (see Note [A thread steps the buckets under the forward] in
docs/design.md).

A StepThread is started by the forward's first hook (ForwardOverlap, statepager.core.
overlap) and steps the buckets of that step, in order, holding the Pager's lock from its
first bucket to its last: every other entry point (a state read, a save, a zero_grad in
place) waits for the step to be whole, as it would for a step() on another thread. While
it runs, the forward's hooks take no lock: each waits, releasing the GIL, until the
thread has stepped the buckets it needs (a count published once their event is
recorded), and then on the device. A bucket that fails on the thread ends the step as it
would on the training thread (a resumable step pending); the error is raised, once, on
the training thread by the next hook that waits for the thread, unless a step has
finished since (raise_failure() then logs it).

Thread-safety: started, waited for and joined from one training thread; the thread itself
touches the step only while holding the Pager's lock. A forked child has no such thread:
there each StepThread counts as returned, and its hooks go on as without one (what needs
the Pager meets its refusal of a child's calls: Note [A Pager across fork]).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref

import torch

from statepager.core.serial import lock_of

log = logging.getLogger("statepager")


class StepThread:
    """Steps `run`'s buckets (a Pipeline, the binding's step in flight) through `advance`
    (StreamedOptimizer.step_in_flight_to, which records each bucket's event) on a thread
    of its own. `binding`: whose Pager's lock it holds, and whose step in flight `run`
    must still be for it to go on."""

    def __init__(self, binding, run, advance):
        self._binding, self._run, self._advance = binding, run, advance
        self._changed = threading.Condition()
        self._stepped = 0     # buckets stepped, each one's event recorded
        self._done = False    # the thread has returned
        self._failure: BaseException | None = None  # a bucket's, not yet raised
        self._last = binding.last  # the binding's last finished step's stats, at the start
        self._thread = threading.Thread(target=self._steps, name="statepager-step",
                                        daemon=False)
        self._device = binding.pager.device
        # Thread-local: what the training thread's step() would create state on.
        self._default_device = torch.get_default_device()
        _live.add(self)

    def start(self) -> None:
        self._run.stats.thread_start_seconds = time.monotonic() - self._run.loop_started
        self._thread.start()

    def wait_for(self, n: int) -> bool:
        """Waits (the GIL released) until n buckets have stepped or the thread has
        returned; True when they have. A failure on the thread raises here."""
        if self._stepped >= n and self._failure is None:
            return True  # published already: most of the forward's hooks take no lock
        with self._changed:
            self._changed.wait_for(lambda: self._stepped >= n or self._done)
        self.raise_failure()
        return self._stepped >= n

    def join(self) -> None:
        """Waits for the thread to return; a failure on it raises here."""
        with self._changed:
            self._changed.wait_for(lambda: self._done)
        self._thread.join()
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raises, once, the error a bucket failed with on the thread; where a step has
        finished since (the failed one, pending, finished by step()), logs it instead."""
        with self._changed:
            failure, self._failure = self._failure, None
        if failure is None:
            return
        if self._binding.last is not self._last:
            log.warning("statepager %s: a bucket failed on the step's thread (%r); the step "
                        "has been finished since", self._binding.name, failure)
            return
        raise failure

    def _steps(self) -> None:
        run, binding = self._run, self._binding
        try:
            if self._default_device.type != "cpu":  # else torch's own, without a mode
                torch.set_default_device(self._default_device)
            with _on(self._device), lock_of(binding):
                cpu = time.thread_time()
                try:
                    while binding.step_in_flight is run and run.stepped < len(run.buckets):
                        self._advance(run.stepped + 1)
                        with self._changed:
                            self._stepped = run.stepped
                            self._changed.notify_all()
                finally:  # under the lock: the step's stats are complete once it is free
                    run.stats.thread_cpu_seconds += time.thread_time() - cpu
        except BaseException as error:  # the step ended as a failed step() ends it
            with self._changed:
                self._failure = error
        finally:
            with self._changed:
                self._done = True
                self._changed.notify_all()

    def _forget(self) -> None:
        """In a forked child: returned, its condition anew (the parent's may be held)."""
        self._changed, self._done = threading.Condition(), True


_live: "weakref.WeakSet[StepThread]" = weakref.WeakSet()
os.register_at_fork(after_in_child=lambda: [t._forget() for t in list(_live)])


def _on(device: torch.device):
    """The thread's current CUDA device (each thread has its own): the Pager's."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

"""Resumable steps: atomic per bucket (see Note [Resumable steps] in docs/design.md).

A step that fails leaves every bucket stepped or not, never torn, and remembers which it
stepped; the next step() finishes that step (the buckets not stepped, with the grads
they have) instead of starting another. Nothing is kept twice: a bucket's page-in is for
a read (Pager.page_in_async(for_read=True): its bytes at rest stay where they are while
it is resident) and its page-out writes in place. Until that page-out is issued, a
failure hands the bucket back (Pager.release_unchanged_async: its device changes
dropped, no write; the pipeline does that, statepager.core.pipeline) and
ResumableStep.put_back() restores what its step changed in ordinary memory: its
parameters' unpaged state (step counters, resident state), grads, residual exception
lists and the param groups' options, the parameters the pager does not own and residual
masters' model parameters (from undo copies, UndoCopies, taken a bucket ahead as an
atomic step takes them), and fp32 masters' model parameters (written anew from the
masters). Once its page-out is issued a bucket counts as stepped: a page-out that fails
leaves its new bytes resident and whole, written by the next step's start
(residency.to_rest).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from statepager.core.atomic import (UndoCopies, copy_groups, rebuild_mirrors, restore_groups,
                                    restore_state)


@dataclass
class _Open:
    """The bucket stepping, as it was before its step (ResumableStep.save)."""

    bucket: object
    params: list            # its parameters and those of its chunks
    state: dict             # UndoCopies.copy_state of their state
    grads: list             # [(param, its grad)]
    groups: list            # copy_groups: the param groups' options (their step counters)
    forms: list             # [(form, its exceptions, its fingerprint)]
    written: bool = False   # after_bucket may have written model parameters


class ResumableStep:
    """One step's progress over `buckets` (the plan it started with), kept from its
    first attempt until every bucket has stepped. The pipeline calls take_ahead(),
    save() and writing() per bucket as it does an AtomicStep's, stepped() once the
    bucket's page-out is issued, and put_back() after a failure."""

    def __init__(self, pager, optimizer, buckets: list, undo: UndoCopies,
                 rebuild_mirror: Callable | None = None):
        self.pager, self.optimizer, self.buckets = pager, optimizer, buckets
        self.undo, self.rebuild_mirror = undo, rebuild_mirror
        self._stepped: set[int] = set()  # id() of the buckets stepped
        # id(bucket) -> the event of its undo copies: those taken before the step
        # (UndoCopies.take_before_step) where they are of these buckets. Unchecked here:
        # the step checks every residual master's parameter against its fingerprint
        # before writing any (Steps._params_checked_up_front), and refuses a changed one.
        self._taken, _ = undo.taken_before_step(buckets, check=False)
        self._open: _Open | None = None

    def remaining(self) -> list:
        """The buckets not stepped yet, in order."""
        return [b for b in self.buckets if id(b) not in self._stepped]

    @property
    def stepped_count(self) -> int:
        return len(self._stepped)

    def take_ahead(self, bucket) -> None:
        """Takes the bucket's undo copies now (AtomicStep.take_ahead)."""
        if id(bucket) not in self._taken:
            self._taken[id(bucket)] = self.undo.take_bucket(bucket)

    def save(self, bucket) -> None:
        """Before the bucket steps: what its step changes outside the pager, kept."""
        self.take_ahead(bucket)
        if self.undo.written_by_the_step(bucket.params, bucket.chunks):
            self.undo.join(self._taken[id(bucket)])
        params = [*bucket.params, *(c.param for c in bucket.chunks)]
        state = self.optimizer.state
        kept = self.undo.copy_state({p: state[p] for p in params if p in state}, part=True)
        self._open = _Open(bucket, params, kept, [(p, p.grad) for p in params],
                           copy_groups(self.optimizer.param_groups),
                           [(f, f.exceptions_as_set, f.fingerprint) for f in bucket.forms])

    def writing(self, bucket) -> None:
        """Before after_bucket: it may write model parameters, once their copies are taken."""
        self.undo.join(self._taken[id(bucket)])
        self._open.written = True

    def stepped(self, bucket) -> None:
        """The bucket stepped (its page-out is issued next)."""
        self._stepped.add(id(bucket))
        self._taken.pop(id(bucket), None)
        self._open = None

    def put_back(self) -> None:
        """After a failure, the buckets not stepped handed back (at rest as before the
        step): what the bucket that was stepping changed in ordinary memory as before
        it. Undo copies of the others are taken again by the next attempt."""
        opened, self._open = self._open, None
        self._taken = {}
        if opened is None:
            return
        b = opened.bucket
        self.undo.settle()
        self.undo.put_back([b])
        if opened.written and self.rebuild_mirror is not None:
            rebuild_mirrors(self.pager, b, self.rebuild_mirror)
        restore_state(self.optimizer.state, opened.state, opened.params)
        restore_groups(self.optimizer.param_groups, opened.groups)
        for p, grad in opened.grads:
            p.grad = grad
        for f, exceptions, fingerprint in opened.forms:
            f.exceptions, f.fingerprint = exceptions, fingerprint

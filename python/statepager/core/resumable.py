"""Resumable steps: atomic per bucket (see Note [Resumable steps] in docs/design.md).

A step that fails leaves every bucket stepped or not, never torn, and remembers which it
stepped; the next step() finishes that step (the buckets not stepped, with the grads
they have) instead of starting another. Nothing is kept twice: a bucket's page-in is for
a read (Pager.page_in_async(for_read=True): its bytes at rest stay where they are while
it is resident) and its page-out writes in place. Until that page-out is issued, a
failure hands the bucket back (pager.services.release_unchanged_async: its device changes
dropped, no write; the pipeline does that, statepager.core.pipeline) and
ResumableStep.put_back() restores what its step changed in ordinary memory: its
parameters' unpaged state (step counters, resident state), grads, residual exception
lists and the param groups' options, the parameters the pager does not own and residual
masters' model parameters (from the bucket's undo copies, taken on the device just before
it steps: Note [A resumable step's undo copies stay on the device] in docs/design.md), and
fp32 masters' model parameters (written anew from the masters). Once its page-out is
issued a bucket counts as stepped: a page-out that fails leaves its new bytes resident and
whole, written by the next step's start (residency.to_rest).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from statepager import _C
from statepager.core.atomic import (UndoCopies, copy_groups, rebuild_mirrors, restore_groups,
                                    restore_state)
from statepager.core.state_access import held
from statepager.util import streams
from statepager.util.flat import copy_each

# Each undo copy starts on a multiple of this many bytes of its bucket's buffer (the
# copies' vector loads and stores stay aligned).
_ALIGN = 64


@dataclass
class _Open:
    """The bucket stepping, as it was before its step (ResumableStep.save)."""

    bucket: object
    params: list            # its parameters and those of its chunks
    state: dict             # UndoCopies.copy_state of their state
    grads: list             # [(param, its grad)]
    groups: list            # copy_groups: the param groups' options (their step counters)
    forms: list             # [(residual form, its exceptions, its fingerprint)]
    undo: "_C.DenseCopies"  # what its step overwrites outside the pager, copied
    written: bool = False   # after_bucket may have written model parameters


class ResumableStep:
    """One step's progress over `buckets` (the plan it started with), kept from its
    first attempt until every bucket has stepped. The pipeline calls save() and
    writing() per bucket as it does an AtomicStep's, stepped() once the bucket's
    page-out is issued, and put_back() after a failure."""

    def __init__(self, pager, optimizer, buckets: list, undo: UndoCopies,
                 rebuild_mirror: Callable | None = None, stationary=()):
        """stationary: those of `buckets` that stay mapped between steps (Note [Stationary
        buckets]): with no bytes at rest to go back to, their stored forms are among
        their undo copies."""
        self.pager, self.optimizer, self.buckets = pager, optimizer, buckets
        self.undo, self.rebuild_mirror = undo, rebuild_mirror
        self._stationary = {id(b) for b in stationary}
        self._stepped: set[int] = set()  # id() of the buckets stepped
        self._open: _Open | None = None

    def remaining(self) -> list:
        """The buckets not stepped yet, in order."""
        return [b for b in self.buckets if id(b) not in self._stepped]

    @property
    def stepped_count(self) -> int:
        return len(self._stepped)

    def save(self, bucket) -> None:
        """Before the bucket steps: what its step changes outside the pager, kept; its
        undo copies queued on the current stream, ahead of its step's kernels."""
        params = [*bucket.params, *(c.param for c in bucket.chunks)]
        kept = self.undo.copy_state({p: held(self.optimizer, p) for p in params
                                     if p in self.optimizer.state}, part=True)
        self._open = _Open(bucket, params, kept, [(p, p.grad) for p in params],
                           copy_groups(self.optimizer.param_groups),
                           [(f, f.exceptions_as_set, f.fingerprint) for f in bucket.forms
                            if f.fmt == "residual"],
                           undo_copies(bucket.undo_targets + bucket.stored
                                       if id(bucket) in self._stationary
                                       else bucket.undo_targets))

    def writing(self, bucket) -> None:
        """Before after_bucket: it may write model parameters."""
        self._open.written = True

    def stepped(self, bucket) -> None:
        """The bucket stepped (its page-out is issued next): its undo copies let go."""
        self._stepped.add(id(bucket))
        self._open = None

    def refill(self, layout, error: BaseException) -> None:
        """After a failure: its buckets without the state the bucket that failed created
        (put_back dropped it), filled again by `layout` (StateLayout)."""
        try:
            for b in self.buckets:
                layout.fill(b)
        except BaseException as failed:
            error.add_note(f"statepager: refilling the buckets after the failed step failed "
                           f"too ({failed!r})")

    def put_back(self) -> None:
        """After a failure, the buckets not stepped handed back (at rest as before the
        step): what the bucket that was stepping changed in ordinary memory as before
        it (its undo copies copied back on the current stream)."""
        opened, self._open = self._open, None
        if opened is None:
            return
        b = opened.bucket
        pairs = opened.undo.pairs()
        with torch.no_grad():
            copy_each([t for t, _ in pairs], [c for _, c in pairs])
        if opened.written and self.rebuild_mirror is not None:
            rebuild_mirrors(self.pager, b, self.rebuild_mirror)
        restore_state(self.optimizer.state, opened.state, opened.params)
        restore_groups(self.optimizer.param_groups, opened.groups)
        for p, grad in opened.grads:
            p.grad = grad
        for f, exceptions, fingerprint in opened.forms:
            f.exceptions, f.fingerprint = exceptions, fingerprint


def undo_copies(targets: list) -> "_C.DenseCopies":
    """A copy of each target with elements, taken now on the current stream into one
    buffer on the targets' device (a dense target's bytes in memory order, one batched
    copy; one with gaps gets a tensor of its own); .pairs() gives (target, its copy):
    Note [A resumable step's undo copies stay on the device]. One call into C++ for the
    bucket."""
    device = next((t.device for t in targets if t.numel()), None)  # those copied
    return _C.dense_copies(targets, _ALIGN, 0 if device is None else streams.current(device))

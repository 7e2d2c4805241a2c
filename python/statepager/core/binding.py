"""The bucket-streamed optimizer step: Pager.attach(optimizer).

An attached optimizer keeps its per-parameter state tensors (and its parameters, when
they are fp32 masters the pager owns) in the pager. step() walks buckets of parameters:
each bucket is paged in, stepped by the optimizer's own algorithm on just those
parameters, and paged out, while the next bucket is read and the previous one written.
A parameter whose state is larger than a bucket steps in chunks (statepager.core.slices),
consecutive buckets holding consecutive chunks: its pager tensors are made of pieces
(Pager.empty's pieces), so that a chunk pages alone.

StreamedOptimizer is the binding: it patches the optimizer's methods and answers for
the parts, each its own module: what is paged (statepager.core.layout), the plan
(statepager.core.planner over statepager.core.plan), one bucket's residency
(statepager.core.residency) and step (statepager.core.bucket_step), a step's pipeline
(statepager.core.pipeline) and the steps: all or nothing, resumable or in place
(statepager.core.steps).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Callable

import torch

from statepager import _C
from statepager.core import (args, defaults, optimizer_methods, residency, state_access,
                             state_dict, support)
from statepager.core.atomic import UndoCopies
from statepager.core.bucket_step import BucketStepper
from statepager.core.fused_adamw import FusedStep, applies_to
from statepager.core.hooks import Hooks
from statepager.core.layout import StateLayout
from statepager.core.plan import Bucket
from statepager.core.planner import Planner
from statepager.core.overlap import ForwardOverlap
from statepager.core.serial import serialized
from statepager.core.step_stats import StepStats
from statepager.core.steps import Steps
from statepager.formats.stored import StoredForm
from statepager.util.flat import flat_view
from statepager.util.units import GiB
from statepager.util.warn import warn_user


def _hook(name: str) -> property:
    """A hook of the binding's Hooks, by name; set, it replaces that hook from the next
    bucket on (tests wrap hooks so, to fail a step)."""
    def get(self):
        return getattr(self.hooks, name)

    def set_(self, value):
        self._use(dataclasses.replace(self.hooks, **{name: value}))
    return property(get, set_, doc=f"Hooks.{name}")


class StreamedOptimizer:
    """The binding between one optimizer and one pager (returned by Pager.attach)."""

    def __init__(self, pager, optimizer: torch.optim.Optimizer, hooks: Hooks = Hooks(), *,
                 bucket_size: int | None, depth: int | None, log_steps: bool,
                 moments: str = "fp32",
                 mains: str = "fp32", name: str = "opt0", atomic: str | bool = "bucket",
                 stationary_bytes: int = 0, bind: bool = True):
        # Pager.attach checked the arguments.
        if optimizer in _attached:
            raise _C.UsageError("this optimizer is already attached to a Pager")
        support.check_optimizer(optimizer)
        self.pager = pager
        self.optimizer = optimizer
        self.name = name
        self.stationary_bytes = stationary_bytes  # Note [Stationary buckets]
        self.moments, self.mains = moments, mains
        self.hooks = hooks
        # False within state_dict_by_reference().
        self.copies_state_dict = True
        self.overlap: ForwardOverlap | None = None  # overlap_forward()'s
        fused = FusedStep(self) if applies_to(optimizer) else None
        undo = UndoCopies(pager, hooks.model_param if mains == "residual" else None)
        self._layout = StateLayout(pager, optimizer, store=name, moments=moments, mains=mains,
                                   hooks=hooks, atomic=atomic, undo=undo, fused=fused)
        # None: chosen from the page size and the budget (statepager.core.defaults).
        chosen = defaults.bucketing(pager.page_size, pager.hbm_budget, bucket_size, depth)
        self._planner = Planner(self._layout, bucket_size=chosen[0], depth=chosen[1],
                                hooks=hooks, stationary_bytes=stationary_bytes)
        self._stepper = BucketStepper(self._layout, hooks)
        self._steps = Steps(self, self._layout, self._planner, self._stepper, undo, name=name,
                            hooks=hooks, atomic=atomic, log_steps=log_steps,
                            host_budget=pager.host_budget)
        for i, group in enumerate(optimizer.param_groups):
            self.check_group(group, i)
        # A refused attach opens no store.
        self._planner.fit(pager.hbm_budget, bucket_given=bucket_size is not None,
                          depth_given=depth is not None)
        self._planner.refuse_a_window_over(pager.hbm_budget)
        if bind:
            self.bind()

    def bind(self) -> None:
        """Attaches the planned binding (what __init__ does unless bind=False, which
        checks and plans and changes nothing): its state into the store, the optimizer's
        methods replaced, the binding recorded in Pager.bindings."""
        pager, optimizer = self.pager, self.optimizer
        # Steady state creates and releases no physical pages: the pool keeps what the
        # pipeline's window of buckets needs.
        pager.services.keep_at_least(self._planner.window())
        _warn_if_the_host_tier_spills(self, pager.host_budget)
        for b in self._planner.buckets:
            self._layout.to_store(b)
        self._adopt_existing_state()
        _attached.add(optimizer)
        optimizer_methods.replace(self, optimizer)
        state_access.wrap(self)  # its state readable between steps
        pager.services.bindings.append(self)

    # -- configuration -------------------------------------------------------------

    before_bucket = _hook("before_bucket")
    after_bucket = _hook("after_bucket")
    before_chunk = _hook("before_chunk")
    after_chunk = _hook("after_chunk")
    before_step = _hook("before_step")
    after_step = _hook("after_step")

    def _use(self, hooks: Hooks) -> None:
        self.hooks = self._layout.hooks = self._planner.hooks = hooks
        self._stepper.hooks = self._steps.hooks = hooks

    @property
    def bucket_size(self) -> int:
        """Bytes of state per bucket (attach's bucket_size, or the default chosen)."""
        return self._planner.bucket_size

    @property
    def depth(self) -> int:
        """The window's consecutive buckets (attach's depth, or the default chosen)."""
        return self._planner.depth

    @property
    def atomic(self) -> str | bool:
        """attach's atomic (args.atomicity): "step", "bucket" or False; set, from the next
        step on (a pending step still finishes)."""
        return self._steps.atomic

    @atomic.setter
    @serialized
    def atomic(self, value) -> None:
        value = args.atomicity(value)
        args.stationary(self._planner.stationary_bytes, value)
        if value == "step" and self.overlap is not None:
            raise _C.UsageError("atomic='step' cannot step under the forward: call "
                                "overlap_forward(...).remove() first")
        self._steps.complete_in_flight()  # its buckets are filled for the atomicity it has
        self._layout.atomic = self._steps.atomic = value
        for b in self._planner.buckets:  # their undo copies, with or without
            self._layout.fill(b, to_store=False)
        if value != "step":
            self._steps.undo.let_go()

    @property
    def log_steps(self) -> bool:
        return self._steps.log_steps

    @property
    def last(self) -> StepStats:
        """The last step's StepStats."""
        return self._steps.last

    # -- setup ---------------------------------------------------------------------

    def _adopt_existing_state(self) -> None:
        """State that already exists in ordinary memory moves into the pager as a load of
        it would (state_dict.adopt_state): in the step's pieces, all or nothing."""
        if self._layout.has_state_to_adopt():
            state_dict.adopt_state(self)

    def check_group(self, group: dict, index: int) -> None:
        """Refuses (UsageError) a param group whose state the pager cannot hold."""
        self._layout.check_group(group, index)

    # -- the state -----------------------------------------------------------------

    def params_in_order(self) -> list:
        """The optimizer's parameters in the order torch's state_dict numbers them (and
        checkpoints do)."""
        return self._layout.params_in_order()

    def resident(self, p) -> bool:
        """True for parameters whose state stays in ordinary memory (keep_resident)."""
        return self._layout.resident(p)

    def forms(self, p) -> list[tuple[str, StoredForm]]:
        """(name, form) of parameter p's paged tensors, in a stable order; 'param' is the
        parameter itself when the pager owns it (an fp32 master)."""
        return self._layout.forms(p)

    @serialized
    def known_form(self, p, name: str, value: torch.Tensor) -> StoredForm | None:
        """The StoredForm of p's state entry `name`, whose working tensor is `value`, where
        p's state is paged by this binding; None otherwise."""
        return self._layout.known_form(p, name, value)

    def empty_state_like(self, p, t: torch.Tensor, dtype: torch.dtype | None = None):
        """A pager tensor for state of parameter p shaped and laid out as t (Pager.
        empty_like), in pieces when p steps in chunks."""
        return self._layout.empty_state_like(p, t, dtype)

    def stored_bytes(self) -> int:
        """The bytes the state takes at rest (its stored forms; state yet to be created
        estimated as the plan estimates it)."""
        return self._layout.stored_bytes()

    def counters_before(self, p) -> dict:
        """p's scalar state (Adam's step count) as it was before this step, for a parameter
        that steps in chunks (BucketStepper.counters_before)."""
        return self._stepper.counters_before(p)

    @serialized
    def state_changed(self) -> None:
        """Paged state entries were added or replaced outside a step (a checkpoint load):
        the buckets take them in."""
        self.to_rest()
        for b in self.buckets:
            self._layout.fill(b)
        self.pager.services.keep_at_least(self._planner.window())

    def forms_kept(self) -> Callable[[], None]:
        """For a change of the state that may fail midway (load_state_dict): the returned
        callable puts back the stored forms of now (which form holds each state entry,
        and the residual ones' exception lists and fingerprints; their bytes are the
        caller's to put back, by a pager epoch) once the state entries are as now again,
        and fills the buckets with them."""
        put_back_forms = self._layout.forms_kept()

        def put_back() -> None:
            put_back_forms()
            self.state_changed()
        return put_back

    # -- the plan ------------------------------------------------------------------

    @property
    @serialized
    def buckets(self) -> list[Bucket]:
        """The plan for the param groups as they are now: groups added, removed or changed
        since the last plan (add_param_group, direct edits) are planned anew, so they are
        streamed from the next step on."""
        return self._steps.planned()

    def params_by_bucket(self) -> list[list]:
        """Per bucket, the parameters it steps, one that steps in chunks in the bucket of
        its first chunk (the order checkpoints list their tensors in)."""
        return [b.params + [c.param for c in b.chunks if c.start == 0] for b in self.buckets]

    @property
    def window_bytes(self) -> int:
        """Physical bytes the step maps at most; the pool keeps them between steps."""
        return self._planner.window()

    @property
    def begun_step_bytes(self) -> int:
        """Physical bytes a begun step maps at most before its step() (begin_step() fills
        the window: Note [A begun step fills the window])."""
        return self._planner.window_parts()[0]

    def _whole_buckets(self):
        """The buckets, each parameter that steps in chunks as a bucket of its own, whole
        (for state_dict(), load_state_dict() and checkpoints through the device, which
        read and write whole state entries: one such parameter's state is resident at
        once, beyond the step's window)."""
        self.to_rest()
        yield from self._planner.whole(self.buckets)

    # -- the state between steps, bucket by bucket -----------------------------------

    def state_in_buckets(self, write: bool = True):
        """Yields each bucket with its state resident and decoded to fp32; encodes and
        pages it out again afterwards. The caller may replace the bucket's parameters'
        state entries by resident pager tensors of its own: they are stored from then on.
        write=False: the caller only
        reads; nothing is encoded, and the stored forms go back to their bytes at rest
        without any write (pager.services.release_unchanged_async). A parameter that steps in
        chunks comes whole, in a bucket of its own."""
        pager = self.pager
        for b in self._whole_buckets():
            pager.page_in_async(b.stored, for_read=not write).wait()
            residency.decode(pager, b)
            try:
                yield b
            finally:
                if write:
                    self._layout.fill(b)  # the caller's new tensors and their stored forms
                    pager.page_in(b.stored + b.working)
                residency.hand_back(pager, b, write)
        if write:
            for b in self.buckets:  # those holding chunks, after their whole buckets
                if b.chunks:
                    self._layout.fill(b)

    def state_in_pieces(self, write: bool = False, rebuild_mains: bool = False):
        """Yields (param, start, stop, entries) bucket by bucket as the step pages them, a
        parameter that steps in chunks chunk by chunk: entries maps each of the
        parameter's paged state entries ("param" for an fp32 master the pager owns) to a
        resident flat view of its fp32 values of elements [start, stop) in memory order
        (0 and its numel where it steps whole). Within the step's window, so within any
        budget attach accepted. write=False: the caller only reads; nothing is encoded or
        written, the stored forms go back to their bytes at rest
        (pager.services.release_unchanged_async). write=True: the caller may write the views; each
        bucket's forms are made from the state entries as they are (pager tensors the
        caller put there are stored from then on), and it is encoded and paged out after.
        rebuild_mains: the caller overwrites the masters from changed model params, so
        their stored form is not checked against them. See Note
        [Reads and loads in the step's pieces] in docs/design.md."""
        self.to_rest()
        pager = self.pager
        for b in self.buckets:
            if write:
                self._layout.fill(b)
            pager.page_in_async(b.stored, for_read=not write).wait()
            try:
                residency.decode(pager, b, check_params=not rebuild_mains)
                for p in b.params:
                    entries = {name: flat_view(f.working) for name, f in self.forms(p)}
                    if entries:
                        yield p, 0, p.numel(), entries
                for c, named in zip(b.chunks, b.chunk_forms):
                    yield c.param, c.start, c.stop, {n: f.working for n, f in named.items()}
            finally:
                residency.hand_back(pager, b, write)

    def stored_in_buckets(self):
        """Yields each bucket with its stored form resident (no decoding), for a caller
        that only reads it: it goes back to its bytes at rest without any write
        (pager.services.release_unchanged_async). A parameter that steps in chunks comes whole, in a
        bucket of its own."""
        for b in self._whole_buckets():  # which ends a begun step first
            self.pager.page_in_async(b.stored, for_read=True).wait()
            try:
                yield b
            finally:
                self.pager.services.release_unchanged_async(b.stored).wait()

    @contextlib.contextmanager
    def state_dict_by_reference(self):
        """Within it, the optimizer's state_dict() is torch's own: its state entries are
        the live paged tensors, not read (for callers that keep only the rest, such as
        Megatron's DistributedOptimizer.state_dict)."""
        self.copies_state_dict = False
        try:
            yield
        finally:
            self.copies_state_dict = True

    # -- the step (statepager.core.steps) ------------------------------------------

    @serialized
    def prepare_step(self) -> None:
        """Called where the next step's grads are being made (the optimizer's zero_grad(),
        and Megatron's): an all-or-nothing step's undo copies of residual masters' model
        parameters are taken now, while the device runs forward and backward, instead of
        within the step (statepager.core.atomic). A step begun and not taken up (a
        skipped step) ends first."""
        self._steps.prepare()

    @serialized
    def step_buckets(self) -> None:
        """One step, or the end of a pending one (see pending). atomic="step": a step
        that raises has changed nothing (statepager.core.atomic); "bucket": it leaves
        each bucket stepped or not and is pending (statepager.core.resumable); either
        way a retry steps once. before_step and after_step, when set, run before the
        first bucket and after the last (not after a failed step)."""
        self._steps.step()

    @property
    def pending(self) -> bool:
        """True while a resumable step that failed partway is unfinished: step() then
        finishes it, as do zero_grad(), state_dict(), saves and pause() first; a load
        forgets it (Note [Resumable steps] in docs/design.md)."""
        return self._steps.pending is not None

    @serialized
    def finish_step(self) -> None:
        """Finishes a pending step (as step() does, its hooks included); nothing
        otherwise. Where it fails again it raises, and the step stays pending."""
        self._steps.finish_pending()

    @serialized
    def drop_pending_step(self) -> None:
        """Forgets a pending step (a load replaced the state): the next step is new."""
        self._steps.drop_pending()

    @serialized
    def begin_step(self) -> None:
        """Starts the next step's first page-ins now, so that they overlap what runs
        before the step (Megatron's grad norm and clipping: the adapter calls it once
        the grads are ready); step() takes them up. Under the forward, a step in flight
        that has stepped every bucket is not waited for: the page-ins follow its
        page-outs as they land, and each later begin_step() issues those room has been
        made for since, waiting for nothing (can_begin_step). Atomic steps only: their
        pager epoch opens now, so a begun step that no step() takes up ends
        (end_begun_step) without writing a byte. Until then, whatever else reads or
        changes the state ends it first (state_dict(), checkpoints, pause(), another
        binding's step on the same Pager: one step is begun per Pager at a time).
        Nothing changes when the page-ins cannot start (a budget too small, a device
        error): step() meets the problem again and reports it, rolled back."""
        self._steps.begin()

    @property
    def begun(self) -> bool:
        """True from begin_step() until step() takes the begun step up or it is ended."""
        return self._steps.begun

    @serialized
    def end_begun_step(self) -> None:
        """Ends a step that begin_step() began and no step() took up: its page-ins are
        waited for and their pages dropped, nothing written. Lets go of the state read
        since the last step (statepager.core.state_access)."""
        self._steps.end_begun()

    @serialized
    def to_rest(self, keep_reads: bool = False) -> None:
        """end_begun_step(), then the stationary buckets a step left mapped paged out (Note
        [Stationary buckets]); keep_reads (a read of opt.state): the reads before it stay."""
        self._steps.to_rest(keep_reads)

    # -- steps under the forward (statepager.core.overlap) -------------------------

    @serialized
    def overlap_forward(self, *modules, forward_param=None, step_thread=False) -> ForwardOverlap:
        """Steps under the next forward of `modules` from the next step() on (core/overlap),
        on a thread of their own with step_thread; remove() on what it returns ends it."""
        if self.overlap is not None:
            raise _C.UsageError("overlap_forward() is set already: remove() it first")
        self.overlap = ForwardOverlap(self, modules, self._planner, forward_param,
                                      step_thread)
        return self.overlap

    @property
    def step_in_flight(self):
        """A step's Pipeline whose buckets are left to the forward, or None."""
        return self._steps.in_flight

    @serialized
    def can_begin_step(self) -> bool:
        """Whether begin_step() would wait for no step in flight: none is, its page-outs
        are done, or it has stepped every bucket (the begun step's page-ins then follow
        its page-outs as they land: Note [Page-ins during backward])."""
        return self._steps.can_begin()

    @serialized
    def complete_step_in_flight(self) -> None:
        self._steps.complete_in_flight()  # Steps.complete_in_flight

    @serialized
    def step_in_flight_to(self, n: int, lazy: bool = False) -> None:
        self._steps.advance_in_flight(n, lazy)  # Steps.advance_in_flight: the forward's hooks


def _warn_if_the_host_tier_spills(binding: StreamedOptimizer, host: int) -> None:
    """A host tier (`host` bytes) that cannot hold the state spills to the store at
    every step: the state's size with resumable or in-place steps, twice it with
    all-or-nothing ones, which write fresh ranges (Note [Atomic steps need twice the
    state in the host tier]). Said at attach, with the fix, rather than found in the
    step's time."""
    stored = binding.stored_bytes()
    needed = 2 * stored if binding.atomic == "step" else stored
    if not host or needed <= host:
        return
    fix = ("Raise host_budget, or attach(atomic='bucket') (resumable steps need the "
           "state once)" if binding.atomic == "step" else "Raise host_budget")
    warn_user(
        f"statepager: optimizer {binding.name!r} keeps about {stored / GiB:.2f} GiB at rest; "
        f"its steps (atomic={binding.atomic!r}) need {needed / GiB:.2f} GiB in the host "
        f"tier, which has {host / GiB:.2f} GiB: about {(needed - host) / GiB:.2f} GiB "
        f"spill to the store at every step. {fix}.")


# Optimizers attached to a Pager (an optimizer is attached once). Weak: a binding lives
# as long as its optimizer, through the methods it set on it.
_attached: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()

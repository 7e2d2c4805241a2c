"""An attached optimizer's steps (statepager.core.binding): each runs a Pipeline
(statepager.core.pipeline), all or nothing (atomic="step", statepager.core.atomic),
atomic per bucket and resumed where it failed (atomic="bucket",
statepager.core.resumable) or in place (atomic=False), its first page-ins possibly begun
ahead of step() (begin_step), and ends as the binding's last stats. Under the forward
(statepager.core.overlap) step() leaves the buckets to the next forward: the step is in
flight until the forward's hooks have stepped them and something else needs the
state."""
from __future__ import annotations

import logging
import time

from statepager.core import interrupts, residency
from statepager.core.atomic import AtomicStep, UndoCopies
from statepager.core.bucket_step import BucketStepper
from statepager.core.hooks import Hooks
from statepager.core.late_reads import ParamChecks
from statepager.core.layout import StateLayout
from statepager.core.pipeline import Pipeline
from statepager.core.plan import Bucket
from statepager.core.planner import Planner
from statepager.core.resumable import ResumableStep
from statepager.core.step_stats import StepStats

log = logging.getLogger("statepager")


class Steps:
    """The steps of one binding (`owner`, a StreamedOptimizer: what AtomicStep reads its
    buckets from, and which this Pager's other bindings are). Called holding the Pager's
    lock (the binding's entry points take it)."""

    def __init__(self, owner, layout: StateLayout, planner: Planner, stepper: BucketStepper,
                 undo: UndoCopies, *, name: str, hooks: Hooks, atomic: str | bool,
                 log_steps: bool, host_budget: int):
        self.owner, self.pager = owner, layout.pager
        self.layout, self.planner, self.stepper, self.undo = layout, planner, stepper, undo
        self.name = name
        self.hooks = hooks      # before_step, after_step; model_param (the fp32 mirror)
        self.atomic = atomic  # "step", "bucket" or False (args.atomicity)
        self.log_steps = log_steps
        self.host_budget = host_budget  # the Pager's host tier: read-aheads where it has one
        self.last = StepStats()
        self._steps = 0
        self._begun: Pipeline | None = None  # begin()'s, until step() takes it up
        self.pending: ResumableStep | None = None  # a resumable step that failed partway
        self.in_flight: Pipeline | None = None  # a deferred step's, until complete
        self.stationary_mapped = False  # left mapped by a step (Note [Stationary buckets])

    def finish_pending(self) -> None:
        """StreamedOptimizer.finish_step: a step in flight completed, then a pending one."""
        self.complete_in_flight()
        if self.pending is not None:
            self.step()

    def drop_pending(self) -> None:
        """Forgets a pending step (a load replaced its state), its resident buckets to rest."""
        pending, self.pending = self.pending, None
        if pending is not None:
            residency.to_rest(self.pager, pending.buckets, unchanged=True)

    def planned(self) -> list[Bucket]:
        """The plan for the param groups as they are now: planned anew (a begun step
        ended first) when they changed since the last plan."""
        if self.planner.changed():
            self.finish_pending()  # over the plan it started with
            self.to_rest()
            for i, group in enumerate(self.layout.optimizer.param_groups):
                self.layout.check_group(group, i)
            self.planner.plan()
            self.pager.services.keep_at_least(self.planner.window())
        return self.planner.buckets

    def prepare(self) -> None:
        """StreamedOptimizer.prepare_step: the next all-or-nothing step's undo copies of
        residual masters' model parameters, taken now (Note [Undo copies of residual
        masters' params are taken before the step]; a resumable step takes its own on the
        device). Nothing while a step is in flight: those are never all or nothing."""
        if self.in_flight is not None:
            return
        self.end_begun()
        buckets = self.planned()
        if self.atomic == "step" and self.layout.mains == "residual":
            self.undo.take_before_step(buckets)

    def step(self) -> None:
        """StreamedOptimizer.step_buckets."""
        self.complete_in_flight()  # a step() with no forward since the last
        if self.hooks.before_step:
            self.hooks.before_step()
        if self.owner.overlap is not None and self.pending is None:
            self._defer()
            return
        self._step_all()
        if self.hooks.after_step:
            self.hooks.after_step()

    def _defer(self) -> None:
        """step() under the forward: the pipeline started, its buckets left to
        advance_in_flight() (the forward's hooks) and complete_in_flight()."""
        t0 = time.monotonic()
        self.planned()
        self._end_others_begun()
        self.pager.services.reads.release()  # their room is the step's
        run = self._begun
        if run is not None and not self._takes_up(run):
            self.end_begun()
        run, self._begun = self._begun, None
        step = None
        if self.atomic == "bucket":
            step = run.atomic if run is not None else self._new_step()
        held = interrupts.Deferral()
        try:
            try:
                held.poll()
                # Read by the first bucket (Pipeline.advance): no device sync in step().
                changed = ParamChecks.queued(step.remaining() if step else self.planned())
                if run is None:
                    run = self.start(step)
            except BaseException:
                if run is not None and step is not None:
                    run.end()
                raise
            run.checked, run.unverified = changed is not None, changed
            run.setup_seconds += time.monotonic() - t0
            run.begin_steps()
            self.in_flight = run
            self.owner.overlap.started(run)
        finally:
            held.release()

    def advance_in_flight(self, n: int, lazy: bool = False) -> None:
        """Steps the step in flight's buckets until n have stepped. lazy (the forward's
        pre-hooks): the last does not wait for room for the next page-in, and where none
        is left to step, the page-ins that page-outs have made room for are issued. Where
        one fails, the step ends as a failed step() does (a resumable one pending) and
        the error raises here."""
        run = self.in_flight
        if run is None or (run.stepped >= n and not (lazy and run.pumpable())):
            return
        held = interrupts.Deferral()
        run.interrupts = held
        try:
            try:
                if run.stepped >= n:  # nothing to step: the page-ins room was made for
                    with self.owner.overlap.pumping(run):
                        run.pump()
                else:
                    with self.owner.overlap.stepping(run, n):
                        run.advance_to(n, room_after=not lazy)
            except BaseException as error:
                # Off the binding's stream: the current one then waits for all it queued,
                # a failed bucket's params put back among it.
                self._in_flight_failed(error)
                raise
        finally:
            run.interrupts = None
            held.release()

    def can_begin(self) -> bool:
        """Whether begin() waits for no step in flight (none, settled, or _hands_over)."""
        return self.in_flight is None or self.in_flight.settled() or self._hands_over()

    def _hands_over(self) -> bool:
        """Whether the next step can begin while the resumable step in flight still pages
        out: it stepped every bucket of the plan as it is (Note [Page-ins during backward])."""
        run, plan = self.in_flight, self.planner.buckets
        return (run is not None and self.atomic == "bucket" and self.pending is None
                and run.stepped == len(run.buckets) == len(plan) and not self.planner.changed()
                and all(a is b for a, b in zip(run.buckets, plan)))

    def complete_in_flight(self) -> None:
        """Steps what is left of the step in flight and finishes it (its page-outs waited
        for, its stats the last); nothing when none is."""
        run = self.in_flight
        if run is None:
            return
        self.advance_in_flight(len(run.buckets))
        held = interrupts.Deferral()
        try:
            try:
                stats = run.complete()
            except BaseException as error:
                self._in_flight_failed(error)
                raise
            self.in_flight = None
            if self._begun is not None:
                self._begun.stop_following()
            self._finish(stats)
        finally:
            self.owner.overlap.joined()  # what comes next waits for none of its events
            held.release()
        if self.hooks.after_step:
            self.hooks.after_step()

    def _in_flight_failed(self, error: BaseException) -> None:
        """After `error` in the step in flight (its pipeline left nothing in flight): a
        resumable step is pending, a bucket stepped or none (step() returned: the step
        is owed)."""
        run, self.in_flight = self.in_flight, None
        if self._begun is not None:
            self._begun.stop_following()
        self.owner.overlap.joined()
        step = run.atomic
        if isinstance(step, ResumableStep):
            self.pending = step
            step.refill(self.layout, error)

    def begin(self) -> None:
        """StreamedOptimizer.begin_step: a step in flight completed first (its page-outs
        and the stats of its bytes are its own), unless it hands over (_hands_over): then
        the begun step's page-ins follow its page-outs as they land, as far as the
        window holds (Note [A begun step fills the window]). Called again while a step is
        begun, issues the page-ins room has been made for since (Pipeline.pump), waiting
        for nothing; where one fails, the begun step ends and step() meets it again."""
        run = self._begun
        if run is not None:
            try:
                run.pump()
            except BaseException as error:  # the pipeline left nothing in flight
                self._begun = None
                if not isinstance(error, Exception):  # an interrupt
                    raise
                log.debug("statepager %s: begin_step() left to step() (%r)", self.name, error)
            return
        if not self.atomic or self.pager.paused:
            return
        follows = self.in_flight if self._hands_over() else None
        if follows is None:
            self.complete_in_flight()
        self._end_others_begun()
        self.pager.services.reads.release()  # their room is the step's
        t0, run = time.monotonic(), None
        held = interrupts.Deferral()  # a Ctrl-C comes at poll(), or once this has ended
        try:
            try:
                step = self._new_step()
            except Exception as error:
                log.debug("statepager %s: begin_step() left to step() (%r)", self.name, error)
                return
            try:
                run = self.start(step, follows)
                run.setup_seconds = time.monotonic() - t0
                held.poll()
                self._begun = run  # last: from here on the begun step is ended as such
            except BaseException as error:
                _end(step, run)
                if not isinstance(error, Exception):  # an interrupt: after the epoch is closed
                    raise
                log.debug("statepager %s: begin_step() left to step() (%r)", self.name, error)
        finally:
            held.release()

    begun = property(lambda self: self._begun is not None)

    def end_begun(self) -> None:
        """StreamedOptimizer.end_begun_step (a step in flight completed first)."""
        self.complete_in_flight()
        self.pager.services.reads.release()
        if self._begun is None:
            return
        with interrupts.deferred():
            run, self._begun = self._begun, None
            run.end()

    def to_rest(self, keep_reads: bool = False) -> None:
        """StreamedOptimizer.to_rest (Note [Stationary buckets]): nothing to page out where
        no step left them mapped (at rest, or paged in by the entry point that reads)."""
        stationary = self.planner.stationary_buckets() if self.stationary_mapped else []
        if not keep_reads or (stationary and self._begun is not None):
            self.end_begun()  # a begun step counts on the stationary buckets being mapped
        if stationary:
            with interrupts.deferred():
                residency.to_rest(self.pager, stationary)
                self.stationary_mapped = False

    def _end_others_begun(self) -> None:
        """Ends the other bindings' begun steps (their page-ins would take this step's room)."""
        for binding in self.pager.bindings:
            if binding is not self.owner:
                binding.end_begun_step()

    def _new_step(self) -> AtomicStep | ResumableStep:
        """The atomic step begin() or step() starts: a pending one, else a new one."""
        if self.atomic == "step":
            return AtomicStep(self.owner, self.undo, self.layout.mirror())
        if self.pending is not None:
            return self.pending
        return ResumableStep(self.pager, self.layout.optimizer, self.planned(), self.undo,
                             self.layout.mirror(), self.planner.stationary_buckets())

    def start(self, atomic: AtomicStep | ResumableStep | None,
              follows: Pipeline | None = None) -> Pipeline:
        """A step's pipeline, its first page-ins issued (the rest as buckets step). A
        resumable step's buckets not stepped, from rest
        (those a failed page-out left resident written now: Note [Resumable steps]; on
        their way there: `follows`)."""
        resumed = atomic is not None and atomic is self.pending
        if isinstance(atomic, ResumableStep):
            if follows is None:
                residency.to_rest(self.pager, atomic.buckets, unchanged=True,
                                  staying=self.planner.stationary_buckets())
            buckets = atomic.remaining()
        else:
            buckets = self.planned()
        run = Pipeline(buckets, self.layout, self.planner, self.stepper, atomic,
                       step=self._steps + 1, host_budget=self.host_budget,
                       fused_groups=self.layout.fused_groups(), resumed=resumed, follows=follows)
        self.stationary_mapped |= bool(self.planner.stationary)
        run.start()
        return run

    def _step_all(self) -> None:
        t0 = time.monotonic()
        if self.pending is None:
            self.planned()  # a pending step finishes over the plan it started with
        self._end_others_begun()
        self.pager.services.reads.release()  # their room is the step's
        run = self._begun
        if run is not None and not self._takes_up(run):
            self.end_begun()  # begun otherwise, or with param groups the fused step differs on
        if self.pending is not None or self.atomic == "bucket":
            self._step_resumable(t0)
        elif self.atomic == "step":
            self._step_atomic(t0)
        else:
            checked = ParamChecks.up_front(self.planned())
            run = self.start(None)
            run.checked, run.setup_seconds = checked, time.monotonic() - t0
            self._finish(run.step_all())

    def _takes_up(self, run: Pipeline) -> bool:
        """Whether step() takes up the begun `run`: begun as it steps (a pending step
        finishing, or a new one of this binding's atomic kind), under the same options."""
        if run.fused_groups != self.layout.fused_groups():
            return False
        if self.pending is not None:
            return run.atomic is self.pending
        kind = {"step": AtomicStep, "bucket": ResumableStep}.get(self.atomic)
        return kind is not None and isinstance(run.atomic, kind)

    def _step_resumable(self, t0: float) -> None:
        """Atomic per bucket (statepager.core.resumable): where it fails, the buckets
        stepped are remembered (pending) and the next step finishes this one. SIGINT is
        held for the step and delivered between buckets (statepager.core.interrupts), so
        a Ctrl-C never splits a bucket's step from its bookkeeping."""
        held = interrupts.Deferral()
        try:
            run, self._begun = self._begun, None
            step = run.atomic if run is not None else self._new_step()
            try:
                try:
                    held.poll()
                    checked = ParamChecks.up_front(step.remaining())
                    if run is None:
                        run = self.start(step)
                except BaseException:
                    if run is not None:
                        run.end()
                    raise
                run.checked = checked
                run.setup_seconds += time.monotonic() - t0
                run.interrupts = held
                stats = run.step_all()
            except BaseException as error:
                # Pending once a bucket stepped; else nothing changed.
                self.pending = step if step.stepped_count else None
                step.refill(self.layout, error)
                raise
            self.pending = None
            self._finish(stats)
        finally:
            held.release()

    def _step_atomic(self, t0: float) -> None:
        """All or nothing (statepager.core.atomic), a KeyboardInterrupt included: SIGINT is
        held (statepager.core.interrupts) for the whole step and delivered where a failure
        is undone (after the epoch opens, between buckets, before the commit) or once the
        step is whole, so that a Ctrl-C never splits opening the epoch from the try that
        ends it, the commit from its bookkeeping, or an undo."""
        held = interrupts.Deferral()
        try:
            run, self._begun = self._begun, None
            step = run.atomic if run is not None else AtomicStep(self.owner, self.undo,
                                                                 self.layout.mirror())
            snapshot = False
            try:
                held.poll()
                step.snapshot()
                snapshot = True
                if run is None:
                    run = self.start(step)
                run.setup_seconds += time.monotonic() - t0
                run.interrupts = held
                stats = run.step_all()
                held.poll()
                t1 = time.monotonic()
                step.commit()
            except BaseException as error:
                self._undo_step(step, run, snapshot, error)
                raise
            stats.commit_seconds = time.monotonic() - t1
            self._finish(stats)
        finally:
            held.release()

    def _undo_step(self, step: AtomicStep, run: Pipeline | None, snapshot: bool,
                   error: BaseException) -> None:
        """After `error`: everything as before the step (its epoch aborted; once its
        snapshot is taken, what it changed in ordinary memory put back)."""
        if not snapshot:
            _end(step, run)
            return
        try:
            step.roll_back()
            for b in self.planned():  # without the state the failed step created
                self.layout.fill(b)
        except BaseException as failed:
            error.add_note(f"statepager: undoing the failed step failed too ({failed!r}): "
                           "the optimizer state may be partly stepped")

    def _finish(self, stats: StepStats) -> None:
        """A step done: its stats are the last, and logged."""
        self._steps += 1
        self.last = stats
        if self.log_steps:
            log.info("statepager %s", stats.summary())


def _end(step: AtomicStep | ResumableStep, run: Pipeline | None) -> None:
    """Ends a step that changed nothing: its run's page-ins waited for, where it has one
    (a resumable step without one has nothing in flight: Pipeline.start hands back)."""
    if run is not None:
        run.end()
    elif isinstance(step, AtomicStep):
        step.abandon()

"""One streamed step's pipeline (statepager.core.binding): its buckets paged in ahead,
stepped one at a time (statepager.core.bucket_step) and paged out: bucket i + k is read
while bucket i steps and the buckets before it are written. Page-ins run at least
`ahead` buckets past the next to step (planner.page_ins_ahead), each admitted once its
pages fit in the window beside those that page-outs still hold and the room kept for
the scratch mapped as each bucket steps (statepager.core.page_ins,
statepager.core.room).

A Pipeline is made when the step starts (its set-up: what each bucket's page-in
brings); start() issues the first page-ins; advance() steps the next bucket and issues
the page-in that its room frees (under the forward, as far as page-outs have landed:
pump() issues the rest later); finish() waits for the rest and returns the step's
stats. step_all() runs advance() to the last bucket and finish(), and leaves nothing in
flight where either fails; end() ends a pipeline started and never streamed.

The step it runs is all or nothing (an AtomicStep: a pager epoch), resumable (a
ResumableStep, statepager.core.resumable: page-ins for a read, so that a bucket not
stepped goes back to its bytes at rest where the step fails) or in place (None).
"""
from __future__ import annotations

import collections
import itertools
import time

from statepager import _C
from statepager.core import interrupts, residency
from statepager.core.atomic import AtomicStep
from statepager.core.bucket_step import BucketStepper
from statepager.core.late_reads import ExceptionCounts, ParamChecks
from statepager.core.layout import StateLayout
from statepager.core.page_ins import PageIns
from statepager.core.planner import Planner, page_ins_ahead
from statepager.core.resumable import ResumableStep
from statepager.core.room import Room, landed
from statepager.core.step_stats import StepStats


class Pipeline:
    """The buckets of one step, each stepped once, in order."""

    def __init__(self, buckets: list, layout: StateLayout, planner: Planner,
                 stepper: BucketStepper, atomic: AtomicStep | ResumableStep | None, *,
                 step: int, host_budget: int, fused_groups: tuple | None,
                 resumed: bool = False, follows: "Pipeline | None" = None):
        """buckets: the plan (planner's, planned anew where the param groups changed), or
        a resumed step's buckets not stepped yet; step: the step's number
        (StepStats.step); host_budget: the Pager's host tier; fused_groups:
        FusedStep.groups_key() (a step begun under other options starts again);
        resumed: the step resumes one that failed (the stepper's counters are those of
        its start, BucketStepper.begin()); follows: the step in flight, every bucket of
        the same plan stepped, whose page-outs this one's page-ins follow as they land
        (Note [Page-ins during backward]): its window is shared, and until
        stop_following() a bucket is paged in once that step has let go of it
        (released())."""
        pager = layout.pager
        self.pager, self.buckets, self.atomic = pager, buckets, atomic
        self.resumed = resumed
        # Resumable: a bucket's page-in keeps its bytes at rest, where a failure hands
        # it back (_hand_back) until its page-out is issued.
        self._for_read = isinstance(atomic, ResumableStep)
        self._stepper, self._planner = stepper, planner
        self._depth = planner.depth
        self.before = pager.stats()  # the pager's stats() at the start
        pager.reset_peak()
        if follows is not None:
            follows._followed = dict(self.before)
        self.t_start = time.monotonic()
        self.stats = StepStats(step=step, buckets=len(buckets))
        self.fused_groups = fused_groups
        # Which moments the fused step reads as stored, per bucket: what its page-in
        # brings and how it steps (a bucket that creates state finds out again).
        self.fused = [layout.fused_forms(b) for b in buckets]
        incoming = [(b.incoming, b.nbytes) if f == b.fused else
                    (x := residency.incoming(b, f), residency.nbytes(x))
                    for b, f in zip(buckets, self.fused)]
        self.incoming = [x for x, _ in incoming]
        named_in = [n for _, n in incoming]
        scratch = [m - b.stored_bytes for m, b in zip(named_in, buckets)]
        self._sched = _Schedule(named_in, scratch, self.ahead)
        page = pager.page_size
        self._followed: dict | None = None  # the stats() where a step following it began
        # The window, within hbm_budget beside the residual masters' scratch held apart
        # (the window planned before the state existed may have been less than it is).
        # The stationary buckets' stored forms (Note [Stationary buckets]) are mapped apart
        # from the room its page-ins share, for the buckets of its plan, stepped or not.
        window, held_bytes = planner.window_parts()
        apart = held_bytes + planner.stationary_pages() * page
        budget = self.before["hbm_budget"]
        limit = (window if budget is None else min(window, budget - apart)) // page
        stationary = {id(b) for b in planner.stationary_buckets()}
        self.stationary = [id(b) in stationary for b in buckets]
        room = follows.page_ins.room if follows is not None else Room(limit, page)
        room.limit = limit  # shared: this plan's window from now on
        # With a host tier, the `depth` buckets past the page-ins in flight are read from
        # the store into free host room (bounded by it: the pager never makes room for a
        # read-ahead), so that their page-in is a copy from host memory that never waits
        # for a file read it could have started earlier. Only that far: the room a
        # read-ahead holds until its page-in is room the buckets stepped meanwhile
        # cannot keep. None where the store's files lie in RAM, mapped for the device
        # (map_ram): a page-in from them is a copy from host memory already, and a
        # read-ahead only adds the kernel's copy into host room, which that page-in then
        # waits for (at half the host budget on the H200, 0.88 GB of the atomic step's
        # 2.22 GB read went that way).
        mapped = self.before["store_mapped_bytes"] > 0
        read_ahead = self._depth if host_budget and not mapped else 0
        self.setup_seconds = 0.0  # StepStats.setup_seconds, so far
        self.checked = False      # residual masters' params checked up front
        # ... or their checks queued up front, read before the first bucket steps
        # (ParamChecks.queued): a step under the forward.
        self.unverified = None
        self.interrupts: "interrupts.Deferral | None" = None  # an atomic step's: polled per bucket
        # The streaming, from the first advance() on.
        self._next = 0                      # the bucket advance() steps
        self._outs = collections.deque()    # per bucket stepped, its page-out handles
        self._landing: dict = {}            # id(bucket) -> its page-out and discard handles
        self._done_in, self._done_out, self._stepping = [], [], []
        self._counting = ExceptionCounts(pager)  # the exceptions of the buckets stepped last
        self.page_ins = PageIns(pager, buckets, self.incoming, room, planner.new_pages,
                                ahead=self.ahead, for_read=self._for_read,
                                read_ahead=read_ahead, outs=self._outs,
                                counting=self._counting, follows=follows,
                                stationary=self.stationary)
        # All or nothing: residual masters' params checked once the last bucket stepped.
        self._checks = ParamChecks() if isinstance(atomic, AtomicStep) else None
        self._open: int | None = None  # the bucket between its page-in's wait and page-out
        self._trace = _C.TraceRange()  # each bucket's step on profilers' timelines (NVTX)
        self._t_loop = 0.0

    @property
    def ahead(self) -> int:
        """Page-ins in flight beyond the bucket stepping (planner.page_ins_ahead)."""
        return page_ins_ahead(self._depth)

    def start(self) -> None:
        """Issues the first page-ins, as far as the window holds (the rest as buckets
        step). None left in flight where one fails."""
        page_ins = self.page_ins
        try:
            page_ins.issue(0, wait=False)
        except BaseException:
            _settle(page_ins.in_flight())
            self._hand_back(list(page_ins.handles))
            raise

    @property
    def following(self) -> bool:
        """Whether its page-ins follow a step in flight's page-outs (`follows`)."""
        return self.page_ins.follows is not None

    def stop_following(self) -> None:
        """The step it followed is complete (or failed: its buckets not let go stay
        resident, and this step, begun, is ended before it steps). Its stats count the
        bytes written from here on: the page-outs before were that step's."""
        if self.page_ins.follows is not None:
            self.page_ins.follows = None
            self.before["bytes_written"] = self.pager.stats()["bytes_written"]

    def released(self, b) -> bool:
        """Whether bucket b, stepped, has let go of every page this step held for it:
        its page-out and the discards of its scratch landed (one that failed never
        has). True for a bucket it has not stepped: a step is followed once it has
        stepped every bucket."""
        key = id(b)
        handles = self._landing.get(key)
        if handles is None:
            return True
        if self._counting.holds(key):
            return False
        more = self._counting.let_go.get(key)
        return all(h.done() and landed(h) for h in
                   (handles if more is None else [*handles, more]))

    def held_bytes(self) -> int:
        """Physical bytes of the window its buckets hold now (Room)."""
        return self.page_ins.room.held_pages() * self.pager.page_size

    def step_all(self) -> StepStats:
        """Steps every bucket (advance()) and finishes; returns the stats (the caller's
        once the step is whole). Where it fails, nothing is left in flight."""
        self.begin_steps()
        return self.complete()

    def begin_steps(self) -> None:
        """Before the first advance(): the counters the buckets step from."""
        if not self.resumed:
            self._stepper.begin()
        self._t_loop = time.monotonic()

    @property
    def loop_started(self) -> float:
        """When begin_steps() ran (time.monotonic()): a deferred step, when step() left
        its buckets to the forward."""
        return self._t_loop

    @property
    def stepped(self) -> int:
        """How many buckets have stepped (or failed to)."""
        return self._next

    def advance_to(self, n: int, room_after: bool = True) -> None:
        """Steps buckets (advance()) until n have stepped. room_after=False: the last one
        does not wait for room for the next page-in (Note [Steps under the forward]).
        Where one fails, nothing is left in flight."""
        try:
            last = min(n, len(self.buckets))
            while self._next < last:
                self.advance(room_after or self._next + 1 < last)
        except BaseException as error:
            self._fail(error)
            raise

    def pump(self) -> None:
        """Issues the page-ins due whose room page-outs have already made, waiting for
        nothing. Where one fails, or a Ctrl-C came meanwhile, nothing is left in flight."""
        try:
            with interrupts.deferred():  # not between a page-in issued and its handle kept
                page_ins, i = self.page_ins, self._next
                if i < len(self.buckets):
                    page_ins.scratch(i, wait=False)
                page_ins.issue(i, wait=False)
        except BaseException as error:
            self._fail(error)
            raise

    def pumpable(self) -> bool:
        """Whether pump() has a page-in to issue now (a check cheap enough for every
        module's pre-hook)."""
        return self.page_ins.pumpable(self._next)

    def settled(self) -> bool:
        """Whether every bucket has stepped and its page-outs, late reads and read-aheads
        are done: complete() would not wait (Note [Page-ins during backward])."""
        handles = ([h for hs in self._outs for h in hs] + self._counting.handles
                   + list(self.page_ins.aheads.values()))
        return (self._next == len(self.buckets) and self._counting.ready()
                and all(h.done() for h in handles))

    def complete(self) -> StepStats:
        """Steps the buckets left and finishes; returns the stats. Where it fails,
        nothing is left in flight."""
        self.advance_to(len(self.buckets))
        try:
            t0 = self.finish()
        except BaseException as error:
            self._fail(error)
            raise
        return self._stats(t0)

    def advance(self, room: bool = True) -> None:
        """Steps the next bucket once its page-in is done and its scratch mapped,
        issues its page-out, maps the next bucket's scratch where the window has room,
        and issues the page-ins through the bucket `ahead` past it once the window has
        room: waiting for it, or (room=False) where page-outs have made it already."""
        i = self._next
        self._next = i + 1
        buckets, atomic, stats, page_ins = self.buckets, self.atomic, self.stats, self.page_ins
        b, n, counting = buckets[i], len(buckets), self._counting
        if self.interrupts is not None:
            self.interrupts.poll()  # a Ctrl-C fails the step here
        t0 = time.monotonic()
        if page_ins.due <= i:  # its page-in left for room by an advance that did not wait
            page_ins.issue(i, wait=True, through=i)
            page_ins.issue(i, wait=False, through=i + self.ahead)  # as many as when it steps
            stats.wait_out_seconds += time.monotonic() - t0
            t0 = time.monotonic()
        page_ins.scratch(i, wait=True)
        stats.wait_out_seconds += time.monotonic() - t0
        t0 = time.monotonic()
        h, scratch = page_ins.handles.pop(i), page_ins.scratch_handles.pop(i, None)
        self._open = i
        h.wait()
        if scratch is not None:
            scratch.wait()
        self._done_in.append(h)
        t_in = time.monotonic()
        stats.wait_in_seconds += t_in - t0
        counting.read()  # bucket i - LAG's, before bucket i's work is queued
        if self.unverified is not None:  # a changed param fails the step before any bucket
            changed, self.unverified = self.unverified, None
            ParamChecks.verify_queued(changed)
        t1 = time.monotonic()
        stats.wait_device_seconds += t1 - t_in
        if atomic and not self._for_read:  # all or nothing: undo copies a bucket ahead
            if i == 0:  # the first's own first
                atomic.take_ahead(b)
            if i + 1 < n:
                atomic.take_ahead(buckets[i + 1])
        self._trace.start(f"step bucket {i}", "step")
        pending = self._stepper.step(b, atomic, self._checks, self.fused[i], self.checked,
                                     resident=self.incoming[i])
        self._trace.end()
        t2 = time.monotonic()
        self._stepping.append((t1, t2))
        stats.compute_seconds += t2 - t1
        held = counting.hold(pending, id(b))  # before anything else can fail
        self._open = None  # stepped: whole, resident until its page-out lands
        if self._for_read:
            atomic.stepped(b)
        if self.stationary[i]:  # its stored forms stay mapped: its scratch dropped alone
            drop = residency.dropped(b, held)
            out, discard = None, (self.pager.discard_async(drop) if drop else None)
        else:
            out, *rest = residency.release(self.pager, b, wait=False, keep=held,
                                           reuse_after=self._sched.reuse_after(i))
            discard = rest[0] if rest else None
        handles = [h for h in (out, discard) if h is not None]
        self._outs.append(handles)
        self._landing[id(b)] = handles
        self._hold_until_landed(i, held, out, discard)
        self._done_out.append(_NOTHING_WRITTEN if out is None else out)
        t0 = time.monotonic()
        if self._next < n:  # mapped while this bucket's work runs
            page_ins.scratch(self._next, wait=False)
        page_ins.issue(self._next, wait=room)
        stats.wait_out_seconds += time.monotonic() - t0

    def _hold_until_landed(self, i: int, held: list, out, discard) -> None:
        """Bucket i, stepped, holds its stored forms' pages until its page-out `out` lands
        (None: a stationary bucket's, kept apart) and its dropped scratch's (what its
        page-in mapped, or all of it where the step made its state) until its `discard`
        does (None: nothing dropped)."""
        window, b = self.page_ins.room, self.buckets[i]
        window.let_go(i)
        if out is not None:
            window.hold_until("page-outs", out, window.count(b.stored))
        if discard is not None:  # its scratch, but what ExceptionCounts holds
            scratch = residency.dropped(b, held)
            if not self.page_ins.holds(i)[1]:  # the fused step's moments have none mapped
                mapped = {id(t) for t in self.incoming[i]}
                scratch = [t for t in scratch if id(t) in mapped]
            window.hold_until("discards", discard, window.count(scratch))

    def finish(self) -> float:
        """After the last bucket: the exceptions read and the checks verified, every
        page-out waited for. Returns when it began (time.monotonic())."""
        t0 = time.monotonic()
        self._counting.read(keep=0)
        if self._checks:
            self._checks.verify()
        for h in [h for handles in self._outs for h in handles]:
            h.wait()
        self._counting.wait_let_go()
        # Done by now (their page-ins waited for them). One that failed left its tensors
        # in the store, whose page-in then read them (or failed the step itself).
        _settle(self.page_ins.aheads.values())
        return t0

    def _fail(self, error: BaseException) -> None:
        """After `error` in the streaming: nothing left in flight, an interrupt
        notwithstanding."""
        with interrupts.deferred():
            try:  # a stepped bucket's exceptions are its stored form's: never left unread
                self._counting.read(keep=0)
            except BaseException as failed:
                error.add_note(f"statepager: reading a stepped bucket's residual "
                               f"exceptions failed too ({failed!r}): its masters may "
                               "not decode")
            page_ins = self.page_ins
            _settle(page_ins.in_flight() + [h for handles in self._outs for h in handles]
                    + self._counting.handles)
            open_ = [] if self._open is None else [self._open]
            self._hand_back(open_ + list(page_ins.handles), error)

    def _hand_back(self, indices: list, error: BaseException | None = None) -> None:
        """A resumable step's buckets `indices`, paged in (or in flight, waited for) and
        not stepped, back to their bytes at rest without a write (their device changes
        dropped), their scratch dropped; then what the bucket stepping changed outside
        the pager put back (ResumableStep.put_back). Nothing for other steps (an epoch's
        abort returns theirs)."""
        if not self._for_read:
            return
        try:
            residency.to_rest(self.pager, [self.buckets[k] for k in indices
                                           if not self.stationary[k]], unchanged=True)
            # A stationary bucket stays mapped: its scratch dropped, its stored forms as
            # its undo copies were (put_back), where it was stepping.
            self.pager.discard_async([t for k in indices if self.stationary[k]
                                      for t in self.buckets[k].working]).wait()
            self.atomic.put_back()
        except BaseException as failed:
            if error is None:
                raise
            error.add_note(f"statepager: handing back the buckets not stepped failed too "
                           f"({failed!r}): the optimizer state may be partly stepped")

    def _stats(self, t0: float) -> StepStats:
        """The step's stats, finish() having begun at t0."""
        pager, stats = self.pager, self.stats
        self._stepper.end()
        pager.services.keep_at_least(self._planner.window())  # state created in this step
        t_end = time.monotonic()
        stats.wait_out_seconds += t_end - t0
        stats.seconds = t_end - self.t_start
        stats.setup_seconds, stats.loop_seconds = self.setup_seconds, t_end - self._t_loop
        after = pager.stats()
        # A step that followed it began with page-ins of its own: its reads end there.
        until = self._followed or after
        stats.bytes_read = until["bytes_read"] - self.before["bytes_read"]
        stats.bytes_written = after["bytes_written"] - self.before["bytes_written"]
        stats.peak_mapped_bytes = until["peak_mapped_bytes"]
        stats.set_io_times([h.times for h in self._done_in], [h.times for h in self._done_out])
        stats.timeline = [(b.nbytes, i.times, s, o.times) for b, i, s, o
                          in zip(self.buckets, self._done_in, self._stepping, self._done_out)]
        return stats

    def end(self) -> None:
        """Ends a started pipeline that stepped nothing: its page-ins waited for (the
        epoch's abort waits for any left, an interrupt here notwithstanding), their pages
        dropped unwritten (an atomic step's, abandoned; a resumable one's, handed back)."""
        try:
            _settle(self.page_ins.in_flight())
        finally:
            if self._for_read:
                self._hand_back(list(self.page_ins.handles))
            else:
                self.atomic.abandon()


class _Schedule:
    """When each bucket of a step is needed again, in bytes named in page-ins (the clock
    of Pager.page_out_async's reuse_after). The step names bucket k's incoming tensors
    (named_in[k]: stored forms and scratch) when it issues its page-in (the
    first ahead + 1 at once, then one after each bucket stepped) and its scratch again
    when it steps (named_at_step[k]: the decode's page-in); steps repeat the same order,
    so bucket i, paged out after its step, is needed again one step's bytes after its
    page-in was issued (sooner where a begun step fills the window: a hint)."""

    def __init__(self, named_in: list, named_at_step: list, ahead: int):
        n = len(named_in)
        incoming = [0, *itertools.accumulate(named_in)]
        scratch = [0, *itertools.accumulate(named_at_step)]
        self._step = incoming[n] + scratch[n]
        # The clock (from the step's start) when bucket k's page-in is issued: the first
        # ahead + 1 at once, then each after bucket k - ahead - 1 stepped.
        self._issued = [incoming[k] + scratch[max(0, k - ahead)] for k in range(n)]
        # ... and once bucket i is paged out: page-ins issued through i + ahead, scratch
        # named through i.
        self._now = [incoming[min(i + ahead, n - 1) + 1] + scratch[i + 1] for i in range(n)]

    def reuse_after(self, i: int) -> int:
        return max(1, self._step + self._issued[i] - self._now[i])


class _NothingWritten:
    """A stationary bucket's page-out in the step's timeline: nothing moved."""
    times = (0.0, 0.0)


_NOTHING_WRITTEN = _NothingWritten()


def _settle(handles) -> None:
    """Waits for every handle, whatever its outcome (a failed step must not leave buckets
    in flight; the error that stopped it is the one raised)."""
    for h in handles:
        try:
            h.wait()
        except Exception:
            pass

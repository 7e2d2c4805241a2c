"""A streamed step's page-ins (statepager.core.pipeline): issued in bucket order, each
once its pages fit in the window beside those held (statepager.core.room), `ahead`
buckets past the next to step at most; a begun step's, before its first bucket steps,
as far as the window holds (see Note [A begun step fills the window] in
docs/design.md)."""
from __future__ import annotations

from statepager.core.room import Room


class PageIns:
    """The page-ins of one pipeline's buckets. `incoming[j]`: what bucket j's page-in
    brings (residency.incoming); `outs`: the pipeline's page-out handles per bucket
    stepped, oldest first, waited for (and popped) to make room; `counting`: its
    ExceptionCounts; `follows`: the Pipeline whose page-outs the page-ins follow
    (Pipeline.released), or None. Used under the Pager's lock, like Room."""

    def __init__(self, pager, buckets: list, incoming: list, room: Room, new_pages, *,
                 ahead: int, for_read: bool, read_ahead: int, outs, counting, follows):
        self.pager, self.buckets, self.incoming, self.room = pager, buckets, incoming, room
        self.ahead, self.follows = ahead, follows
        self._new_pages = new_pages  # Planner.new_pages
        self._for_read, self._read_ahead = for_read, read_ahead
        self._outs, self._counting = outs, counting
        self.due = 0             # the bucket whose page-in is to be issued next
        self.handles: dict = {}  # bucket index -> its page-in's handle
        self.aheads: dict = {}   # bucket index -> its read-ahead's handle
        self._counted: dict = {}  # bucket index -> what its page-in holds (Room.count)

    def holds(self, j: int) -> tuple:
        """What bucket j's page-in holds (Room.count): its incoming tensors' pages and
        those of its state yet to be created."""
        counted = self._counted.get(j)
        if counted is None:
            counted = self.room.count(self.incoming[j], self._new_pages(self.buckets[j]))
            self._counted[j] = counted
        return counted

    def first(self, fill: bool = False) -> None:
        """A step's first page-ins: the `ahead` + 1 buckets from the first, or, following
        a step in flight, those that step has let go of and the window has room for;
        fill (a begun step): fill()."""
        if fill:
            self.fill()
        elif self.follows is None:
            for j in range(min(self.ahead + 1, len(self.buckets))):
                self._page_in(j)
        else:
            self.issue(0, wait=False)

    def issue(self, stepped: int, wait: bool, through: int | None = None) -> None:
        """Issues the page-ins due, through bucket `through` (by default `ahead` past the
        bucket that steps next, `stepped` having stepped), each once its pages fit in the
        window: waiting for the page-outs that make room, oldest first, where `wait`,
        else only as far as they have landed. Page-ins in flight and the one due are
        never more than `depth` consecutive buckets, whose pages the window holds, so a
        page-in that does not fit always has a page-out to wait for (callers keep
        `through` so)."""
        last = min(stepped + self.ahead if through is None else through,
                   len(self.buckets) - 1)
        while self.due <= last:
            if not self._admitted(self.due, wait):
                return
            self._page_in(self.due)

    def fill(self) -> None:
        """Before the step's first bucket steps (a begun step): page-ins in order, past
        `ahead`, while each fits in the window beside what is held (no page-out of its
        own to wait for: at most the window's `depth` buckets). Waits for nothing."""
        room = self.room
        while self.due < len(self.buckets) and room.fits(self.holds(self.due)):
            if not self._admitted(self.due, wait=False):
                return
            self._page_in(self.due)

    def pumpable(self, stepped: int) -> bool:
        """Whether issue(stepped, wait=False) has a page-in to issue now (a check cheap
        enough for every module's pre-hook)."""
        if self.due > min(stepped + self.ahead, len(self.buckets) - 1):
            return False
        outs = self._outs
        return (self.room.fits(self.holds(self.due))
                or bool(outs) and all(h.done() for h in outs[0]))

    def _admitted(self, j: int, wait: bool) -> bool:
        """Whether bucket j's page-in may be issued now: its pages fit (after the
        page-outs waited for, where `wait`), the step followed has let go of the bucket,
        and the residual masters' scratch of the buckets before is let go."""
        outs, room, counting, counted = self._outs, self.room, self._counting, self.holds(j)
        while outs and not room.fits(counted):
            if not wait and not all(h.done() for h in outs[0]):
                return False
            for h in outs.popleft():
                h.wait()
        if self.follows is not None and not (room.fits(counted) and self._released(j)):
            return False  # issued by a later call (begin_step's, or the step's own)
        # Queued behind the work of the buckets whose page-outs were waited for.
        if not wait and not all(h.done() for h in counting.handles):
            return False
        counting.wait_let_go()
        return True

    def _released(self, j: int) -> bool:
        return self.follows is None or self.follows.released(self.buckets[j])

    def _page_in(self, j: int) -> None:
        """Issues bucket j's page-in, and the read-aheads past it."""
        pager, buckets, aheads = self.pager, self.buckets, self.aheads
        self.handles[j] = pager.page_in_async(self.incoming[j], for_read=self._for_read)
        self.room.hold(j, self.holds(j))
        self.due = j + 1
        for k in range(max(j + 1, max(aheads, default=0) + 1),
                       min(j + self._read_ahead + 1, len(buckets))):
            if not self._released(k):
                break  # read ahead by a later page-in's call
            aheads[k] = pager.read_ahead_async(buckets[k].stored)

"""A streamed step's page-ins (statepager.core.pipeline): each bucket's stored forms,
issued in bucket order once their pages fit in the window beside those held
(statepager.core.room), and its scratch, mapped unfilled just before the bucket steps,
for which the window keeps room (see Note [Scratch is mapped as its bucket steps] and
Note [A begun step fills the window] in docs/design.md)."""
from __future__ import annotations

from statepager.core.room import Room

# The buckets from the next to step on whose scratch the window keeps room for: the one
# stepping next, and the one after it, mapped while the first steps.
SCRATCH_AHEAD = 2


class PageIns:
    """The page-ins of one pipeline's buckets. `incoming[j]`: what bucket j's step needs
    resident (residency.incoming: its stored forms, then its scratch); `outs`: the
    pipeline's page-out handles per bucket stepped, oldest first, waited for (and popped)
    to make room; `counting`: its ExceptionCounts; `follows`: the Pipeline whose
    page-outs the page-ins follow (Pipeline.released), or None; `stationary[j]`: bucket
    j stays mapped between steps (Note [Stationary buckets]): its stored forms hold no
    room (the window keeps theirs apart) and are paged in to be written, not for a read.
    Used under the Pager's lock, like Room."""

    def __init__(self, pager, buckets: list, incoming: list, room: Room, new_pages, *,
                 ahead: int, for_read: bool, read_ahead: int, outs, counting, follows,
                 stationary: list):
        self.pager, self.buckets, self.room = pager, buckets, room
        self.ahead, self.follows = ahead, follows
        self.stationary = stationary
        cut = [len(b.stored) for b in buckets]
        self._stored = [x[:n] for x, n in zip(incoming, cut)]
        self._scratch = [x[n:] for x, n in zip(incoming, cut)]
        self._new_pages = new_pages  # Planner.new_pages
        self._for_read, self._read_ahead = for_read, read_ahead
        self._outs, self._counting = outs, counting
        self.due = 0             # the bucket whose page-in is to be issued next
        self.next = 0            # the bucket that steps next (issue()'s `stepped`)
        self.handles: dict = {}  # bucket index -> its stored forms' page-in's handle
        self.scratch_handles: dict = {}  # bucket index -> its scratch's page-in's handle
        self.aheads: dict = {}   # bucket index -> its read-ahead's handle
        self._counted: dict = {}  # bucket index -> what its page-in holds (Room.count)
        self._scratch_counted: dict = {}  # bucket index -> what its scratch holds

    def holds(self, j: int) -> tuple:
        """What bucket j's page-in holds (Room.count): its stored forms' pages and those
        of its state yet to be created."""
        counted = self._counted.get(j)
        if counted is None:
            counted = (([], 0) if self.stationary[j] else
                       self.room.count(self._stored[j], self._new_pages(self.buckets[j])))
            self._counted[j] = counted
        return counted

    def scratch_holds(self, j: int) -> tuple:
        """What bucket j's scratch holds once mapped (Room.count)."""
        counted = self._scratch_counted.get(j)
        if counted is None:
            counted = self.room.count(self._scratch[j])
            self._scratch_counted[j] = counted
        return counted

    def in_flight(self) -> list:
        """The handles of every page-in and read-ahead issued and not taken by a step."""
        return [*self.handles.values(), *self.scratch_handles.values(), *self.aheads.values()]

    def issue(self, stepped: int, wait: bool, through: int | None = None) -> None:
        """Issues the page-ins due, `stepped` buckets having stepped, each once its pages
        fit in the window beside those held and the room kept for scratch: through
        bucket `through`, waiting for the page-outs that make room, oldest first, where
        `wait`, else only as far as they have landed; without `through`, `ahead` past
        the next bucket so, then as far as the window holds, waiting for nothing."""
        self.next = stepped
        last = min(stepped + self.ahead if through is None else through,
                   len(self.buckets) - 1)
        while self.due <= last:
            if not self._admitted(self.due, wait):
                return
            self._page_in(self.due)
        while through is None and self.due < len(self.buckets):
            if not self._admitted(self.due, wait=False):
                return
            self._page_in(self.due)

    def scratch(self, i: int, wait: bool) -> bool:
        """Bucket i steps next: maps its scratch, unfilled (its page-in issued before):
        now where the window has room, else (wait) once the page-outs that make it have
        landed (the room kept for it is then free). Whether it is mapped or being
        mapped."""
        self.next = i
        if i >= self.due or i in self.scratch_handles or not self._scratch[i]:
            return i < self.due
        counted = self.scratch_holds(i)
        if not self._room(counted, wait, spare=self._spare(skip=i)) and not wait:
            return False  # waited for every page-out: fits (the room kept for it)
        self.scratch_handles[i] = self.pager.page_in_async(
            (), for_read=self._for_read, overwrite=self._scratch[i])
        self.room.hold(i, counted)
        return True

    def pumpable(self, stepped: int) -> bool:
        """Whether issue(stepped, wait=False) or scratch(stepped, False) has a page-in to
        issue now (a check cheap enough for every module's pre-hook)."""
        room, outs = self.room, self._outs
        if (stepped < self.due and self._scratch[stepped]
                and stepped not in self.scratch_handles):
            return True
        if self.due >= len(self.buckets):
            return False
        return (room.fits(self.holds(self.due), self._spare())
                or bool(outs) and all(h.done() for h in outs[0]))

    def _spare(self, skip: int | None = None) -> int:
        """Pages kept free for the scratch not mapped yet of the next SCRATCH_AHEAD
        buckets to step whose page-ins are issued (but bucket `skip`'s): a bucket's
        page-in keeps room for it once it is among them."""
        stop = min(self.next + SCRATCH_AHEAD, self.due, len(self.buckets))
        return sum(len(self.scratch_holds(k)[0]) for k in range(self.next, stop)
                   if k != skip and self._scratch[k] and k not in self.scratch_handles)

    def _room(self, counted: tuple, wait: bool, spare: int) -> bool:
        """Whether `counted` fits beside what is held and `spare` pages: after waiting
        for the page-outs that make room, oldest first, where `wait`."""
        outs, room = self._outs, self.room
        while outs and not room.fits(counted, spare):
            if not wait and not all(h.done() for h in outs[0]):
                return False
            for h in outs.popleft():
                h.wait()
        return room.fits(counted, spare)

    def _admitted(self, j: int, wait: bool) -> bool:
        """Whether bucket j's page-in may be issued now: its pages fit beside the room
        kept for scratch (after the page-outs waited for, where `wait`), the step
        followed has let go of the bucket, and the residual masters' scratch of the
        buckets before is let go."""
        if not self._room(self.holds(j), wait, self._spare()) and not wait:
            return False  # issued by a later call; waited for every page-out: fits
        if self.follows is not None and not self._released(j):
            return False  # issued by a later call (begin_step's, or the step's own)
        # Queued behind the work of the buckets whose page-outs were waited for.
        counting = self._counting
        if not wait and not all(h.done() for h in counting.handles):
            return False
        counting.wait_let_go()
        return True

    def _released(self, j: int) -> bool:
        return self.follows is None or self.follows.released(self.buckets[j])

    def _page_in(self, j: int) -> None:
        """Issues bucket j's page-in, and the read-aheads past it."""
        pager, buckets, aheads = self.pager, self.buckets, self.aheads
        # A stationary bucket is not handed back where its step fails (its undo copies
        # put it back), and what is paged in for a read would go back to stale bytes.
        self.handles[j] = pager.page_in_async(self._stored[j],
                                              for_read=self._for_read and not self.stationary[j])
        self.room.hold(j, self.holds(j))
        self.due = j + 1
        for k in range(max(j + 1, max(aheads, default=0) + 1),
                       min(j + self._read_ahead + 1, len(buckets))):
            if not self._released(k):
                break  # read ahead by a later page-in's call
            if not self.stationary[k]:
                aheads[k] = pager.read_ahead_async(buckets[k].stored)

"""The pages a step's pipeline (statepager.core.pipeline) holds mapped, against its window:
a page-in is admitted once its pages fit beside those held (see Note [The pipeline admits
page-ins by pages] in docs/design.md).

A bucket holds the pages of its incoming tensors from its page-in on; once stepped,
those of its stored forms until its page-out lands and those of its scratch until the
discard that drops it does (a page two of them touch is mapped once: the pool counts
references per page). Pages are counted as Planner._pages counts them: runs of pages
touched by address, and pages of state yet to be created, counted apart."""
from __future__ import annotations

import collections

from statepager.core.planner import page_runs


class Room:
    """The pages held by one pipeline's buckets, at most `limit` (the window's, beside
    the residual masters' scratch that ExceptionCounts holds); a step begun while the
    one before it still pages out shares that one's (Note [Page-ins during backward]).
    Used under the Pager's lock (the binding's entry points take it).

    Holds that wait for a handle go in lanes, one per kind of handle, in the order they
    were issued: a lane's handles land in that order (page-outs on the device-to-host
    queue, discards behind the stream's kernels), so a poll asks each lane's oldest
    alone (cheap enough for every forward pre-hook). A hold whose handle landed out of
    order is let go at the next poll after those before it: later, never too early; one
    whose handle failed is kept (landed)."""

    def __init__(self, limit: int, page_size: int):
        self.limit, self._page = limit, page_size
        self._refs: collections.Counter = collections.Counter()  # page -> holds on it
        self._new = 0  # pages of state yet to be created, held
        self._until_let_go: dict = {}  # key -> its holds (pages, new) without a handle
        self._lanes: dict = {}  # lane -> deque of (handle, (pages, new)), oldest first

    def count(self, tensors, new: int = 0) -> tuple[list, int]:
        """What `tensors` (and `new` pages of state yet to be created) hold: (their pages,
        new)."""
        pages = [p for first, last in page_runs(tensors, self._page)
                 for p in range(first, last + 1)]
        return pages, new

    def hold(self, key, counted: tuple[list, int]) -> None:
        """`counted` (count()) held for `key` until let_go(key)."""
        self._take(counted)
        self._until_let_go.setdefault(key, []).append(counted)

    def let_go(self, key) -> None:
        """Drops the holds of `key` (hold())."""
        for counted in self._until_let_go.pop(key, ()):
            self._drop(counted)

    def hold_until(self, lane, handle, counted: tuple[list, int]) -> None:
        """`counted` held until `handle` is done; `lane` names the handles that land in
        the order they are given (see the class doc)."""
        self._take(counted)
        self._lanes.setdefault(lane, collections.deque()).append((handle, counted))

    def fits(self, counted: tuple[list, int], spare: int = 0) -> bool:
        """Whether `counted` fits beside the pages held now (holds whose handles are done
        let go first) and `spare` pages kept free."""
        self._poll()
        pages, new = counted
        extra = sum(1 for p in pages if p not in self._refs)
        return len(self._refs) + self._new + extra + new + spare <= self.limit

    def held_pages(self) -> int:
        """The pages held now (holds whose handles are done let go first)."""
        self._poll()
        return len(self._refs) + self._new

    def _poll(self) -> None:
        for lane in self._lanes.values():
            while lane and lane[0][0].done() and landed(lane[0][0]):
                self._drop(lane.popleft()[1])

    def _take(self, counted) -> None:
        pages, new = counted
        self._refs.update(pages)
        self._new += new

    def _drop(self, counted) -> None:
        pages, new = counted
        self._refs.subtract(pages)
        for p in pages:
            if self._refs[p] <= 0:
                del self._refs[p]
        self._new -= new


def landed(handle) -> bool:
    """Whether a handle that is done succeeded. One that failed keeps its hold: a failed
    page-out leaves its bucket resident, and the pipeline's wait for it raises its error."""
    try:
        handle.wait()  # done: returns at once, or raises the bucket's error
    except Exception:
        return False
    return True


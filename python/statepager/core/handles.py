"""PageHandle: a page-in or page-out in flight (Pager.page_in_async and the like)."""
from __future__ import annotations


class PageHandle:
    """A bucket being paged in or out, by `core` (a Pager's C++ core). wait() blocks until
    it is done (the GIL released) and raises its error; done() tells without waiting."""

    def __init__(self, core, ticket):
        self._core = core
        self._ticket = ticket

    def wait(self) -> None:
        self._core.wait(self._ticket)

    def done(self) -> bool:
        return self._core.is_done(self._ticket)

    @property
    def times(self) -> tuple[float, float]:
        """(start, end) of the bucket's I/O on the time.monotonic() clock, once done."""
        return self._ticket.times

"""Pager.pause() / resume(): a Pager's tensors paged out and all its physical memory
given back to the device (to lend the GPU to an inference engine, say), then paged back
in, bit-exact and at the same addresses.

All or nothing: when a bucket of pause() fails (a full disk, say), what went out is paged
back in and the error raised, leaving the Pager as before. Should paging back in fail
too, the Pager stays paused, and resume() brings back what is out. A resume() that fails
leaves what came back in and the Pager paused: resume() again brings back the rest.

Thread-safety: called under the Pager's lock (statepager.core.serial).
"""
from __future__ import annotations

import torch

from statepager import _C
from statepager.core import interrupts


class Sleep:
    """Whether a Pager is paused, and the extents its pause() paged out."""

    def __init__(self):
        self._out = None  # the extents pause() paged out; None: not paused

    @property
    def paused(self) -> bool:
        return self._out is not None

    def pause(self, core, bucket_size: int, discard_after: int | None = None) -> None:
        """core: the Pager's _C.Pager. discard_after: drop the bytes instead, after the
        work queued on that stream (see Pager.pause)."""
        if self._out is not None:
            raise _C.UsageError("this Pager is already paused: call resume() first")
        ids = core.resident_extents()
        # Paused before anything goes out: an interrupt anywhere from here on leaves it
        # paused with resume() bringing back what went out, or (below) not paused with
        # everything back in; never its tensors out and resume() refused.
        self._out = ids
        if discard_after is not None:
            self._discard(core, ids, discard_after)
            return
        try:
            core.page_all(ids, bucket_size, True)
            core.trim()
        except BaseException:
            with interrupts.deferred():
                try:
                    core.page_all(ids, bucket_size, False)
                except BaseException as unwind_error:
                    unwind_error.args = (f"{unwind_error} (while paging back in after pause() "
                                         "failed: the Pager stays paused, and resume() brings "
                                         "back what is out)",) + unwind_error.args[1:]
                    raise
                self._out = None
            raise

    def _discard(self, core, ids: list, stream: int) -> None:
        """One discard of every resident extent: a failed one drops nothing (the core
        keeps a failed bucket's extents as they were), so the Pager is not paused then."""
        try:
            core.wait(core.discard_extents(ids, stream))
        except BaseException:
            self._out = None
            raise
        core.trim()

    def read(self, core, x: torch.Tensor) -> torch.Tensor:
        """While paused, the bytes of x as a new CPU tensor of its shape and dtype, read
        from where pause() paged them out to (the host tier or the store) without paging
        anything: no counter changes and no file is written. core: the Pager's _C.Pager.
        x: a contiguous tensor whose memory lies in one extent that pause() paged out (a
        pager tensor, a view of one, or a tensor in a segment of the Pager's MemPool).
        UsageError, before anything is read, when not paused or x is not such a tensor;
        the store's I/O errors from the read."""
        if not isinstance(x, torch.Tensor):
            raise _C.UsageError(f"read_paused(x): x must be a tensor, not {type(x).__name__}")
        core.check_usable()
        if self._out is None:
            raise _C.UsageError("read_paused(): the Pager is not paused: read x itself")
        if not x.is_contiguous():
            raise _C.UsageError("read_paused(x): x must be contiguous (its bytes are read as "
                                "one range): keep x.contiguous() made before pause()")
        out = torch.empty(x.shape, dtype=x.dtype)
        if out.numel() and not core.read_at_rest(self._out, x.data_ptr(), out):
            raise _C.UsageError(f"read_paused(x): the tensor of shape {list(x.shape)} is not "
                                "in the memory this Pager's pause() paged out")
        return out

    def resume(self, core, bucket_size: int) -> None:
        if self._out is None:
            raise _C.UsageError("this Pager is not paused")
        core.page_all(self._out, bucket_size, False)
        self._out = None


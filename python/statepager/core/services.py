"""What statepager's own modules call on a Pager, not users: `pager.services`.

A Pager's public members are what users call (statepager.core.pager); the steps, the
checkpoints, the integrations and torch_memory_saver's API also need its tensors' pieces,
their stores, undo copies in host memory, its attached optimizers, the state read
between steps and the snapshots a save copies. Those live here, one object per Pager,
made with it and holding its C++ core.
Thread-safety: move_to_store, release_unchanged_async and keep_at_least hold the Pager's
lock (statepager.core.serial), as its entry points do; snapshot and restore are called
inside between_steps(), which holds it; the others read only.
Errors: UsageError for arguments of the wrong type or range, and while the Pager is
paused, closed or in a forked child (check_not_paused); the core's typed errors else.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Sequence

import torch

from statepager import _C
from statepager.core import args, scope, state_access
from statepager.core.handles import PageHandle
from statepager.core.serial import lock_of, serialized
from statepager.util import streams
from statepager.util.flat import flat_view


class PagerServices:
    """Per Pager (`pager`, whose C++ core is `core`): the services above.
    `reads`: the attached optimizers' state read between steps (state_access.Reads);
    `bindings`: the attached StreamedOptimizers, in attach order (Pager.bindings)."""

    def __init__(self, pager, core, open_epoch):
        self.pager = pager
        self._core = core
        self.reads = state_access.Reads(pager, open_epoch)
        self.bindings: list = []

    # -- tensors ---------------------------------------------------------------------

    def host_like(self, t: torch.Tensor) -> torch.Tensor:
        """An uninitialized CPU tensor laid out as torch.empty_like(t), in host memory the
        device copies to and from directly (pinned on CUDA) and of exactly its size
        (torch's pinned allocator rounds up to a power of two); freed with it."""
        like = torch.empty_like(t, device="meta")
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return torch.empty_like(t, device="cpu")
        flat = self._core.host_empty(nbytes).view(like.dtype)
        return flat.as_strided(like.shape, like.stride())

    def pieces(self, t: torch.Tensor) -> list[int]:
        """The byte sizes of the pieces t's storage is made of (Pager.empty(pieces=...));
        one for a tensor made without."""
        return self._core.piece_bytes(t)

    def piece_views(self, t: torch.Tensor) -> list[torch.Tensor]:
        """t's elements as 1-D views in memory order, one per piece (each pages that
        piece alone); [t] for a tensor of one piece."""
        sizes = self.pieces(t)
        if len(sizes) == 1:
            return [t]
        flat, views, at = flat_view(t), [], 0
        for nbytes in sizes:
            views.append(flat[at:at + nbytes // t.element_size()])
            at += nbytes // t.element_size()
        return views

    def owns_each(self, values: Iterable) -> list[bool]:
        """Pager.owns() of each value, in one call."""
        return self._core.owns_each(list(values))

    def store_of(self, t: torch.Tensor) -> str:
        """The name of the store t's bytes live in ("" the default one)."""
        return self._core.store_of(t)

    @serialized
    def move_to_store(self, tensors: Iterable[torch.Tensor], store: str) -> None:
        """The tensors' bytes live in store `store` (directory/<store>/; "" the default)
        from now on; those at rest move on their next page-in. Not while being paged."""
        self._core.move_to_store(args.tensors("move_to_store", tensors),
                                 args.text("store", store))

    @serialized
    def release_unchanged_async(self, tensors: Iterable[torch.Tensor],
                                reuse_after: int = 0) -> PageHandle:
        """Pages out tensors the caller only read since their page-in, after the work
        queued on the current stream: those Pager.page_in_async(for_read=True) brought in
        go back to their bytes at rest without a write; the others are paged out as
        page_out_async() does (allocator/pager.h, Pager::release_unchanged)."""
        self.check_not_paused("release_unchanged()")
        tensors = args.tensors("release_unchanged", tensors)
        reuse_after = args.integer("reuse_after", reuse_after)
        stream = streams.current(self.pager.device)
        return PageHandle(self._core, self._core.release_unchanged(tensors, stream,
                                                                   reuse_after))

    def routed_pool(self):
        """The Pager's MemPool with allocations routed to it, for the caller to allocate
        into: see statepager.core.scope.routed_pool."""
        return scope.routed_pool(self.pager, self._core)

    @serialized
    def keep_at_least(self, nbytes: int) -> None:
        """Keeps at least `nbytes` of unmapped pages for reuse (never lowers Pager.keep)."""
        nbytes = args.integer("nbytes", nbytes)
        if nbytes > self.pager.keep:
            self.pager.keep = nbytes
            self._core.set_keep(nbytes)

    # -- the Pager's state -------------------------------------------------------------

    def check_not_paused(self, what: str) -> None:
        """UsageError while paused, closed or in a forked child (see Pager.close()):
        `what` (e.g. "step()") would page tensors."""
        self._core.check_usable()
        if self.pager.paused:
            raise _C.UsageError(f"this Pager is paused: call resume() first ({what} pages "
                                "tensors in or out, and a paused Pager holds no memory)")

    def end_begun_steps(self, finish: bool = False, to_rest: bool = True) -> None:
        """Ends the bindings' steps begun and not taken up (StreamedOptimizer.begin_step)
        and puts their stationary buckets at rest (StreamedOptimizer.to_rest) before what
        reads or moves all the state (pause, checkpoints, close), and lets go of the state
        read since the last step (statepager.core.state_access); finish:
        steps a failure left pending are finished first (StreamedOptimizer.finish_step);
        to_rest=False: the stationary buckets stay (close() drops them)."""
        self.reads.release()
        for binding in self.bindings if finish else ():
            binding.finish_step()
        for binding in self.bindings:
            if to_rest:
                binding.to_rest()
            else:
                binding.end_begun_step()

    # -- the state at rest, between steps (statepager.checkpoint builds on these) ------

    @contextlib.contextmanager
    def between_steps(self, what: str, replaces_state: bool = False):
        """Holds the Pager for `what` (e.g. "save()"), an operation on all attached state
        that must run between steps: takes its lock for the block, refuses while paused
        or closed (UsageError), and ends steps begun and not taken up first; steps left
        pending are finished first unless it replaces the state (a load drops them)."""
        with lock_of(self.pager):
            self.check_not_paused(what)
            self.end_begun_steps(finish=not replaces_state)
            yield

    def snapshot(self, tensors: Sequence[torch.Tensor]):
        """Holds the store ranges of `tensors` (at rest: paged out or zero) as they are
        now, for a copy of this moment: a later page-out of one of them writes elsewhere
        until the snapshot is released (allocator/store_snapshot.h). Returns it, with
        .placements, copy_to(files, targets, chunk_bytes) and release()."""
        return self._core.snapshot(list(tensors))

    def restore(self, tensors: Sequence[torch.Tensor], zero: Sequence[bool], src: str,
                offsets: Sequence[int]) -> str:
        """Replaces the bytes at rest of `tensors` (paged out) with those of file `src`
        at `offsets` (zero[i]: tensor i becomes zeros instead), all or nothing
        (allocator/store_restore.h). Returns how the bytes were copied."""
        return self._core.restore(list(tensors), list(zero), src, list(offsets))

"""Pager: the user-facing object. Policy lives here; the byte moving is in C++ (_C)."""
from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import sys
import weakref
from typing import Iterable, Sequence

import torch

from statepager import _C
from statepager.checkpoint import save_load as checkpoint
from statepager.core import (adapters, args, guard, interrupts, ranks, scope, serial,
                             state_access)
from statepager.core.serial import serialized
from statepager.core.flat import flat_view
from statepager.core.stream import StreamedOptimizer

MiB = 1 << 20
GiB = 1 << 30

log = logging.getLogger("statepager")


class PageHandle:
    """A bucket being paged in or out. wait() blocks until it is done and raises its error."""

    def __init__(self, pager: "Pager", ticket):
        self._pager = pager
        self._ticket = ticket

    def wait(self) -> None:
        self._pager._core.wait(self._ticket)

    def done(self) -> bool:
        return self._pager._core.is_done(self._ticket)

    @property
    def times(self) -> tuple[float, float]:
        """(start, end) of the bucket's I/O on the time.monotonic() clock, once done."""
        return self._ticket.times


class Epoch:
    """An all-or-nothing change of pager tensors (Pager.begin_epoch): end it with commit()
    or abort()."""

    def __init__(self, pager: "Pager", epoch: int):
        self._pager = pager
        self._epoch = epoch

    def commit(self) -> None:
        """Keeps what the tensors hold now."""
        with serial.lock_of(self._pager):
            self._pager._core.commit_epoch(self._epoch)

    def abort(self) -> None:
        """Returns every tensor to its bytes and residency of the epoch's begin, once its
        paging in flight is done; resident ones are dropped without being written."""
        with serial.lock_of(self._pager):
            self._pager._core.abort_epoch(self._epoch)


class Pager:
    """Tensors whose bytes live in a paged pool and, when not resident, in a store file.

    directory: the store directory (a str, os.PathLike or bytes path), exclusive to this
        Pager (a second one is refused with StoreBusyError). A new directory (created), an empty one, or one holding a store
        that statepager left (after a crash: its files are deleted); any other directory
        is refused with UsageError, untouched, as are a symbolic link to a directory (pass
        the directory itself) and a directory inside another store. The path is made
        absolute once (self.directory); statepager creates its files new and never through
        a symbolic link. close() deletes what statepager created there, and the directory
        if statepager made it. "{rank}" in it becomes the torch.distributed rank (0 when
        not initialized), so each rank of a job gets its own store. Each attached
        optimizer keeps its state in its own store, directory/<its name>/; other tensors
        in the default one, directory/state.bin.
    device: "cpu" (host backend) or "cuda[:N]" (CUDA virtual memory), or its torch.device.
    page_size: bytes per physical page; a multiple of the device granularity (4 KiB on
        the host, 2 MiB on CUDA), at most 1 GiB.
    hbm_budget: physical bytes the pool may hold at once, at least one page (None:
        unbounded).
    keep: unmapped physical bytes kept for reuse instead of being returned.
    arena_size: address space reserved for the pager's tensors, at least one page (up to
        128 TiB, rounded up to whole pages; costs no memory); no tensor can be larger.
    io_depth, io_block: I/O requests in flight (1 to 1024) and bytes per request (a
        multiple of 4 KiB up to 256 MiB); None: chosen for the store's medium (64 x 4 MiB
        on a disk, 32 x 1 MiB in RAM; stats() says).
    host_budget: bytes of host memory for paged-out tensors (the host tier; pinned on
        CUDA, allocated once here), up to 128 TiB; 0: none, every page-out goes to the
        store. A page-out goes to the host tier while it has room, else to the store; a
        page-in from it is a copy-engine copy, no file I/O. An atomic step keeps the
        bytes before the step until it commits, so holding the state through steps takes
        twice its size.
    map_ram: where the store's files lie in RAM (tmpfs, ramfs), map them for the device's
        own copies (the default): page-ins and page-outs then move no byte through the
        CPU and run at copy-engine speed, where io_uring would have the kernel copy every
        byte on the CPU's cores (on the H200 machine, Megatron's fp32 step 1.0 s through
        io_uring, 0.5 s mapped). The files' pages are pinned while mapped; a store's
        growth maps, populates and registers its new bytes on the I/O thread; freed
        ranges keep their memory (the store holds its high-water mark of RAM). False:
        io_uring always. No effect on a store on disk. stats() counts the bytes moved
        this way (mapped_read_bytes, mapped_written_bytes).
    Arguments outside these ranges, or of another type (direct_io and map_ram are bools),
    are refused with a UsageError naming them (statepager.core.args says what is taken).
    """

    def __init__(
        self,
        directory: str,
        device: str | torch.device = "cpu",
        *,
        page_size: int = 32 * MiB,
        hbm_budget: int | None = None,
        keep: int = 0,
        arena_size: int = 1 << 40,
        io_depth: int | None = None,
        io_block: int | None = None,
        direct_io: bool = True,
        host_budget: int = 0,
        map_ram: bool = True,
    ):
        guard.install()  # repr/pickle/copy of its tensors cannot crash (statepager.guard)
        serial.add(self)  # its lock, held by every entry point
        # The attached optimizers' state read between steps; statepager's own (steps,
        # state_access), not for users.
        self.reads = state_access.Reads(self, self._begin_epoch)
        # Types and signs here; the core checks the ranges (it knows the device).
        page_size = args.integer("page_size", page_size)
        hbm_budget = args.optional_integer("hbm_budget", hbm_budget)
        keep = args.integer("keep", keep)
        arena_size = args.integer("arena_size", arena_size)
        io_depth = args.optional_integer("io_depth", io_depth, minimum=1)  # 0 would be None
        io_block = args.optional_integer("io_block", io_block, minimum=1)
        host_budget = args.integer("host_budget", host_budget)
        direct_io, map_ram = args.flag("direct_io", direct_io), args.flag("map_ram", map_ram)
        directory = args.path("directory", directory).replace("{rank}", str(ranks.rank()))
        self.device = args.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        budget = hbm_budget if hbm_budget is not None else (1 << 64) - 1
        self._core = _C.Pager(
            directory, str(self.device), page_size, budget, keep, arena_size,
            io_depth or 0, io_block or 0, direct_io, host_budget, map_ram,
        )
        _track(self)
        self._unbounded = hbm_budget is None
        self.directory = self._core.directory  # absolute, ancestors' links resolved
        self.page_size = page_size
        self.keep = keep
        self._paused = None
        self._mem_pool = None  # the MemPool of scope(), created on first use
        self._bindings = []    # attached optimizers, in attach order (checkpoint layout)
        self._saving = None    # the background save in flight (statepager.checkpoint)

    # -- tensors ---------------------------------------------------------------------

    def empty(self, *shape, dtype: torch.dtype = torch.float32, store: str = "",
              strides: Sequence[int] | None = None,
              pieces: Sequence[int] | None = None) -> torch.Tensor:
        """A deferred tensor: address reserved, no memory and no I/O until page_in().
        `store` names the store its bytes go to ("" the default one); `strides` its
        memory layout (None: contiguous). `pieces`: the byte sizes of consecutive parts
        of its bytes (in memory order) that are paged on their own, each through a view
        of exactly its bytes (the tensor itself pages them all); every one but the last a
        multiple of 4 KiB, together the tensor's bytes. None: one part."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        return self._core.empty(args.shape(shape), args.dtype(dtype), args.text("store", store),
                                None if strides is None else args.shape(strides, "strides"),
                                None if pieces is None else args.integers("pieces", pieces))

    def empty_like(self, t: torch.Tensor, dtype: torch.dtype | None = None,
                   pieces: Sequence[int] | None = None) -> torch.Tensor:
        """empty() shaped and laid out as torch.empty_like(t) would be (preserve_format:
        a channels_last or transposed t gives the same strides), optionally another dtype,
        in `pieces` (see empty())."""
        like = torch.empty_like(t, dtype=dtype, device="meta")
        return self.empty(like.shape, dtype=like.dtype, strides=like.stride(), pieces=pieces)

    def host_like(self, t: torch.Tensor) -> torch.Tensor:
        """An ordinary CPU tensor shaped and laid out as torch.empty_like(t), uninitialized,
        in host memory this pager's device copies to and from directly (pinned on CUDA, so
        that copy_(non_blocking=True) is queued, not waited for) and of exactly its size:
        torch's pinned allocator rounds each allocation up to a power of two. Its memory
        is freed with it."""
        like = torch.empty_like(t, device="meta")
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return torch.empty_like(t, device="cpu")
        flat = self._core.host_empty(nbytes).view(like.dtype)
        return flat.as_strided(like.shape, like.stride())

    def pieces(self, t: torch.Tensor) -> list[int]:
        """The byte sizes of the pieces t's storage is made of (empty(pieces=...)); one
        for a tensor made without."""
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

    def owns(self, t) -> bool:
        """True when t is a tensor whose bytes are a tensor of this pager (a view of one
        included); False for anything else (sparse tensors, numbers)."""
        return isinstance(t, torch.Tensor) and t.layout == torch.strided and self._core.owns(t)

    def owns_each(self, values: Iterable) -> list[bool]:
        """owns() of each value, in one call."""
        return self._core.owns_each(list(values))

    def store_of(self, t: torch.Tensor) -> str:
        """The name of the store t's bytes live in ("" the default one)."""
        return self._core.store_of(t)

    @serialized
    def move_to_store(self, tensors: Iterable[torch.Tensor], store: str) -> None:
        """The tensors' bytes live in store `store` from now on (directory/<store>/, opened
        on first use; "" the default store). Nothing is copied: tensors with bytes at rest
        move on their next page-in. Not while they are being paged."""
        self._core.move_to_store(args.tensors("move_to_store", tensors),
                                 args.text("store", store))

    def residency(self, t: torch.Tensor) -> str:
        """'zero', 'file', 'host', 'resident', 'paging_in' or 'paging_out'; 'mixed' for a
        tensor whose pieces (empty(pieces=...)) are not all alike."""
        return self._core.residency(t)

    def is_resident(self, t: torch.Tensor) -> bool:
        return self.residency(t) == "resident"

    # -- paging ----------------------------------------------------------------------

    @serialized
    def page_in_async(self, tensors: Iterable[torch.Tensor], for_read: bool = False
                      ) -> PageHandle:
        """for_read: the caller will only read them and hand them back with
        release_unchanged_async(): where their bytes lie at rest is remembered (their
        host-tier copies stay, that room taken while they are resident), so that handing
        them back writes nothing."""
        self.check_not_paused("page_in()")
        return PageHandle(self, self._core.page_in(args.tensors("page_in", tensors),
                                                   args.flag("for_read", for_read)))

    @serialized
    def page_out_async(self, tensors: Iterable[torch.Tensor], reuse_after: int = 0) -> PageHandle:
        """Pages out after the work already queued on the current stream. reuse_after > 0
        says they will be paged in again once about that many more bytes have been named
        in page_in calls: the host tier then keeps whatever is needed sooner (without it,
        the least recently used tensors leave it first; allocator/pager.h)."""
        self.check_not_paused("page_out()")
        tensors = args.tensors("page_out", tensors)
        reuse_after = args.integer("reuse_after", reuse_after)
        return PageHandle(self, self._core.page_out(tensors, self._stream(), reuse_after))

    @serialized
    def release_unchanged_async(self, tensors: Iterable[torch.Tensor],
                                reuse_after: int = 0) -> PageHandle:
        """Pages out tensors the caller did not write since their page-in (it only read
        them), after the work already queued on the current stream: each that
        page_in_async(for_read=True) brought in goes back to its bytes at rest (zeros,
        its store range or its host-tier copy) without any write; the others are paged
        out as page_out_async() does (allocator/pager.h, Pager::release_unchanged)."""
        self.check_not_paused("release_unchanged()")
        tensors = args.tensors("release_unchanged", tensors)
        reuse_after = args.integer("reuse_after", reuse_after)
        return PageHandle(self, self._core.release_unchanged(tensors, self._stream(),
                                                             reuse_after))

    @serialized
    def read_ahead_async(self, tensors: Iterable[torch.Tensor]) -> PageHandle:
        """Reads 'file' tensors into free host-tier room (never making room), so that
        their page-in is a copy-engine copy; others are skipped."""
        self.check_not_paused("read_ahead()")
        return PageHandle(self, self._core.read_ahead(args.tensors("read_ahead", tensors)))

    @serialized
    def discard_async(self, tensors: Iterable[torch.Tensor]) -> PageHandle:
        """Drops the tensors' bytes, resident or at rest, without any I/O (they become
        'zero'), after the work already queued on the current stream."""
        self.check_not_paused("discard()")
        return PageHandle(self, self._core.discard(args.tensors("discard", tensors),
                                                   self._stream()))

    @serialized
    def page_in(self, tensors: Sequence[torch.Tensor] | torch.Tensor) -> None:
        self.page_in_async(tensors).wait()

    @serialized
    def page_out(self, tensors: Sequence[torch.Tensor] | torch.Tensor) -> None:
        self.page_out_async(tensors).wait()

    @serialized
    def begin_epoch(self, tensors: Iterable[torch.Tensor]) -> Epoch:
        """Opens an epoch over `tensors` (at rest, in no other epoch): until it ends, paging
        them out never overwrites the bytes they hold now (copy-on-write into fresh store
        ranges), so Epoch.abort() can return to them. An optimizer step runs in one.
        An attached optimizer's state read since its last step is let go first
        (statepager.core.state_access)."""
        tensors = args.tensors("begin_epoch", tensors)
        self.reads.release()
        return self._begin_epoch(tensors)

    def _begin_epoch(self, tensors: list) -> Epoch:
        """begin_epoch() without letting the state reads go (the reads' own epochs,
        state_access.Reads): an epoch opened and not handed over (an interrupt) is
        aborted."""
        epoch = self._core.begin_epoch(tensors)
        try:
            return Epoch(self, epoch)
        except BaseException:
            self._core.abort_epoch(epoch)
            raise

    def _stream(self) -> int:
        if self.device.type != "cuda":
            return 0
        return torch.cuda.current_stream(self.device).cuda_stream

    # -- construction ------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self, min_bytes: int = 1 * MiB):
        """Builds optimizer state straight into this pager (see statepager.scope):
        allocations on this pager's device go to its pool, new fp32 tensors of at least
        `min_bytes` become pager tensors, and the oldest are paged out whenever the pool
        would pass hbm_budget. Yields the Capture, whose `.tensors` lists them."""
        min_bytes = args.integer("min_bytes", min_bytes)
        with serial.lock_of(self):
            self.check_not_paused("scope()")
            self.reads.release()  # their room in the pool
        capture = scope.Capture(self, min_bytes)
        with contextlib.ExitStack() as stack:
            if self.device.type == "cuda":
                if self._mem_pool is None:
                    self._mem_pool = scope.mem_pool_for(self)
                _C.route_device(self.device.index, self._core)
                stack.callback(_C.route_device, self.device.index, None)
                stack.enter_context(scope.using_pool(self._mem_pool, self.device))
            stack.enter_context(capture)
            yield capture

    # -- sleep / wake ----------------------------------------------------------------

    @serialized
    def pause(self, bucket_size: int = 256 * MiB) -> None:
        """Pages out everything resident, in buckets of about `bucket_size` bytes, and
        returns all physical memory to the device (e.g. to lend the GPU to an inference
        engine). resume() brings it back. While paused, paging (page_in, page_out, an
        attached optimizer's step, scope(), save, load) is refused: call resume() first.

        All or nothing: when a bucket fails (a full disk, say), what went out is paged
        back in and the error raised, leaving the Pager as before. Should paging back in
        fail too, the Pager stays paused, and resume() brings back what is out."""
        bucket_size = args.integer("bucket_size", bucket_size, minimum=1)
        self._core.check_usable()
        if self._paused is not None:
            raise _C.UsageError("this Pager is already paused: call resume() first")
        self._end_begun_steps()
        ids = self._core.resident_extents()
        # Paused before anything goes out: an interrupt anywhere from here on leaves it
        # paused with resume() bringing back what went out, or (below) not paused with
        # everything back in; never its tensors out and resume() refused.
        self._paused = ids
        try:
            self._core.page_all(ids, bucket_size, True)
            self._core.trim()
        except BaseException:
            with interrupts.deferred():
                try:
                    self._core.page_all(ids, bucket_size, False)
                except BaseException as unwind_error:
                    unwind_error.args = (f"{unwind_error} (while paging back in after pause() "
                                         "failed: the Pager stays paused, and resume() brings "
                                         "back what is out)",) + unwind_error.args[1:]
                    raise
                self._paused = None
            raise

    @serialized
    def resume(self, bucket_size: int = 256 * MiB) -> None:
        """Pages back in, bit-exact and at the same addresses, what pause() paged out.
        When it fails, what came back stays in and the Pager stays paused: resume()
        again brings back the rest."""
        bucket_size = args.integer("bucket_size", bucket_size, minimum=1)
        self._core.check_usable()
        if self._paused is None:
            raise _C.UsageError("this Pager is not paused")
        self._core.page_all(self._paused, bucket_size, False)
        self._paused = None

    def _end_begun_steps(self) -> None:
        """Ends the bindings' steps begun and not taken up (StreamedOptimizer.begin_step)
        before what reads or moves all the state (pause, checkpoints, close), and lets
        go of the state read since the last step (statepager.core.state_access)."""
        self.reads.release()
        for binding in self._bindings:
            binding.end_begun_step()

    @property
    def paused(self) -> bool:
        return self._paused is not None

    def check_not_paused(self, what: str) -> None:
        """UsageError while paused, closed or in a forked child (see close()): `what`
        (e.g. "step()") would page tensors."""
        self._core.check_usable()
        if self._paused is not None:
            raise _C.UsageError(f"this Pager is paused: call resume() first ({what} pages "
                                "tensors in or out, and a paused Pager holds no memory)")

    # -- optimizers ------------------------------------------------------------------

    @serialized
    def attach(self, optimizer, *, bucket_size: int = 256 * MiB, depth: int = 3,
               log_steps: bool = False, before_bucket=None, after_bucket=None,
               moments: str = "fp32", mains: str = "fp32", model_param=None,
               name: str | None = None, keep_resident=None, atomic: bool = True,
               before_chunk=None, after_chunk=None):
        """Streams `optimizer`'s state through this pager: its state tensors (and its
        parameters, when this pager owns them) live here, and step() pages each bucket
        of about `bucket_size` bytes in, steps it, and pages it out, with `depth`
        buckets resident or in flight at most. `moments` ("fp32", "bf16", "q8") and
        `mains` ("fp32", "residual": needs `model_param(master)` -> its bf16 parameter)
        choose the on-disk formats (statepager.formats). `name` identifies the binding in
        checkpoints and names its own store, directory/<name>/ (default "opt<i>", i its
        attach order); parameters for which `keep_resident(p)` is true keep their state
        in ordinary memory and step unpaged. `model_param(master)` is also the model
        parameter that after_bucket writes from a master: a failed step restores it.
        atomic: a step that raises changes nothing and a retry steps once
        (statepager.atomic; the store needs room for a second copy of the state);
        atomic=False steps in place and a failed step leaves the state partly stepped.
        A parameter whose state is larger than bucket_size steps in chunks of consecutive
        elements over consecutive buckets when the optimizer's step is torch's Adam step
        and its pager tensors are made of pieces (statepager.core.slices; the binding
        makes the state so; an fp32 master the pager owns must be made with
        empty(pieces=statepager.core.slices.pieces(numel, 4)), as PagedAdamW makes them),
        else it is a bucket of its own. before_chunk(p, start, stop) and
        after_chunk(p, start, stop) are then called around the step of elements
        [start, stop) of p (memory order), where before_bucket and after_bucket get whole
        parameters; with bucket hooks but no chunk hooks, no parameter steps in chunks.
        A Megatron DistributedOptimizer or ChainedOptimizer is attached through
        statepager.integrations.megatron (one binding per member; returns a
        MegatronBinding); it sets name, before_bucket, after_bucket, model_param and
        keep_resident itself, and passing any of them is refused (UsageError).
        Returns the StreamedOptimizer binding; its `.last` holds the last step's StepStats."""
        # Every argument is checked before anything is made: the binding's store
        # (directory/<name>/) opens when its plan first moves state there.
        bucket_size, depth = args.bucketing(bucket_size, depth)
        log_steps, atomic = args.flag("log_steps", log_steps), args.flag("atomic", atomic)
        moments, mains = args.formats(moments, mains)
        hooks = {"before_bucket": before_bucket, "after_bucket": after_bucket,
                 "model_param": model_param, "keep_resident": keep_resident,
                 "before_chunk": before_chunk, "after_chunk": after_chunk}
        hooks = {k: args.hook(k, v) for k, v in hooks.items()}
        name = args.optimizer_name(name)
        self.check_not_paused("attach()")
        adapter = adapters.find(optimizer)
        if adapter is not None:
            adapters.refuse_set_options(adapter, {"name": name, **hooks})
            return adapter.attach(self, optimizer, bucket_size=bucket_size, depth=depth,
                                  log_steps=log_steps, moments=moments, mains=mains,
                                  atomic=atomic)
        args.optimizer(optimizer)
        guard.refuse_model_params(self, optimizer)
        name = f"opt{len(self._bindings)}" if name is None else name
        if any(b.name == name for b in self._bindings):
            raise _C.UsageError(f"an optimizer named {name!r} is already attached to this "
                                "Pager: give each attach() its own name")
        binding = StreamedOptimizer(self, optimizer, bucket_size=bucket_size, depth=depth,
                                    log_steps=log_steps, moments=moments, mains=mains,
                                    name=name, atomic=atomic, **hooks)
        self._bindings.append(binding)
        return binding

    @property
    def bindings(self) -> tuple:
        """The attached optimizers' StreamedOptimizer bindings, in attach order (a
        Megatron optimizer has one per member)."""
        return tuple(self._bindings)

    # -- checkpoints -------------------------------------------------------------------

    @serialized
    def save(self, path: str, *, background: bool = False, via: str = "store",
             checksum: str = "crc32c"):
        """Writes the state of every attached optimizer to the new directory `path`,
        atomically (see statepager.checkpoint). Call it between steps. The bytes are
        copied from the store's files (via="store"; "device" streams them through the
        device instead, bucket by bucket). background=True returns as soon as the state
        of this moment is secured: steps may run while the copy finishes, and a bucket's
        page-out waits until that bucket has been copied. checksum="crc32" writes the
        format-3 checkpoint older statepagers read (zlib crc32, a second read of the
        files); the default crc32c is computed while copying. Returns a SaveHandle:
        wait(), done(), and .method, .bytes, .seconds of the save."""
        self.check_not_paused("save()")
        return self._save(path, background, via, checksum)

    @serialized
    def load(self, path: str, *, missing_ok: bool = False) -> bool:
        """Loads a checkpoint written by save() into the attached optimizers, after
        verifying format, layout, entries and checksums; nothing changes if any check
        fails. Returns True. A path that holds no checkpoint (nothing there, a file, a
        directory without the manifest) is a UsageError naming what is missing, so that a
        mistyped path never trains from scratch; missing_ok=True ("load if present")
        returns False instead where nothing exists at `path`. With a host tier, the loaded
        state is then read into it as far as it has room, first buckets first (the next
        step's page-ins are host copies)."""
        self.check_not_paused("load()")
        return self._load(path, missing_ok)

    @serialized
    def save_to(self, base: str, *, background: bool = False):
        """save() into this rank's part of a training loop's checkpoint directory:
        base/statepager/rankNNNNN (rank from torch.distributed, else 0), one
        subdirectory per attached optimizer (by name), atomic as a whole."""
        self.check_not_paused("save_to()")
        return self._save(checkpoint.rank_directory(base), background, "store")

    @serialized
    def load_from(self, base: str, *, missing_ok: bool = False) -> bool:
        """load() of what save_to(base) wrote for this rank, with load()'s missing_ok:
        True to return False where there is none (e.g. a checkpoint of a run without
        statepager)."""
        self.check_not_paused("load_from()")
        return self._load(checkpoint.rank_directory(base), missing_ok)

    def _save(self, path: str, background: bool, via: str, checksum: str = "crc32c"):
        checkpoint.check_save_options(background, via, checksum)
        self._end_begun_steps()
        self._settle_save()
        handle = checkpoint.save(self, self._core, path, background=background, via=via,
                                 checksum=checksum)
        if background:
            self._saving = handle  # one at a time: the next save or load waits for it
        return handle

    def _load(self, path: str, missing_ok: bool) -> bool:
        self._end_begun_steps()
        self._settle_save()
        loaded = checkpoint.load(self, self._core, path, missing_ok)
        if loaded:
            self._fill_host_tier()
        return loaded

    def _fill_host_tier(self) -> None:
        """Reads the attached optimizers' state from the store into the host tier's free
        room, in the order their steps need it, until the room is used (a load leaves
        it all in the store). A read that fails leaves its tensors in the store, where
        their page-in reads them: the load stands."""
        if not self._core.stats()["host_budget_bytes"]:
            return
        handles = [self.read_ahead_async(b.stored) for binding in self._bindings
                   for b in binding.buckets]
        for h in handles:
            try:
                h.wait()
            except _C.Error as e:
                log.warning("statepager: reading the loaded state into the host tier "
                            "failed (%s); it is read from the store instead", e)

    def _settle_save(self) -> None:
        """Waits for the background save, if any, and raises its error if no wait() has
        (a failed save is reported once); the pager forgets it either way."""
        handle, self._saving = self._saving, None
        if handle is not None:
            handle.settle()

    # -- state -----------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters of the pool and the store (allocator/pager.h, PagerStats): bytes
        mapped, cached and read/written, requests, buckets, the I/O shape, the host tier
        (host_budget_bytes, host_used_bytes, host_bytes of tensors there now,
        bytes_to_host, bytes_from_host, spills and spilled_bytes written back to the store
        to make room, read_aheads and read_ahead_bytes), the mapped store in RAM
        (map_ram: mapped_read_bytes of bytes_read, mapped_written_bytes of
        bytes_written, store_mapped_bytes), unchanged_bytes handed back to their bytes at
        rest without a write (release_unchanged_async);
        budget_bytes is the hbm_budget, None when unbounded."""
        s = self._core.stats()
        if self._unbounded:
            s["budget_bytes"] = None  # the core's "no budget" is its largest size
        return s

    @serialized
    def keep_at_least(self, nbytes: int) -> None:
        """Keeps at least `nbytes` of unmapped pages for reuse (never lowers `keep`)."""
        nbytes = args.integer("nbytes", nbytes)
        if nbytes > self.keep:
            self.keep = nbytes
            self._core.set_keep_bytes(nbytes)

    def free_device_memory(self) -> int:
        """Bytes the device reports free now (cudaMemGetInfo; on the host backend, the
        host's available memory)."""
        return self._core.free_device_memory()

    def reset_peak(self) -> None:
        self._core.reset_peak()

    @property
    def file_path(self) -> str:
        return self._core.file_path

    @serialized
    def close(self) -> None:
        """Waits for paging to finish, drops all state and deletes what the Pager created in
        its directory (the directory too, when the Pager made it). Idempotent. Afterwards
        the Pager's tensors have no memory (any access to their data raises in torch; their
        repr says 'closed'), and every call but stats() and close() raises UsageError
        ("this Pager is closed").

        A Pager belongs to the process that made it. In a forked child (os.fork(), a
        launcher's worker) every such call, close() included, raises UsageError at once
        and touches nothing of the parent's: its store, its lock, its threads, its memory.
        Leaving a `with` block in the child and the child's exit close nothing."""
        self._core.check_owner()
        try:
            self._end_begun_steps()
        finally:
            self._core.close()
        if self._mem_pool is not None:
            self._mem_pool = None
            scope.retire_pool_of(id(self))

    def __enter__(self) -> "Pager":
        return self

    def __exit__(self, *exc) -> None:
        if self._core.owner_pid == os.getpid():  # a forked child leaves the parent's alone
            self.close()


# Pagers not yet garbage-collected, by creation order; closed at interpreter exit. A forked
# child starts with none: those it inherits are its parent's (see Pager.close()).
_live: "weakref.WeakValueDictionary[int, Pager]" = weakref.WeakValueDictionary()
_serials = itertools.count()
os.register_at_fork(after_in_child=_live.clear)


def _track(pager: Pager) -> None:
    serial = next(_serials)
    if serial == 0:
        atexit.register(_close_at_exit)
    _live[serial] = pager


def _close_at_exit() -> None:
    """Closes the Pagers still open when the interpreter exits, newest first: their I/O
    threads are joined and their stores deleted while torch, CUDA and Python are whole,
    before Python tears down its objects (in no set order) and C++ its statics. Registered
    when the first Pager is made, so it runs before the atexit handlers of torch and of
    anything set up before that, and after those registered later."""
    for serial in sorted(_live.keys(), reverse=True):
        pager = _live.get(serial)
        if pager is None:
            continue
        try:
            pager.close()
        except Exception as e:  # an exit status or traceback of the program's own matters more
            print(f"statepager: closing the Pager on {pager.directory} at exit failed: {e}",
                  file=sys.stderr)

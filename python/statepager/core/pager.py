"""Pager: the user-facing object. Policy lives here; the byte moving is in C++ (_C).

Pager(directory, device, *, page_size, hbm_budget, keep, arena_size, io_depth, io_block,
direct_io, host_budget, map_ram):
directory: the store directory (str, os.PathLike or bytes), exclusive to this Pager
    (a second one: StoreBusyError): new, empty, or holding a store statepager left
    after a crash (its files are deleted); anything else, a symbolic link to a
    directory or a directory inside another store is refused (UsageError), untouched.
    close() deletes what statepager created there, and the directory if it made it.
    "{rank}" becomes the torch.distributed rank. Each attached optimizer keeps its
    state in its own store, directory/<its name>/; other tensors in directory/state.bin.
device: "cpu" (host backend) or "cuda[:N]" (CUDA virtual memory), or its torch.device.
page_size: bytes per physical page; a multiple of the device granularity (4 KiB on
    the host, 2 MiB on CUDA), at most 1 GiB; None: chosen from the device and
    hbm_budget (statepager.core.defaults).
hbm_budget: physical bytes the pool may hold at once, at least one page (None:
    unbounded). keep: unmapped physical bytes kept for reuse.
arena_size: address space reserved for the pager's tensors (costs no memory; up to
    128 TiB, whole pages); no tensor can be larger.
io_depth, io_block: I/O requests in flight (1 to 1024) and bytes per request (4 KiB
    multiples up to 256 MiB); None: chosen for the store's medium (stats() says).
host_budget: bytes of host memory for paged-out tensors (the host tier; pinned on
    CUDA, allocated here), up to 128 TiB; 0: none. A page-out goes there while it has
    room, else to the store. Holding the state through steps takes its size, twice that
    for all-or-nothing steps (attach(atomic="step"): they keep the bytes of before).
map_ram: map a store in RAM (tmpfs, ramfs) for the device's own copies (default
    True; Note [A store in RAM is mapped] in docs/design.md); False: io_uring always.
Arguments outside these ranges or of another type: UsageError naming them (core.args).
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterable, Sequence

import torch

from statepager import _C
from statepager.core import args, attach, defaults, guard, lifetime, scope, serial, sleep
from statepager.core.handles import PageHandle
from statepager.core.serial import serialized
from statepager.core.services import PagerServices
from statepager.util import ranks, streams
from statepager.util.units import MiB


log = logging.getLogger("statepager")


class Epoch:
    """An all-or-nothing change of pager tensors (Pager.begin_epoch): end it with commit()
    or abort()."""

    @classmethod
    def open(cls, pager: "Pager", tensors: list) -> "Epoch":
        """Opens one; an epoch opened and not handed over (an interrupt) is aborted."""
        epoch = pager._core.begin_epoch(tensors)
        try:
            return cls(pager, epoch)
        except BaseException:
            pager._core.abort_epoch(epoch)
            raise

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
    The constructor's arguments: the module docstring."""

    def __init__(
        self,
        directory: str,
        device: str | torch.device = "cpu",
        *,
        page_size: int | None = None,
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
        # Types and signs here; the core checks the ranges (it knows the device).
        page_size = args.optional_integer("page_size", page_size)
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
        if page_size is None:
            page_size = defaults.page_size(self.device.type, hbm_budget)
        budget = hbm_budget if hbm_budget is not None else (1 << 64) - 1
        self._core = _C.Pager(
            directory, str(self.device), page_size, budget, keep, arena_size,
            io_depth or 0, io_block or 0, direct_io, host_budget, map_ram,
        )
        # What statepager's own modules call on it (attached optimizers, state reads,
        # snapshots, pieces...), not users.
        self.services = PagerServices(self, self._core, self._begin_epoch)
        lifetime.track(self)
        self._unbounded = hbm_budget is None
        self.hbm_budget, self.host_budget = hbm_budget, host_budget  # as made (None: unbounded)
        self.directory = self._core.directory  # absolute, ancestors' links resolved
        self.page_size = page_size
        self.keep = keep
        self._sleep = sleep.Sleep()

    # -- tensors ---------------------------------------------------------------------

    def empty(self, *shape, dtype: torch.dtype = torch.float32, store: str = "",
              strides: Sequence[int] | None = None,
              pieces: Sequence[int] | None = None, arena_end: str = "low") -> torch.Tensor:
        """A deferred tensor: address reserved, no memory and no I/O until page_in().
        `store`: the store its bytes go to ("" the default one); `strides`: its layout
        (None: contiguous); `pieces`: byte sizes of consecutive parts of its bytes paged
        on their own through views (services.piece_views), all but the last multiples of
        4 KiB; `arena_end`: "low" (first fit from the arena's bottom) or "high" (from its
        top): tensors paged together share pages best with nothing else between them
        (Note [Stored forms pack at the arena's top])."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        return self._core.empty(args.shape(shape), args.dtype(dtype), args.text("store", store),
                                None if strides is None else args.shape(strides, "strides"),
                                None if pieces is None else args.integers("pieces", pieces),
                                args.choice("arena_end", arena_end, ("low", "high")))

    def empty_like(self, t: torch.Tensor, dtype: torch.dtype | None = None,
                   pieces: Sequence[int] | None = None) -> torch.Tensor:
        """empty() shaped and laid out as torch.empty_like(t) would be (preserve_format:
        a channels_last or transposed t gives the same strides), optionally another dtype,
        in `pieces` (see empty())."""
        like = torch.empty_like(t, dtype=dtype, device="meta")
        return self.empty(like.shape, dtype=like.dtype, strides=like.stride(), pieces=pieces)

    def owns(self, t) -> bool:
        """Whether t is a tensor of this pager or a view of one (False for others)."""
        return isinstance(t, torch.Tensor) and t.layout == torch.strided and self._core.owns(t)

    def residency(self, t: torch.Tensor) -> str:
        """'zero', 'file', 'host', 'resident', 'paging_in' or 'paging_out'; 'mixed' for a
        tensor whose pieces (empty(pieces=...)) are not all alike."""
        return self._core.residency(t)

    def is_resident(self, t: torch.Tensor) -> bool:
        return self.residency(t) == "resident"

    # -- paging ----------------------------------------------------------------------

    @serialized
    def page_in_async(self, tensors: Iterable[torch.Tensor], for_read: bool = False,
                      overwrite: Iterable[torch.Tensor] = ()) -> PageHandle:
        """for_read: the caller will only read them and hand them back with
        services.release_unchanged_async(): where their bytes lie at rest is remembered (their
        host-tier copies stay, that room taken while they are resident), so that handing
        them back writes nothing. overwrite: more tensors to page in, which the caller
        writes whole before reading any of their bytes (scratch): a 'zero' one is mapped
        without its zero fill (its bytes undefined until written), so the page-in waits
        for no copy; the others page in like `tensors`."""
        self.services.check_not_paused("page_in()")
        return PageHandle(self._core, self._core.page_in(
            args.tensors("page_in", tensors), args.flag("for_read", for_read),
            args.tensors("page_in(overwrite=...)", overwrite)))

    @serialized
    def page_out_async(self, tensors: Iterable[torch.Tensor], reuse_after: int = 0) -> PageHandle:
        """Pages out after the work queued on the current stream. reuse_after > 0: they
        are paged in again after about that many more bytes of page_in calls, and the
        host tier keeps what is needed sooner (else least recently used leaves first)."""
        self.services.check_not_paused("page_out()")
        tensors = args.tensors("page_out", tensors)
        reuse_after = args.integer("reuse_after", reuse_after)
        return PageHandle(self._core, self._core.page_out(tensors, streams.current(self.device),
                                                    reuse_after))

    @serialized
    def read_ahead_async(self, tensors: Iterable[torch.Tensor]) -> PageHandle:
        """Reads 'file' tensors into free host-tier room (never making room), so that
        their page-in is a copy-engine copy; others are skipped."""
        self.services.check_not_paused("read_ahead()")
        return PageHandle(self._core, self._core.read_ahead(args.tensors("read_ahead", tensors)))

    @serialized
    def discard_async(self, tensors: Iterable[torch.Tensor]) -> PageHandle:
        """Drops the tensors' bytes, resident or at rest, without any I/O (they become
        'zero'), after the work already queued on the current stream."""
        self.services.check_not_paused("discard()")
        return PageHandle(self._core, self._core.discard(args.tensors("discard", tensors),
                                                   streams.current(self.device)))

    @serialized
    def page_in(self, tensors: Sequence[torch.Tensor] | torch.Tensor) -> None:
        self.page_in_async(tensors).wait()

    @serialized
    def page_out(self, tensors: Sequence[torch.Tensor] | torch.Tensor) -> None:
        self.page_out_async(tensors).wait()

    @serialized
    def begin_epoch(self, tensors: Iterable[torch.Tensor]) -> Epoch:
        """Opens an epoch over `tensors` (at rest, in no other epoch): until it ends,
        paging them out never overwrites the bytes they hold now (copy-on-write), so
        Epoch.abort() can return to them. An optimizer step runs in one. State read
        since the last step is let go first (statepager.core.state_access)."""
        tensors = args.tensors("begin_epoch", tensors)
        self.services.reads.release()
        return self._begin_epoch(tensors)

    def _begin_epoch(self, tensors: list) -> Epoch:
        """begin_epoch() without letting the state reads go (state_access.Reads' own)."""
        return Epoch.open(self, tensors)

    # -- construction ------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self, min_bytes: int = 1 * MiB):
        """Builds optimizer state straight into this pager (see statepager.scope):
        allocations on this pager's device go to its pool, new fp32 tensors of at least
        `min_bytes` become pager tensors, and the oldest are paged out whenever the pool
        would pass hbm_budget. Yields the Capture, whose `.tensors` lists them and
        `.pool` is the torch.cuda.MemPool allocations go to (None on the host backend)."""
        min_bytes = args.integer("min_bytes", min_bytes)
        with serial.lock_of(self):
            self.services.check_not_paused("scope()")
            self.services.reads.release()  # their room in the pool
        capture = scope.Capture(self, min_bytes)
        with contextlib.ExitStack() as stack:
            if self.device.type == "cuda":
                capture.pool = stack.enter_context(self.services.routed_pool())
                stack.enter_context(torch.cuda.use_mem_pool(capture.pool, self.device))
            stack.enter_context(capture)
            yield capture

    # -- sleep / wake ----------------------------------------------------------------

    @serialized
    def pause(self, bucket_size: int = 256 * MiB, discard: bool = False) -> None:
        """Pages out everything resident, in buckets of about `bucket_size` bytes, and
        returns all physical memory to the device (e.g. to lend the GPU to an inference
        engine), all or nothing; resume() brings it back. While paused, paging (page_in,
        page_out, a step, scope(), checkpoints) is refused. See statepager.core.sleep.
        discard=True: the resident bytes are dropped instead, with no I/O, after the work
        queued on the current stream (a KV cache, say): resume() brings those tensors back
        zero-filled, at the same addresses."""
        bucket_size = args.integer("bucket_size", bucket_size, minimum=1)
        discard = args.flag("discard", discard)
        self._core.check_usable()
        self.services.end_begun_steps(finish=True)
        self._sleep.pause(self._core, bucket_size,
                          streams.current(self.device) if discard else None)

    @serialized
    def resume(self, bucket_size: int = 256 * MiB) -> None:
        """Pages back in, bit-exact and at the same addresses, what pause() paged out.
        When it fails, what came back stays in and the Pager stays paused: resume()
        again brings back the rest."""
        bucket_size = args.integer("bucket_size", bucket_size, minimum=1)
        self._core.check_usable()
        self._sleep.resume(self._core, bucket_size)

    @serialized
    def read_paused(self, x: torch.Tensor) -> torch.Tensor:
        """While paused, x's bytes read where they lie, changing nothing (see Sleep.read)."""
        return self._sleep.read(self._core, x)

    @property
    def paused(self) -> bool:
        return self._sleep.paused

    # -- optimizers ------------------------------------------------------------------

    @serialized
    def attach(self, optimizer, *, bucket_size: int | None = None, depth: int | None = None,
               moments: str = "fp32", mains: str = "fp32", atomic="bucket",
               name: str | None = None, hooks=None, log_steps: bool = False,
               stationary_bytes: int = 0, bind: bool = True):
        """Streams `optimizer`'s state through this pager: each step pages buckets of
        about `bucket_size` bytes in, steps them and pages them out, within the pages of
        `depth` consecutive buckets (None: chosen to fit hbm_budget). Returns its binding. The
        keywords (bind=False: planned; its bind() attaches it): statepager.core.attach."""
        return attach.attach(
            self, optimizer, bucket_size=bucket_size, depth=depth, log_steps=log_steps,
            moments=moments, mains=mains, name=name, atomic=atomic,
            stationary_bytes=stationary_bytes, hooks=hooks, bind=bind)

    @property
    def bindings(self) -> tuple:
        """The attached StreamedOptimizers, in attach order (one per Megatron member)."""
        return tuple(self.services.bindings)

    # -- state -----------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters of the pool, the store, the host tier and the I/O (each field is
        documented at PagerStats in allocator/pager.h, under the name of the knob it
        reports: page_size, hbm_budget (None when unbounded), host_budget, io_block)."""
        s = self._core.stats()
        if self._unbounded:
            s["hbm_budget"] = None  # the core's "no budget" is its largest size
        return s

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
        """Waits for paging to finish, drops all state and deletes what the Pager created
        in its directory (and the directory, if it made it). Idempotent. Afterwards its
        tensors have no memory (any access to their data raises) and every call but
        stats() and close() raises UsageError. A Pager belongs to the process that made
        it: in a forked child every such call, close() included, raises UsageError at
        once and touches nothing of the parent's (store, lock, threads, memory)."""
        self._core.check_owner()
        try:
            self.services.end_begun_steps(to_rest=False)
        finally:
            self._core.close()
        scope.retire_pool_of(id(self))

    def __enter__(self) -> "Pager":
        return self

    def __exit__(self, *exc) -> None:
        if self._core.owner_pid == os.getpid():  # a forked child leaves the parent's alone
            self.close()

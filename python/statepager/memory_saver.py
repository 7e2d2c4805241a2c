"""torch_memory_saver's API over statepager Pagers: `from statepager.memory_saver import
torch_memory_saver`, or install_as_torch_memory_saver() first so that the trainer's own
`import torch_memory_saver` gets it (see Note [torch_memory_saver's API] in
docs/design.md).

A tag's memory lives in Pagers of its own, one per (tag, backup, device), as
torch_memory_saver keys its MemPools, and one more per such key for its CUDA graphs:
region() routes the allocations made inside it on the current CUDA device into that
Pager's pool (Pager.scope()), cuda_graph() captures into its graphs' one, pause(tag)
pauses those Pagers, resume(tag) brings them back at the same addresses. Backup:
- none (the default): pause() drops the bytes (Pager.pause(discard=True)); after resume()
  the tensors read zeros;
- enable_cpu_backup: bit-exact through a store in RAM (/dev/shm where there is one), sized
  for the region's bytes when the region ends, so that the first pause runs at the speed
  of the ones after it;
- enable_disk_backup: the same in a store under set_disk_backup_dir() (or
  $TMS_DISK_BACKUP_DIR).

Thread-safety: like torch_memory_saver's configuration, a region is the calling thread's
(torch's MemPool routing is per thread) and regions nest; use one thread for regions,
pause() and resume().
Errors: statepager.UsageError for bad arguments, naming the argument and the fix, raised
before anything changes; the Pagers' errors (OutOfMemoryError, StoreIOError, ...) from
pause() and resume().
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import types

import torch

from statepager import _C
from statepager.core import args
from statepager.core.pager import Pager

DEFAULT_TAG = "default"
HOOK_MODES = ("torch", "preload")  # both are statepager's pluggable allocator
_NO_CAPTURE = (1 << 64) - 1  # scope()'s min_bytes: no tensor becomes a pager tensor


class Region:
    """One open region(): its Pager's scope(), closed while a region nested in it is open
    (one Pager is routed per device at a time) and opened again when that one ends."""

    def __init__(self, pager: Pager, min_bytes: int):
        self.pager = pager
        self.min_bytes = min_bytes
        self.pool = None  # the scope's torch.cuda.MemPool while open (CUDA)
        self._stack = None

    def open(self) -> None:
        stack = contextlib.ExitStack()
        self.pool = stack.enter_context(self.pager.scope(min_bytes=self.min_bytes)).pool
        self._stack = stack

    def close(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


class TorchMemorySaver:
    """torch_memory_saver.TorchMemorySaver's interface (0.0.10). device: None, the current
    CUDA device at each region (as torch_memory_saver); "cpu" puts regions on the host
    backend, where only what Pager.scope() captures there (fp32 copies and *_like tensors)
    is a region's: for tests without a GPU."""

    def __init__(self, device: str | torch.device | None = None):
        self._device = None if device is None else args.device(device)
        # (tag, backup, device, "region" or "graph") -> its Pager, and its MemPool's id
        self._pagers: dict[tuple, Pager] = {}
        self._pool_ids: dict[tuple, tuple] = {}
        self._paused_bytes: dict[tuple, int] = {}  # what resume() brings back, per key
        self._regions: list[Region] = []  # open regions, innermost last
        self._capturing = False  # inside cuda_graph()
        self._roots: dict[str, str] = {}  # base directory -> the one made in it
        self._disk_dir = os.environ.get("TMS_DISK_BACKUP_DIR") or None
        self._retain = os.environ.get("TMS_RETAIN_CPU_BACKUP") == "1"
        self._margin = 0
        self._hook_mode = "torch"

    # -- regions ---------------------------------------------------------------------

    @contextlib.contextmanager
    def region(self, tag: str = DEFAULT_TAG, enable_cpu_backup: bool = False,
               enable_disk_backup: bool = False, cpu_backup_backend: str | None = None):
        """Allocations made inside on the current device are the tag's: pause(tag) gives
        their memory back. Regions nest: the innermost one's tag and backup apply, and
        the outer one's again after it."""
        key = self._key("region()", tag, enable_cpu_backup, enable_disk_backup,
                        cpu_backup_backend)
        if self._capturing:
            raise _C.UsageError("region() inside cuda_graph(): the capture's allocations "
                                "go to the graph's pool whatever the region; open the "
                                "region before the capture or after it")
        with self._innermost(key):
            yield
        if key[1] != "none":
            reserve_store(self._pagers[key])

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag: str = DEFAULT_TAG, enable_cpu_backup: bool = False,
                   cpu_backup_backend: str | None = None):
        """torch.cuda.graph(cuda_graph, ...) capturing into the pool of the tag's graphs,
        so the graph's memory is paused and resumed with the tag at the same addresses
        (replays stay valid). `pool` is replaced by that pool: a tag's graphs share it, as
        graphs given one pool do. It is never a region's: what a capture frees is the
        graph's scratch at every replay, which eager tensors must not be given. A capture
        that fails is ended and the current stream restored (see capture())."""
        key = self._key("cuda_graph()", tag, enable_cpu_backup, False, cpu_backup_backend,
                        kind="graph")
        if key[2].type != "cuda":
            raise _C.UsageError("cuda_graph(): this memory saver is on the host backend; "
                                "CUDA graphs need TorchMemorySaver() on a CUDA device")
        if self._capturing:
            raise _C.UsageError("cuda_graph() inside cuda_graph(): end the first capture "
                                "before starting another")
        if stream is not None and stream == torch.cuda.default_stream(stream.device):
            raise _C.UsageError("cuda_graph(): stream is the default stream, which CUDA "
                                "graphs cannot be captured on: pass stream=None or a "
                                "torch.cuda.Stream()")
        pager = self._usable_pager(key)
        with self._outer_closed(), pager.services.routed_pool() as mem_pool:
            self._pool_ids[key] = mem_pool.id
            self._capturing = True
            try:
                with capture(cuda_graph, mem_pool.id, stream, capture_error_mode):
                    yield
            finally:
                self._capturing = False
        if key[1] != "none":
            reserve_store(pager)

    @contextlib.contextmanager
    def disable(self):
        """Allocations inside go to PyTorch's own allocator, in a pool of their own that
        is emptied at the end (torch_memory_saver's disable())."""
        if self._capturing:
            raise _C.UsageError("disable() inside cuda_graph(): the capture's allocations "
                                "are the graph's; allocate outside the capture instead")
        with self._outer_closed():
            if self._device_now().type == "cuda":
                pool = torch.cuda.MemPool()
                with torch.cuda.use_mem_pool(pool):
                    yield
                del pool
            else:
                yield

    @contextlib.contextmanager
    def _innermost(self, key: tuple):
        region = Region(self._usable_pager(key), 1 if key[2].type == "cpu" else _NO_CAPTURE)
        with self._outer_closed():
            region.open()
            if region.pool is not None:
                self._pool_ids[key] = region.pool.id
            self._regions.append(region)
            try:
                yield region
            finally:
                self._regions.pop()
                region.close()

    @contextlib.contextmanager
    def _outer_closed(self):
        """Closes the innermost open region for the duration (one Pager is routed per
        device at a time) and opens it again after."""
        outer = self._regions[-1] if self._regions else None
        if outer is not None:
            outer.close()
        try:
            yield
        finally:
            if outer is not None:
                outer.open()

    def _usable_pager(self, key: tuple) -> Pager:
        pager = self._pager_for(key)
        if pager.paused:
            raise _C.UsageError(f"tag {key[0]!r} is paused: resume({key[0]!r}) before "
                                "allocating into it again")
        return pager

    # -- pause / resume ----------------------------------------------------------------

    def pause(self, tag: str | None = None) -> None:
        """Gives back the memory of `tag` (None: of every tag not paused). Backed-up bytes
        go to the tag's store; others are dropped. All or nothing over the tags."""
        keys = self._keys_of("pause", tag, paused=False)
        done = []
        try:
            for key in keys:
                pager = self._pagers[key]
                nbytes = pager.stats()["mapped_bytes"]
                pager.pause(discard=key[1] == "none")
                self._paused_bytes[key] = nbytes
                done.append(key)
        except BaseException:
            for key in reversed(done):
                self._pagers[key].resume()
            raise

    def resume(self, tag: str | None = None) -> None:
        """Brings back the memory of `tag` (None: of every paused tag) at the same
        addresses: backed-up bytes bit-exact, others zero-filled. With
        memory_margin_bytes set, refused (OutOfMemoryError) when that would leave less
        free on the device; a failed resume() leaves the rest paused: resume() again."""
        keys = self._keys_of("resume", tag, paused=True)
        self._check_margin(keys)
        for key in keys:
            self._pagers[key].resume()
            self._paused_bytes.pop(key, None)

    def _check_margin(self, keys: list) -> None:
        if not self._margin or not keys:
            return
        need = sum(self._paused_bytes.get(key, 0) for key in keys)
        free = self._pagers[keys[0]].free_device_memory()
        if free < need + self._margin:
            raise _C.OutOfMemoryError(
                f"resume() needs {need} bytes and memory_margin_bytes = {self._margin} "
                f"must stay free, but the device has {free} free: free memory first, or "
                "lower memory_margin_bytes")

    def _keys_of(self, what: str, tag: str | None, paused: bool) -> list:
        if self._regions or self._capturing:
            raise _C.UsageError(f"{what}() inside region() or cuda_graph(): leave it first "
                                "(its allocations would go to memory being paused)")
        if tag is None:
            return [k for k, p in self._pagers.items() if p.paused == paused]
        tag = args.text("tag", tag)
        keys = [k for k in self._pagers if k[0] == tag]
        if any(self._pagers[k].paused == (not paused) for k in keys):
            state = "not paused" if paused else "already paused"
            fix = "pause" if paused else "resume"
            raise _C.UsageError(f"{what}({tag!r}): tag {tag!r} is {state}: {fix}({tag!r}) "
                                "first")
        return keys  # a tag nothing was allocated under: nothing to do

    # -- settings --------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> str:
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, value: str) -> None:
        if value not in HOOK_MODES:
            raise _C.UsageError(f"hook_mode must be one of {HOOK_MODES}, not {value!r} "
                                "(both mean statepager's allocator: no LD_PRELOAD needed)")
        self._hook_mode = value

    @property
    def memory_margin_bytes(self) -> int:
        return self._margin

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        self._margin = args.integer("memory_margin_bytes", value)

    @property
    def retain_cpu_backup(self) -> bool:
        """Accepted for compatibility: a backed-up tag's store keeps its memory between
        pauses whatever this says (that is what makes every pause fast)."""
        return self._retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._retain = args.flag("retain_cpu_backup", value)

    def set_disk_backup_dir(self, path: str) -> None:
        """The directory (made if needed) that enable_disk_backup regions made from now on
        keep their stores in, each in a directory of its own deleted when it closes."""
        path = os.fspath(args.path("path", path))
        os.makedirs(path, exist_ok=True)
        self._disk_dir = path

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False):
        """While x's tag is paused with enable_cpu_backup, x's bytes as a CPU tensor of its
        shape and dtype, read from the tag's store without resuming it or changing
        anything (Pager.read_paused); None otherwise where
        torch_memory_saver returns None: the tag not paused (no backup is kept after
        resume(), whatever retain_cpu_backup says) or backed up to disk. zero_copy=True
        returns a copy too: the bytes lie in the tag's store file, not in a host buffer
        per tensor that a view could alias. UsageError for x not a contiguous tensor of a
        tag, or of a paused tag without backup (its bytes were dropped)."""
        if not isinstance(x, torch.Tensor):
            raise _C.UsageError(f"get_cpu_backup(x): x must be a tensor, not {type(x).__name__}")
        args.flag("zero_copy", zero_copy)
        key = self._key_holding(x)
        if key is None:
            raise _C.UsageError(f"get_cpu_backup(x): the tensor of shape {list(x.shape)} is "
                                "not in any tag's memory: pass a tensor allocated inside "
                                "region()")
        pager = self._pagers[key]
        if not pager.paused or key[1] == "disk":
            return None
        if key[1] == "none":
            raise _C.UsageError(f"get_cpu_backup(x): tag {key[0]!r} has no backup, so pause() "
                                "dropped x's bytes: use region(enable_cpu_backup=True)")
        return pager.read_paused(x)

    # -- tags and their Pagers ---------------------------------------------------------

    def tags(self) -> dict[str, bool]:
        """{tag: paused} of every tag something was allocated under."""
        out: dict[str, bool] = {}
        for key, pager in self._pagers.items():
            out[key[0]] = out.get(key[0], False) or pager.paused
        return out

    def tag_of(self, x: torch.Tensor) -> str | None:
        """The tag whose memory holds tensor x (a region's or a graph's), None when no
        tag's does. On CUDA a region's tensors are PyTorch's blocks in segments of the
        tag's pool (not pager tensors: Pager.owns() is False for them)."""
        key = self._key_holding(x)
        return None if key is None else key[0]

    def _key_holding(self, x) -> tuple | None:
        if not isinstance(x, torch.Tensor):
            raise _C.UsageError(f"x must be a tensor, not {type(x).__name__}")
        for key, pager in self._pagers.items():
            if pager.owns(x) or pool_holds(self._pool_ids.get(key), x):
                return key
        return None

    def pager(self, tag: str, backup: str = "none", device=None,
              graph: bool = False) -> Pager | None:
        """The Pager of (tag, backup, device) ("none", "cpu" or "disk"; device None: the
        current one) for regions, or for cuda_graph() captures when `graph`; None before
        one made it."""
        device = self._device_now() if device is None else args.device(device)
        return self._pagers.get((tag, backup, device, "graph" if graph else "region"))

    def _key(self, what: str, tag, cpu_backup, disk_backup, backend,
             kind: str = "region") -> tuple:
        tag = args.text("tag", tag)
        cpu_backup = args.flag("enable_cpu_backup", cpu_backup)
        disk_backup = args.flag("enable_disk_backup", disk_backup)
        if backend not in (None, "pinned", "mmap"):
            raise _C.UsageError(f"{what}: cpu_backup_backend must be None, 'pinned' or "
                                f"'mmap', not {backend!r}")
        if backend is not None and not cpu_backup:
            raise _C.UsageError(f"{what}: cpu_backup_backend requires enable_cpu_backup=True")
        if cpu_backup and disk_backup:
            raise _C.UsageError(f"{what}: enable_cpu_backup and enable_disk_backup are "
                                "exclusive: choose one")
        if disk_backup and self._disk_dir is None:
            raise _C.UsageError(f"{what}: enable_disk_backup needs a directory: call "
                                "set_disk_backup_dir(path) or set TMS_DISK_BACKUP_DIR first")
        backup = "cpu" if cpu_backup else "disk" if disk_backup else "none"
        return tag, backup, self._device_now(), kind

    def _device_now(self) -> torch.device:
        if self._device is not None and self._device.type != "cuda":
            return self._device
        if not torch.cuda.is_available():
            raise _C.UsageError("torch_memory_saver needs a CUDA device (none is "
                                "available); TorchMemorySaver(device='cpu') runs on the "
                                "host backend")
        index = self._device.index if self._device is not None else None
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def _pager_for(self, key: tuple) -> Pager:
        pager = self._pagers.get(key)
        if pager is None:
            base = self._disk_dir if key[1] == "disk" else ram_directory()
            root = self._roots.get(base)
            if root is None:
                root = self._roots[base] = tempfile.mkdtemp(prefix="statepager-saver-",
                                                            dir=base)
            directory = os.path.join(root, str(len(self._pagers)))
            pager = self._pagers[key] = Pager(directory, device=key[2])
        return pager

    def close(self) -> None:
        """Closes every tag's Pager (their tensors lose their memory) and deletes the
        directories made for them."""
        for pager in self._pagers.values():
            pager.close()
        self._pagers.clear()
        self._pool_ids.clear()
        self._paused_bytes.clear()
        for root in self._roots.values():
            with contextlib.suppress(OSError):
                os.rmdir(root)
        self._roots.clear()


@contextlib.contextmanager
def capture(graph, pool_id, stream, capture_error_mode):
    """torch.cuda.graph(graph, pool=pool_id, ...) that, when it fails, leaves no capture
    underway on its stream and the current stream as before: torch.cuda.graph leaves its
    capture stream current when capture_begin() or capture_end() raises, and the capture
    running when capture_end() refuses a body that left another stream current."""
    context = torch.cuda.graph(graph, pool=pool_id, stream=stream,
                               capture_error_mode=capture_error_mode)
    before = torch.cuda.current_stream()
    try:
        with context:
            yield
    except BaseException:
        with torch.cuda.stream(context.capture_stream):
            if torch.cuda.is_current_stream_capturing():
                with contextlib.suppress(RuntimeError):  # the error raised is the one to see
                    graph.capture_end()
        torch.cuda.set_stream(before)
        raise


def pool_holds(pool_id: tuple | None, x: torch.Tensor) -> bool:
    """Whether x's memory lies in a segment of the MemPool `pool_id` (CUDA tensors)."""
    if pool_id is None or x.device.type != "cuda":
        return False
    address = x.untyped_storage().data_ptr()
    return any(tuple(s["segment_pool_id"]) == tuple(pool_id) and s["device"] == x.device.index
               and s["address"] <= address < s["address"] + s["total_size"]
               for s in torch.cuda.memory_snapshot(pool_id, include_traces=False))


def ram_directory() -> str:
    """Where stores of enable_cpu_backup tags go: /dev/shm (RAM, mapped for the device's
    copies) where there is one, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def reserve_store(pager: Pager) -> None:
    """Sizes `pager`'s store for its mapped bytes now, so that the first pause writes
    into room that exists (and, in RAM, is mapped for the device) as later ones do: the
    file is allocated to that size, and one page paged through the store maps it. Never
    shrinks it. NoSpaceError-like OSError when the directory has no room: raised here,
    at the region's end, and not at the pause."""
    nbytes = pager.stats()["mapped_bytes"]
    fd = os.open(pager.file_path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size >= nbytes:
            return
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            raise _C.NoSpaceError(
                f"the backup store {pager.file_path} needs {nbytes} bytes for the region "
                f"just made and its filesystem has no room ({e.strerror}): free space, or "
                "use enable_disk_backup with set_disk_backup_dir(path) on a larger "
                "one") from None
    finally:
        os.close(fd)
    probe = pager.empty(4096, dtype=torch.uint8)
    pager.page_in(probe)
    pager.page_out(probe)
    del probe


def configure_subprocess():
    """torch_memory_saver's LD_PRELOAD set-up for subprocesses: nothing to set up here
    (hook_mode "preload" is statepager's allocator too)."""
    return contextlib.nullcontext()


torch_memory_saver = TorchMemorySaver()


def install_as_torch_memory_saver() -> types.ModuleType:
    """Makes `import torch_memory_saver` (from now on, in this process) give this module's
    API: a module named torch_memory_saver with torch_memory_saver, TorchMemorySaver and
    configure_subprocess. Returns it. UsageError when the real package is imported
    already (its allocator hooks may hold memory: install this first)."""
    current = sys.modules.get("torch_memory_saver")
    if current is not None and getattr(current, "__statepager__", False):
        return current
    if current is not None:
        raise _C.UsageError("torch_memory_saver (the package) is imported already: call "
                            "statepager.memory_saver.install_as_torch_memory_saver() "
                            "before anything imports it")
    module = types.ModuleType("torch_memory_saver", __doc__)
    module.__statepager__ = True
    module.__path__ = []  # a package: its submodules may be registered in sys.modules
    module.torch_memory_saver = torch_memory_saver
    module.TorchMemorySaver = TorchMemorySaver
    module.configure_subprocess = configure_subprocess
    sys.modules["torch_memory_saver"] = module
    return module

"""Pager.scope(): build optimizer state straight into the pager, within an HBM budget.

Inside the scope, on the pager's device:
- allocations are routed into the pager's pool (torch.cuda.MemPool over statepager's
  pluggable allocator): each segment is mapped at once and stays resident;
- every new fp32 tensor of at least `min_bytes` made from another tensor by a copy or a
  *_like / new_* factory (the `shard.clone().float()` of an optimizer's master weights,
  zeros_like moments, ...) is created as a pager tensor instead, written in place, and
  tracked;
- when the pool's mapped bytes would pass the pager's hbm_budget, the oldest tracked
  tensors are paged out to the store first. Construction therefore holds at most the
  budget plus the segment being written, and the state lands in its final place.

A model is read whenever it runs, so what a model is made of must not be paged out:
- plain factories (torch.empty, zeros, ...) are not captured: they are how modules build
  their parameters and buffers (and Megatron's DDP its grad buffers); nor is anything
  made while a module is converted (module.to(), .float(), .cuda(), ...);
- a tracked tensor that becomes a module's parameter or buffer (`nn.Parameter(w.clone())`,
  `register_buffer(name, x.float())`), or whose storage another tensor shares (a view), is
  kept resident for good: never paged out by the scope. New tensors that then do not fit
  in the budget are made as ordinary tensors, as outside the scope.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from statepager import _C

aten = torch.ops.aten
log = logging.getLogger("statepager")

# Ops whose output is a fresh tensor (never a view of an input) made from another tensor.
_COPIES = {aten._to_copy.default, aten.clone.default}
_FACTORIES = {
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.new_empty.default, aten.new_zeros.default,
    aten.new_full.default, aten.new_empty_strided.default,
}
_ZEROS = {aten.empty_like.default, aten.zeros_like.default, aten.new_empty.default,
          aten.new_zeros.default, aten.new_empty_strided.default}

_allocator = None


def pluggable_allocator():
    """The process-wide CUDAPluggableAllocator over statepager_alloc/statepager_free
    (PyTorch may free through it at any time, so it is never dropped)."""
    global _allocator
    if _allocator is None:
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(
            _C.__file__, "statepager_alloc", "statepager_free")
    return _allocator


# MemPools of Pager.scope(). PyTorch aborts the process (an internal assert in ~MemPool:
# "captures_underway.empty()") when a MemPool is destroyed while any pool is being
# allocated into, which a garbage collection inside another pager's scope() does to the
# pool of a pager that died. So the pools are owned here: a pager's pool is retired when
# the pager closes or dies, and retired pools are destroyed only while no scope is open.
_pools_in_use = 0
_pools_of_pagers: dict = {}  # id(pager) -> its MemPool, while the pager is open
_retired_pools: list = []


def mem_pool_for(pager):
    """A new MemPool over the pluggable allocator for `pager`, retired when the pager
    closes (retire_pool_of) or dies."""
    pool = _pools_of_pagers[id(pager)] = torch.cuda.MemPool(pluggable_allocator().allocator())
    weakref.finalize(pager, retire_pool_of, id(pager))
    return pool


def retire_pool_of(pager_id: int) -> None:
    """Drops the pager's pool once no scope is open (the pager must hold it no more)."""
    pool = _pools_of_pagers.pop(pager_id, None)
    if pool is not None:
        _retired_pools.append(pool)
    _drop_retired_pools()


@contextlib.contextmanager
def routed_pool(pager, core):
    """Routes the pluggable allocator on `pager`'s CUDA device to `core` (its _C pager)
    and yields the pager's MemPool (made on first use), counted in use, for the caller
    to allocate into: Pager.scope() makes it the thread's pool, a CUDA graph capture the
    capture's (torch refuses both at once for one pool)."""
    if pager.device.type != "cuda":
        raise _C.UsageError(f"routed_pool(): this pager is on {pager.device}; MemPools "
                            "are CUDA's (use scope() on the host backend)")
    pool = _pools_of_pagers.get(id(pager))
    if pool is None:
        pool = mem_pool_for(pager)
    _C.route_device(pager.device.index, core)
    try:
        with pool_in_use():
            yield pool
    finally:
        _C.route_device(pager.device.index, None)


@contextlib.contextmanager
def pool_in_use():
    """Counts a pool being allocated into (by a thread or a CUDA graph capture) for its
    duration: no retired pool is destroyed meanwhile (see _retired_pools)."""
    global _pools_in_use
    _pools_in_use += 1
    try:
        yield
    finally:
        _pools_in_use -= 1
        _drop_retired_pools()


def _drop_retired_pools() -> None:
    if _pools_in_use == 0:
        _retired_pools.clear()


class Capture(TorchDispatchMode):
    """The dispatch mode of Pager.scope(); `tensors` lists what it created, oldest first,
    `kept` those of them it keeps resident because something else reads them."""

    def __init__(self, pager, min_bytes: int):
        super().__init__()
        self.pager = pager
        self.min_bytes = min_bytes
        self.pool = None  # the MemPool allocations go to (Pager.scope sets it on CUDA)
        self.tensors: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []    # resident for good: shared or a module's
        self._resident = collections.deque()  # tracked tensors still resident, oldest first
        self._made = None                     # what the previous op made, if it made one
        self._hooks = []

    def __enter__(self):
        module = torch.nn.modules.module
        self._hooks = [module.register_module_parameter_registration_hook(self._registered),
                       module.register_module_buffer_registration_hook(self._registered)]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        made, self._made = self._made, None
        if func is aten.detach.default and args[0] is made:
            return self._detached(func(*args, **kwargs))
        if func not in _COPIES and func not in _FACTORIES:
            return func(*args, **kwargs)
        out_meta, device = _output(func, args, kwargs)
        if not self._wanted(out_meta, device) or _converting_a_module():
            return func(*args, **kwargs)
        t = self._new(out_meta)
        if t is None:  # no room: the budget is held by tensors kept resident
            return func(*args, **kwargs)
        if func in _COPIES:
            t.copy_(args[0])
        elif func not in _ZEROS:
            t.copy_(func(*args, **kwargs))  # ones/full: small transient, rare in practice
        self._made = t
        return t

    def _detached(self, alias: torch.Tensor) -> torch.Tensor:
        """A detach right after a tensor was made: torch.zeros_like() and the like hand
        their caller such an alias, and so does `x.clone().detach()`. The alias is what
        the caller keeps, so it is tracked in place of the tensor made, which then dies:
        what shares the storage afterwards is someone else (see make_room)."""
        self.tensors[-1] = alias
        self._resident[-1] = alias
        return alias

    def _registered(self, module, name, value):
        """Module registration hook: a tensor made here that becomes a parameter or buffer
        is the module's, read whenever it runs, so it is kept resident."""
        if isinstance(value, torch.Tensor) and self.pager.owns(value):
            storage = value.data_ptr() - value.storage_offset() * value.element_size()
            for t in self.tensors:  # made here: storage offset 0
                if t.data_ptr() == storage and not _holds(self.kept, t):
                    self._keep(t)
        return None

    def _wanted(self, meta, device) -> bool:
        return (isinstance(meta, torch.Tensor) and meta.dtype == torch.float32
                and device == self.pager.device and meta.is_contiguous()
                and meta.numel() * 4 >= self.min_bytes)

    def _new(self, meta) -> torch.Tensor | None:
        nbytes = meta.numel() * 4
        if not self.make_room(nbytes):
            return None
        t = self.pager.empty(meta.shape, dtype=torch.float32)
        self.pager.page_in(t)  # zero-filled, no I/O
        self.tensors.append(t)
        self._resident.append(t)
        return t

    def make_room(self, nbytes: int) -> bool:
        """Pages out the oldest tracked tensors until `nbytes` more fit in the budget.
        Pages shared with neighbours free less than a tensor's size, and a new tensor
        may touch two partial pages, so the fit is checked on the pool's own count.
        False when they do not fit because tensors kept resident hold the budget: the
        new tensor is then made as an ordinary one, as outside the scope."""
        budget = self.pager.stats()["hbm_budget"]
        if budget is None:
            return True
        need = nbytes + 2 * self.pager.page_size
        mapped = self.pager.stats()["mapped_bytes"]
        while self._resident and mapped + need > budget:
            batch, estimate = [], mapped
            while self._resident and estimate + need > budget:
                t = self._resident.popleft()
                if _C.storage_use_count(t) > 1:  # a view, a parameter's .data, ...
                    self._keep(t)
                    continue
                batch.append(t)
                estimate -= t.numel() * 4
            self.pager.page_out(batch)
            mapped = self.pager.stats()["mapped_bytes"]
        return mapped + need <= budget or not self.kept

    def _keep(self, t: torch.Tensor) -> None:
        """t stays resident for good (paged back in if it was out) and is no longer
        paged by the scope."""
        if _holds(self._resident, t):
            self._resident = collections.deque(r for r in self._resident if r is not t)
        else:
            self.make_room(t.numel() * 4)
            self.pager.page_in(t)  # its bytes are in the store (a copy, never scratch)
        if not self.kept:
            log.warning("statepager scope(): a tensor it made (size %s) is also a module's "
                        "parameter or buffer, or a view shares it, so it stays resident; what "
                        "then does not fit in hbm_budget is made as ordinary tensors. Build "
                        "models outside pager.scope().", tuple(t.shape))
        self.kept.append(t)


def _holds(tensors, t: torch.Tensor) -> bool:
    """`t in tensors` by identity (`in` would compare the tensors' values)."""
    return any(x is t for x in tensors)


def _converting_a_module() -> bool:
    """True inside nn.Module._apply (module.to(), .float(), .cuda(), .to_empty(), ...),
    whose results become the module's parameters and buffers. Found on the call stack:
    torch offers no hook around it."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _MODULE_APPLY:
            return True
        frame = frame.f_back
    return False


_MODULE_APPLY = torch.nn.Module._apply.__code__


def _output(func, args, kwargs):
    """The op's output as a meta tensor (shape, dtype) and the device it would be on,
    learned without running it."""
    first = args[0]  # every captured op makes its output from a tensor, its first argument
    device = torch.device(kwargs.get("device") or first.device)
    if device.type == "cuda" and device.index is None:  # "cuda" means the current device
        device = torch.device("cuda", torch.cuda.current_device())
    meta_kwargs = _to_meta(kwargs)
    if "device" in kwargs:
        meta_kwargs["device"] = "meta"
    return func(*_to_meta(args), **meta_kwargs), device


def _to_meta(x):
    """Arguments as meta tensors, to learn an op's output without running it."""
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x

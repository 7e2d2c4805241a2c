"""Pager.scope(): build optimizer state straight into the pager, within an HBM budget.

Inside the scope, on the pager's device:
- allocations are routed into the pager's pool (torch.cuda.MemPool over statepager's
  pluggable allocator): each segment is mapped at once and stays resident;
- every new fp32 tensor of at least `min_bytes` made by a copy or factory op (the
  `shard.clone().float()` of an optimizer's master weights, zeros_like moments, ...)
  is created as a pager tensor instead, written in place, and tracked;
- when the pool's mapped bytes would pass the pager's hbm_budget, the oldest tracked
  tensors are paged out to the store first. Construction therefore holds at most the
  budget plus the segment being written, and the state lands in its final place.
"""
from __future__ import annotations

import collections
import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from statepager import _C

aten = torch.ops.aten

# Ops whose output is a fresh tensor (never a view of an input).
_COPIES = {aten._to_copy.default, aten.clone.default}
_FACTORIES = {
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.empty.memory_format, aten.zeros.default, aten.ones.default,
    aten.full.default, aten.empty_strided.default, aten.new_empty.default,
    aten.new_zeros.default, aten.new_full.default, aten.new_empty_strided.default,
}
_ZEROS = {aten.empty_like.default, aten.zeros_like.default, aten.empty.memory_format,
          aten.zeros.default, aten.empty_strided.default, aten.new_empty.default,
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
def using_pool(pool, device):
    """torch.cuda.use_mem_pool(pool, device), counted (see _retired_pools)."""
    global _pools_in_use
    _pools_in_use += 1
    try:
        with torch.cuda.use_mem_pool(pool, device):
            yield
    finally:
        _pools_in_use -= 1
        _drop_retired_pools()


def _drop_retired_pools() -> None:
    if _pools_in_use == 0:
        _retired_pools.clear()


class Capture(TorchDispatchMode):
    """The dispatch mode of Pager.scope(); `tensors` lists what it created, oldest first."""

    def __init__(self, pager, min_bytes: int):
        super().__init__()
        self.pager = pager
        self.min_bytes = min_bytes
        self.tensors: list[torch.Tensor] = []
        self._resident = collections.deque()  # tracked tensors still resident, oldest first

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _COPIES and func not in _FACTORIES:
            return func(*args, **kwargs)
        out_meta, device = _output(func, args, kwargs)
        if not self._wanted(out_meta, device):
            return func(*args, **kwargs)
        t = self._new(out_meta)
        if func in _COPIES:
            t.copy_(args[0])
        elif func not in _ZEROS:
            t.copy_(func(*args, **kwargs))  # ones/full: small transient, rare in practice
        return t

    def _wanted(self, meta, device) -> bool:
        return (isinstance(meta, torch.Tensor) and meta.dtype == torch.float32
                and device == self.pager.device and meta.is_contiguous()
                and meta.numel() * 4 >= self.min_bytes)

    def _new(self, meta) -> torch.Tensor:
        nbytes = meta.numel() * 4
        self.make_room(nbytes)
        t = self.pager.empty(meta.shape, dtype=torch.float32)
        self.pager.page_in(t)  # zero-filled, no I/O
        self.tensors.append(t)
        self._resident.append(t)
        return t

    def make_room(self, nbytes: int) -> None:
        """Pages out the oldest tracked tensors until `nbytes` more fit in the budget.
        Pages shared with neighbours free less than a tensor's size, and a new tensor
        may touch two partial pages, so the fit is checked on the pool's own count."""
        budget = self.pager.stats()["budget_bytes"]
        if budget is None:
            return
        need = nbytes + 2 * self.pager.page_size
        mapped = self.pager.stats()["mapped_bytes"]
        while self._resident and mapped + need > budget:
            batch, estimate = [], mapped
            while self._resident and estimate + need > budget:
                t = self._resident.popleft()
                batch.append(t)
                estimate -= t.numel() * 4
            self.pager.page_out(batch)
            mapped = self.pager.stats()["mapped_bytes"]


def _output(func, args, kwargs):
    """The op's output as a meta tensor (shape, dtype) and the device it would be on,
    learned without running it."""
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    device = torch.device(kwargs.get("device") or (first.device if first is not None else "cpu"))
    if device.type == "cuda" and device.index is None:  # "cuda" means the current device
        device = torch.device("cuda", torch.cuda.current_device())
    meta_kwargs = _to_meta(kwargs)
    if "device" in kwargs or first is None:
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

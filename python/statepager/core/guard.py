"""Introspection of pager tensors that cannot crash the process.

A pager tensor that is not resident has no memory behind its address: reading it is
SIGSEGV on the host backend and an illegal-address error (the CUDA context is lost) on
the GPU. The Python protocols that read a tensor without being asked to — repr/str/print
(debuggers, logging, pytest), pickle and torch.save, copy.copy and copy.deepcopy (also of
the dicts, optimizers and modules holding the tensor) — are guarded here for every tensor
whose storage is a pager extent, views included:
- repr of one that is not resident is a placeholder with its size, dtype and residency,
  and so is repr/str of its storage (UntypedStorage, TypedStorage), which would read
  every byte;
- pickling or copying one raises UsageError naming what to call instead.
A closed Pager's tensors have no memory (torch raises on any access to their storages'
data, see Pager.close()); they count as not resident here ('closed').
Resident pager tensors and all other tensors behave exactly as before. Explicit data
access (ops, .item(), .tolist(), .numpy(), indexing) is not guarded: README, "What must
not be touched".

These protocols are looked up on the tensor's class, and pager tensors are plain
torch.Tensor (fused kernels and Megatron need exactly that), so install() wraps them on
torch.Tensor, torch.nn.Parameter and the storage classes, once per process; Pager() calls
it. The check is one
address lookup (_C.residency_of), made only by these protocols.
"""
from __future__ import annotations

import torch

from statepager import _C

_installed = False


def install() -> None:
    """Wraps the protocols above on torch.Tensor and torch.nn.Parameter (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    tensor, param = torch.Tensor, torch.nn.Parameter
    tensor.__repr__ = _guarded_repr(tensor.__repr__)
    tensor.__reduce_ex__ = _refusing("pickle, torch.save or copy.copy", tensor.__reduce_ex__)
    tensor.__deepcopy__ = _refusing("deepcopy", tensor.__deepcopy__)
    # Parameter pickles through Tensor.__reduce_ex__ (of .data), but copies on its own.
    param.__deepcopy__ = _refusing("deepcopy", param.__deepcopy__)
    for storage in (torch.UntypedStorage, torch.TypedStorage):
        storage.__repr__ = _guarded_storage_text(storage.__repr__)
        storage.__str__ = _guarded_storage_text(storage.__str__)


def not_resident(t: torch.Tensor) -> str | None:
    """The residency of pager tensor t when it is not resident ('zero', 'file', 'host',
    'paging_in', 'paging_out', or 'closed': its Pager is closed and its storage has no
    memory); None when t is resident or not a pager tensor."""
    residency = _C.residency_of(t)
    if residency is None and _without_memory(t):
        return "closed"
    return None if residency in (None, "resident") else residency


def _without_memory(t: torch.Tensor) -> bool:
    """A tensor whose storage has no memory (a closed Pager's)."""
    try:
        return _closed(t.untyped_storage())
    except (RuntimeError, NotImplementedError):  # no storage (sparse, some subclasses)
        return False


def _closed(untyped) -> bool:
    """An UntypedStorage of a closed Pager: the access to its data raises its message."""
    try:
        untyped.data_ptr()
    except (RuntimeError, NotImplementedError) as e:  # also fake tensors' storages
        return "Pager is closed" in str(e)  # the closed Pager's message (python/module.cc)
    return False


def _storage_residency(storage) -> str | None:
    """not_resident() of the bytes of an UntypedStorage or TypedStorage."""
    untyped = storage._untyped_storage if isinstance(storage, torch.TypedStorage) else storage
    if untyped.device.type == "meta":
        return None
    if _closed(untyped):
        return "closed"
    return not_resident(torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped))


def _describe(t: torch.Tensor, residency: str) -> str:
    return f"size={tuple(t.shape)}, dtype={t.dtype}, device='{t.device}', residency '{residency}'"


def _guarded_repr(original):
    def __repr__(self, *args, **kwargs):
        residency = not_resident(self)
        if residency is None:
            return original(self, *args, **kwargs)
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (f"tensor(<statepager: not resident, pager.page_in() to read>, "
                f"{_describe(self, residency)}{grad})")

    __repr__.__wrapped__ = original
    return __repr__


def _guarded_storage_text(original):
    def guarded(self, *args, **kwargs):
        residency = _storage_residency(self)
        if residency is None:
            return original(self, *args, **kwargs)
        return (f"<statepager: not resident, pager.page_in() to read>\n"
                f"[{torch.typename(self)}(device={self.device}) of {self.nbytes()} bytes, "
                f"residency '{residency}']")

    guarded.__name__ = original.__name__
    guarded.__wrapped__ = original
    return guarded


def _refusing(what: str, original):
    def guarded(self, *args, **kwargs):
        residency = not_resident(self)
        if residency is not None:
            raise _C.UsageError(
                f"cannot {what} a pager tensor that is not resident ({_describe(self, residency)}):"
                " its bytes are in the store, and reading its address would crash the process."
                " For an attached optimizer's state use opt.state_dict() (a host copy, made "
                "bucket by bucket) or statepager.checkpoint.save(pager, path); for a tensor of "
                "your own, pager.page_in(t) first.")
        return original(self, *args, **kwargs)

    guarded.__name__ = original.__name__
    guarded.__wrapped__ = original
    return guarded


def refuse_model_params(pager, optimizer) -> None:
    """Pager.attach() pages out the parameters the pager owns between steps (fp32
    masters). An nn.Parameter is a model's: its forward would read it paged out, so one
    the pager owns (made inside pager.scope(), e.g. by module.float() or .to()) is refused."""
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if isinstance(p, torch.nn.Parameter) and pager.owns(p):
                raise _C.UsageError(
                    f"parameter {i} of param group {g} (size {tuple(p.shape)}) is an "
                    "nn.Parameter in this Pager's memory (made inside pager.scope()?): attach() "
                    "would page it out between steps, and the model's forward would then read "
                    "unmapped memory. Build and convert the model outside pager.scope().")

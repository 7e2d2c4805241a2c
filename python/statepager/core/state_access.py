"""An attached optimizer's state, readable between steps.

Between steps an attached optimizer's paged state is not resident: reading
`opt.state[p]["exp_avg"]` as logging and debuggers do would read unmapped memory. So
attach() replaces `optimizer.state` by a PagedState: the same defaultdict, whose
per-parameter dicts, reached from outside statepager's entry points, are ParamState
views that page an entry in on access (__getitem__, get, values(), items()): the tensor
returned is the state tensor itself, resident and holding its values (decoded into its
fp32 tensor, with bf16 or q8 moments).

Each entry read is paged in inside a pager epoch of its own (Reads), so nothing of it is
ever written back: the stored state stays as the optimizer left it, and a change made to
a tensor read this way is not kept (change state with opt.load_state_dict()). What was
read stays resident until the next step, begin_step, zero_grad, state_dict(),
load_state_dict(), save, load, pause, scope(), begin_epoch() or close() lets it go, or
until reading more would pass the largest step's window (Pager.keep): the earliest read
go first. A reference kept past that points at unmapped memory again (README, "What must
not be touched").

statepager's own code (the step, state_dict(), checkpoints) runs holding the Pager's lock
(statepager.core.serial) and sees the state as it is: PagedState behaves as the plain
defaultdict there, as it does for torch's own step.
"""
from __future__ import annotations

import collections
from collections.abc import ItemsView, MutableMapping, ValuesView

import torch

from statepager import _C
from statepager.core import serial
from statepager.util.units import MiB



def held(optimizer, p, default=None):
    """p's state dict as the optimizer holds it, or `default` where it has none (.get: no
    entry is made, as a defaultdict's [] would); never paged in on access, also outside
    the Pager's lock (state_in_buckets()), and without PagedState's check of it (the step's
    own reads)."""
    return dict.get(optimizer.state, p, default)


class PagedState(collections.defaultdict):
    """optimizer.state of an attached optimizer (see the module doc)."""

    def __init__(self, binding, state):
        super().__init__(dict, state)
        self.binding = binding

    def _raw(self) -> bool:
        return serial.holding(self.binding.pager)

    def __getitem__(self, p):
        entries = super().__getitem__(p)
        return entries if self._raw() else ParamState(self.binding, p, entries)

    def get(self, p, default=None):
        if self._raw() or p not in self:
            return super().get(p, default)
        return self[p]

    def values(self):
        return super().values() if self._raw() else ValuesView(self)

    def items(self):
        return super().items() if self._raw() else ItemsView(self)

    def as_held(self) -> dict:
        """{param: its state dict} as held, nothing paged in: for metadata (shapes, dtypes,
        Pager.residency); reading the data of a pager tensor in it that is not resident
        crashes the process."""
        return dict(super().items())

    # Copies and pickles are of the state as held: a pager tensor that is not resident
    # is then refused (statepager.guard), as for a plain defaultdict.
    def __reduce__(self):
        return collections.defaultdict, (dict,), None, None, iter(super().items())

    def copy(self):
        return collections.defaultdict(dict, super().items())

    __copy__ = copy


class ParamState(MutableMapping):
    """One parameter's state as read from outside statepager's entry points: a view of
    its dict whose pager tensors are paged in as they are read (Reads)."""

    __slots__ = ("_binding", "_param", "_entries")

    def __init__(self, binding, param, entries: dict):
        self._binding, self._param, self._entries = binding, param, entries

    def __getitem__(self, name):
        value = self._entries[name]
        if not isinstance(value, torch.Tensor) or not self._binding.pager.owns(value):
            return value
        with serial.lock_of(self._binding):
            self._binding.complete_step_in_flight()  # its buckets are the pipeline's
            return self._binding.pager.services.reads.read(self._binding, self._param, name, value)

    def __setitem__(self, name, value) -> None:
        with serial.lock_of(self._binding):
            self._entries[name] = value

    def __delitem__(self, name) -> None:
        with serial.lock_of(self._binding):
            del self._entries[name]

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return repr(dict(self.items()))


def wrap(binding) -> None:
    """binding.optimizer.state as a PagedState (again after torch replaced it: its
    load_state_dict sets a new defaultdict)."""
    optimizer = binding.optimizer
    if not (isinstance(optimizer.state, PagedState) and optimizer.state.binding is binding):
        optimizer.state = PagedState(binding, optimizer.state)


class Reads:
    """Per Pager: the state entries read from outside its entry points, each resident in
    an epoch of its own (aborted when let go: its pages dropped unwritten), earliest
    first. Used holding the Pager's lock."""

    def __init__(self, pager, open_epoch):
        self.pager = pager
        # Pager.begin_epoch without letting the reads go: an epoch opened and not handed
        # over (an interrupt) is aborted.
        self._open_epoch = open_epoch
        self._open = collections.OrderedDict()  # id(tensor) -> (tensor, Epoch, bytes)

    def read(self, binding, p, name: str, value: torch.Tensor) -> torch.Tensor:
        """value (p's state entry `name`), resident and holding its values."""
        key = id(value)
        if key in self._open and self._open[key][0] is value:
            self._open.move_to_end(key)
            return value
        self.pager.services.check_not_paused(f"reading opt.state[p][{name!r}]")
        form = binding.known_form(p, name, value)
        if form is None:
            if self.pager.is_resident(value):
                return value  # made resident by its owner (pager.page_in)
            raise _C.UsageError(
                f"opt.state[p][{name!r}] (size {tuple(value.shape)}) is a pager tensor the "
                f"attached optimizer {binding.name!r} does not page (its parameter is in no "
                "param group): page it in with pager.page_in(t) to read it")
        if key not in self._open and any(self.pager.is_resident(t) for t in form.tensors):
            # A stationary bucket's (Note [Stationary buckets]): read at rest, in an epoch,
            # as the others are; the reads before it stay.
            binding.to_rest(keep_reads=True)
        if self.pager.is_resident(form.working) and key not in self._open:
            return value  # resident already (an optimizer stepping in place, or its owner's)
        tensors = form.tensors + ([form.working] if form.scratch else [])
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._make_room(nbytes, max(self.pager.keep, nbytes))
        epoch = self._open_epoch(tensors)
        try:
            self._page_in(tensors, name, nbytes)
            with torch.no_grad():
                form.decode()
        except BaseException:
            epoch.abort()
            raise
        self._open[key] = (value, epoch, nbytes)
        return value

    def _make_room(self, nbytes: int, cap: int) -> None:
        """Lets the earliest reads go until `nbytes` more stay within `cap`."""
        while self._open and sum(n for _, _, n in self._open.values()) + nbytes > cap:
            self._let_go_oldest()

    def _page_in(self, tensors: list, name: str, nbytes: int) -> None:
        """page_in, letting the earliest reads go while the pool is out of room."""
        while True:
            try:
                self.pager.page_in(tensors)
                return
            except _C.OutOfMemoryError as e:
                if not self._open:
                    raise _C.OutOfMemoryError(
                        f"reading opt.state[p][{name!r}] pages in {nbytes / MiB:.1f} MiB, and "
                        f"the pager has no room for it ({e}): read the state with "
                        "opt.state_dict() (a host copy, bucket by bucket), or raise "
                        "hbm_budget") from e
                self._let_go_oldest()

    def _let_go_oldest(self) -> None:
        _, (_, epoch, _) = self._open.popitem(last=False)
        epoch.abort()

    def release(self) -> None:
        """Lets every read go (before what pages the state or needs the pool's room)."""
        while self._open:
            self._let_go_oldest()

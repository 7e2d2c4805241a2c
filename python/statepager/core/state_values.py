"""An attached optimizer's paged state as values, parameter by parameter: copied out to
host memory, and copied back in place. For what addresses the state per parameter rather
than as a torch state dict, and needs the masters too (a change of data-parallel size
slices each parameter's master and moments along the shard ranges); state_dict() and
load_state_dict() are built on the same parts.

read(binding, masters): {param: {name: host tensor}} for every parameter whose state the
pager holds: each paged entry, and "param" for an fp32 master the pager owns (masters=
True), laid out as the entry and holding the values a step reads (a narrow stored form
decoded to fp32: the working tensor's dtype).

load(binding, values): values[param][name] copied into those same tensors, in place,
all or nothing.

Note [State values per parameter] in docs/design.md. Both move the state bucket by bucket
as the step pages it (Note [Reads and loads in the step's pieces]): the device holds one
window at a time, whatever the state's size; read's copies take the state's size in host
memory (in fp32). Both run holding the Pager's lock (statepager.core.serial) and first
finish a step in flight or left pending by a failure (StreamedOptimizer.finish_step).
"""
from __future__ import annotations

import contextlib

import torch

from statepager import _C
from statepager.core import serial
from statepager.core.atomic import begin_epoch_at_rest
from statepager.util.flat import flat_view


def read(binding, masters: bool = True) -> dict:
    """{param: {name: host copy}} (see the module doc), parameters in the order the
    step's buckets page them, each one's entries in the order of binding.forms."""
    state = binding.optimizer.state
    out = {}
    with serial.lock_of(binding.pager):
        binding.finish_step()
        # closing: an interrupted read hands its bucket back now, under the lock. Only
        # the copies run without grad (see copy_in).
        with contextlib.closing(binding.state_in_pieces()) as pieces:
            for p, start, stop, entries in pieces:
                copies = out.setdefault(p, {})
                for name, values in entries.items():
                    entry = _entry(p, state.get(p, {}), name)
                    if entry is None or name == "param" and not masters:
                        continue
                    if name not in copies:
                        copies[name] = torch.empty_strided(
                            entry.size(), entry.stride(), dtype=entry.dtype, device="cpu")
                    with torch.no_grad():
                        flat_view(copies[name])[start:stop].copy_(values)
    return {p: copies for p, copies in out.items() if copies}


def load(binding, values: dict) -> None:
    """Copies values[param][name] (a tensor of the entry's shape, any dtype, layout or
    device) into the paged entry, for the parameters and names given; others keep
    theirs. Refused before anything changes (UsageError naming the parameter, the entry
    and the fix): a paused Pager, a parameter whose state the pager does not hold, a name
    that is none of its paged entries, a value of another shape. All or nothing: the
    copies run in a pager epoch, and a failure midway (NoSpaceError, say) puts back every
    tensor's bytes and stored form. Residual masters are encoded against their model
    params as they are at the load; where the load gives every residual master's
    "param", the stored ones are not checked against those params (a checkpoint's load
    replaces the model params first: Note [State values per parameter])."""
    with serial.lock_of(binding.pager):
        binding.pager.services.check_not_paused("loading optimizer state")
        targets = _targets(binding, values)
        binding.finish_step()
        undo = Undo(binding)
        try:
            copy_in(binding, InTargetOrder(
                {id(p): named for p, named in values.items()}, targets),
                rebuild_mains=_every_master_given(binding, values))
        except BaseException:
            undo.roll_back()
            raise
        undo.commit()


def copy_in(binding, sources: "InTargetOrder", rebuild_mains: bool = False) -> None:
    """Copies each source value into its paged entry, bucket by bucket (inside the
    caller's Undo). rebuild_mains: the sources overwrite every residual master, so their
    stored forms are not checked against the model params
    (StreamedOptimizer.state_in_pieces)."""
    # closing: a bucket that fails is paged out now, inside the caller's epoch, not
    # whenever the generator is collected (after the roll-back). Only the copies run
    # without grad: the forms the generator makes hold views of model params, which views
    # made under no_grad would keep from later in-place updates with grad mode on.
    with contextlib.closing(binding.state_in_pieces(
            write=True, rebuild_mains=rebuild_mains)) as pieces:
        for p, start, stop, entries in pieces:
            with torch.no_grad():
                for name, view in entries.items():
                    source = sources.get(p, name)
                    if source is not None:
                        view.copy_(source[start:stop])


class Undo:
    """A change's way back: the copies change paged bytes inside a pager epoch opened
    here, and the binding's stored forms (StreamedOptimizer.forms_kept); a torch load
    also replaces the optimizer's state and param_groups by new objects, leaving the old
    ones as they were, which roll_back() puts back."""

    def __init__(self, binding):
        optimizer = binding.optimizer
        self.binding, self.state, self.groups = binding, optimizer.state, optimizer.param_groups
        binding.to_rest()  # the epoch opens over the state at rest
        self.forms = binding.forms_kept()
        self.epoch = begin_epoch_at_rest(binding.pager, binding.buckets)

    def commit(self) -> None:
        self.epoch.commit()

    def roll_back(self) -> None:
        self.epoch.abort()
        optimizer = self.binding.optimizer
        optimizer.state, optimizer.param_groups = self.state, self.groups
        self.forms()


class InTargetOrder:
    """A value to load as a flat tensor in its target's memory order (the order the
    target's pieces take), converted once per entry where its layout differs.
    values: id(param) -> {name: value}; targets: id(param) -> {name: the tensor it goes
    into}."""

    def __init__(self, values: dict, targets: dict):
        self.values, self.targets, self.done = values, targets, {}

    def get(self, p, name: str):
        value = self.values.get(id(p), {}).get(name)
        if value is None:
            return None
        key = (id(p), name)
        if key not in self.done:
            target = self.targets[id(p)][name]
            if value.stride() != target.stride() or not value.is_contiguous() and \
                    not torch.ops.aten.is_non_overlapping_and_dense.default(value):
                laid = torch.empty_strided(target.size(), target.stride(), dtype=value.dtype,
                                           device=value.device)
                laid.copy_(value)
                value = laid
            self.done[key] = flat_view(value)
        return self.done[key]


def _every_master_given(binding, values: dict) -> bool:
    """Whether `values` holds the "param" of every residual master the binding pages."""
    if binding.mains != "residual":
        return False
    return all("param" in values.get(p, ()) for g in binding.optimizer.param_groups
               for p in g["params"]
               if not binding.resident(p) and any(n == "param" for n, _ in binding.forms(p)))


def _entry(p, held: dict, name: str):
    """The tensor p's paged entry `name` is: the master itself for "param"."""
    return p if name == "param" else held.get(name)


def _targets(binding, values: dict) -> dict:
    """id(param) -> {name: the paged tensor its value goes into}, each value checked."""
    state = binding.optimizer.state
    out = {}
    for p, named in values.items():
        paged = {name for name, _ in binding.forms(p)} if not binding.resident(p) else set()
        if not paged:
            raise _C.UsageError(
                f"loading optimizer state: the parameter of shape {tuple(p.shape)} has no "
                "state the pager holds (not a parameter of this optimizer, kept resident, or "
                "without state yet: a step or load_state_dict() makes it); nothing was "
                "loaded")
        held = state.get(p, {})
        into = out[id(p)] = {}
        for name, value in named.items():
            if name not in paged:
                raise _C.UsageError(
                    f"loading optimizer state: {name!r} is not a paged entry of the "
                    f"parameter of shape {tuple(p.shape)} (it has {sorted(paged)}); set "
                    "other entries with load_state_dict(); nothing was loaded")
            target = _entry(p, held, name)
            if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise _C.UsageError(
                    f"loading optimizer state: {name!r} of the parameter of shape "
                    f"{tuple(p.shape)} must be a tensor of that shape, not {got}; nothing "
                    "was loaded")
            into[name] = target
    return out

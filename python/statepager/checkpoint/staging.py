"""A checkpoint load's staging (statepager.checkpoint): one optimizer's manifest entry
checked against the attached optimizer, with everything the load assigns decoded first.

check_layout(binding, entry, data)   class, formats, parameter shapes, param group count
check_entries(binding, entry, data)  each parameter's state entries: those state_names
                                     lists, each held as a paged tensor or small state,
                                     and nothing more; whole (statepager.core.whole_state:
                                     no step counter or moment missing); and, where the
                                     parameter has state in the attached optimizer, the
                                     same entries as there (a load never leaves a live
                                     entry beside loaded ones)
missing_state(binding, data)         the paged state the checkpoint holds for parameters
                                     that have none yet (torch creates state in the first
                                     step): the load creates it, ZERO, and drops it again
                                     if the load fails
Staged(binding, entry, data)         each stored tensor against the live one (dtype, shape,
                                     strides) and the order to restore them in; the
                                     small state, residual exception lists, hyperparameters
                                     and state entry order, decoded. Constructing it changes
                                     nothing; apply() only assigns, so it cannot fail.
`data` is the optimizer's manifest.DataFile; Staged expects check_entries passed.
Errors: CorruptStoreError for malformed values, CheckpointMismatchError for values that do
not fit the attached optimizer.
"""
from __future__ import annotations

import re

import torch

from statepager import _C
from statepager.checkpoint.manifest import CheckpointMismatchError, DataFile, stored
from statepager.core import whole_state


def check_layout(binding, entry: dict, data: DataFile) -> None:
    opt = binding.optimizer
    if entry.get("class") != type(opt).__name__:
        _mismatch(data, f"it was a {entry.get('class')}, is a {type(opt).__name__}")
    formats = {"moments": binding.moments, "mains": binding.mains}
    if entry.get("formats") != formats:
        _mismatch(data, f"saved with formats {entry.get('formats')}, attached with {formats}")
    if entry.get("shapes") != [list(p.shape) for p in binding.params_in_order()]:
        _mismatch(data, "the parameter shapes differ")
    groups = entry.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        saved = len(groups) if isinstance(groups, list) else groups
        _mismatch(data, f"{saved!r} param groups saved, {len(opt.param_groups)} attached")


def check_entries(binding, entry: dict, data: DataFile) -> None:
    """Refuses a checkpoint whose state entries of a parameter are incomplete (a step
    counter or a moment missing) or differ from the attached optimizer's, naming the
    parameter and the entry (see the module docstring)."""
    names, small = entry.get("state_names"), entry.get("small_state")
    if not isinstance(names, dict) or not all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in names.values()):
        _corrupt(data, "'state_names' is not a mapping to lists of names")
    if not isinstance(small, dict) or not all(isinstance(v, dict) for v in small.values()):
        _corrupt(data, "'small_state' is not a mapping to mappings")
    params = binding.params_in_order()
    if set(names) != {str(j) for j in range(len(params))}:
        _corrupt(data, f"'state_names' lists the entries of parameters {sorted(names)}, not of "
                 f"each of its {len(params)} parameters")
    paged = {}  # parameter index -> the state entries held as paged tensors
    for j, name in data.tensors:
        base = name.partition(":")[0]
        if base != "param":  # the parameter itself (an fp32 master), not a state entry
            paged.setdefault(j, set()).add(base)
    for j, p in enumerate(params):
        listed = names[str(j)]
        held = paged.get(j, set()) | {k for k in small.get(str(j), {})
                                      if not k.endswith(":exceptions")}
        for name in listed:
            if name not in held:
                _corrupt(data, f"parameter {j} state entry {name!r} is missing: its state "
                         f"lists {listed}, the checkpoint holds no value of {name!r}")
        for name in sorted(held - set(listed)):
            _corrupt(data, f"parameter {j} state entry {name!r} is not in its state's "
                     f"entries {listed}")
        live = list(binding.optimizer.state.get(p, {}))  # .get: state is a defaultdict
        if live and set(live) != set(listed):
            _mismatch(data, f"parameter {j} has the state entries {listed} in the checkpoint "
                      f"and {live} in the attached optimizer (differing in "
                      f"{sorted(set(live) ^ set(listed))})")
    index = {id(p): j for j, p in enumerate(params)}
    for g, (group, saved) in enumerate(zip(binding.optimizer.param_groups,
                                           entry["param_groups"])):
        members = [(j, p.shape, names[str(j)], paged.get(j, set()))
                   for p in group["params"] if names[str(j := index[id(p)])]]
        found = whole_state.gap(binding.optimizer, g, saved if isinstance(saved, dict) else {},
                                members)
        if found is not None:
            _corrupt(data, f"{found}: the checkpoint is incomplete")


def missing_state(binding, data: DataFile) -> dict:
    """Parameter index -> {state name: (shape, dtype, strides)} of the paged state the
    checkpoint holds for parameters without state in the attached optimizer. With a
    narrow format the state entry is the fp32 working tensor, laid out as its param."""
    params = binding.params_in_order()
    out = {}
    for (j, name), t in data.tensors.items():
        if j >= len(params):
            _corrupt(data, f"parameter {j} {name} names no parameter")
        p = params[j]
        base, _, suffix = name.partition(":")
        if base == "param" or binding.optimizer.state.get(p):
            continue
        if suffix:
            out.setdefault(j, {})[base] = (list(p.shape), p.dtype, list(p.stride()))
            continue
        if t["shape"] != list(p.shape) or len(t["strides"]) != len(t["shape"]):
            _mismatch(data, f"parameter {j} {name} is {t['shape']} (strides {t['strides']}), "
                      f"the parameter {list(p.shape)}")
        out.setdefault(j, {})[base] = (t["shape"], _dtype(data, t["dtype"], name),
                                       t["strides"])
    return out


class Staged:
    """One optimizer's part of a checkpoint, checked and decoded (see the module
    docstring). restore: (tensors, zero, offsets) in bucket order, for Pager::restore."""

    def __init__(self, binding, entry: dict, data: DataFile):
        self.binding, self.data = binding, data
        self._params = binding.params_in_order()
        self._stage_tensors()
        self._stage_small_state(entry.get("small_state"))
        self._stage_param_groups(entry["param_groups"])
        self._stage_state_names(entry["state_names"])

    def apply(self) -> None:
        """Assigns the staged small state, exception lists, state entry order and
        hyperparameters."""
        opt = self.binding.optimizer
        for p, values in self._small:
            opt.state[p].update(values)
        for form, exceptions in self._exceptions:
            form.exceptions = exceptions
            form.fingerprint = None  # the checkpoint's residual was encoded from its params
        for p, names in self._orders:
            state = opt.state.get(p)
            if state:  # torch's order of the entries, as saved
                opt.state[p] = {**{n: state[n] for n in names if n in state}, **state}
        for group, values in self._groups:
            group.update(values)

    # -- checks ---------------------------------------------------------------------

    def _stage_tensors(self) -> None:
        saved = self.data.tensors
        live = {(j, n): t for j, p in enumerate(self._params)
                for n, t in stored(self.binding, p)}
        for key in live.keys() ^ saved.keys():
            _mismatch(self.data, f"parameter {key[0]} {key[1]} is only in "
                      f"{'the checkpoint' if key in saved else 'the attached optimizer'}")
        for key, t in saved.items():
            self._check_tensor(key, t, live[key])
        index = {id(p): j for j, p in enumerate(self._params)}
        order = [(saved[(index[id(p)], n)], t) for bucket in self.binding.params_by_bucket()
                 for p in bucket for n, t in stored(self.binding, p)]
        self.restore = ([t for _, t in order], [s["zero"] for s, _ in order],
                        [s["offset"] or 0 for s, _ in order])

    def _check_tensor(self, key, t: dict, like: torch.Tensor) -> None:
        what = f"parameter {key[0]} {key[1]}"
        saved = (t["dtype"], t["shape"], t["strides"])
        if saved != (str(like.dtype), list(like.shape), list(like.stride())):
            _mismatch(self.data, f"{what} is {t['dtype']} {t['shape']} with strides "
                      f"{t['strides']}, expected {like.dtype} {list(like.shape)} with "
                      f"strides {list(like.stride())}")

    def _stage_small_state(self, small) -> None:
        """Decodes the small per-parameter state: self._small [(param, {key: value})] and
        self._exceptions [(form, (indices, bits))], one for every residual master."""
        if not isinstance(small, dict):
            _corrupt(self.data, "'small_state' is not a mapping")
        self._small, self._exceptions = [], []
        for i, values in small.items():
            j = self._param_index(i)
            if not isinstance(values, dict):
                _corrupt(self.data, f"small state entry {i!r} is not a mapping")
            self._stage_small(i, self._params[j], values)
        with_list = {id(form) for form, _ in self._exceptions}
        for j, p in enumerate(self._params):
            for name, form in self.binding.forms(p):
                if form.fmt == "residual" and id(form) not in with_list:
                    _corrupt(self.data, f"parameter {j} small state lacks '{name}:exceptions', "
                             "the exception list of its residual master")

    def _stage_small(self, i: str, p, values: dict) -> None:
        forms = dict(self.binding.forms(p))
        paged = {n for n, _ in stored(self.binding, p)} | set(forms)
        staged = {}
        for k, v in values.items():
            what = f"parameter {i} small state {k!r}"
            if k.endswith(":exceptions"):
                form = forms.get(k.removesuffix(":exceptions"))
                if form is None or form.fmt != "residual":
                    _corrupt(self.data, f"{what} belongs to no residual master")
                self._exceptions.append((form, self._exception_list(v, form, what)))
            elif k in paged:
                _corrupt(self.data, f"{what} names a paged tensor")
            else:
                current = self.binding.optimizer.state.get(p, {}).get(k)
                staged[k] = self._decode(v, current, what)
                if not _fits(staged[k], current):
                    _mismatch(self.data, f"{what} is {_kind(staged[k])}, the optimizer holds "
                              f"{_kind(current)}")
        self._small.append((p, staged))

    def _exception_list(self, v, form, what: str) -> tuple:
        """A residual master's exceptions: flat int64 indices into it, int32 bits."""
        if not isinstance(v, list) or len(v) != 2:
            _corrupt(self.data, f"{what} is not a pair (indices, bits)")
        idx, bits = (self._decode(x, form.working, what) for x in v)
        n = form.working.numel()
        if not (isinstance(idx, torch.Tensor) and isinstance(bits, torch.Tensor)
                and idx.dtype == torch.int64 and bits.dtype == torch.int32
                and idx.dim() == bits.dim() == 1 and len(idx) == len(bits)
                and (len(idx) == 0 or (int(idx.min()) >= 0 and int(idx.max()) < n))):
            _corrupt(self.data, f"{what} is not an int64 index list into its {n} elements "
                     "with int32 bits of the same length")
        return idx, bits

    def _stage_param_groups(self, groups: list) -> None:
        self._groups = []
        for j, (group, saved) in enumerate(zip(self.binding.optimizer.param_groups, groups)):
            if not isinstance(saved, dict) or "params" in saved:
                _corrupt(self.data, f"param group {j} is malformed")
            values = {}
            for k, v in saved.items():
                what = f"param group {j} {k!r}"
                if k not in group:
                    _mismatch(self.data, f"{what} is not a hyperparameter of the attached "
                              "optimizer")
                values[k] = self._decode(v, group[k], what)
                if not _fits(values[k], group[k]):
                    _mismatch(self.data, f"{what} is {_kind(values[k])}, the optimizer holds "
                              f"{_kind(group[k])}")
            self._groups.append((group, values))

    def _stage_state_names(self, names: dict) -> None:
        """self._orders [(param, [state names])]: torch's order of its state entries
        (checked by check_entries)."""
        self._orders = [(self._params[self._param_index(i)], v) for i, v in names.items()]

    def _param_index(self, i) -> int:
        if not (isinstance(i, str) and re.fullmatch(r"0|[1-9][0-9]*", i)
                and int(i) < len(self._params)):
            _corrupt(self.data, f"state entry {i!r} names no parameter")
        return int(i)

    def _decode(self, v, like, what: str):
        """A value manifest.encode() wrote, decoded; a tensor goes to the device of `like`
        (the value the optimizer holds now) when that is a tensor."""
        if isinstance(v, dict) and v.keys() == {"tensor", "dtype", "device"}:
            dtype = _dtype(self.data, v["dtype"], what)
            device = like.device if isinstance(like, torch.Tensor) else v["device"]
            try:
                return torch.tensor(v["tensor"], dtype=dtype, device=device)
            except (TypeError, ValueError, RuntimeError) as e:
                _corrupt(self.data, f"{what} is not a {dtype} tensor on {device}: {e}")
        if isinstance(v, dict) and v.keys() == {"tuple"} and isinstance(v["tuple"], list):
            likes = (like if isinstance(like, tuple) and len(like) == len(v["tuple"])
                     else [None] * len(v["tuple"]))
            return tuple(self._decode(x, y, what) for x, y in zip(v["tuple"], likes))
        return v  # JSON's own values (a plain dict among them) are what was saved


def _dtype(data: DataFile, name, what: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        _corrupt(data, f"{what} has the unknown dtype {name!r}")
    return dtype


def _mismatch(data: DataFile, what: str):
    raise CheckpointMismatchError(f"{data.where} does not fit: {what}. Load it into the "
                                  "same model, optimizers and sharding it was saved from.")


def _corrupt(data: DataFile, what: str):
    raise _C.CorruptStoreError(f"{data.where}: {what}. Nothing was loaded")


def _fits(saved, live) -> bool:
    """Whether a loaded value may replace the one the optimizer holds: tensors of the same
    shape, numbers for numbers, flags for flags, sequences alike; None fits anything."""
    if saved is None or live is None:
        return True
    if isinstance(saved, torch.Tensor) or isinstance(live, torch.Tensor):
        return (isinstance(saved, torch.Tensor) and isinstance(live, torch.Tensor)
                and saved.shape == live.shape)
    if isinstance(saved, bool) or isinstance(live, bool):
        return type(saved) is type(live)
    if isinstance(live, (int, float)):
        return isinstance(saved, (int, float))
    if isinstance(live, (tuple, list)):
        return (isinstance(saved, (tuple, list)) and len(saved) == len(live)
                and all(map(_fits, saved, live)))
    return type(saved) is type(live)


def _kind(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {list(v.shape)}"
    return f"{type(v).__name__} {v!r}"

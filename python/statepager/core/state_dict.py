"""state_dict() and load_state_dict() of an attached optimizer.

Both are torch's own, entry for entry (keys, order, values, param_groups, hooks), and
never replace or move the tensors in `optimizer.state`. state_dict() returns copies of
the paged tensors, taken to host memory; load_state_dict() copies a torch state dict
(from an attached optimizer or not) into the paged tensors in place, all or nothing (a
load that fails leaves the optimizer as it was); an entry that is its paged tensor
already (a state dict taken within state_dict_by_reference()) is not copied. Both go
bucket by bucket as the step pages them, a parameter that steps in chunks chunk by chunk
(StreamedOptimizer.state_in_pieces), so the state is never all on the device at once and
both run within any budget attach accepted (Note [Reads and loads in the step's pieces]
in docs/design.md). Both are linear in the number of parameters.
"""
from __future__ import annotations

import collections
from itertools import chain

import torch

from statepager import _C
from statepager.core import state_values, support, whole_state


def paged_state_dict(binding) -> dict:
    """torch's state_dict of binding.optimizer, the paged tensors as host copies (torch's
    would share the live tensors, which are not resident). Other entries are shared, as
    torch's are. Within binding.state_dict_by_reference(), torch's own."""
    optimizer = binding.optimizer
    if not binding.copies_state_dict:
        return type(optimizer).state_dict(optimizer)
    live = optimizer.state
    copies = {id(live[p][name]): copy
              for p, named in state_values.read(binding, masters=False).items()
              for name, copy in named.items()}
    shown = collections.defaultdict(dict)
    for p, st in live.items():
        # Only state of parameters no longer in any group (which torch's own state_dict
        # refuses with a KeyError) is not in a bucket: it is passed on as it is.
        shown[p] = {name: copies.get(id(v), v) for name, v in st.items()}
    optimizer.state = shown  # torch's packing and hooks see the copies
    try:
        return type(optimizer).state_dict(optimizer)
    finally:
        optimizer.state = live


def paged_load_state_dict(binding, state_dict: dict) -> None:
    """torch's load_state_dict of binding.optimizer; the paged entries are copied into
    the paged tensors in place (new ones, created in the pager, where a parameter has
    none of that layout).

    All or nothing. Refused before anything changes: on a paused Pager (UsageError),
    where torch refuses (the param groups), and where a parameter's state is incomplete
    (below). The new pager tensors are made before the optimizer's state is replaced,
    and the copy runs in a pager epoch: when anything fails midway (NoSpaceError, say),
    the optimizer is put back as it was (the same tensors with the same bytes,
    param_groups, step counters). Hooks registered with register_load_state_dict_pre_hook
    run first, those of ..._post_hook after a load that succeeded.

    Incomplete state: torch loads whatever entries a parameter's state holds, and a
    parameter without state (none in the state dict, or an empty one) starts fresh at
    its next step; so does this, but refuses (UsageError naming the parameter and the
    entries) a parameter that holds only part of its state, by the rule of
    statepager.core.whole_state applied to the state dict's param groups: each parameter
    with state holds "step" where another of its group does, the paged entries (dense
    tensors shaped like their parameter) that another of its group and shape holds, and
    under Adam and AdamW all of Adam's entries ("step", "exp_avg", "exp_avg_sq", and
    "max_exp_avg_sq" with amsgrad). Parameters kept resident (attach(keep_resident=...))
    load as torch loads them.
    """
    binding.pager.services.check_not_paused("load_state_dict()")
    optimizer = binding.optimizer
    sd = state_dict.copy()
    # torch's hooks (register_load_state_dict_pre/post_hook) see the whole state dict
    # and the whole loaded state: they run here, not inside torch's load of the rest.
    pre = optimizer._optimizer_load_state_dict_pre_hooks
    post = optimizer._optimizer_load_state_dict_post_hooks
    for hook in pre.values():
        result = hook(optimizer, sd)
        if result is not None:
            sd = result
    _load_paged(binding, sd, "load_state_dict")
    for hook in post.values():
        hook(optimizer)


def adopt_state(binding) -> None:
    """The state binding.optimizer made before attach, moved into the pager as
    load_state_dict() would load it (in the step's pieces, all or nothing), without
    torch's state-dict hooks: attach is no load of the user's."""
    optimizer = binding.optimizer
    index = {id(p): i for i, p in enumerate(binding.params_in_order())}
    groups = [{**g, "params": [index[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    state = {index[id(p)]: dict(st) for p, st in optimizer.state.items() if id(p) in index}
    _load_paged(binding, {"state": state, "param_groups": groups}, "attach")


def _load_paged(binding, sd: dict, what: str) -> None:
    """paged_load_state_dict's load of `sd`, after its hooks (`what` names the caller in
    refusals)."""
    optimizer = binding.optimizer
    params = _id_map(optimizer.param_groups, sd["param_groups"])
    # Per parameter: its loaded entries' names in order, and those the pager holds.
    order, paged, rest = {}, {}, {}
    for k, st in sd["state"].items():
        p = params.get(k)
        if p is None or binding.resident(p) or not isinstance(st, dict):
            rest[k] = st
            continue
        order[id(p)] = list(st)
        paged[id(p)] = {name: v for name, v in st.items() if support.pageable_loaded(name, v, p)}
        rest[k] = {name: v for name, v in st.items() if name not in paged[id(p)]}
    _check_whole(binding, sd, params, paged, what)
    targets = _targets(binding, params, paged)
    undo = state_values.Undo(binding)
    try:
        _load(binding, {**sd, "state": rest}, params, order, paged, targets)
    except BaseException:
        undo.roll_back()
        raise
    undo.commit()


def _check_whole(binding, sd: dict, params: dict, paged: dict, what: str) -> None:
    """Refuses a parameter whose state in `sd` is not whole (statepager.core.whole_state;
    paged: id(param) -> its paged entries, for the parameters the pager holds)."""
    for g, group in enumerate(sd["param_groups"]):
        members = [(k, params[k].shape, list(st), paged[id(params[k])])
                   for k in group["params"] if id(params[k]) in paged
                   and (st := sd["state"].get(k))]
        found = whole_state.gap(binding.optimizer, g, group, members)
        if found is not None:
            raise _C.UsageError(
                f"{what}: {found}: its next step would mix state of different "
                "steps. Load a whole state dict (the optimizer's state_dict()), or none for "
                "that parameter (it then starts fresh); nothing was loaded")


def _targets(binding, params: dict, paged: dict) -> dict:
    """id(param) -> {name: the pager tensor its paged entry is loaded into}: its own
    where dtype and layout fit (loaded in place), else a new one (ZERO: no memory), made
    here, before anything changes."""
    optimizer, pager = binding.optimizer, binding.pager
    out = {}
    for p in params.values():
        if id(p) not in paged:
            continue
        own = {n: v for n, v in optimizer.state.get(p, {}).items() if pager.owns(v)}
        into = out[id(p)] = {}
        for name, v in paged[id(p)].items():
            dtype = support.loaded_dtype(p, v)
            t = own.get(name)
            like = torch.empty_like(v, dtype=dtype, device="meta")
            if t is None or t.dtype != dtype or t.stride() != like.stride():
                t = binding.empty_state_like(p, v, dtype=dtype)
            into[name] = t
    return out


def _load(binding, sd: dict, params: dict, order: dict, paged: dict, targets: dict) -> None:
    """torch's load of `sd` (the state dict without the paged entries: casts,
    param_groups, __setstate__); then each parameter's state as loaded, the targets
    (_targets) in place of its paged entries, in the saved order; then the paged values
    copied into the targets bucket by bucket as the step pages them, a parameter that
    steps in chunks chunk by chunk (StreamedOptimizer.state_in_pieces)."""
    optimizer = binding.optimizer
    pre = optimizer._optimizer_load_state_dict_pre_hooks
    post = optimizer._optimizer_load_state_dict_post_hooks
    optimizer._optimizer_load_state_dict_pre_hooks = collections.OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = collections.OrderedDict()
    try:
        type(optimizer).load_state_dict(optimizer, sd)
    finally:
        optimizer._optimizer_load_state_dict_pre_hooks = pre
        optimizer._optimizer_load_state_dict_post_hooks = post
    for p in params.values():
        if id(p) in order:
            loaded, into = optimizer.state[p], targets[id(p)]
            optimizer.state[p] = {name: into.get(name, loaded.get(name))
                                  for name in order[id(p)]}
    # A value that is its target already (a state dict taken by reference and given back,
    # as Megatron's load_state_dict does) needs no copy.
    values = {k: moved for k, named in paged.items()
              if (moved := {n: v for n, v in named.items() if v is not targets[k][n]})}
    if values:
        state_values.copy_in(binding, state_values.InTargetOrder(values, targets))


def _id_map(groups: list, saved_groups: list) -> dict:
    """Saved parameter index -> parameter, as torch's load_state_dict pairs them (and
    with its refusals, raised before anything changes)."""
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match "
                         "the size of optimizer's group")
    return dict(zip(chain.from_iterable(s["params"] for s in saved_groups),
                    chain.from_iterable(g["params"] for g in groups)))

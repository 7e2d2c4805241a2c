"""state_dict() and load_state_dict() of an attached optimizer.

Both are torch's own, entry for entry (keys, order, values, param_groups, hooks), and
never replace or move the tensors in `optimizer.state`: state_dict() returns copies of
the paged tensors, taken bucket by bucket to host memory; load_state_dict() copies a
torch state dict (from an attached optimizer or not) into the paged tensors in place,
bucket by bucket, so the state is never all on the device at once. Both are linear in
the number of parameters.
"""
from __future__ import annotations

import collections
from itertools import chain

import torch

from statepager.core import support


def paged_state_dict(binding) -> dict:
    """torch's state_dict of binding.optimizer, the paged tensors as host copies (torch's
    would share the live tensors, which are not resident). Other entries are shared, as
    torch's are. Within binding.state_dict_by_reference(), torch's own."""
    optimizer = binding.optimizer
    if not binding.copies_state_dict:
        return type(optimizer).state_dict(optimizer)
    copies = {}
    with torch.no_grad():
        for b in binding.state_in_buckets(write=False):
            for p in b.params:
                for v in optimizer.state.get(p, {}).values():
                    if binding.pager.owns(v):
                        copies[id(v)] = v.to("cpu", copy=True)
    live = optimizer.state
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
    none of that layout)."""
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
    old = {id(p): {n: v for n, v in optimizer.state.get(p, {}).items() if binding.pager.owns(v)}
           for p in params.values()}
    # torch loads the rest (casts, param_groups, __setstate__).
    optimizer._optimizer_load_state_dict_pre_hooks = collections.OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = collections.OrderedDict()
    try:
        type(optimizer).load_state_dict(optimizer, {**sd, "state": rest})
    finally:
        optimizer._optimizer_load_state_dict_pre_hooks = pre
        optimizer._optimizer_load_state_dict_post_hooks = post
    with torch.no_grad():
        for b in binding.state_in_buckets():
            for p in b.params:
                mine = old.pop(id(p), {})  # the rest is let go with its bucket
                if id(p) in order:
                    _load_entries(binding, optimizer, p, order[id(p)], paged[id(p)], mine)
    for hook in post.values():
        hook(optimizer)


def _load_entries(binding, optimizer, p, order: list, paged: dict, old: dict) -> None:
    """p's state as loaded: the entries torch loaded, the paged ones copied into pager
    tensors (its old ones where shape, dtype and layout match), in the saved order."""
    loaded = optimizer.state[p]
    state = {}
    for name in order:
        if name not in paged:
            state[name] = loaded[name]
            continue
        v = paged[name]
        dtype = support.loaded_dtype(p, v)
        t = old.get(name)
        like = torch.empty_like(v, dtype=dtype, device="meta")
        if t is None or t.dtype != dtype or t.stride() != like.stride():
            t = binding.empty_state_like(p, v, dtype=dtype)
            binding.pager.page_in(t)
        t.copy_(v)
        state[name] = t
    optimizer.state[p] = state


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

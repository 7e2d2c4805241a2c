"""Whether each parameter's optimizer state is whole: load_state_dict() and checkpoint
loads refuse, before anything changes, a parameter that would be left with part of its
state (its next step would mix state of different steps, or fail).

The rule, among the parameters of one param group that have state: each holds "step"
where another does, and the paged entries (dense tensors shaped like their parameter)
that another of the same shape holds, as every torch optimizer creates them; under Adam
and AdamW (whose state the pager creates itself), Adam's entries ("step", "exp_avg",
"exp_avg_sq", and "max_exp_avg_sq" with amsgrad). A parameter without state is whole:
it starts fresh at its next step, as in torch.
"""
from __future__ import annotations

from statepager.core import support


def gap(optimizer, index: int, group: dict, members: list) -> str | None:
    """The first parameter of param group `index` whose state is not whole, described
    for an error message, or None. group: the group's hyperparameters as loaded (amsgrad);
    members: (label, shape, names, paged) of its parameters that have state, where names
    are all its state entries and paged those the pager holds."""
    adam = support.DeferredState.for_optimizer(optimizer)
    stepped = [label for label, _, names, _ in members if "step" in names]
    shaped = {}  # shape -> the paged entries of the parameters of that shape
    for _, shape, _, paged in members:
        shaped.setdefault(tuple(shape), set()).update(paged)
    for label, shape, names, _ in members:
        rules = [(shaped[tuple(shape)], f"the other parameters of shape {list(shape)} in "
                  "its param group hold")]
        if stepped:
            rules.append(({"step"}, f"parameter {stepped[0]} of its param group holds"))
        if adam is not None:
            rules.append((set(adam.names(group)), f"{type(optimizer).__name__} keeps for "
                          "every parameter"))
        for required, why in rules:
            missing = sorted(required - set(names))
            if missing:
                return (f"parameter {label} of param group {index} has the state entries "
                        f"{list(names)}, without {missing}, which {why}")
    return None

"""What an attached torch optimizer can stream, and refusals for what it cannot.

A refusal is a statepager.UsageError raised before anything changes (at attach, at
add_param_group, or before the step that first sees a group appended to param_groups
directly), naming what to do instead. Everything else behaves as the unattached
optimizer, bit for bit: state is created when and as torch creates it, in the param's
memory layout, and only for parameters that have a gradient.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

from statepager import _C
from statepager.core.state_access import held


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuses optimizers whose step cannot run on one bucket of parameters at a time."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise _C.UsageError(
            "LBFGS cannot be attached: its step re-evaluates the closure (the whole model) "
            "many times over a flat view of all parameters at once, so it cannot step "
            "bucket by bucket. Leave LBFGS unattached (its state is a few vectors per "
            "history entry), or attach a first-order optimizer (Adam, SGD, ...).")


def check_group(group: dict, index: int, device: torch.device,
                keep_resident: Callable[[torch.Tensor], bool]) -> None:
    """Refuses a param group whose state the pager cannot hold."""
    if group.get("differentiable"):
        raise _C.UsageError(
            f"param group {index} has differentiable=True: a differentiable optimizer "
            "keeps its state in the autograd graph of the step, which the pager would "
            "page out under it. Create the optimizer with differentiable=False to attach "
            "it, or leave it unattached.")
    for i, p in enumerate(group["params"]):
        if keep_resident(p):
            continue
        if p.layout != torch.strided:
            raise _C.UsageError(
                f"param group {index} parameter {i} is a {p.layout} tensor: only dense "
                "parameters have state the pager can hold. Keep it resident "
                "(attach(..., hooks=statepager.Hooks(keep_resident=...))) or make it dense.")
        if p.device != device:
            raise _C.UsageError(
                f"param group {index} parameter {i} is on {p.device}, the pager on "
                f"{device}: its state would be created on {device}. Attach to a Pager on "
                f"{p.device}, or keep it resident "
                "(attach(..., hooks=statepager.Hooks(keep_resident=...))).")


def pageable(v, p: torch.Tensor) -> bool:
    """True for state entries the pager holds: dense tensors shaped like their parameter
    (moments, buffers). Scalars (step counters), factored statistics (Adafactor's row and
    column variances) and sparse state (SGD momentum of sparse gradients) stay in
    ordinary memory."""
    return (isinstance(v, torch.Tensor) and v.layout == torch.strided and v.dim() > 0
            and v.shape == p.shape and v.device == p.device and not v.requires_grad)


def pageable_loaded(name, v, p: torch.Tensor) -> bool:
    """True for the entries of a loaded state dict that the pager holds: as pageable(),
    from any device ("step" entries, which torch's load casts by their own rule, never)."""
    return (name != "step" and isinstance(v, torch.Tensor) and v.layout == torch.strided
            and v.dim() > 0 and v.shape == p.shape)


def loaded_dtype(p: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The dtype torch's load_state_dict gives a state tensor of p other than "step"
    (Optimizer._process_value_according_to_param_policy): p's for floating p."""
    return p.dtype if p.is_floating_point() else v.dtype


class DeferredState:
    """State created at the step, as the optimizer's own step creates it, but straight
    into the pager: its tensors are ZERO extents, so nothing is allocated outside the
    pager and nothing is read for them. For Adam and AdamW (those not overriding
    _init_group); other optimizers create their state in their step in ordinary memory,
    and the binding moves it into the pager right after (one bucket at a time)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @staticmethod
    def for_optimizer(optimizer) -> "DeferredState | None":
        # What the class's _init_group wraps: once anything compiles (Megatron's model
        # does), torch._dynamo wraps each optimizer class's _init_group in disable().
        if isinstance(optimizer, torch.optim.Adam) and \
                inspect.unwrap(type(optimizer)._init_group) is \
                inspect.unwrap(torch.optim.Adam._init_group):
            return DeferredState(optimizer)
        return None

    def moments(self, group: dict) -> int:
        """How many param-shaped tensors a parameter of `group` gets."""
        return len(self.names(group)) - 1

    @staticmethod
    def names(group: dict) -> list[str]:
        """The state entries Adam creates for a parameter of `group`: "step", then its
        param-shaped moments."""
        return ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad")
                                                    else [])

    def create(self, group: dict, p: torch.Tensor, zeros_like: Callable) -> bool:
        """Creates p's state as Adam._init_group (torch 2.11) does on p's first step with
        a gradient, the moments from zeros_like(p); False when torch would create none
        now (no gradient, state already there, or a sparse gradient, which torch's step
        refuses itself)."""
        if p.grad is None or p.grad.is_sparse or len(held(self.optimizer, p, ())) != 0:
            return False
        from torch.optim.optimizer import _device_dtype_check_for_fused, _get_scalar_dtype

        if group["fused"]:
            _device_dtype_check_for_fused(p)
        state = self.optimizer.state[p]
        if group["capturable"] or group["fused"]:
            state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]),
                                        device=p.device)
        else:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        for name in self.names(group)[1:]:
            state[name] = zeros_like(p)
        return True

"""An attached optimizer's own methods, replaced by attach (statepager.core.binding):
step(), zero_grad(), state_dict(), load_state_dict() and add_param_group() go through
its binding. Each holds the Pager's lock (statepager.core.serial): a step, a
state_dict() or a save on another thread waits for the one running."""
from __future__ import annotations

import functools
import types

import torch

from statepager import _C
from statepager.core import state_access, state_dict
from statepager.core.serial import lock_of, serialized


def replace(binding, optimizer) -> None:
    """Sets the methods on the optimizer instance. They refer to `binding` (a reference
    cycle, which the garbage collector frees with the optimizer)."""
    step = torch.optim.Optimizer.profile_hook_step(functools.partial(_paged_step, binding))
    # LR schedulers wrap step() to notice it ran; ours sets the same flag
    # (_opt_called), so mark it the way theirs is marked.
    step._wrapped_by_lr_sched = True
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.state_dict = types.MethodType(_paged_state_dict, binding)
    optimizer.load_state_dict = types.MethodType(_paged_load_state_dict, binding)
    optimizer.add_param_group = functools.partial(_paged_add_param_group, binding)
    optimizer.zero_grad = functools.partial(_paged_zero_grad, binding, optimizer.zero_grad)


def _paged_step(binding, optimizer, closure=None):
    """optimizer.step() of an attached optimizer (the closure runs outside the lock)."""
    binding.pager.services.check_not_paused("step()")
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    with lock_of(binding):
        binding.pager.services.check_not_paused("step()")
        optimizer._opt_called = True  # what LR schedulers check; their step wrapper is replaced
        binding.step_buckets()
    return loss


def _paged_zero_grad(binding, zero_grad, *args, **kwargs):
    """optimizer.zero_grad() of an attached optimizer: a pending step finished with the
    grads it needs, then its own, then prepare_step(). A step in flight under the
    forward keeps its grads: it goes on unless they are zeroed in place
    (set_to_none=False), which completes it first."""
    with lock_of(binding):
        to_none = args[0] if args else kwargs.get("set_to_none", True)
        if binding.step_in_flight is None or not to_none:
            binding.finish_step()
        result = zero_grad(*args, **kwargs)
        binding.prepare_step()
    return result


def _paged_state_dict(binding) -> dict:
    with lock_of(binding):
        binding.finish_step()
        return state_dict.paged_state_dict(binding)


def _paged_load_state_dict(binding, loaded: dict) -> None:
    with lock_of(binding):
        try:
            state_dict.paged_load_state_dict(binding, loaded)
        finally:
            state_access.wrap(binding)  # torch's load sets optimizer.state anew
        binding.drop_pending_step()  # loaded: the state it left is replaced


@serialized
def _paged_add_param_group(binding, param_group: dict) -> None:
    """torch's add_param_group, refused (and undone) when the pager cannot hold the new
    group's state; the group is streamed from the next step on."""
    optimizer = binding.optimizer
    binding.complete_step_in_flight()  # its buckets step with the groups of its step()
    type(optimizer).add_param_group(optimizer, param_group)
    try:
        binding.check_group(optimizer.param_groups[-1], len(optimizer.param_groups) - 1)
    except _C.UsageError:
        optimizer.param_groups.pop()
        raise

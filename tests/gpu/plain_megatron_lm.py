"""Megatron-LM's pretrain_gpt.py without statepager, able to resume a DistributedOptimizer
checkpoint exactly: python plain_megatron_lm.py PRETRAIN_GPT ARGS... (torchrun runs it in
place of the script).

megatron-core 0.19.2 without TransformerEngine and apex (its inner optimizer torch's AdamW)
cannot resume a DistributedOptimizer checkpoint, its own included, for two reasons, each
worked around here and nothing else:
- the load builds the optimizer's sharded state dict from DistributedOptimizer.state_dict(),
  which asserts that the inner optimizer's states share one "step", and before the first
  step there are none (its init_state_fn makes the moments only). Before that method runs
  on an optimizer that has not stepped, each state is made as torch's AdamW makes it for
  its first step (zero moments through Megatron's own init_state_fn, step 0); the load then
  sets the checkpoint's moments and step. A run that loads nothing steps from those zeros
  exactly as from an empty state.
- DistributedOptimizer.load_state_dict sets the step from the checkpoint's param groups as
  one tensor that every state shares (torch's AdamW then advances it once per parameter in
  each step: foreach adds to each list entry), and then, loading dp_reshardable's parameter
  state, copies into it the loader's own step from before the load (non-persistent there):
  the next step's bias corrections restart. After it, each state gets a step tensor of its
  own holding the checkpoint's step, as the first of those two lines meant.
Importing statepager fails here (a checkpoint that needed it to load would fail the run)."""
import importlib.abc
import os
import runpy
import sys

import torch
from megatron.core.optimizer import distrib_optimizer

_state_dict = distrib_optimizer.DistributedOptimizer.state_dict
_load_state_dict = distrib_optimizer.DistributedOptimizer.load_state_dict


def state_dict(self):
    inner = self.optimizer
    fresh = not any("step" in s for s in inner.state.values())
    if (not distrib_optimizer.HAVE_APEX_OR_TE and fresh
            and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))):
        self.init_state_fn(inner, self.config)
        for s in inner.state.values():
            s["step"] = torch.tensor(0.0)
    return _state_dict(self)


def load_state_dict(self, state_dict):
    _load_state_dict(self, state_dict)
    inner = self.optimizer
    if distrib_optimizer.HAVE_APEX_OR_TE or not isinstance(inner, (torch.optim.Adam,
                                                                   torch.optim.AdamW)):
        return
    steps = {g["step"] for g in state_dict["optimizer"]["param_groups"]}
    assert len(steps) == 1, steps  # as Megatron's own load asserts
    step = float(steps.pop())
    for s in inner.state.values():
        s["step"] = torch.tensor(step)


class NoStatepager(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "statepager":
            raise ImportError(f"{name}: Megatron-LM runs here without statepager")
        return None


if __name__ == "__main__":
    assert not [m for m in sys.modules if m.split(".")[0] == "statepager"]
    sys.meta_path.insert(0, NoStatepager())
    distrib_optimizer.DistributedOptimizer.state_dict = state_dict
    distrib_optimizer.DistributedOptimizer.load_state_dict = load_state_dict
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")

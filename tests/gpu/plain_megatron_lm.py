"""Megatron-LM's pretrain_gpt.py without statepager, able to resume a DistributedOptimizer
checkpoint: python plain_megatron_lm.py PRETRAIN_GPT ARGS... (torchrun runs it in place of
the script).

megatron-core 0.19.2 without TransformerEngine and apex (its inner optimizer torch's AdamW)
cannot resume any DistributedOptimizer checkpoint, its own included: the load builds the
optimizer's sharded state dict from DistributedOptimizer.state_dict(), which asserts that
the inner optimizer's states share one "step", and before the first step there are none
(its init_state_fn makes the moments only). This works around that one assertion and
nothing else: before that method runs on an optimizer that has not stepped, each state is
made as torch's AdamW makes it for its first step (zero moments through Megatron's own
init_state_fn, step 0). The load then sets the checkpoint's step (load_state_dict takes it
from the saved param groups) and moments; a run that loads nothing steps from those zeros
exactly as from an empty state. Megatron's own code is unchanged otherwise. Importing
statepager fails here (a checkpoint that needed it to load would fail the run)."""
import importlib.abc
import os
import runpy
import sys

import torch
from megatron.core.optimizer import distrib_optimizer

_state_dict = distrib_optimizer.DistributedOptimizer.state_dict


def state_dict(self):
    inner = self.optimizer
    fresh = not any("step" in s for s in inner.state.values())
    if (not distrib_optimizer.HAVE_APEX_OR_TE and fresh
            and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))):
        self.init_state_fn(inner, self.config)
        for s in inner.state.values():
            s["step"] = torch.tensor(0.0)
    return _state_dict(self)


class NoStatepager(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "statepager":
            raise ImportError(f"{name}: Megatron-LM runs here without statepager")
        return None


if __name__ == "__main__":
    assert not [m for m in sys.modules if m.split(".")[0] == "statepager"]
    sys.meta_path.insert(0, NoStatepager())
    distrib_optimizer.DistributedOptimizer.state_dict = state_dict
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")

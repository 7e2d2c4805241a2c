"""Every use statepager makes of megatron-core, one function or method per need.

Nothing else in statepager names a Megatron attribute: when Megatron changes, this file
(and its contract test, tests/gpu/test_megatron_contract.py, which checks CONTRACT)
is where statepager changes. check_version() refuses, at attach, a megatron-core outside
the range these were written and tested against. Imports megatron lazily (statepager
imports without it).
"""
from __future__ import annotations

import functools
import importlib.metadata

import torch

from statepager import _C

# megatron-core releases these accesses are written and tested against: [low, high).
SUPPORTED = ((0, 19), (0, 20))

# What the methods below use, for the contract test: (module, class or None, name,
# parameter names or None). Instance attributes made in __init__ are checked on a
# built optimizer (INSTANCE_ATTRIBUTES).
CONTRACT = (
    ("megatron.core.optimizer", None, "ChainedOptimizer", None),
    ("megatron.core.optimizer", None, "DistributedOptimizer", None),
    ("megatron.core.optimizer.cpu_offloading.hybrid_optimizer", None,
     "HybridDeviceOptimizer", None),
    ("megatron.core.optimizer.optimizer", None, "_get_param_grad_norm_group", ["param"]),
    ("megatron.core.optimizer", "DistributedOptimizer", "_get_model_param_range_map",
     ["self", "param"]),
    ("megatron.core.optimizer", "DistributedOptimizer",
     "_build_model_param_to_state_dict_param_map", ["self", "state_dict"]),
    ("megatron.core.optimizer", "DistributedOptimizer", "_copy_model_grads_to_main_grads",
     ["self"]),
    ("megatron.core.optimizer", "DistributedOptimizer", "_copy_main_params_to_model_params",
     ["self"]),
    ("megatron.core.optimizer", "DistributedOptimizer", "_copy_model_params_to_main_params",
     ["self"]),
    ("megatron.core.optimizer", "DistributedOptimizer", "state_dict", ["self"]),
    ("megatron.core.optimizer", "DistributedOptimizer", "step", ["self"]),
    ("megatron.core.optimizer", "ChainedOptimizer", "step", ["self"]),
    ("megatron.core.optimizer", "DistributedOptimizer", "get_parameters", ["self"]),
    ("megatron.core.optimizer", "DistributedOptimizer", "offload_to_cpu", None),
    ("megatron.core.optimizer", "DistributedOptimizer", "restore_from_cpu", None),
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBuffer", "reset",
     ["self"]),
    # Megatron-LM's training calls it; statepager.megatron_lm takes model_chunks from it.
    ("megatron.core.optimizer", None, "get_megatron_optimizer", ["config", "model_chunks"]),
)
INSTANCE_ATTRIBUTES = (
    "optimizer", "config", "ddp_config", "model_float16_groups", "model_fp32_groups",
    "shard_fp32_from_float16_groups", "shard_fp32_groups", "model_param_gbuf_map",
    "buffers", "is_stub_optimizer", "data_parallel_group",
)
# ... and of each of its grad buffers (_ParamAndGradBuffer), with the model params'
# main_grad views into grad_data.
BUFFER_ATTRIBUTES = ("grad_data", "extra_main_grads")

# Megatron's checkpoint methods that read the state behind the pager's back (refused).
CHECKPOINT_METHODS = (
    "sharded_state_dict", "load_state_dict", "save_parameter_state",
    "load_parameter_state", "get_parameter_state_dp_zero",
    "get_parameter_state_dp_reshardable", "load_parameter_state_from_dp_zero",
    "load_parameter_state_from_dp_reshardable", "load_parameter_state_from_fs_model_space",
    "load_parameter_state_from_fully_reshardable",
)


def is_megatron(optimizer) -> bool:
    return type(optimizer).__module__.startswith("megatron.")


def version() -> tuple:
    try:
        text = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path
        from megatron.core import package_info

        text = package_info.__version__
    return tuple(int("".join(c for c in part if c.isdigit()) or 0)
                 for part in text.split(".")[:3])


def check_version() -> None:
    """UsageError unless the installed megatron-core is in SUPPORTED."""
    low, high = SUPPORTED
    try:
        found = version()
    except (ImportError, AttributeError, ValueError):
        found = None
    if found is None or not low <= found[:2] < high:
        have = "an unknown version" if found is None else ".".join(map(str, found))
        raise _C.UsageError(
            f"statepager supports megatron-core {low[0]}.{low[1]}.x (>= {low[0]}.{low[1]}, "
            f"< {high[0]}.{high[1]}), not {have}: install megatron-core=="
            f"{low[0]}.{low[1]}.* (statepager[megatron]), or update statepager")


def members(optimizer) -> list:
    """(index, member) of each DistributedOptimizer of `optimizer` (a ChainedOptimizer's
    members, or the optimizer itself) that holds parameters (stubs left out)."""
    from megatron.core.optimizer import ChainedOptimizer

    chain = (optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer)
             else [optimizer])
    return [(i, m) for i, m in enumerate(chain) if not getattr(m, "is_stub_optimizer", False)]


def override_step(optimizer, step):
    """Sets `optimizer`'s step() (the training loop's; ChainedOptimizer.step steps its
    members through their other methods, never their step()) on the instance, and
    returns the step() it had (Megatron's, or one set on the instance before)."""
    previous = optimizer.step
    optimizer.step = step
    return previous


def grad_norm_group(main):
    """The group whose grad norm Megatron counts `main` in."""
    from megatron.core.optimizer.optimizer import _get_param_grad_norm_group

    return _get_param_grad_norm_group(main)


class Internals:
    """Megatron's view of one DistributedOptimizer `d`, as statepager needs it."""

    def __init__(self, d):
        self.d = d

    def unsupported(self) -> str | None:
        """What in d's configuration statepager cannot page, with the fix; None if all
        is supported."""
        from megatron.core.optimizer import DistributedOptimizer
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import (
            HybridDeviceOptimizer)

        d = self.d
        if not isinstance(d, DistributedOptimizer):
            return (f"it is a {type(d).__name__}. Use the distributed optimizer "
                    "(OptimizerConfig.use_distributed_optimizer=True).")
        cfg, ddp = d.config, d.ddp_config
        if getattr(ddp, "use_megatron_fsdp", False):
            return "Megatron-FSDP manages the optimizer state itself. Turn use_megatron_fsdp off."
        if cfg.use_precision_aware_optimizer or getattr(cfg, "optimizer_cpu_offload", False) \
                or isinstance(d.optimizer, HybridDeviceOptimizer):
            return ("the precision-aware optimizer and optimizer CPU offload keep the state "
                    "in their own kernels. Turn use_precision_aware_optimizer and "
                    "optimizer_cpu_offload off; statepager takes their place.")
        if getattr(ddp, "fp8_param_gather", False) or getattr(ddp, "fp4_param_gather", False) \
                or getattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
            return ("fp8/fp4 param gather (incl. the MXFP8 grad-buffer reuse) is not "
                    "supported. Train with bf16 or fp16 params.")
        for model_param, _ in self.float16_params():
            if type(model_param) is not torch.nn.Parameter:  # TE's fp8 / NVFP4 tensors
                return (f"a parameter is a {type(model_param).__name__}. Train with bf16 "
                        "or fp16 params.")
        grads16 = any(self.grad_dtype(m) != torch.float32 for m, _ in self.float16_params())
        if grads16 and cfg.fp16:
            return ("fp16 training unscales fp16 grads in place before the step. Set "
                    "grad_reduce_in_fp32=True in the DDP config.")
        if grads16 and cfg.log_num_zeros_in_grad:
            return ("log_num_zeros_in_grad counts zeros in whole-model fp32 grads. Turn "
                    "log_num_zeros_in_grad off, or set grad_reduce_in_fp32=True.")
        return None

    # -- parameters ----------------------------------------------------------------------

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps the mains."""
        return self.d.optimizer

    def float16_params(self) -> list:
        """(model param, its fp32 main) of each bf16/fp16 model parameter of d."""
        return [(m, main) for models, mains in zip(self.d.model_float16_groups,
                                                    self.d.shard_fp32_from_float16_groups)
                for m, main in zip(models, mains)]

    def fp32_params(self) -> list:
        """(model param, its fp32 shard) of each native fp32 model parameter of d."""
        return [(m, shard) for models, shards in zip(self.d.model_fp32_groups,
                                                      self.d.shard_fp32_groups)
                for m, shard in zip(models, shards)]

    def replace_mains(self, replace) -> dict:
        """Each main for which replace(main) returns a tensor is replaced by it in
        Megatron's groups and model_param.main_param. Returns {id(old): new}; the inner
        optimizer's references are the caller's."""
        moved = {}
        for models, mains in zip(self.d.model_float16_groups,
                                 self.d.shard_fp32_from_float16_groups):
            for i, (model_param, main) in enumerate(zip(models, mains)):
                new = replace(main)
                if new is not None:
                    moved[id(main)] = mains[i] = model_param.main_param = new
        return moved

    def is_expert(self) -> bool:
        """Whether d steps expert-parallel parameters (not all-reduced over all ranks)."""
        return any(not getattr(p, "allreduce", True)
                   for group in self.d.model_float16_groups + self.d.model_fp32_groups
                   for p in group)

    @staticmethod
    def grad_dtype(model_param) -> torch.dtype:
        return model_param.main_grad.dtype

    def shard(self, model_param, whole: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's slice of `whole` (default model_param itself, detached), flat."""
        r = self.d._get_model_param_range_map(model_param)["param"]
        whole = model_param.detach() if whole is None else whole
        return whole.view(-1)[r.start:r.end]

    def grad_shard(self, model_param) -> torch.Tensor:
        """This rank's slice of model_param's reduce-scattered grad (main_grad)."""
        return self.shard(model_param, model_param.main_grad)

    def param_buffer_slice(self, model_param) -> torch.Tensor:
        """This rank's slice of model_param in the DDP param buffer (what the param
        all-gather sends)."""
        r = self.d._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
        gbuf, _, bucket = self.d.model_param_gbuf_map[model_param]
        return self.d.buffers[gbuf].buckets[bucket].param_data.view(-1)[r.start:r.end]

    def state_dict_params(self, state_dict) -> dict:
        """{model param: its tensor in `state_dict`} (reload_model_params(state_dict))."""
        return self.d._build_model_param_to_state_dict_param_map(state_dict)

    # -- d's methods -----------------------------------------------------------------------

    def copy_grads_as_megatron(self) -> None:
        """Megatron's own model-grads-to-main-grads."""
        type(self.d)._copy_model_grads_to_main_grads(self.d)

    def state_dict_as_megatron(self) -> dict:
        return type(self.d).state_dict(self.d)

    def zero_grad_as_megatron(self, *args, **kwargs) -> None:
        type(self.d).zero_grad(self.d, *args, **kwargs)

    def on_grads_zeroed(self, handler) -> None:
        """Each of d's grad buffers zeroed by handler(buffer, reset) in place of reset():
        the training loop's model.zero_grad_buffer() resets them (before it calls the
        optimizer's zero_grad). Set on the buffer instances, which d shares with the DDP
        model."""
        for buffer in self.d.buffers:
            buffer.reset = functools.partial(handler, buffer, buffer.reset)

    @staticmethod
    def zero_grads_but(buffer, kept: list) -> None:
        """What buffer.reset() does, but the main grads of the model params `kept` (views
        into its grad data, or extra main grads of its own) keep their values."""
        data = buffer.grad_data.view(-1)
        base, size = data.data_ptr(), data.element_size()
        spans = sorted(((g.data_ptr() - base) // size, (g.data_ptr() - base) // size + g.numel())
                       for g in (p.main_grad for p in kept)
                       if base <= g.data_ptr() < base + data.numel() * size)
        at = 0
        for start, stop in spans:
            data[at:start].zero_()
            at = max(at, stop)
        data[at:].zero_()
        kept_extra = {id(p.main_grad) for p in kept}
        for grad in buffer.extra_main_grads:
            if id(grad) not in kept_extra:
                grad.zero_()

    def data_parallel_size(self) -> int:
        return self.d.data_parallel_group.size()

    def overlaps_param_gather(self) -> bool:
        """Whether DDP all-gathers the params in the forward's hooks."""
        return bool(self.d.ddp_config.overlap_param_gather)

    def override(self, *, copy_grads, copy_mains_to_params, copy_params_to_mains,
                 state_dict, zero_grad, get_parameters=None, refused: dict) -> None:
        """Sets d's methods, on the instance (never its class): the hooks that
        step_with_ready_grads and reload_model_params call, state_dict, zero_grad (what
        ChainedOptimizer's and the training loop's zero_grad() call), get_parameters,
        and callables that refuse each method named in `refused` ({name: refusal})."""
        d = self.d
        d.zero_grad = zero_grad
        d._copy_model_grads_to_main_grads = copy_grads
        d._copy_main_params_to_model_params = copy_mains_to_params
        d._copy_model_params_to_main_params = copy_params_to_mains
        d.state_dict = state_dict
        if get_parameters is not None:
            d.get_parameters = get_parameters
        for name, refusal in refused.items():
            if hasattr(d, name):
                setattr(d, name, refusal)

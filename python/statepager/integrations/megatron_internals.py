"""Every use statepager makes of megatron-core, one function or method per need.

Nothing else in statepager names a Megatron attribute: when Megatron changes, this file and
its contract test (tests/gpu/test_megatron_contract.py, which checks CONTRACT) change.
megatron_version.check_version() refuses, at attach, a megatron-core outside the range these
were written and tested against. Imports megatron lazily (statepager imports without it).
"""
from __future__ import annotations

import functools

import torch

from statepager import _C


# What the methods below use, for the contract test: (module, class or None, name,
# parameter names or None). Instance attributes made in __init__ are checked on a
# built optimizer (INSTANCE_ATTRIBUTES).
CONTRACT = (
    ("megatron.core.optimizer", None, "ChainedOptimizer", None),
    ("megatron.core.optimizer", None, "DistributedOptimizer", None),
    ("megatron.core.optimizer.optimizer", None, "Float16OptimizerWithFloat16Params", None),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params",
     "_copy_model_grads_to_main_grads", ["self"]),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params",
     "_copy_main_params_to_model_params", ["self"]),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params",
     "_copy_model_params_to_main_params", ["self", "state_dict"]),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "zero_grad",
     ["self", "set_to_none"]),
    ("megatron.core.optimizer.emerging_optimizers", None, "TensorParallelMuon", None),
    ("megatron.core.parallel_state", None, "get_data_parallel_world_size",
     ["with_context_parallel"]),
    ("megatron.core.parallel_state", None, "get_expert_data_parallel_world_size", None),
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
    # Every checkpoint format reads and sets the state through these two (megatron_states).
    ("megatron.core.optimizer", "DistributedOptimizer", "_get_main_param_and_optimizer_states",
     ["self", "model_param"]),
    ("megatron.core.optimizer", "DistributedOptimizer", "_set_main_param_and_optimizer_states",
     ["self", "model_param", "tensors"]),
    ("megatron.core.optimizer", "DistributedOptimizer", "sharded_state_dict",
     ["self", "model_sharded_state_dict", "is_loading"]),
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBuffer", "reset", ["self"]),
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup",
     "start_grad_sync", ["self", "force_all_reduce"]),
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup",
     "start_param_sync", ["self", "force_sync"]),
    # Megatron-LM's training calls it; statepager.megatron_lm takes model_chunks from it.
    ("megatron.core.optimizer", None, "get_megatron_optimizer", ["config", "model_chunks"]),
)
# A DistributedOptimizer's methods that get, and that set, param states (megatron_states
# wraps them); one loads behind the accessors' back (refused).
PARAM_STATE_READS = ("save_parameter_state", "get_parameter_state_dp_zero",
                     "get_parameter_state_dp_reshardable")
PARAM_STATE_LOADS = ("load_state_dict", "load_parameter_state") + tuple(
    f"load_parameter_state_from_{f}"
    for f in ("dp_zero", "dp_reshardable", "fs_model_space", "fully_reshardable"))
LEGACY_LOAD = "load_parameter_state_from_dp_zero_legacy"
# ... and those that read a Float16 member's mains behind the pager (refused).
CHECKPOINT_METHODS = ("sharded_state_dict",) + PARAM_STATE_READS + PARAM_STATE_LOADS
CONTRACT += tuple(("megatron.core.optimizer", "DistributedOptimizer", name, None) for name in
                  PARAM_STATE_READS + PARAM_STATE_LOADS + (LEGACY_LOAD, "optimizer_state_keys",
                                                           "offload_to_cpu", "restore_from_cpu"))
INSTANCE_ATTRIBUTES = (
    "optimizer", "config", "ddp_config", "model_float16_groups", "model_fp32_groups",
    "shard_fp32_from_float16_groups", "shard_fp32_groups", "model_param_gbuf_map",
    "buffers", "is_stub_optimizer", "data_parallel_group", "model_param_group_index_map")
# ... on a Float16OptimizerWithFloat16Params, and on the DDP model chunks whose grad buffers
# statepager finds a Float16OptimizerWithFloat16Params' grads in.
MIXED_PRECISION_ATTRIBUTES = ("optimizer", "config", "float16_groups", "fp32_from_float16_groups",
                              "fp32_from_fp32_groups", "is_stub_optimizer")
MODEL_CHUNK_ATTRIBUTES = ("buffers", "expert_parallel_buffers", "ddp_config", "bucket_groups",
                          "expert_parallel_bucket_groups")
BUFFER_ATTRIBUTES = ("grad_data", "extra_main_grads", "params")  # of each grad buffer
BUCKET_GROUP_ATTRIBUTES = ("params",)  # ... and of each bucket group of a model chunk
# ... on a built TensorParallelMuon; its pg_collection's groups (dataclass fields).
MUON_ATTRIBUTES, MUON_GROUPS = ("tp_mode", "pg_collection"), ("tp", "expt_tp", "gtp_remat",
                                                              "expt_gtp_remat")

_OFFLOAD = ("the precision-aware optimizer and optimizer CPU offload keep the state in their "
            "own kernels. Turn use_precision_aware_optimizer and optimizer_cpu_offload off.")


def is_megatron(optimizer) -> bool:
    """Megatron's optimizers, which the adapter attaches (not emerging_optimizers' torch
    optimizers: members' inner ones, attached as torch optimizers)."""
    module = type(optimizer).__module__
    return (module.startswith("megatron.")
            and not module.startswith("megatron.core.optimizer.emerging_optimizers"))


def members(optimizer) -> list:
    """(index among all leaves, member) of each optimizer that `optimizer` steps params
    with: its chain's leaves (ChainedOptimizer's, LayerWiseDistributedOptimizer's, nested)
    in Megatron's step order, or itself; stubs and members without params here left out."""
    return [(i, m) for i, m in enumerate(_leaves(optimizer))
            if not getattr(m, "is_stub_optimizer", False) and _has_params(m)]


def _has_params(member) -> bool:  # False: none on this rank (a layer-wise chain's member)
    inner = getattr(member, "optimizer", None)
    return inner is None or any(g["params"] for g in inner.param_groups)


def _leaves(optimizer) -> list:
    from megatron.core.optimizer import ChainedOptimizer

    if not isinstance(optimizer, ChainedOptimizer):
        return [optimizer]
    return [leaf for m in optimizer.chained_optimizers for leaf in _leaves(m)]


def model_chunks(optimizer) -> list:
    """The DDP model chunks of the chain's distributed and layer-wise optimizers (none for
    a non-distributed chain)."""
    from megatron.core.optimizer import ChainedOptimizer

    found = list(getattr(optimizer, "model_chunks", None) or [])
    if isinstance(optimizer, ChainedOptimizer):
        found += [c for m in optimizer.chained_optimizers for c in model_chunks(m)]
    return list({id(c): c for c in found}.values())


def on_grad_sync_start(chunks, handler) -> None:
    """handler() after each grad-sync start of the DDP model chunks' bucket groups: in the
    last micro-batch's backward as each group's grads are ready (overlap_grad_reduce),
    else all at finish_grad_sync."""
    _wrap_groups(chunks, "start_grad_sync",
                 lambda group, call: lambda *a, **k: (call(*a, **k), handler())[0])


def before_param_gather(chunks, handler) -> None:
    """handler(params) before each bucket group's param all-gather is dispatched, params:
    the model params it gathers. With overlap_param_gather the forward's pre-hook of the
    first module using a group dispatches its (and, once waited for, the next group's);
    without it, the end of the optimizer's step; force_sync (a checkpoint, an eval) now."""
    _wrap_groups(chunks, "start_param_sync",
                 lambda group, call: lambda *a, **k: (handler(group.params), call(*a, **k))[1])


def _wrap_groups(chunks, name: str, wrap) -> None:
    """Sets wrap(group, its method `name`) as `name` on each bucket group instance."""
    for group in (g for c in chunks for g in c.bucket_groups + c.expert_parallel_bucket_groups):
        setattr(group, name, wrap(group, getattr(group, name)))


def view(d, chunks=()) -> "Internals":
    """Megatron's view of member d (members()): a DistributedOptimizer's Internals, else
    a Float16OptimizerWithFloat16Params' MixedPrecisionInternals, whose grad buffers are
    found in `chunks` (model_chunks()); anything else an Internals whose unsupported()
    names it."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    if isinstance(d, Float16OptimizerWithFloat16Params):
        return MixedPrecisionInternals(d, chunks)
    return Internals(d)


def inner_problem(inner) -> str | None:
    """Why statepager cannot page the inner torch optimizer `inner` of a Megatron member,
    with the fix; None for those it steps exactly in buckets: torch's Adam, AdamW, SGD, and
    TensorParallelMuon (in whole matrices: Newton-Schulz needs each one whole)."""
    name = f"{type(inner).__module__}.{type(inner).__qualname__}"
    if type(inner) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        return None
    if name == "megatron.core.optimizer.emerging_optimizers.TensorParallelMuon":
        return _muon_problem(inner, name)
    known = {
        "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam":
            "Transformer Engine's FusedAdam counts its step per param group and call, which "
            "a step in buckets would advance once per bucket, and it is untested here. Run "
            "without Transformer Engine's optimizers (megatron-core falls back to "
            "torch.optim.AdamW when transformer_engine.pytorch.optimizers does not import)",
        "megatron.core.optimizer.emerging_optimizers.TensorParallelAdaptiveMuon":
            "its step fails in emerging-optimizers 0.3.0 (AdaptiveMuon's scale_mode is never "
            "set). Use --optimizer muon",
        "emerging_optimizers.soap.soap.SOAP":
            "SOAP replaces its state tensors at every step, and the pager holds state at "
            "fixed addresses. Use --optimizer muon or adam",
    }
    why = known.get(name) or (
        "statepager has not been checked against it (it pages torch's Adam, AdamW and SGD and "
        "Megatron's TensorParallelMuon). Use one of those, or leave this optimizer unattached")
    return f"its inner optimizer is a {name}: {why}."


def _muon_problem(muon, name: str) -> str | None:
    """Why TensorParallelMuon `muon` cannot step in buckets: a matrix spanning ranks (its
    tp_mode not "blockwise" over several tensor-parallel ranks, or a GTP-remat group) is
    gathered in collectives, one per matrix in step order, untested in buckets."""
    groups = muon.pg_collection
    wide = [g for g in MUON_GROUPS  # blockwise: each rank orthogonalizes its own block
            if (muon.tp_mode != "blockwise" or "gtp" in g)
            and getattr(groups, g, None) is not None
            and torch.distributed.get_world_size(getattr(groups, g)) > 1]
    if not wide:
        return None
    return (f"its inner optimizer is a {name} whose matrices span the ranks of its "
            f"{', '.join(wide)} group (tp_mode {muon.tp_mode!r}): Newton-Schulz gathers each "
            "matrix in collectives across that group, untested in buckets. Use --muon-tp-mode "
            "blockwise (Megatron's default: each rank its own block), or tensor-parallel size 1.")


def override_step(optimizer, step):
    """Sets `optimizer`'s step() (the training loop's) on the instance; returns the old."""
    previous, optimizer.step = optimizer.step, step
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

        if isinstance(self.d, HybridDeviceOptimizer):
            return _OFFLOAD
        if not isinstance(self.d, DistributedOptimizer):
            return (f"it is a {type(self.d).__name__}. Use the distributed optimizer "
                    "(OptimizerConfig.use_distributed_optimizer=True), or bf16 params "
                    "(a Float16OptimizerWithFloat16Params: non-distributed and layer-wise "
                    "chains).")
        return self._config_problem(self.d.ddp_config) or self._params_problem()

    def _config_problem(self, ddp) -> str | None:
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import (
            HybridDeviceOptimizer)

        cfg = self.d.config
        if getattr(ddp, "use_megatron_fsdp", False):
            return "Megatron-FSDP manages the optimizer state itself. Turn use_megatron_fsdp off."
        if cfg.use_precision_aware_optimizer or getattr(cfg, "optimizer_cpu_offload", False) \
                or isinstance(self.inner, HybridDeviceOptimizer):
            return _OFFLOAD
        if getattr(ddp, "fp8_param_gather", False) or getattr(ddp, "fp4_param_gather", False) \
                or getattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
            return ("fp8/fp4 param gather (incl. the MXFP8 grad-buffer reuse) is not "
                    "supported. Train with bf16 or fp16 params.")
        return inner_problem(self.inner)

    def _params_problem(self) -> str | None:
        cfg = self.d.config
        if any(not hasattr(m, "main_grad") for m, _ in self.float16_params() + self.fp32_params()):
            return ("a model param has no main_grad: the model is not wrapped in Megatron's "
                    "DistributedDataParallel. Wrap each model chunk in it before building "
                    "the optimizer.")
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

    def buffers(self) -> list:
        """The DDP grad buffers holding d's model params' main grads."""
        return list(self.d.buffers)

    state_dict_holds_state = False  # d.state_dict() holds no mains or inner state

    # -- parameters ----------------------------------------------------------------------

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps the mains."""
        return self.d.optimizer

    def _groups(self) -> tuple[list, list, list]:
        """d's per-param-group lists: the bf16/fp16 model params, their fp32 mains, and
        the native fp32 model params."""
        return (self.d.model_float16_groups, self.d.shard_fp32_from_float16_groups,
                self.d.model_fp32_groups)

    def float16_params(self) -> list:
        """(model param, its fp32 main) of each bf16/fp16 model parameter of d."""
        models, mains, _ = self._groups()
        return [(m, main) for ms, mains_ in zip(models, mains) for m, main in zip(ms, mains_)]

    def fp32_params(self) -> list:
        """(model param, its fp32 shard) of each native fp32 model parameter of d."""
        return [(m, shard) for models, shards in zip(self.d.model_fp32_groups,
                                                      self.d.shard_fp32_groups)
                for m, shard in zip(models, shards)]

    def main_of(self, model_param) -> torch.Tensor:
        """What d's inner optimizer steps for model_param (its main, or an fp32 shard)."""
        group, order = self.d.model_param_group_index_map[model_param]
        return self.d.optimizer.param_groups[group]["params"][order]

    def state_keys(self) -> tuple:
        """The tensor state entries d's inner optimizer keeps per main (Adam: 2 moments)."""
        return tuple(self.d.optimizer_state_keys)

    def replace_mains(self, replace) -> dict:
        """Each main for which replace(main) returns a tensor is replaced by it in Megatron's
        groups and model_param.main_param: {id(old): new} (the inner optimizer's: the caller's)."""
        moved = {}
        model_groups, main_groups, _ = self._groups()
        for models, mains in zip(model_groups, main_groups):
            for i, (model_param, main) in enumerate(zip(models, mains)):
                new = replace(main)
                if new is not None:
                    moved[id(main)] = mains[i] = model_param.main_param = new
        return moved

    def is_expert(self) -> bool:
        """Whether d steps expert-parallel parameters (not all-reduced over all ranks)."""
        models, _, fp32 = self._groups()
        return any(not getattr(p, "allreduce", True) for group in models + fp32 for p in group)

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

    def copy_grads_as_megatron(self) -> None:  # Megatron's own model-grads-to-main-grads
        type(self.d)._copy_model_grads_to_main_grads(self.d)

    def state_dict_as_megatron(self) -> dict:
        return type(self.d).state_dict(self.d)

    def zero_grad_as_megatron(self, *args, **kwargs) -> None:
        type(self.d).zero_grad(self.d, *args, **kwargs)

    def on_grads_zeroed(self, handler) -> None:
        """Each of d's grad buffers (shared with the DDP model) zeroed by handler(buffer,
        reset) in place of reset(), which the loop's model.zero_grad_buffer() calls."""
        for buffer in self.buffers():
            buffer.reset = functools.partial(handler, buffer, buffer.reset)

    @staticmethod
    def zero_grads_but(buffer, kept: list) -> None:
        """buffer.reset() but for the main grads of the model params `kept` (views into
        its grad data, or extra main grads of its own)."""
        data = buffer.grad_data.view(-1)
        base, size = data.data_ptr(), data.element_size()
        at, spans = 0, sorted(((g.data_ptr() - base) // size, (g.data_ptr() - base) // size
                               + g.numel()) for g in (p.main_grad for p in kept)
                              if base <= g.data_ptr() < base + data.numel() * size)
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

    def overlaps_param_gather(self) -> bool:  # DDP all-gathers params in the forward's hooks
        return bool(self.d.ddp_config.overlap_param_gather)

    def override(self, *, copy_grads, copy_mains_to_params, copy_params_to_mains,
                 state_dict, zero_grad, get_parameters=None, param_states=None,
                 refused: dict) -> None:
        """Sets d's methods on the instance (never its class): the hooks step_with_ready_grads
        and reload_model_params call, state_dict (unless None), zero_grad, get_parameters,
        the param-state accessors (answer_param_states), refusals ({name: refusal})."""
        d = self.d
        if param_states is not None:
            answer_param_states(d, param_states)
        d.zero_grad = zero_grad
        d._copy_model_grads_to_main_grads = copy_grads
        d._copy_main_params_to_model_params = copy_mains_to_params
        d._copy_model_params_to_main_params = copy_params_to_mains
        if state_dict is not None:
            d.state_dict = state_dict
        if get_parameters is not None:
            d.get_parameters = get_parameters
        for name, refusal in refused.items():
            if hasattr(d, name):
                setattr(d, name, refusal)


def answer_param_states(d, states) -> None:
    """d's param-state accessors (every checkpoint format's) answered by `states`."""
    d._get_main_param_and_optimizer_states = states.get
    d._set_main_param_and_optimizer_states = states.set
    for name in PARAM_STATE_LOADS + PARAM_STATE_READS:  # the methods that call them
        wrap = states.loading if name in PARAM_STATE_LOADS else states.reading
        setattr(d, name, wrap(getattr(d, name)))
    d.sharded_state_dict = states.sharding(d.sharded_state_dict)


class MixedPrecisionInternals(Internals):
    """Megatron's view of one Float16OptimizerWithFloat16Params `d` (of a non-distributed
    or layer-wise chain): each bf16 model param this rank steps is whole, its fp32 main
    shaped like it (a "shard" is the whole param), the mains copied into the params."""

    state_dict_holds_state = True

    def __init__(self, d, chunks=()):
        super().__init__(d)
        self._chunks = list(chunks)

    def unsupported(self) -> str | None:
        ddp = next((c.ddp_config for c in self._chunks), None)
        return self._config_problem(ddp) or self._params_problem()

    def _groups(self) -> tuple[list, list, list]:
        return self.d.float16_groups, self.d.fp32_from_float16_groups, self.d.fp32_from_fp32_groups

    def fp32_params(self) -> list:
        """(model param, itself) of each native fp32 model param: stepped in place."""
        return [(p, p) for group in self.d.fp32_from_fp32_groups for p in group]

    def shard(self, model_param, whole: torch.Tensor | None = None) -> torch.Tensor:
        """`whole` (default model_param itself, detached), shaped like the main."""
        return (model_param if whole is None else whole).detach().view(model_param.shape)

    def grad_shard(self, model_param) -> torch.Tensor:
        return model_param.main_grad

    def param_buffer_slice(self, model_param) -> torch.Tensor:
        """The model param itself (Megatron's main-to-model copy writes it)."""
        return model_param.detach()

    def state_dict_params(self, state_dict) -> dict:
        raise _C.UsageError(
            "reload_model_params(state_dict) with a Float16OptimizerWithFloat16Params: Megatron "
            "does not initialize its mains from a state dict either. Load the model's weights "
            "into the model, then call reload_model_params()")

    def buffers(self) -> list:
        """The grad buffers of the chain's model chunks that hold d's params' grads."""
        mine = {id(p) for p, _ in self.float16_params() + self.fp32_params()}
        return [b for c in self._chunks for b in c.buffers + c.expert_parallel_buffers
                if any(id(p) in mine for p in b.params)]

    def data_parallel_size(self) -> int:
        """The data-parallel ranks (expert ones for an expert member) its grads are
        all-reduced over (the layer-wise chain all-gathers its params over them)."""
        from megatron.core import parallel_state

        if self.is_expert():
            return parallel_state.get_expert_data_parallel_world_size()
        return parallel_state.get_data_parallel_world_size(with_context_parallel=True)

    def overlaps_param_gather(self) -> bool:
        return bool(getattr(self.d.config, "overlap_param_gather", False))

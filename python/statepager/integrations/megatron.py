"""Megatron-core drop-in: Pager.attach() of a DistributedOptimizer or ChainedOptimizer.

    pager = statepager.Pager(directory=..., device="cuda", hbm_budget=...)
    with pager.scope():
        optimizer = get_megatron_optimizer(config, model_chunks)
    pager.attach(optimizer)

Nothing in Megatron changes; a few methods are bound on each DistributedOptimizer
instance (never on its class):
- its inner torch optimizer steps bucket by bucket (statepager.stream); each bucket's
  updated mains are copied into the DDP param buffer as soon as it is stepped, and the
  param all-gather then runs exactly as Megatron decides it (step_with_ready_grads is
  Megatron's own);
- bf16 grads are upcast per bucket inside the step, never as a whole-model fp32 copy.
  For the grad norm and clipping, which Megatron computes over `.grad` of every main
  before the step, each paged main is represented by a one-element "norm carrier"
  whose grad is that main's fp32 grad norm, and a "clip probe" (a parameter marked
  shared, so outside the norm) whose grad of 1 comes back scaled by Megatron's clip
  coefficient; the step applies that coefficient to the upcast grads. fp32 grads
  (grad_reduce_in_fp32) are used in place, as upstream does;
- native fp32 params (views of an fp32 param buffer) keep their state resident;
- a step that raises is undone (statepager.atomic): mains and moments return to their
  bytes of before it, and so does the DDP param buffer, rewritten from the restored mains
  (`_shard16`, the same memory as the buffer's slice; with residual mains from undo
  copies). Each member is undone on its own: in a ChainedOptimizer, members that
  Megatron stepped before the failing one stay stepped;
- reload_model_params refreshes the mains through the pager; checkpoint methods that
  would read the state behind the pager's back are refused with what to use instead
  (Pager.save_to / load_from), and offload_to_cpu / restore_from_cpu point to
  Pager.pause / resume.

Each DistributedOptimizer of a ChainedOptimizer is its own binding, named
"<index>-dense" or "<index>-expert" (stable across runs of the same model), with its own
store, <the rank's pager directory>/<name>/; all share the rank's Pager (one page pool,
one HBM budget, one I/O ring).
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch

from statepager import _C
from statepager.core.pager import MiB

_REFUSED_CHECKPOINT_METHODS = (
    "sharded_state_dict", "load_state_dict", "save_parameter_state",
    "load_parameter_state", "get_parameter_state_dp_zero",
    "get_parameter_state_dp_reshardable", "load_parameter_state_from_dp_zero",
    "load_parameter_state_from_dp_reshardable", "load_parameter_state_from_fs_model_space",
    "load_parameter_state_from_fully_reshardable",
)


def attach(pager, optimizer, *, bucket_size: int = 256 * MiB, depth: int = 3,
           log_steps: bool = False, moments: str = "fp32", mains: str = "fp32"):
    """Streams every DistributedOptimizer in `optimizer` through `pager`. Returns the
    MegatronBinding; refuses (UsageError) configurations it cannot page exactly."""
    from megatron.core.optimizer import ChainedOptimizer

    members = (optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer)
               else [optimizer])
    live = [(i, m) for i, m in enumerate(members) if not getattr(m, "is_stub_optimizer", False)]
    for _, m in live:
        _check_supported(m)
    binding = MegatronBinding(optimizer)
    for i, m in live:
        binding.members.append(_Member(pager, m, f"{i}-{_kind(m)}", bucket_size=bucket_size,
                                       depth=depth, log_steps=log_steps, moments=moments,
                                       mains=mains))
    return binding


@dataclass
class MegatronBinding:
    """The bindings of one Megatron optimizer: one StreamedOptimizer per member."""

    optimizer: object
    members: list = field(default_factory=list)

    @property
    def streams(self) -> list:
        return [m.stream for m in self.members]

    @property
    def last(self) -> list:
        """StepStats of the last step, one per member."""
        return [m.stream.last for m in self.members]


def _kind(d) -> str:
    expert = any(not getattr(p, "allreduce", True)
                 for group in d.model_float16_groups + d.model_fp32_groups for p in group)
    return "expert" if expert else "dense"


def _refuse(what: str, instead: str):
    raise _C.UsageError(f"statepager cannot page this Megatron optimizer: {what}. {instead}")


def _check_supported(d) -> None:
    from megatron.core.optimizer import DistributedOptimizer
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    if not isinstance(d, DistributedOptimizer):
        _refuse(f"it is a {type(d).__name__}",
                "Use the distributed optimizer (OptimizerConfig.use_distributed_optimizer=True).")
    cfg, ddp = d.config, d.ddp_config
    if getattr(ddp, "use_megatron_fsdp", False):
        _refuse("Megatron-FSDP manages the optimizer state itself", "Turn use_megatron_fsdp off.")
    if cfg.use_precision_aware_optimizer or getattr(cfg, "optimizer_cpu_offload", False) \
            or isinstance(d.optimizer, HybridDeviceOptimizer):
        _refuse("the precision-aware optimizer and optimizer CPU offload keep the state in "
                "their own kernels", "Turn use_precision_aware_optimizer and "
                "optimizer_cpu_offload off; statepager takes their place.")
    if getattr(ddp, "fp8_param_gather", False) or getattr(ddp, "fp4_param_gather", False) \
            or getattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
        _refuse("fp8/fp4 param gather (incl. the MXFP8 grad-buffer reuse) is not supported",
                "Train with bf16 or fp16 params.")
    for p in (p for group in d.model_float16_groups for p in group):
        if type(p) is not torch.nn.Parameter:  # TE's fp8 / NVFP4 tensors are subclasses
            _refuse(f"a parameter is a {type(p).__name__}", "Train with bf16 or fp16 params.")
    grads16 = any(_grad_dtype(p) != torch.float32
                  for group in d.model_float16_groups for p in group)
    if grads16 and cfg.fp16:
        _refuse("fp16 training unscales fp16 grads in place before the step",
                "Set grad_reduce_in_fp32=True in the DDP config.")
    if grads16 and cfg.log_num_zeros_in_grad:
        _refuse("log_num_zeros_in_grad counts zeros in whole-model fp32 grads",
                "Turn log_num_zeros_in_grad off, or set grad_reduce_in_fp32=True.")


def _grad_dtype(model_param) -> torch.dtype:
    return model_param.main_grad.dtype


class _Member:
    """One DistributedOptimizer streamed through the pager."""

    def __init__(self, pager, d, name: str, **options):
        self.pager, self.d = pager, d
        self._adopt_mains()
        self.model_of: dict[int, torch.nn.Parameter] = {}  # main -> model param
        for models, mains in zip(d.model_float16_groups, d.shard_fp32_from_float16_groups):
            for model_param, main in zip(models, mains):
                self.model_of[id(main)] = model_param
        self.bf16_grads = any(_grad_dtype(p) != torch.float32 for p in self.model_of.values())
        # True from a streamed inner step until Megatron's main->param copy that follows it
        # in step_with_ready_grads: the step already copied each bucket's mains.
        self.mains_copied = False
        self._clip = {}       # grad-norm group -> clip coefficient of this step
        self._carriers = {}   # main -> its norm carrier (bf16 grads only)
        self._probes = {}     # grad-norm group -> clip probe (bf16 grads only)
        self._norm_group = {}  # main -> its grad-norm group (bf16 grads only)
        if self.bf16_grads:
            self._make_carriers()
        self.stream = pager.attach(
            d.optimizer, name=name, before_bucket=self._grads_in, after_bucket=self._mains_out,
            keep_resident=lambda p: not pager.owns(p), model_param=self._shard16, **options)
        self._bind()

    # -- setup -------------------------------------------------------------------------

    def _adopt_mains(self) -> None:
        """Mains built outside Pager.scope() move into the pager, keeping their
        attributes; Megatron's references to each (its groups, the inner optimizer's
        param groups and state, model_param.main_param) are repointed."""
        d, pager = self.d, self.pager
        moved = {}
        for models, mains in zip(d.model_float16_groups, d.shard_fp32_from_float16_groups):
            for i, (model_param, main) in enumerate(zip(models, mains)):
                if pager.owns(main):
                    continue
                paged = pager.empty_like(main)
                pager.page_in(paged)
                with torch.no_grad():
                    paged.copy_(main)
                pager.page_out(paged)
                paged.__dict__.update(main.__dict__)
                moved[id(main)] = mains[i] = model_param.main_param = paged
        inner = d.optimizer
        for group in inner.param_groups:
            for i, p in enumerate(group["params"]):
                if id(p) in moved:
                    group["params"][i] = moved[id(p)]
                    if p in inner.state:
                        inner.state[moved[id(p)]] = inner.state.pop(p)

    def _make_carriers(self) -> None:
        from megatron.core.optimizer.optimizer import _get_param_grad_norm_group

        device = next(iter(self.model_of.values())).device
        for mains in self.d.shard_fp32_from_float16_groups:
            for main in mains:
                carrier = torch.zeros(1, device=device)
                carrier.__dict__.update(main.__dict__)
                self._carriers[id(main)] = carrier
                group = self._norm_group[id(main)] = _get_param_grad_norm_group(main)
                if group not in self._probes:
                    probe = torch.zeros(1, device=device)
                    probe.__dict__.update(main.__dict__)
                    probe.shared = True  # clipped, but outside the norm
                    self._probes[group] = probe

    def _bind(self) -> None:
        d = self.d
        d._copy_model_grads_to_main_grads = types.MethodType(_copy_grads, self)
        d._copy_main_params_to_model_params = types.MethodType(_copy_mains_to_params, self)
        d._copy_model_params_to_main_params = types.MethodType(_reload_mains, self)
        d.state_dict = types.MethodType(_state_dict, self)
        if self.bf16_grads:
            d.get_parameters = types.MethodType(_parameters_with_carriers, self)
        for method in _REFUSED_CHECKPOINT_METHODS:
            if hasattr(d, method):
                setattr(d, method, _refusal(method, "statepager holds this optimizer's "
                        "state: save it with pager.save_to(base) and load it with "
                        "pager.load_from(base) (run Megatron with --no-save-optim "
                        "--no-load-optim for its own checkpoints)"))
        for method in ("offload_to_cpu", "restore_from_cpu"):
            setattr(d, method, _refusal(method, "the state is already off the GPU between "
                    "steps; to return the pool's memory use pager.pause() and pager.resume()"))
        inner_step = d.optimizer.step

        def step(*args, **kwargs):
            self.mains_copied = False
            self._read_clip()
            result = inner_step(*args, **kwargs)
            self.mains_copied = True
            return result

        d.optimizer.step = step

    # -- per step ------------------------------------------------------------------------

    def _grad16(self, main) -> torch.Tensor:
        """The main's slice of its model param's (reduce-scattered) grad."""
        model_param = self.model_of[id(main)]
        r = self.d._get_model_param_range_map(model_param)["param"]
        return model_param.main_grad.view(-1)[r.start:r.end]

    def _shard16(self, main) -> torch.Tensor:
        """The main's slice of its bf16 model param (what the residual format builds on)."""
        model_param = self.model_of[id(main)]
        r = self.d._get_model_param_range_map(model_param)["param"]
        return model_param.detach().view(-1)[r.start:r.end]

    def _param_buffer_slice(self, model_param) -> torch.Tensor:
        r = self.d._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
        gbuf, _, bucket = self.d.model_param_gbuf_map[model_param]
        return self.d.buffers[gbuf].buckets[bucket].param_data.view(-1)[r.start:r.end]

    def _read_clip(self) -> None:
        """Megatron's clip coefficient of this step, as it scaled each probe's grad."""
        self._clip = {}
        for group, probe in self._probes.items():
            if probe.grad is not None:
                coeff = probe.grad.item()
                if coeff != 1.0:
                    self._clip[group] = coeff

    def _grads_in(self, params) -> None:
        if not self.bf16_grads:
            return  # fp32 grads: Megatron set main.grad to the buffer's view, in place
        for main in params:
            if id(main) not in self.model_of:
                continue
            grad = self._grad16(main).float()
            coeff = self._clip.get(self._norm_group[id(main)])
            if coeff is not None:
                grad.mul_(coeff)  # what Megatron's clip does to an fp32 grad
            main.grad = grad

    @torch.no_grad()
    def _mains_out(self, params) -> None:
        for main in params:
            model_param = self.model_of.get(id(main))
            if model_param is None:
                continue
            self._param_buffer_slice(model_param).copy_(main)
            if self.bf16_grads:
                main.grad = None


def _copy_grads(self: _Member, *_) -> None:
    """Megatron's model-grads-to-main-grads, with bf16 grads left in the grad buffer:
    the mains' norm carriers get the fp32 grad norms, the probes a grad of one."""
    d = self.d
    if not self.bf16_grads:
        return type(d)._copy_model_grads_to_main_grads(d)
    for models, shards in zip(d.model_fp32_groups, d.shard_fp32_groups):
        for model_param, shard in zip(models, shards):
            r = d._get_model_param_range_map(model_param)["param"]
            shard.grad = model_param.main_grad.view(-1)[r.start:r.end].float()
    for mains in d.shard_fp32_from_float16_groups:
        for main in mains:
            main.grad = None
            self._carriers[id(main)].grad = torch.norm(self._grad16(main).float()).reshape(1)
    for probe in self._probes.values():
        probe.grad = torch.ones(1, device=probe.device)


def _parameters_with_carriers(self: _Member) -> list:
    """get_parameters() as Megatron's norm and clip code sees it: each paged main stands
    in as its norm carrier, and the clip probes come last."""
    params = [self._carriers.get(id(p), p)
              for group in self.d.optimizer.param_groups for p in group["params"]]
    return params + list(self._probes.values())


@torch.no_grad()
def _copy_mains_to_params(self: _Member, *_) -> None:
    """Mains into the DDP param buffer. Right after a streamed step (Megatron's
    step_with_ready_grads calls this after the inner step) the paged mains were copied
    bucket by bucket already: paging them in again would read the whole state a second
    time. Elsewhere they are paged in to copy."""
    d = self.d
    for models, shards in zip(d.model_fp32_groups, d.shard_fp32_groups):
        for model_param, shard in zip(models, shards):
            self._param_buffer_slice(model_param).copy_(shard)
    if self.mains_copied:
        self.mains_copied = False
        return
    for bucket in self.stream.state_in_buckets():
        self._mains_out(bucket.params)


@torch.no_grad()
def _reload_mains(self: _Member, state_dict=None) -> None:
    """reload_model_params: mains rebuilt from the model params (or from `state_dict`'s
    tensors in their place), bucket by bucket through the pager."""
    d = self.d
    source = d._build_model_param_to_state_dict_param_map(state_dict) if state_dict else {}

    def shard_of(model_param):
        r = d._get_model_param_range_map(model_param)["param"]
        return source.get(model_param, model_param).view(-1)[r.start:r.end]

    for models, shards in zip(d.model_fp32_groups, d.shard_fp32_groups):
        for model_param, shard in zip(models, shards):
            shard.copy_(shard_of(model_param))
    for bucket in self.stream.state_in_buckets(rebuild_mains=True):
        for main in bucket.params:
            model_param = self.model_of.get(id(main))
            if model_param is not None:
                main.copy_(shard_of(model_param))


def _state_dict(self: _Member):
    """Megatron's state_dict() holds no parameter state (it reads only the step counters
    and param groups), so torch's own state_dict, which references the paged tensors
    without reading them, serves it."""
    inner = self.d.optimizer
    paged = inner.state_dict
    inner.state_dict = types.MethodType(type(inner).state_dict, inner)
    try:
        return type(self.d).state_dict(self.d)
    finally:
        inner.state_dict = paged


def _refusal(method: str, instead: str):
    def refuse(*_, **__):
        raise _C.UsageError(f"{method}() is not available on a statepager-attached Megatron "
                            f"optimizer: {instead}.")
    return refuse

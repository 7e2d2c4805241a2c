"""statepager's options on Megatron-LM's command line (--statepager-*, one argument group
in Megatron's --help) and in the environment (STATEPAGER_*, for launchers that build the
command line themselves), and the Megatron flags statepager refuses.

A flag on the command line wins over its environment variable; an environment variable
gives the flag's default. Bad values are refused with a message naming the flag or the
variable and what is allowed.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from statepager._C import UsageError
from statepager.core.args import parse_size

MOMENTS = ("fp32", "bf16", "q8")
MAINS = ("fp32", "residual")
ATOMIC = ("bucket", "step", "off")  # attach(atomic=): "bucket", "step", False
ON_OFF = ("off", "on")
OPTIMIZER_CHECKPOINT = ("statepager", "megatron")  # who saves the optimizer's state


class RefusedConfiguration(UsageError):
    """The run's options or Megatron flags are ones statepager cannot serve; nothing has
    started yet."""


@dataclass(frozen=True)
class Options:
    """How statepager pages a Megatron-LM run's optimizer (Pager and attach arguments)."""

    directory: str                  # the rank's store; "{rank}" becomes the global rank
    hbm_budget: int | None = None   # bytes of device memory the pool may hold
    host_budget: int = 0            # bytes of pinned host memory between HBM and the store
    page_size: int | None = None    # None: chosen from the device and hbm_budget
    bucket_size: int | None = None  # None (and depth): chosen to fit hbm_budget
    depth: int | None = None
    stationary_bytes: int = 0       # the first buckets' stored forms kept mapped
    moments: str = "fp32"
    mains: str = "fp32"
    atomic: str = "bucket"          # ATOMIC; attach_atomic() gives attach()'s value
    overlap_forward: str = "off"    # ON_OFF: steps under the next forward
    step_thread: str = "off"        # ON_OFF: ... on a thread of their own
    optimizer_checkpoint: str = "statepager"  # OPTIMIZER_CHECKPOINT

    def attach_atomic(self) -> str | bool:
        return False if self.atomic == "off" else self.atomic


# flag (without --statepager-), environment variable, Options field, parse, help
_FLAGS = (
    ("dir", "STATEPAGER_DIR", "directory", str,
     "this rank's store directory, on local NVMe; {rank} becomes the global rank "
     "(e.g. /nvme/sp-{rank}). Turns statepager on"),
    ("hbm-budget", "STATEPAGER_HBM_BUDGET", "hbm_budget", "size",
     "device memory the page pool may hold, e.g. 8G (default: unbounded)"),
    ("host-budget", "STATEPAGER_HOST_BUDGET", "host_budget", "size",
     "pinned host memory that keeps paged-out state between HBM and the store files, e.g. "
     "64G; above it the least needed state goes to the store (default: none)"),
    ("page-size", "STATEPAGER_PAGE_SIZE", "page_size", "size",
     "bytes per physical page, a multiple of 2M (default: chosen from hbm_budget, up to "
     "256M)"),
    ("bucket-size", "STATEPAGER_BUCKET_SIZE", "bucket_size", "size",
     "optimizer state per streamed bucket, e.g. 256M (default: chosen to fit "
     "hbm_budget, up to 512M)"),
    ("depth", "STATEPAGER_DEPTH", "depth", "depth",
     "the step's window in buckets: the pages of this many consecutive buckets, at "
     "least 2 (default: 4, fewer to fit hbm_budget)"),
    ("stationary-bytes", "STATEPAGER_STATIONARY_BYTES", "stationary_bytes", "size",
     "optimizer state that stays on the device between steps, within hbm_budget: the "
     "first buckets up to this many bytes at rest are never paged out, e.g. 2G (default: "
     "none; needs --statepager-atomic bucket or off)"),
    ("moments", "STATEPAGER_MOMENTS", "moments", MOMENTS,
     "on-disk format of Adam's moments: fp32 (default, exact), bf16 or q8"),
    ("mains", "STATEPAGER_MAINS", "mains", MAINS,
     "on-disk format of the fp32 master weights: fp32 (default) or residual (lossless, "
     "about 2 bytes per parameter)"),
    ("atomic", "STATEPAGER_ATOMIC", "atomic", ATOMIC,
     "what a step that fails leaves: bucket (default: each bucket stepped or not, the "
     "next step finishes it), step (all or nothing; the host tier needs twice the state) "
     "or off (in place)"),
    ("overlap-forward", "STATEPAGER_OVERLAP_FORWARD", "overlap_forward", ON_OFF,
     "on: each step ends under the next forward, each bucket stepped before the first "
     "layer that uses it (more than one data-parallel rank needs --overlap-param-gather; "
     "default off)"),
    ("step-thread", "STATEPAGER_STEP_THREAD", "step_thread", ON_OFF,
     "on (with --statepager-overlap-forward on): the buckets step on a thread of their "
     "own while the forward runs, each layer waiting only until its buckets are stepped "
     "(default off)"),
    ("optimizer-checkpoint", "STATEPAGER_OPTIMIZER_CHECKPOINT", "optimizer_checkpoint",
     OPTIMIZER_CHECKPOINT,
     "who saves and loads the optimizer state: statepager (default: the store's ranges "
     "copied beside Megatron's checkpoint, stored formats kept; loads at the same layout) "
     "or megatron (Megatron's own optimizer checkpoint, read and set through the pager in "
     "fp32: loads at another data-parallel size and from runs without statepager)"),
)


_METAVARS = {str: "DIR", "size": "SIZE", "depth": "N"}


def _parse(kind, text: str):
    """`text` as the flag's value; ValueError with what is allowed."""
    if kind is str:
        if not text:
            raise ValueError("an empty path")
        return text
    if kind == "size":
        try:
            n = parse_size(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a size: give a number with an optional unit K, "
                             "M, G or T (binary), e.g. 512M or 8G") from None
        if n <= 0:
            raise ValueError(f"{text!r} is {n} bytes: it must be more than 0")
        return n
    if kind == "depth":
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a whole number") from None
        if n < 2:
            raise ValueError(f"{n} is too small: one bucket steps while the next is in flight "
                             "(at least 2)")
        return n
    if text not in kind:
        raise ValueError(f"{text!r} is not one of {', '.join(kind)}")
    return text


def _argparse_type(kind):
    def convert(text: str):
        try:
            return _parse(kind, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = "size" if kind == "size" else "value"
    return convert


def add_arguments(parser: argparse.ArgumentParser, environ=os.environ) -> None:
    """The statepager group, each flag defaulting to its environment variable when set.
    RefusedConfiguration for an environment variable with a bad value."""
    group = parser.add_argument_group(
        "statepager", "optimizer state paged to local NVMe by statepager (python -m "
        "statepager.megatron_lm). Each flag can instead be set by the environment "
        "variable shown.")
    for flag, var, field, kind, text in _FLAGS:
        default = None
        if environ.get(var):
            try:
                default = _parse(kind, environ[var])
            except ValueError as e:
                raise RefusedConfiguration(f"environment variable {var}: {e}") from None
        group.add_argument(f"--statepager-{flag}", dest=f"statepager_{field}",
                           default=default, type=_argparse_type(kind),
                           metavar=_METAVARS.get(kind) or "{" + ",".join(kind) + "}",
                           help=f"{text} [env {var}]")


def options_from(args) -> Options:
    """The Options in Megatron's parsed arguments (after add_arguments);
    RefusedConfiguration when no store directory was given."""
    values = {field: getattr(args, f"statepager_{field}", None) for _, _, field, _, _ in _FLAGS}
    if not values["directory"]:
        raise RefusedConfiguration(
            "statepager.megatron_lm needs a store directory: pass --statepager-dir "
            "/nvme/sp-{rank} (or set STATEPAGER_DIR)")
    return Options(**{k: v for k, v in values.items() if v is not None})


# (flag, test of Megatron's parsed arguments, why and what to do)
_REFUSED = (
    ("--use-megatron-fsdp", lambda a: _on(a, "use_megatron_fsdp"),
     "Megatron-FSDP manages the optimizer state itself: drop it"),
    ("--use-torch-fsdp2", lambda a: _on(a, "use_torch_fsdp2"),
     "FSDP2 shards the optimizer state itself: drop it"),
    ("--use-precision-aware-optimizer", lambda a: _on(a, "use_precision_aware_optimizer"),
     "its kernels keep the state themselves: drop it (statepager's --statepager-moments "
     "and --statepager-mains take its place)"),
    ("--optimizer-cpu-offload", lambda a: _on(a, "optimizer_cpu_offload"),
     "statepager keeps the state off the GPU instead: drop it"),
    ("--optimizer-cuda-graph", lambda a: _on(a, "optimizer_cuda_graph"),
     "a captured step cannot page buckets: drop it"),
    ("--fp8-param-gather", lambda a: _on(a, "fp8_param_gather"),
     "fp8 params are not paged: drop it (--fp8 compute with bf16 params is fine)"),
    ("--fp4-param-gather", lambda a: _on(a, "fp4_param_gather"),
     "fp4 params are not paged: drop it"),
    ("--reuse-grad-buf-for-mxfp8-param-ag",
     lambda a: _on(a, "reuse_grad_buf_for_mxfp8_param_ag"), "it needs fp8 params: drop it"),
    ("--fp16", lambda a: _on(a, "fp16"),
     "the loss scaler's state lives in Megatron's optimizer checkpoint, which statepager "
     "replaces: train with --bf16"),
    ("--log-num-zeros-in-grad",
     lambda a: (_on(a, "log_num_zeros_in_grad")
                and not _on(a, "accumulate_allreduce_grads_in_fp32")),
     "it counts zeros in whole-model fp32 grads, which statepager never builds: drop it, "
     "or add --accumulate-allreduce-grads-in-fp32"),
    ("--ckpt-format", lambda a: ((_on(a, "save") or _on(a, "load"))
                                 and getattr(a, "ckpt_format", "torch_dist") != "torch_dist"),
     "statepager saves beside torch_dist checkpoints only: use --ckpt-format torch_dist "
     "(the default)"),
    ("--non-persistent-save-interval", lambda a: _on(a, "non_persistent_save_interval"),
     "non-persistent checkpoints are not saved with statepager's state: drop it"),
    ("--moe-use-upcycling", lambda a: _on(a, "moe_use_upcycling"),
     "upcycling saves a checkpoint without the optimizer: run it without statepager"),
    ("--load-main-params-from-ckpt", lambda a: _on(a, "load_main_params_from_ckpt"),
     "statepager loads the master weights from its own checkpoint: drop it"),
    ("--muon-tp-mode", lambda a: (getattr(a, "optimizer", None) == "muon"
                                  and getattr(a, "muon_tp_mode", "blockwise") != "blockwise"
                                  and _tensor_parallel(a) > 1),
     "Muon's duplicated and distributed modes gather each matrix across the "
     "tensor-parallel ranks in collectives, which statepager has not been tested to keep "
     "in order: use --muon-tp-mode blockwise (the default), or tensor-parallel size 1"),
    ("--rl-offload-optimizer-during-inference",
     lambda a: _on(a, "rl_offload_optimizer_during_inference"),
     "the state is already off the GPU between steps: drop it"),
)


def _tensor_parallel(args) -> int:
    """The larger of the tensor-parallel sizes of dense layers and of experts."""
    return max(getattr(args, "tensor_model_parallel_size", 1) or 1,
               getattr(args, "expert_tensor_parallel_size", 1) or 1)


def _on(args, name: str) -> bool:
    """Whether Megatron argument `name` is set (absent ones, from other releases, are not)."""
    return bool(getattr(args, name, None))


# Megatron flags that steps under the forward cannot run with.
_NOT_UNDER_THE_FORWARD = (
    # Without it, Megatron all-gathers every param at the end of step(), before the
    # forward has stepped their mains.
    ("data-parallel size > 1 without --overlap-param-gather",
     lambda a: (getattr(a, "data_parallel_size", 1) or 1) > 1
     and not _on(a, "overlap_param_gather"),
     "add --overlap-param-gather (each bucket group's all-gather then waits for its "
     "mains' step), or run one data-parallel rank, or drop --statepager-overlap-forward"),
    # The members' grads must be in grad buffers of their own that statepager reaches.
    ("no --use-distributed-optimizer",
     lambda a: not (_on(a, "use_distributed_optimizer") or _layer_wise(a)),
     "add --use-distributed-optimizer"),
    ("--no-use-layer-wise-param-layout",
     lambda a: _layer_wise(a) and not getattr(a, "use_layer_wise_param_layout", True),
     "drop it (Muon's and Adam's params then share grad buffers)"),
)


def _layer_wise(args) -> bool:
    return _on(args, "use_layer_wise_distributed_optimizer")


def refusals(args, options: Options | None = None) -> list[str]:
    """Why each Megatron flag in `args` (its parsed arguments) cannot run with statepager
    and `options` (default Options()), naming the flag and what to do; empty when all
    can."""
    options = Options(directory="") if options is None else options
    out = [f"{flag}: {why}" for flag, test, why in _REFUSED if test(args)]
    if not (_on(args, "use_distributed_optimizer") or _layer_wise(args)) \
            and options.atomic == "bucket":
        out.append("--use-distributed-optimizer is missing: without it Megatron builds a "
                   "non-distributed optimizer, whose grad buffers statepager cannot reach "
                   "to finish a resumable step (--statepager-atomic bucket) before they "
                   "are zeroed: add --use-distributed-optimizer (--optimizer muon then "
                   "builds the layer-wise one), or pass --statepager-atomic step (SGD, "
                   "which Megatron's DistributedOptimizer refuses)")
    if options.step_thread == "on" and options.overlap_forward != "on":
        out.append("--statepager-step-thread on steps the buckets under the forward: add "
                   "--statepager-overlap-forward on, or drop --statepager-step-thread")
    return out


def check(args) -> Options:
    """The Options of a run with Megatron arguments `args`, or RefusedConfiguration
    naming every flag to change."""
    options = options_from(args)
    refused = refusals(args, options)
    if options.overlap_forward == "on":
        refused += [f"{flag} with --statepager-overlap-forward on: {why}"
                    for flag, test, why in _NOT_UNDER_THE_FORWARD if test(args)]
    if refused:
        raise RefusedConfiguration("statepager cannot run with these Megatron flags:\n  "
                                   + "\n  ".join(refused))
    return options

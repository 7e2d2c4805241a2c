"""Every access statepager.megatron_lm makes to Megatron-LM's training code
(megatron.training), in one class, one method per need, checked against the supported
release when it is made.

Megatron-LM is not changed on disk: install() replaces a few functions in the namespaces
of megatron.training's modules (the names its own code looks up when it calls them), each
by a wrapper that calls the one it replaced. Nothing else of Megatron's is touched.

Supported: the megatron-core releases of statepager.integrations.megatron_version and
Megatron-LM's training code of the same release (branch core_r0.19.0; the megatron-core
wheel ships it as well). Another release is refused by MegatronLM() with a UsageError
naming both.

Thread-safety: none; everything here runs on the training thread, except what the
wrappers the caller passes do.
"""
from __future__ import annotations

import importlib
import inspect

from statepager._C import UsageError
from statepager.integrations.megatron_version import check_version, supported_range

# What MegatronLM wraps, by module: each must exist in the supported release.
_NAMES = {
    "arguments": ("add_megatron_arguments", "set_global_variables"),
    "training": ("get_megatron_optimizer", "save_checkpoint", "load_checkpoint",
                 "training_log", "print_rank_last"),
    "checkpointing": ("save_checkpoint", "load_checkpoint", "schedule_async_save",
                      "get_checkpoint_name", "get_loaded_iteration",
                      "get_checkpoint_tracker_filename"),
    "global_vars": ("get_args", "get_timers", "get_tensorboard_writer", "get_wandb_writer"),
}


class MegatronLM:
    """megatron.training, as statepager.megatron_lm uses it."""

    def __init__(self):
        try:
            from megatron.core import package_info
        except ImportError as e:
            raise UsageError(f"megatron-core is not importable ({e}): install megatron-core "
                             f"{supported_range()} with pip install 'statepager[megatron]'"
                             ) from e
        check_version(package_info.__version__)
        self.version = package_info.__version__
        self._modules = {}
        for name, attributes in _NAMES.items():
            try:
                module = importlib.import_module(f"megatron.training.{name}")
            except ImportError as e:
                raise UsageError(f"megatron.training.{name} is not importable ({e}): put "
                                 "Megatron-LM's training code of the megatron-core release "
                                 "on PYTHONPATH") from e
            missing = [a for a in attributes if not hasattr(module, a)]
            if missing:
                raise UsageError(f"megatron.training.{name} has no {', '.join(missing)}: this "
                                 "Megatron-LM is not the release statepager supports, "
                                 f"megatron-core {supported_range()}")
            self._modules[name] = module
        self._replaced = []  # (module, name, original), in installation order

    # -- installing wrappers -------------------------------------------------------------

    def _wrap(self, module: str, name: str, make) -> None:
        """module.name = make(original)."""
        m = self._modules[module]
        original = getattr(m, name)
        setattr(m, name, make(original))
        self._replaced.append((m, name, original))

    def uninstall(self) -> None:
        """Puts back every function replaced, newest first."""
        while self._replaced:
            module, name, original = self._replaced.pop()
            setattr(module, name, original)

    def wrap_argument_parser(self, add_group) -> None:
        """add_group(parser) runs after Megatron adds its arguments, in every parser
        Megatron builds (so --help lists the group, and unknown-flag checks know it)."""
        def make(original):
            def add_megatron_arguments(parser):
                parser = original(parser)
                add_group(parser)
                return parser
            return add_megatron_arguments
        self._wrap("arguments", "add_megatron_arguments", make)

    def wrap_parsed_arguments(self, check) -> None:
        """check(args) runs once Megatron has parsed and validated its arguments, before it
        makes them global (and before torch.distributed starts)."""
        def make(original):
            def set_global_variables(args, *a, **kw):
                check(args)
                return original(args, *a, **kw)
            return set_global_variables
        self._wrap("arguments", "set_global_variables", make)

    def wrap_optimizer_builder(self, build) -> None:
        """build(megatron_build, model_chunks) replaces training's get_megatron_optimizer;
        megatron_build() calls it as Megatron did and returns the optimizer."""
        def make(original):
            signature = inspect.signature(original)

            def get_megatron_optimizer(*a, **kw):
                chunks = signature.bind(*a, **kw).arguments["model_chunks"]
                return build(lambda: original(*a, **kw), chunks)
            return get_megatron_optimizer
        self._wrap("training", "get_megatron_optimizer", make)

    def wrap_save(self, save) -> None:
        """save(iteration, optimizer, release, megatron_save) replaces save_checkpoint, as
        training and as checkpointing see it; megatron_save(optimizer) calls Megatron's
        with the given optimizer in place of the one it was called with (None: Megatron
        saves everything but the optimizer; the LR scheduler still, unless
        --no-save-optim)."""
        def make(original):
            signature = inspect.signature(original)

            def save_checkpoint(*a, **kw):
                bound = signature.bind(*a, **kw)
                call = _with_optimizer(original, bound)
                values = bound.arguments
                return save(values["iteration"], values["optimizer"],
                            bool(values.get("release", False)), call)
            return save_checkpoint
        for module in ("checkpointing", "training"):
            self._wrap(module, "save_checkpoint", make)

    def wrap_load(self, load) -> None:
        """load(optimizer, load_arg, megatron_load) replaces load_checkpoint, as training
        and as checkpointing see it; megatron_load(optimizer) calls Megatron's with the
        given optimizer (None: Megatron loads everything but the optimizer, the LR
        scheduler included where it would load it) and returns (iteration, flops)."""
        def make(original):
            signature = inspect.signature(original)

            def load_checkpoint(*a, **kw):
                bound = signature.bind(*a, **kw)
                bound.apply_defaults()
                return load(bound.arguments["optimizer"], bound.arguments["load_arg"],
                            _with_optimizer(original, bound))
            return load_checkpoint
        for module in ("checkpointing", "training"):
            self._wrap(module, "load_checkpoint", make)

    def wrap_async_schedule(self, scheduled) -> None:
        """scheduled(request) runs as save_checkpoint hands an async save request to the
        queue, before it does; request.finalize_fns run on every rank, in lockstep, once
        every rank's write is done, and rank 0's include the tracker-file write."""
        def make(original):
            def schedule_async_save(request):
                scheduled(request)
                return original(request)
            return schedule_async_save
        self._wrap("checkpointing", "schedule_async_save", make)

    def wrap_training_log(self, log) -> None:
        """log(iteration, megatron_log) replaces training_log; megatron_log() calls it as
        Megatron did."""
        def make(original):
            signature = inspect.signature(original)

            def training_log(*a, **kw):
                iteration = signature.bind(*a, **kw).arguments["iteration"]
                return log(iteration, lambda: original(*a, **kw))
            return training_log
        self._wrap("training", "training_log", make)

    def appending_to_log_line(self, suffix):
        """A context in which the first line training's print_rank_last prints gets
        suffix() appended (training_log prints its iteration line through it)."""
        import contextlib

        module = self._modules["training"]

        @contextlib.contextmanager
        def context():
            original = module.print_rank_last
            pending = [True]

            def print_rank_last(message):
                if pending[0]:
                    pending[0] = False
                    message += suffix()
                return original(message)

            module.print_rank_last = print_rank_last
            try:
                yield
            finally:
                module.print_rank_last = original
        return context()

    # -- reading Megatron's state --------------------------------------------------------

    def args(self):
        return self._modules["global_vars"].get_args()

    def log_timers(self, seconds: dict, iteration: int, normalizer: int) -> None:
        """Megatron's timer report ("(min, max) time across ranks (ms)") of `seconds`
        (name -> seconds over `normalizer` iterations), written to TensorBoard and W&B
        too under --log-timers-to-tensorboard. Every rank must call it (it gathers), and
        only under --timing-log-level >= 1, as Megatron logs its own optimizer timers."""
        args, timers = self.args(), self._modules["global_vars"].get_timers()
        names = list(seconds)
        for name, value in seconds.items():
            timers(name, log_level=1).set_elapsed(value)
        if args.log_timers_to_tensorboard:
            for writer in self.writers():
                timers.write(names, writer, iteration, normalizer=normalizer, reset=False)
        timers.log(names, normalizer=normalizer)

    def write_scalars(self, values: dict, iteration: int) -> None:
        """values (name -> number) to the TensorBoard and W&B writers Megatron opened on
        this rank (the last one), at its --tensorboard-log-interval."""
        args = self.args()
        interval = getattr(args, "tensorboard_log_interval", 1) or 1
        if iteration % interval:
            return
        for writer in self.writers():
            if hasattr(writer, "add_scalar"):  # TensorBoard's SummaryWriter
                for name, value in values.items():
                    writer.add_scalar(name, value, iteration)
            else:                              # the wandb module
                writer.log(values, iteration)

    def writers(self) -> list:
        """TensorBoard and W&B writers Megatron opened on this rank (none, one or both)."""
        g = self._modules["global_vars"]
        return [w for w in (g.get_tensorboard_writer(), g.get_wandb_writer()) if w is not None]

    def iteration_directory(self, base: str, iteration: int, release: bool = False) -> str:
        """Megatron's directory of an iteration's checkpoint under `base`."""
        return self._modules["checkpointing"].get_checkpoint_name(
            base, iteration, release=release, return_base_dir=True)

    def loaded_iteration(self) -> int | None:
        """The iteration Megatron's last load_checkpoint found in the tracker (or
        --ckpt-step); None or -1 when it found none."""
        return self._modules["checkpointing"].get_loaded_iteration()

    def tracker_names_release(self, base: str) -> bool:
        """Whether the tracker file under `base` names the release checkpoint."""
        try:
            with open(self._modules["checkpointing"].get_checkpoint_tracker_filename(base)) as f:
                return f.read().strip() == "release"
        except FileNotFoundError:
            return False


def _with_optimizer(original, bound):
    """A call of `original` with `bound`'s arguments, the optimizer replaced."""
    def call(optimizer):
        arguments = dict(bound.arguments)
        arguments["optimizer"] = optimizer
        b = inspect.BoundArguments(bound.signature, arguments)
        return original(*b.args, **b.kwargs)
    return call

"""Megatron's own optimizer checkpoints on a streamed DistributedOptimizer.

Every parameter-state format of Megatron's DistributedOptimizer (sharded_state_dict's
dp_reshardable, fully_reshardable and dp_zero_gather_scatter;
save_parameter_state / load_parameter_state) reads each model param's main and moments
through _get_main_param_and_optimizer_states and sets them through
_set_main_param_and_optimizer_states. ParamStates answers both from the pager
(statepager.core.state_values), so the formats work unchanged: Note [Megatron's
checkpoint formats] in docs/design.md.

- get: the first call for a paged main reads the whole state to host memory bucket by
  bucket (one window on the device) and answers each model param from that read, which
  it then forgets; what is left of it goes when the outermost method that reads param
  states returns (reading()), or at a step or a load. The tensors are fp32 host copies
  of the values a step reads (narrow formats decoded); a resident main (a native fp32
  param's shard) and the step counter are given as they are, as Megatron gives them.
- set: within a load (every method that sets param states, wrapped by loading()), the
  values are gathered and loaded at the outermost load's end, all or nothing
  (state_values.load); a set outside a load is loaded at once. The step counter is not
  set: Megatron's load_state_dict restores it from the param groups, and the one a
  dp_reshardable checkpoint hands back is the loader's own from before the load (the
  format keeps it non-persistent). Residual mains are encoded against the model params
  as the load finds them: Megatron loads the model first.
"""
from __future__ import annotations

import functools

import torch

from statepager import _C
from statepager.core import serial, state_values


class ParamStates:
    """_get/_set_main_param_and_optimizer_states of one member (MegatronMember), and the
    wrappers of Megatron's methods that call them (loading, reading, sharding)."""

    def __init__(self, member):
        self.member = member
        self._read = None     # id(main) -> {name: host copy}, what is left of one read
        self._pending = None  # within a load: [(main, {name: value})]
        self._reading = 0     # reading() calls under way (one of Megatron's calls another)

    def forget(self) -> None:
        """The state changes (a step, a load), or its reader returned: what was read goes."""
        self._read = None

    def get(self, model_param) -> dict:
        main = self.member.megatron.main_of(model_param)
        binding = self.member.binding
        with serial.lock_of(self.member.pager):
            copies = {}
            if not binding.resident(main):  # a resident main is in no read
                if self._read is None or id(main) not in self._read:
                    self._read = {id(p): v for p, v in state_values.read(binding).items()}
                copies = self._read.pop(id(main), {})
            tensors = {"param": copies.get("param", main)}
            for name, value in self._held(main).items():
                if isinstance(value, torch.Tensor):
                    tensors[name] = copies.get(name, value)
        return tensors

    def set(self, model_param, tensors: dict) -> None:
        main = self.member.megatron.main_of(model_param)
        tensors = {k: v for k, v in tensors.items() if k != "step"}  # see the module doc
        if self._pending is not None:
            self._pending.append((main, tensors))
        else:
            self._load([(main, tensors)])

    def make_state(self) -> None:
        """An inner optimizer that has not stepped gets the state its first step would
        make (step 0, zero moments; paged ones pager tensors without memory): Megatron's
        checkpoint methods need one (megatron-core 0.19.2 with torch's optimizers reads
        the step count from it, and a load into none allocates the whole state on the
        device)."""
        binding = self.member.binding
        with serial.lock_of(self.member.pager):
            state = binding.optimizer.state
            mains = [p for g in binding.optimizer.param_groups for p in g["params"]]
            if not mains or any(state.get(p) for p in mains):
                return
            for p in mains:
                zeros = torch.zeros_like if binding.resident(p) else \
                    functools.partial(binding.empty_state_like, p)
                state[p] = {"step": torch.tensor(0.0),
                            **{k: zeros(p) for k in self.member.megatron.state_keys()}}
            binding.state_changed()

    def loading(self, load):
        """`load` (a bound Megatron method that sets param states) loading what it sets at
        its end, all or nothing, into a state made first (make_state); within another
        such load (load_state_dict calls a load_parameter_state_from_*), that one's end
        loads it."""
        @functools.wraps(load)
        def load_then_set(*args, **kwargs):
            if self._pending is not None:
                return load(*args, **kwargs)
            self.make_state()
            binding = self.member.binding
            with serial.lock_of(self.member.pager):  # the state as it is (no page-ins)
                steps = {p: held["step"] for p, held in binding.optimizer.state.items()
                         if "step" in held}
            self._pending = []
            try:
                # The inner optimizer's state dict that load_state_dict reads and loads
                # back holds the live paged tensors: no read, no copy (Megatron replaces
                # their values by the sets after).
                with binding.state_dict_by_reference():
                    result = load(*args, **kwargs)
                pending = self._pending
                self._pending = None
                self._own_step_counters()
                self._load(pending)
            except BaseException:
                self._pending = None
                # Megatron's load_state_dict wrote its shared counter into the state it
                # read (by reference), which torch's load may have replaced since.
                with serial.lock_of(self.member.pager):
                    state = binding.optimizer.state
                    for p, step in steps.items():
                        if p in state:
                            state[p]["step"] = step
                raise
            return result
        return load_then_set

    def reading(self, read):
        """`read` (a bound Megatron method that gets param states) forgetting what is left
        of the state read once the outermost such call returns."""
        @functools.wraps(read)
        def read_then_forget(*args, **kwargs):
            self._reading += 1
            try:
                return read(*args, **kwargs)
            finally:
                self._reading -= 1
                if not self._reading:
                    self.forget()
        return read_then_forget

    def sharding(self, sharded_state_dict):
        """Megatron's sharded_state_dict, reading() its state; for a load (is_loading)
        into a state made first (make_state)."""
        read = self.reading(sharded_state_dict)

        @functools.wraps(sharded_state_dict)
        def with_state(model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
            if is_loading:
                self.make_state()
            return read(model_sharded_state_dict or {}, is_loading, *args, **kwargs)
        return with_state

    def _own_step_counters(self) -> None:
        """Megatron's load_state_dict gives every param's state one shared "step" tensor
        (megatron-core 0.19.2, torch's optimizers), which torch's AdamW then advances
        once per param a step: each gets a copy of its own."""
        with serial.lock_of(self.member.pager):
            seen = set()
            for held in self.member.binding.optimizer.state.values():
                step = held.get("step")
                if isinstance(step, torch.Tensor):
                    if id(step) in seen:
                        held["step"] = step.clone()
                    seen.add(id(step))

    def _held(self, main) -> dict:
        """main's state entries as the inner optimizer holds them (under the lock)."""
        return self.member.binding.optimizer.state.get(main, {})

    def _load(self, pending: list) -> None:
        """Each (main, values): the paged entries through the pager, all or nothing; then
        the entries Megatron keeps resident (a native fp32 param's shard), copied as
        Megatron copies them. Every entry must be given (as Megatron's own set asks),
        and of its shape: refused before anything changes."""
        binding = self.member.binding
        with serial.lock_of(self.member.pager):
            self.forget()
            paged, resident = {}, []
            for main, values in pending:
                names = set() if binding.resident(main) else {n for n, _ in binding.forms(main)}
                for name, target in {"param": main, **self._held(main)}.items():
                    if not isinstance(target, torch.Tensor) or name == "step":
                        continue
                    value = values.get(name)
                    if not isinstance(value, torch.Tensor):
                        raise _C.UsageError(
                            f"loading Megatron's optimizer state: it holds no {name!r} for a "
                            f"parameter of shape {tuple(target.shape)} (a checkpoint of "
                            "another optimizer?); nothing was loaded")
                    if name in names:
                        paged.setdefault(main, {})[name] = value
                    else:
                        resident.append((target, value))
            for target, value in resident:
                if value.shape != target.shape:
                    raise _C.UsageError(
                        f"loading Megatron's optimizer state: a value of shape "
                        f"{tuple(value.shape)} for a tensor of shape {tuple(target.shape)}; "
                        "the checkpoint does not fit this model; nothing was loaded")
            if paged:
                state_values.load(binding, paged)
            with torch.no_grad():
                for target, value in resident:
                    target.copy_(value)

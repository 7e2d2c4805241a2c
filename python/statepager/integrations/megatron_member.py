"""One member of a Megatron optimizer streamed through the pager (MegatronMember): the
hooks that bring its grads into a bucket and copy its mains out, and its methods set on
the Megatron instance. The design: statepager.integrations.megatron's docstring."""
from __future__ import annotations

import torch

from statepager import _C
from statepager.core import defaults, slices
from statepager.core.hooks import Hooks
from statepager.core.serial import serialized
from statepager.util.flat import copy_each, flat_view, zero_each
from statepager.util.units import MiB
from statepager.integrations import megatron_internals as internals
from statepager.integrations.megatron_states import ParamStates


class MegatronMember:
    """One DistributedOptimizer streamed through the pager: its inner torch optimizer is
    a StreamedOptimizer whose bucket hooks bring the grads in and copy the mains out, and
    its Megatron hooks are this object's methods."""

    def __init__(self, pager, view, name: str, begins_step: bool = False, **options):
        """The member's mains moved into the pager and its binding planned, nothing of
        Megatron's changed but the mains (undo_adoption() puts them back); bind()
        attaches it. view: Megatron's view of the member (megatron_internals.view).
        begins_step: the member Megatron steps first, whose streamed step begins when its
        grads are ready, to overlap the grad norm and clipping (at most one member does:
        the pager's budget holds one step's window at a time)."""
        self.pager = pager
        self.begins_step = begins_step
        self.optimizer = view.d  # the DistributedOptimizer or Float16 optimizer
        self.megatron = view
        # The mains' pieces follow the bucket size attach starts from (core.defaults).
        self._replaced = self._adopt_mains(defaults.bucketing(
            pager.page_size, pager.hbm_budget, options["bucket_size"], options["depth"])[0])
        self.model_of: dict[int, torch.nn.Parameter] = {  # main -> model param
            id(main): model_param for model_param, main in self.megatron.float16_params()}
        self.bf16_grads = any(self.megatron.grad_dtype(p) != torch.float32
                              for p in self.model_of.values())
        # A native fp32 model param's shard (what the inner optimizer steps, in place) ->
        # the model param.
        self.fp32_model_of: dict[int, torch.nn.Parameter] = {
            id(shard): model_param for model_param, shard in self.megatron.fp32_params()}
        self._slices: dict[int, torch.Tensor] = {}  # id(main) -> _buffer_slice(main)
        # True from a streamed inner step until Megatron's main->param copy that follows it
        # in step_with_ready_grads: the step already copied each bucket's mains.
        self.mains_copied = False
        self._clip = {}       # grad-norm group -> clip coefficient of this step
        self._carriers = {}   # main -> its norm carrier (bf16 grads only)
        self._probes = {}     # grad-norm group -> clip probe (bf16 grads only)
        self._norm_group = {}  # main -> its grad-norm group (bf16 grads only)
        # id() of model params whose main grads a step in flight still reads: zeroed
        # once their main has stepped (zero_grads).
        self._zero_after_step: set[int] = set()
        self.param_states: ParamStates | None = None  # a distributed member's, from bind()
        if self.bf16_grads:
            self._make_carriers()
        try:
            self.binding = pager.attach(self.megatron.inner, name=name, bind=False, hooks=Hooks(
                before_bucket=self._grads_in, after_bucket=self._mains_out,
                keep_resident=lambda p: not pager.owns(p), model_param=self._shard16,
                before_chunk=self._grads_in_chunk, after_chunk=self._mains_out_chunk,
                before_step=self._before_step, after_step=self._after_step), **options)
        except BaseException:
            self.undo_adoption()
            raise

    def bind(self) -> None:
        """Attaches the planned binding and sets the member's methods on Megatron's
        instance and its grad buffers."""
        self.binding.bind()
        # A DistributedOptimizer's checkpoint formats all go through its param-state
        # accessors, which the pager answers; a Float16 optimizer's read the mains.
        distributed = not self.megatron.state_dict_holds_state
        self.param_states = ParamStates(self) if distributed else None
        checkpoints = () if distributed else internals.CHECKPOINT_METHODS + ("state_dict",)
        refused = {m: _refusal(m, "statepager holds this optimizer's state: save it with "
                               "statepager.checkpoint.save(pager, rank_directory(base)) and "
                               "load it with "
                               "statepager.checkpoint.load(pager, rank_directory(base)) "
                               "(run Megatron with --no-save-optim --no-load-optim for its "
                               "own checkpoints)") for m in checkpoints}
        if distributed:
            refused[internals.LEGACY_LOAD] = _refusal(
                internals.LEGACY_LOAD, "it sets the mains directly, behind the pager: load "
                "that checkpoint once without statepager and save it again in a current "
                "format")
        for m in ("offload_to_cpu", "restore_from_cpu"):
            refused[m] = _refusal(m, "the state is already off the GPU between steps; to "
                                  "return the pool's memory use pager.pause() and "
                                  "pager.resume()")
        self.megatron.override(
            copy_grads=self.copy_grads, copy_mains_to_params=self.copy_mains_to_params,
            copy_params_to_mains=self.reload_mains,
            state_dict=None if self.megatron.state_dict_holds_state else self.state_dict,
            zero_grad=self.zero_grad,
            get_parameters=self.parameters_with_carriers if self.bf16_grads else None,
            param_states=self.param_states, refused=refused)
        self.megatron.on_grads_zeroed(self.zero_grads)

    # -- setup -------------------------------------------------------------------------

    def _adopt_mains(self, bucket_size: int) -> dict:
        """Mains built outside Pager.scope() move into the pager, keeping their
        attributes, as do mains that scope() made of one piece and that may step in
        chunks with bucket_size (slices.may_step_in_chunks: they are made of pieces);
        Megatron's references to each (its groups, the inner optimizer's param groups
        and state, model_param.main_param) are repointed. Returns {id(new main): the
        main it replaced}."""
        pager = self.pager
        # What scope() left resident goes out first: the budget may hold little more.
        pager.page_out([main for _, main in self.megatron.float16_params() if pager.owns(main)])

        # Every copy is made before Megatron's references change: a failure leaves them.
        fresh = {}
        for _, main in self.megatron.float16_params():
            pieces = slices.pieces(main.numel(), 4) \
                if slices.may_step_in_chunks(main.numel(), bucket_size) else None
            if not pager.owns(main) or pager.services.pieces(main) != (pieces or [4 * main.numel()]):
                fresh[id(main)] = self._paged_copy(main, pieces)
        olds = {id(main): main for _, main in self.megatron.float16_params()}
        self._repoint(self.megatron.replace_mains(lambda main: fresh.get(id(main))))
        return {id(fresh[k]): olds[k] for k in fresh}

    def undo_adoption(self) -> None:
        """Megatron's references back to the mains it had before _adopt_mains (an attach
        that fails after it leaves the optimizer as it was)."""
        self._repoint(self.megatron.replace_mains(lambda main: self._replaced.get(id(main))))
        self._replaced = {}

    def _repoint(self, moved: dict) -> None:
        """The inner optimizer's param groups and state, each main `moved` ({id(old):
        new}) replaced."""
        inner = self.megatron.inner
        for group in inner.param_groups:
            for i, p in enumerate(group["params"]):
                if id(p) in moved:
                    group["params"][i] = moved[id(p)]
                    if p in inner.state:
                        inner.state[moved[id(p)]] = inner.state.pop(p)

    def _paged_copy(self, main: torch.Tensor, pieces) -> torch.Tensor:
        """A pager tensor holding main's values and attributes, paged out; made of
        `pieces` (Pager.empty), copied piece by piece. main may be a pager tensor of one
        piece (scope() made it), at rest."""
        pager = self.pager
        t = pager.empty_like(main, pieces=pieces)
        owned = pager.owns(main)
        if owned:
            self._page_in(main, main)
        try:
            at = 0
            for view in pager.services.piece_views(t):
                self._page_in(view, main)
                with torch.no_grad():
                    flat_view(view).copy_(flat_view(main)[at:at + view.numel()])
                pager.page_out(view)
                at += view.numel()
        finally:
            if owned:
                pager.page_out(main)
        t.__dict__.update(main.__dict__)
        return t

    def _page_in(self, t: torch.Tensor, main: torch.Tensor) -> None:
        """page_in(t) of a copy of main; a budget too small for it is a UsageError."""
        try:
            self.pager.page_in(t)
        except _C.OutOfMemoryError as e:
            budget = self.pager.stats()["hbm_budget"]
            if budget is None:  # the device itself is full
                raise
            raise _C.UsageError(
                f"hbm_budget {budget / MiB:.0f} MiB cannot hold {t.numel() * 4 / MiB:.1f} MiB "
                f"of a {main.numel() * 4 / MiB:.1f} MiB fp32 main of Megatron's (it may span "
                "two pages) while moving it into the pager: raise hbm_budget") from e

    def _make_carriers(self) -> None:
        device = next(iter(self.model_of.values())).device
        for _, main in self.megatron.float16_params():
            carrier = torch.zeros(1, device=device)
            carrier.__dict__.update(main.__dict__)
            self._carriers[id(main)] = carrier
            group = self._norm_group[id(main)] = internals.grad_norm_group(main)
            if group not in self._probes:
                probe = torch.zeros(1, device=device)
                probe.__dict__.update(main.__dict__)
                probe.shared = True  # clipped, but outside the norm
                self._probes[group] = probe

    # -- the streamed step's hooks -------------------------------------------------------

    def _before_step(self) -> None:
        if self.param_states is not None:
            self.param_states.forget()
        self.mains_copied = False
        self._read_clip()

    def _after_step(self) -> None:
        self.mains_copied = True

    def _grad16(self, main) -> torch.Tensor:
        """The main's slice of its model param's (reduce-scattered) grad."""
        return self.megatron.grad_shard(self.model_of[id(main)])

    def _shard16(self, main) -> torch.Tensor:
        """The main's slice of its bf16 model param (what the residual format builds on)."""
        return self.megatron.shard(self.model_of[id(main)])

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

    def _grads_in_chunk(self, main, start: int, stop: int) -> None:
        if start == 0:  # its first chunk in this step: the whole grad, outside the pager
            self._grads_in([main])

    def _buffer_slice(self, main) -> torch.Tensor:
        """The main's model param's slice of the DDP param buffer, the view made once
        (Megatron's lookup took the host ~10 us a main, each bucket of each step): the
        buffers stay where they are, as the mains do (Note [A bucket keeps what its forms
        fix])."""
        view = self._slices.get(id(main))
        if view is None:
            view = self._slices[id(main)] = self.megatron.param_buffer_slice(
                self.model_of[id(main)])
        return view

    @torch.no_grad()
    def _mains_out_chunk(self, main, start: int, stop: int) -> None:
        model_param = self.model_of.get(id(main))
        if model_param is None:
            return
        target = flat_view(self._buffer_slice(main))
        target[start:stop].copy_(flat_view(main)[start:stop])
        if stop == main.numel():
            if self.bf16_grads:
                main.grad = None
            self._zeroed_after_step(model_param)

    @torch.no_grad()
    def _mains_out(self, params) -> None:
        # Native fp32 params, stepped in place, are done with their grads.
        self._zeroed_after_step(*(self.fp32_model_of[id(p)] for p in params
                                  if id(p) in self.fp32_model_of))
        mains = [main for main in params if id(main) in self.model_of]
        if not mains:
            return
        # One multi-tensor copy for the bucket: a copy_ per main took ~4 ms of the host's
        # time in the 1.34 B GPT's bucket of ~200 small parameters (H200).
        copy_each([self._buffer_slice(main) for main in mains], mains)
        if self.bf16_grads:
            for main in mains:
                main.grad = None
        self._zeroed_after_step(*(self.model_of[id(main)] for main in mains))

    # -- Megatron's hooks, set on the DistributedOptimizer ------------------------------
    # Each holds the Pager's lock (statepager.core.serial): they page the state, and
    # Megatron's code calls them outside the inner optimizer's entry points.

    @serialized
    def copy_grads(self, *_) -> None:
        """Megatron's model-grads-to-main-grads, with bf16 grads left in the grad buffer:
        the mains' norm carriers get the fp32 grad norms, the probes a grad of one. Then
        the streamed step begins (begins_step), its page-ins running while Megatron
        computes the grad norm and clips."""
        self._copy_grads()
        if self.begins_step:
            self.binding.begin_step()

    def _copy_grads(self) -> None:
        if not self.bf16_grads:
            return self.megatron.copy_grads_as_megatron()
        for model_param, shard in self.megatron.fp32_params():
            shard.grad = self.megatron.grad_shard(model_param).float()
        for _, main in self.megatron.float16_params():
            main.grad = None
            self._carriers[id(main)].grad = torch.norm(self._grad16(main).float()).reshape(1)
        for probe in self._probes.values():
            probe.grad = torch.ones(1, device=probe.device)

    @serialized
    def zero_grad(self, *args, **kwargs) -> None:
        """Megatron's zero_grad() (the training loop's, at each iteration's start), then
        the next step's preparation while forward and backward run (StreamedOptimizer.
        prepare_step: an all-or-nothing step's undo copies, with residual mains). A step
        in flight under the forward keeps the grads it reads, unless they are zeroed in
        place."""
        to_none = args[0] if args else kwargs.get("set_to_none", True)
        if self.binding.step_in_flight is None or not to_none:
            self.binding.finish_step()  # a pending step, with the grads it needs
        self.megatron.zero_grad_as_megatron(*args, **kwargs)
        self.binding.prepare_step()

    @serialized
    def zero_grads(self, buffer, reset) -> None:
        """A grad buffer's reset() (Megatron's loop zeroes them, model.zero_grad_buffer(),
        before it calls zero_grad()): a pending step finishes first, with its grads; the
        grads of the mains a step in flight under the forward has not stepped yet are
        zeroed once they have (_zeroed_after_step), the rest now (Note [Megatron's failed
        step finishes before the grads are zeroed])."""
        run = self.binding.step_in_flight
        if run is None:
            self.binding.finish_step()
            return reset()
        kept = [m for b in run.buckets[run.stepped:]
                for m in map(self.model_param_of, list(b.params) + [c.param for c in b.chunks])
                if m is not None]
        self.megatron.zero_grads_but(buffer, kept)
        self._zero_after_step.update(id(p) for p in kept)

    def model_param_of(self, p) -> torch.nn.Parameter | None:
        """The model param the inner optimizer's parameter p (a main, or a native fp32
        param's shard) stands for; None for another."""
        model_param = self.model_of.get(id(p))
        return model_param if model_param is not None else self.fp32_model_of.get(id(p))

    def _zeroed_after_step(self, *model_params) -> None:
        """Zeroes the main grads of those of model_params that zero_grads left to their
        step, in one multi-tensor op (on the step's stream: before the forward's next use
        waits for it, and backward's)."""
        left = [p for p in model_params if id(p) in self._zero_after_step]
        for p in left:
            self._zero_after_step.discard(id(p))
        if left:
            zero_each([p.main_grad for p in left])

    def parameters_with_carriers(self) -> list:
        """get_parameters() as Megatron's norm and clip code sees it: each paged main
        stands in as its norm carrier, and the clip probes come last."""
        params = [self._carriers.get(id(p), p)
                  for group in self.megatron.inner.param_groups for p in group["params"]]
        return params + list(self._probes.values())

    @serialized
    @torch.no_grad()
    def copy_mains_to_params(self, *_) -> None:
        """Mains into the DDP param buffer. Right after a streamed step (Megatron's
        step_with_ready_grads calls this after the inner step) the paged mains were
        copied bucket by bucket already: paging them in again would read the whole state
        a second time. Elsewhere they are paged in to copy."""
        for model_param, shard in self.megatron.fp32_params():
            _copy_apart(self.megatron.param_buffer_slice(model_param), shard)
        if self.binding.step_in_flight is not None:
            return  # each bucket's mains go to the buffer as the forward steps it
        if self.mains_copied:
            self.mains_copied = False
            return
        # Read in the step's pieces (within the budget attach accepted), written nowhere.
        for main, start, stop, entries in self.binding.state_in_pieces():
            if id(main) in self.model_of and "param" in entries:
                flat_view(self._buffer_slice(main))[start:stop].copy_(entries["param"])

    @serialized
    @torch.no_grad()
    def reload_mains(self, state_dict=None) -> None:
        """reload_model_params: mains rebuilt from the model params (or from
        `state_dict`'s tensors in their place), in the step's pieces through the pager."""
        source = self.megatron.state_dict_params(state_dict) if state_dict else {}

        def shard_of(model_param):
            return self.megatron.shard(model_param, source.get(model_param, model_param))

        for model_param, shard in self.megatron.fp32_params():
            _copy_apart(shard, shard_of(model_param))
        # In the step's pieces: a main that steps in chunks is rebuilt chunk by chunk.
        for main, start, stop, entries in self.binding.state_in_pieces(write=True,
                                                                       rebuild_mains=True):
            model_param = self.model_of.get(id(main))
            if model_param is not None and "param" in entries:
                entries["param"].copy_(flat_view(shard_of(model_param))[start:stop])

    @serialized
    def state_dict(self):
        """Megatron's state_dict() holds no parameter state (it reads only the step
        counters and param groups), so the inner optimizer's state_dict by reference
        (torch's own, which does not read the paged tensors) serves it."""
        with self.binding.state_dict_by_reference():
            return self.megatron.state_dict_as_megatron()


def _copy_apart(target: torch.Tensor, source: torch.Tensor) -> None:
    """target.copy_(source) unless both are the same memory (a Float16 member's native
    fp32 params are the tensors its inner optimizer steps in place)."""
    if target.data_ptr() != source.data_ptr():
        target.copy_(source)


def _refusal(method: str, instead: str):
    def refuse(*_, **__):
        raise _C.UsageError(f"{method}() is not available on a statepager-attached Megatron "
                            f"optimizer: {instead}.")
    return refuse


"""Megatron-core drop-in: Pager.attach() of a DistributedOptimizer, ChainedOptimizer or
LayerWiseDistributedOptimizer.

    pager = statepager.Pager(directory=..., device="cuda", hbm_budget=...)
    with pager.scope():
        optimizer = get_megatron_optimizer(config, model_chunks)
    pager.attach(optimizer)

Nothing in Megatron changes; a MegatronMember per member (a DistributedOptimizer, or the
Float16OptimizerWithFloat16Params of a non-distributed or layer-wise chain: SGD, Muon and
the Adam beside it) sets a few of its methods on the instance (never on its class),
through statepager.integrations.megatron_internals, the one place that names Megatron's
attributes. The inner torch optimizers it pages are listed by
megatron_internals.inner_problem (Muon steps whole matrices: a matrix larger than
bucket_size is a bucket of its own, and attach checks that window against hbm_budget):
- its inner torch optimizer steps bucket by bucket (statepager.core.binding); each bucket's
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
- a step that raises leaves each bucket stepped or not (atomic="bucket", the default,
  statepager.core.resumable; Megatron's retry of the step finishes it, as does
  zero_grad() and, first in Megatron's loop, model.zero_grad_buffer()) or is undone
  (atomic="step", statepager.core.atomic): mains and moments of what did not step
  return to their bytes of before it, and so does the DDP param buffer, rewritten from
  the restored mains (`_shard16`, the same memory as the buffer's slice; with residual
  mains from undo copies). Each member on its own: in a ChainedOptimizer, members that
  Megatron stepped before the failing one stay stepped;
- reload_model_params refreshes the mains through the pager; a DistributedOptimizer's
  checkpoint formats read and set the state through the pager
  (statepager.integrations.megatron_states); a Float16 member's checkpoint methods, which
  would read the mains behind the pager's back, are refused with what to use instead
  (statepager.checkpoint.save / load into rank_directory(base)), and offload_to_cpu /
  restore_from_cpu point to Pager.pause / resume.

Each member of a chain is its own binding, named "<index>-dense" or "<index>-expert"
(index: its place among the chain's leaves, stable across runs of the same model), with
its own store, <the rank's pager directory>/<name>/; all share the rank's Pager (one page
pool, one HBM budget, one I/O ring). Attaching checks the megatron-core version
(megatron_version.SUPPORTED) and refuses the Pager.attach options it sets itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from statepager import _C
from statepager.core import adapters
from statepager.core.serial import lock_of
from statepager.integrations import megatron_internals as internals
from statepager.integrations import megatron_version
from statepager.integrations.megatron_member import MegatronMember


def attach(pager, optimizer, *, bucket_size: int | None = None, depth: int | None = None,
           log_steps: bool = False, moments: str = "fp32", mains: str = "fp32",
           atomic="bucket", stationary_bytes: int = 0):
    """Streams every member of `optimizer` through `pager` (stationary_bytes: of a
    single member). Returns the MegatronBinding;
    refuses (UsageError) a megatron-core outside the supported range and configurations
    it cannot page exactly, before changing anything."""
    megatron_version.check_version()
    chunks = internals.model_chunks(optimizer)
    views = [(i, internals.view(m, chunks)) for i, m in internals.members(optimizer)]
    for _, view in views:
        problem = view.unsupported() or _resumable_problem(view, atomic)
        if problem is not None:
            raise _C.UsageError(f"statepager cannot page this Megatron optimizer: {problem}")
    if stationary_bytes and len(views) > 1:
        raise _C.UsageError(
            f"stationary_bytes needs a single member, and this Megatron optimizer chains "
            f"{len(views)} (dense and expert, or Muon's layer-wise chain): each steps beside "
            "the others' stationary buckets (Note [Stationary buckets]). Use "
            "stationary_bytes=0")
    binding = MegatronBinding(optimizer)
    try:  # every member planned (its window checked) before any is attached
        for i, view in views:
            kind = "expert" if view.is_expert() else "dense"
            binding.members.append(MegatronMember(
                pager, view, f"{i}-{kind}", begins_step=not binding.members,
                bucket_size=bucket_size, depth=depth, log_steps=log_steps, moments=moments,
                mains=mains, atomic=atomic, stationary_bytes=stationary_bytes))
    except BaseException:
        for m in reversed(binding.members):
            m.undo_adoption()
        raise
    for m in binding.members:
        m.bind()
    binding.megatron_step = internals.override_step(optimizer, binding.step)
    return binding


def _resumable_problem(view, atomic) -> str | None:
    """A resumable step finishes before Megatron zeroes the grads it still reads, which
    needs the grad buffers (Note [Megatron's failed step finishes before the grads are
    zeroed]); a non-distributed chain does not know its model's."""
    if atomic != "bucket" or view.buffers():
        return None
    return (f"its {type(view.d).__name__} does not know the DDP grad buffers its grads are "
            "in (a non-distributed chain has no model chunks), and a resumable step "
            "(atomic='bucket', the default) must finish before model.zero_grad_buffer() "
            "zeroes them. Attach with atomic='step' (all or nothing) or atomic=False, or "
            "build Adam with use_distributed_optimizer=True and Muon with "
            "use_layer_wise_distributed_optimizer=True")


adapters.register(adapters.Adapter(
    name="Megatron", matches=internals.is_megatron, attach=attach,
    sets=("name", "hooks")))


@dataclass
class MegatronBinding:
    """The bindings of one Megatron optimizer: one StreamedOptimizer per member."""

    optimizer: object
    members: list = field(default_factory=list)
    megatron_step: object = None  # the optimizer's step() before attach set binding.step
    early: "PageInsDuringBackward | None" = None  # overlap_forward's
    _gathers_hooked: bool = False  # overlap_forward() set _before_param_gather

    @property
    def bindings(self) -> list:
        """The members' StreamedOptimizers, in order."""
        return [m.binding for m in self.members]

    def step(self, *args, **kwargs):
        """Megatron's step() of the optimizer (set on it at attach). Its first member
        begins its streamed step once the grads are ready (MegatronMember.copy_grads); a
        step Megatron then skips (inf/NaN grads) or that fails before the inner step is
        ended here, its pages dropped unwritten. Holds the Pager's lock throughout
        (statepager.core.serial): Megatron's step calls the members' hooks."""
        if self.early is not None:
            self.early.next_backward()
        with lock_of(self.members[0].pager):
            try:
                return self.megatron_step(*args, **kwargs)
            finally:
                for m in self.members:
                    if m.binding.begun:
                        m.binding.end_begun_step()

    def overlap_forward(self, *model_chunks, page_in_during_backward: bool = True,
                        step_thread: bool = False) -> list:
        """Each member's steps end under the next forward of `model_chunks` (the DDP
        model chunks; StreamedOptimizer.overlap_forward): Megatron's step() returns once
        the first page-ins are issued, and each bucket's mains reach the param buffer
        before the first module that uses them runs, and before any param all-gather
        of a bucket group holding them is dispatched (with overlap_param_gather, each
        in the forward's hooks; without it, at one rank, the all-gather at the end of
        step() gathers each param onto itself). More than one data-parallel rank needs
        overlap_param_gather (without it Megatron all-gathers every param at the end
        of step()); in a ChainedOptimizer a member's step in flight completes when the
        next one starts. page_in_during_backward: the next step's first page-ins begin
        in the backward before it (PageInsDuringBackward). step_thread: the buckets step
        on a thread of their own (Note [A thread steps the buckets under the forward]).
        Returns the members' ForwardOverlaps."""
        held = [[id(b) for b in m.megatron.buffers()] for m in self.members]
        flat = [b for ids in held for b in ids]
        if not all(held) or len(set(flat)) < len(flat):
            raise _C.UsageError(
                "overlap_forward() keeps, per member, the grads of the mains a step in "
                "flight has not stepped, in the member's own grad buffers: this chain's "
                "members do not know theirs (a non-distributed chain) or share them (a "
                "layer-wise chain over one buffer layout). Use the distributed optimizer, "
                "or the layer-wise one over Megatron-LM's layout, or step without "
                "overlap_forward()")
        for m in self.members:
            size = m.megatron.data_parallel_size()
            if size > 1 and not m.megatron.overlaps_param_gather():
                raise _C.UsageError(
                    f"overlap_forward() with {size} data-parallel ranks needs "
                    "overlap_param_gather (Megatron-LM: --overlap-param-gather): without "
                    "it Megatron all-gathers every param at the end of step(), before the "
                    "forward has stepped their mains")
        overlaps = [m.binding.overlap_forward(*model_chunks, forward_param=m.model_param_of,
                                              step_thread=step_thread)
                    for m in self.members]
        # Without overlap_param_gather (one rank) the all-gather at the end of step()
        # gathers each param onto itself: left alone, or it would step every bucket.
        if not self._gathers_hooked and any(m.megatron.overlaps_param_gather()
                                            for m in self.members):
            internals.before_param_gather(model_chunks, self._before_param_gather)
            self._gathers_hooked = True  # once: the hooks read the members' overlaps anew
        if page_in_during_backward and self.early is None:
            self.early = PageInsDuringBackward(self.members[0].binding, model_chunks)
        return overlaps

    def _before_param_gather(self, params) -> None:
        """Before a bucket group's param all-gather is dispatched: the buckets holding
        its params' mains stepped, the current stream (which the collective follows)
        after them."""
        for m in self.members:
            overlap = m.binding.overlap
            if overlap is not None:
                overlap.before_reading(params, key=params)

    def complete_step_in_flight(self) -> None:
        """Steps what each member's step in flight has left (overlap_forward): the
        model params are then the step's, for what reads them outside a forward."""
        for m in self.members:
            m.binding.complete_step_in_flight()

    @property
    def last(self) -> list:
        """StepStats of the last step, one per member."""
        return [m.binding.last for m in self.members]


class PageInsDuringBackward:
    """Begins the first member's next step (begin_step: its first page-ins) in the
    backward before it, where Megatron's copy_grads would begin it after the backward:
    at the first grad-sync start of the DDP bucket groups (the last micro-batch's) by
    which begin_step() waits for nothing (can_begin_step: the step in flight has
    stepped every bucket, its page-ins following its page-outs; so that the autograd
    thread never blocks) and the page-ins find their pages in the pool, held by the
    step in flight or in device memory the backward has freed since its first grad sync
    (so that the driver's peak need not rise: Note [Page-ins during backward]). Each
    later grad-sync start issues the page-ins room has been made for since."""

    def __init__(self, binding, model_chunks):
        self.binding = binding
        self.steps_begun = 0  # steps begun in a backward, in all
        # Grad-sync starts that began nothing, by what held them back (bench megatron).
        self.held_back = {"the step in flight": 0, "room": 0}
        self._first: int | None = None  # torch's allocated bytes at the first grad sync
        self._room: int | None = None  # what the page-ins need beyond the pool's pages
        self._begun = False
        internals.on_grad_sync_start(model_chunks, self._grad_sync_started)

    def next_backward(self) -> None:
        """Megatron's step() has begun: the next backward measures anew."""
        self._first, self._room, self._begun = None, None, False

    def _grad_sync_started(self) -> None:
        binding = self.binding
        if binding.overlap is None:
            return
        if self._begun:
            if binding.begun:
                binding.begin_step()  # the page-ins room has been made for since
            return
        device = binding.pager.device
        on_cuda = device.type == "cuda"  # the host backend's memory is the host's
        now = torch.cuda.memory_allocated(device) if on_cuda else 0
        if self._first is None:
            self._first = now
        if not binding.can_begin_step():
            self.held_back["the step in flight"] += 1
            return
        if self._room is None:  # counted once a backward; the step in flight's pages reused
            run = binding.step_in_flight
            held = run.held_bytes() if run is not None else 0
            self._room = max(0, binding.begun_step_bytes - held
                             - binding.pager.stats()["cached_bytes"]) if on_cuda else 0
        if self._first - now < self._room:
            self.held_back["room"] += 1
            return
        self._begun = True
        binding.begin_step()
        self.steps_begun += binding.begun

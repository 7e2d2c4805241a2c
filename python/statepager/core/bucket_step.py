"""One bucket's step within a streamed step (statepager.core.pipeline): its state
decoded, the bucket hooks around it, the optimizer's own algorithm (or the fused step,
statepager.core.fused_adamw) on just its parameters and chunks, its state encoded."""
from __future__ import annotations

from typing import Callable

from statepager import _C
from statepager.core import residency, slices
from statepager.core.atomic import AtomicStep
from statepager.core.hooks import Hooks
from statepager.core.late_reads import ParamChecks
from statepager.core.layout import StateLayout
from statepager.core.state_access import held
from statepager.core.plan import Bucket
from statepager.core.resumable import ResumableStep

_ABSENT = object()


class BucketStepper:
    """Steps the buckets of one binding, one at a time. Per step (begin()), it keeps the
    param groups' own step counters and the scalar state of parameters that step in
    chunks as they were before it, so that each advances once per step."""

    def __init__(self, layout: StateLayout, hooks: Hooks):
        self.layout = layout
        self.hooks = hooks  # before_bucket, after_bucket, before_chunk, after_chunk
        self._raw_step = _raw_step_function(layout.optimizer)
        # Optimizers that count steps per param group (TE's and apex's FusedAdam) must
        # advance the count once per step, not once per bucket: each group's count
        # before the step, and after the last bucket that stepped it.
        self._group_steps: list = []
        self._group_steps_after: list = []
        self._counts: dict[int, dict] = {}  # in a step: counters of split params before it

    def begin(self) -> None:
        """At the start of a step's buckets: the counters as they are now."""
        groups = self.layout.optimizer.param_groups
        self._group_steps = [g.get("step", _ABSENT) for g in groups]
        self._group_steps_after = list(self._group_steps)
        self._counts = {}

    def end(self) -> None:
        """After the last bucket: each param group's counter as its last bucket left it."""
        for g, counter in zip(self.layout.optimizer.param_groups, self._group_steps_after):
            _set_counter(g, counter)

    def counters_before(self, p) -> dict:
        """p's scalar state (Adam's step count) as it was before this step, for a parameter
        that steps in chunks: taken at its first chunk, so that each chunk steps from it
        and the count advances once per step (slices.step_in_slices)."""
        return self._counts.setdefault(id(p), slices.counters(held(self.layout.optimizer, p)
                                                              or {}))

    def step(self, bucket: Bucket, atomic: AtomicStep | ResumableStep | None,
             checks: ParamChecks | None,
             fused: list | None, checked: bool = False, resident=()) -> list:
        """Steps one bucket, its residual masters' checks left to `checks` where given,
        skipped where `checked` (up front); `fused` is StateLayout.fused_forms(bucket);
        `resident`: its tensors paged in already (residency.decode).
        Returns the bucket's pending exceptions (residency.encode)."""
        layout, hooks, pager = self.layout, self.hooks, self.layout.pager
        # The fused step (statepager.core.fused_adamw) reads and writes the moments in their
        # stored form: they are not decoded unless it turns out not to apply.
        residency.decode(pager, bucket, not checked, skip=fused or (), checks=checks,
                         resident=resident)
        if atomic:
            atomic.save(bucket)
        _call(hooks.before_bucket, hooks.before_chunk, bucket)
        if layout.create_deferred_state(bucket) or layout.chunks_got_state(bucket):
            layout.fill(bucket)
            fused = layout.fused_forms(bucket)
            # Their new state is zero: paged in zero-filled, nothing read (decoded, where
            # the fused step does not read the moments as stored, by the same zero fill).
            # For a read: the bucket's other stored forms, resident, keep their bytes at
            # rest (a resumable step hands them back there if the bucket fails).
            pager.page_in_async(bucket.stored + (bucket.working if fused is None else []),
                                for_read=True).wait()
        if fused is not None and layout.fused.ready(bucket):
            layout.fused.step(bucket, fused)
        else:
            if fused:
                moments = {id(f) for f in fused}
                residency.decode(pager, bucket,
                                 skip=[f for f in bucket.forms if id(f) not in moments],
                                 checks=checks)
            fused = None
            self._raw_step_bucket(bucket)
        if atomic:
            atomic.writing(bucket)
        _call(hooks.after_bucket, hooks.after_chunk, bucket)
        return residency.encode(bucket, skip=fused or ())

    def _raw_step_bucket(self, bucket: Bucket) -> None:
        """The optimizer's own step on the bucket's parameters (their state decoded)."""
        optimizer = self.layout.optimizer
        groups = optimizer.param_groups
        if bucket.params:
            saved = [g["params"] for g in groups]
            try:
                for g, params, counter in zip(groups, bucket.groups, self._group_steps):
                    g["params"] = params
                    _set_counter(g, counter)
                self._raw_step(optimizer)
                for i, g in enumerate(groups):
                    if g["params"]:
                        self._group_steps_after[i] = g.get("step", _ABSENT)
            finally:
                for g, params in zip(groups, saved):
                    g["params"] = params
        for c in bucket.chunks:
            state = held(optimizer, c.param)
            if c.param.grad is not None and not state:
                raise _C.UsageError(
                    f"{type(optimizer).__name__} created no state for a parameter that "
                    "steps in chunks before its step: attach an optimizer whose state "
                    "torch.optim.Adam creates (not overriding _init_group), or raise bucket_size")
            slices.step_in_slices(optimizer, self._raw_step, c.group, c.param,
                                  [(c.start, c.stop)], self.counters_before(c.param))
        if self.layout.adopt(bucket):  # state the optimizer created lazily in this step
            self.layout.fill(bucket)
            # The new stored forms (zero), to encode into; for a read, as above.
            self.layout.pager.page_in_async(bucket.stored, for_read=True).wait()


def _set_counter(group: dict, counter) -> None:
    """Sets a param group's own step counter ('step'), or removes it (_ABSENT)."""
    if counter is _ABSENT:
        group.pop("step", None)
    else:
        group["step"] = counter


def _raw_step_function(optimizer) -> Callable:
    """The optimizer's algorithm without the hook wrapper (hooks run once, around buckets)."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step)


def _call(whole, chunk, bucket: Bucket) -> None:
    """A bucket hook with the bucket's whole parameters, then a chunk hook per chunk."""
    if whole:
        whole(bucket.params)
    for c in bucket.chunks if chunk else ():
        chunk(c.param, c.start, c.stop)

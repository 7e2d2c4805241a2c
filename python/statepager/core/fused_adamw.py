"""The fused AdamW step of a bucket on CUDA (kernels/adamw.cu).

Where it applies, each parameter of a bucket steps in one kernel that reads its
moments in their stored format (fp32, bf16, q8) and writes them back in it: no fp32
scratch for the moments, no decode and encode passes, none of the ~10 foreach ops of
torch's step. One call per bucket launches them all (_C.kernels.adamw_step_many, which
also does the host arithmetic of the step's scalars): a call per parameter from Python
took 14-17 ms in the 1.34 B GPT's last bucket, the one of many small parameters (on the
H200, bench megatron q8), 0.4 ms in the others. The arithmetic is torch's multi-tensor
AdamW's, op for op, so the bits are those of the unfused path
(tests/gpu/test_codec_kernels.py holds it to them).

It applies to a bucket when the optimizer's step is torch.optim.Adam's (Adam, AdamW,
PagedAdamW) and would run its foreach implementation (foreach=True, or foreach and fused
left None, as by default), with decoupled weight decay (AdamW) or none, no amsgrad,
maximize, capturable or differentiable, float hyperparameters; every parameter of the
bucket has its state (the binding creates it, zero, before a parameter's first step),
and every grad is fp32 with its parameter's memory layout. Otherwise the bucket steps as
before. A parameter that steps in chunks (statepager.core.slices) steps one kernel per
chunk, each from the count of before the step, the count advancing once. The codec
kernels' switch (codecs.use_kernels) turns it off too; STATEPAGER_FUSED_ADAMW=0 turns off
just this.
"""
from __future__ import annotations

import os

import torch

from statepager import _C
from statepager.core.state_access import held
from statepager.util import streams
from statepager.util.flat import copy_each
from statepager.formats import codecs

_fused_on = os.environ.get("STATEPAGER_FUSED_ADAMW", "1") != "0"
_ONE = torch.tensor(1.0)  # what torch adds to a CPU step count


def use_fused(enabled: bool) -> bool:
    """Turns the fused step on or off; returns the previous setting."""
    global _fused_on
    previous, _fused_on = _fused_on, bool(enabled)
    return previous


def applies_to(optimizer) -> bool:
    """True when the optimizer's algorithm is torch's Adam step (Adam, AdamW and their
    subclasses that keep it)."""
    return _unhooked(type(optimizer).step) is _unhooked(torch.optim.Adam.step)


def _unhooked(step):
    """A class's step without the profiling hook torch puts around it (once per class,
    marked `hooked`, at the first optimizer's construction)."""
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def _group_fusable(group: dict) -> bool:
    foreach, fused = group.get("foreach"), group.get("fused")
    plain = [group.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable")]
    beta1, beta2 = group["betas"]
    return (not any(plain) and not fused and (foreach is True or (foreach is None and fused is None))
            and (group.get("decoupled_weight_decay", False) or group["weight_decay"] == 0)
            and all(isinstance(x, (float, int)) and not isinstance(x, bool)
                    for x in (group["lr"], beta1, beta2, group["eps"], group["weight_decay"])))


class FusedStep:
    """The fused step of one binding's buckets (StreamedOptimizer)."""

    def __init__(self, binding):
        self.binding = binding
        self.optimizer = binding.optimizer

    def groups_key(self) -> tuple:
        """What moment_forms() decides on besides the parameters and their state, which
        only a step changes: the switches and each param group's options."""
        return (_fused_on, codecs.kernels_on(),
                tuple(_group_fusable(g) for g in self.optimizer.param_groups))

    def may_step(self, group: dict, p: torch.Tensor) -> bool:
        """True when the fused step may run parameter p of param group `group` (once it
        has its state): what the bucket's plan counts on (no fp32 scratch of the moments)."""
        return _fused_on and _group_fusable(group) and _param_fusable(p)

    def moment_forms(self, bucket) -> list | None:
        """The stored forms of the bucket's moments (its chunks' included) when the fused
        step may run it (its grads are checked later, by ready()): they need not be
        decoded. None otherwise. Each pipeline asks it of every bucket: a param group
        is judged once per call, not once per parameter."""
        if not _fused_on:
            return None
        groups = self.optimizer.param_groups
        members = [(gi, p, dict(self.binding.forms(p)))
                   for gi, params in enumerate(bucket.groups) for p in params]
        members += [(c.group, c.param, named)
                    for c, named in zip(bucket.chunks, bucket.chunk_forms)]
        fusable: dict[int, bool] = {}
        forms = []
        for gi, p, named in members:
            ok = fusable.get(gi)
            if ok is None:
                ok = fusable[gi] = _group_fusable(groups[gi])
            s = held(self.optimizer, p)
            m, v = named.get("exp_avg"), named.get("exp_avg_sq")
            if not ok or not s or m is None or v is None or not _param_fusable(p):
                return None
            step = s.get("step")
            if not isinstance(step, torch.Tensor) or step.is_cuda:
                return None
            forms += [m, v]
        return forms if members else None

    def ready(self, bucket) -> bool:
        """After before_bucket set the grads: True when every one is fp32, dense and laid
        out as its parameter, and no parameter is listed twice (torch would step it twice;
        several chunks of one parameter are its parts, each stepped once)."""
        whole = [p for group in bucket.groups for p in group]
        chunked = {id(c.param): c.param for c in bucket.chunks}
        ids = {id(p) for p in whole}
        if len(ids) != len(whole) or not ids.isdisjoint(chunked):
            return False
        params = whole + list(chunked.values())
        return all(p.grad is None or (
            p.grad.dtype == torch.float32 and p.grad.layout == torch.strided
            and p.grad.device == p.device and p.grad.stride() == p.stride()) for p in params)

    @torch.no_grad()
    def step(self, bucket, forms: list) -> None:
        """torch.optim.Adam.step on the bucket's parameters and chunks, in one call that
        launches a kernel per parameter or chunk of one; `forms` is what moment_forms()
        returned for the bucket (its parameters' moments, then its chunks')."""
        groups = self.optimizer.param_groups
        hypers = [(g["lr"], *g["betas"], g["eps"], g["weight_decay"]) for g in groups]
        calls = FusedCalls.of(bucket, forms)
        params, grads = calls.params, [p.grad for p in calls.params]
        # Each count is set to its value before the step plus one (as _multi_tensor_adam
        # adds to CPU counts) once the kernels are queued: a refused call leaves them as
        # they were. A chunk steps from its parameter's count before the step.
        counts = [held(self.optimizer, p)["step"] for p in params]
        if any(g is None for g in grads) or calls.chunks:
            stepped = [i for i, g in enumerate(grads) if g is not None]
            params, grads, counts = ([x[i] for i in stepped] for x in (params, grads, counts))
            group_of, ms, vs, fmts = ([x[i] for i in stepped] for x in (
                calls.group_of, calls.ms, calls.vs, calls.fmts))
            before = list(counts)
            for c, m, v, fmt in calls.chunks:
                if c.param.grad is not None:
                    counts.append(held(self.optimizer, c.param)["step"])
                    before.append(self.binding.counters_before(c.param)["step"])
                    params.append(c.of(c.param))
                    grads.append(c.of(c.param.grad))
                    group_of.append(c.group)
                    ms.append(m)
                    vs.append(v)
                    fmts.append(fmt)
        else:
            group_of, ms, vs, fmts, before = calls.group_of, calls.ms, calls.vs, calls.fmts, counts
        if not params:
            return
        after = _C.counts_after(before)  # None for counters of other dtypes: torch's add
        added = None if after is not None else torch._foreach_add(before, _ONE, alpha=1.0)
        _C.kernels.adamw_step_many(
            params, grads, ms, vs, fmts, [hypers[gi] for gi in group_of],
            after if added is None else [a.item() for a in added],
            streams.current(params[0].device))
        if added is None:
            _C.set_counts(counts, after)
        else:
            copy_each(counts, list(added))


class FusedCalls:
    """What FusedStep.step takes of a bucket's plan and moment forms, gathered once and
    kept on the bucket while its forms stay (a step asks anew, moment_forms()): its whole
    parameters, each one's param group (index), its moments' stored tensors and their
    format, as the kernel call takes them; then per chunk (it, its moments' stored
    tensors, their format)."""

    def __init__(self, bucket, forms: list):
        self.forms = forms
        whole = [(gi, p) for gi, params in enumerate(bucket.groups) for p in params]
        moments = [(_stored(m), _stored(v), m.fmt) for m, v in zip(forms[0::2], forms[1::2])]
        self.group_of = [gi for gi, _ in whole]
        self.params = [p for _, p in whole]
        self.ms = [m for m, _, _ in moments[:len(whole)]]
        self.vs = [v for _, v, _ in moments[:len(whole)]]
        self.fmts = [fmt for _, _, fmt in moments[:len(whole)]]
        self.chunks = [(c, *mv) for c, mv in zip(bucket.chunks, moments[len(whole):])]

    @staticmethod
    def of(bucket, forms: list) -> "FusedCalls":
        calls = bucket.fused_calls
        if calls is None or calls.forms != forms:
            calls = bucket.fused_calls = FusedCalls(bucket, forms)
        return calls


def _param_fusable(p: torch.Tensor) -> bool:
    """True when the kernels can step p: fp32 on a device that runs them (a CUDA tensor,
    kernels built and on)."""
    return p.dtype == torch.float32 and codecs.kernels_used(p)


def _stored(form) -> list:
    """A moment's stored tensors as the kernel takes them: fp32 its working tensor (laid
    out as its parameter), else its stored tensors (q8: codes and scales)."""
    return [form.working] if form.fmt == "fp32" else list(form.tensors)

"""The fused AdamW step of a bucket on CUDA (kernels/adamw.cu).

Where it applies, each parameter of a bucket steps in one kernel that reads its
moments in their stored format (fp32, bf16, q8) and writes them back in it: no fp32
scratch for the moments, no decode and encode passes, none of the ~10 foreach ops of
torch's step. The arithmetic is torch's multi-tensor AdamW's, op for op, so the bits are
those of the unfused path (tests/gpu/test_codec_kernels.py holds it to them).

It applies to a bucket when the optimizer's step is torch.optim.Adam's (Adam, AdamW,
PagedAdamW) and would run its foreach implementation (foreach=True, or foreach and fused
left None, as by default), with decoupled weight decay (AdamW) or none, no amsgrad,
maximize, capturable or differentiable, float hyperparameters; every parameter of the
bucket has its state already (its first step is torch's own), and every grad is fp32
with its parameter's memory layout. Otherwise the bucket steps as before. The codec
kernels' switch (codecs.use_kernels) turns it off too; STATEPAGER_FUSED_ADAMW=0 turns off
just this.
"""
from __future__ import annotations

import os

import torch

from statepager import _C
from statepager.formats import codecs
from statepager.core.flat import flat_view

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

    def moment_forms(self, bucket) -> list | None:
        """The stored forms of the bucket's moments when the fused step may run it (its
        grads are checked later, by ready()): they need not be decoded. None otherwise."""
        if not (_fused_on and self.optimizer.param_groups):
            return None
        if not all(_group_fusable(g) for g, params in zip(self.optimizer.param_groups,
                                                          bucket.groups) if params):
            return None
        forms = []
        for p in bucket.params:
            if not (p.dtype == torch.float32 and _kernels_for(p)):
                return None
            state = self.optimizer.state.get(p)
            named = dict(self.binding.forms(p))
            if not state or "exp_avg" not in named or "exp_avg_sq" not in named \
                    or not isinstance(state.get("step"), torch.Tensor) or state["step"].is_cuda:
                return None
            forms += [named["exp_avg"], named["exp_avg_sq"]]
        return forms

    def ready(self, bucket) -> bool:
        """After before_bucket set the grads: True when every one is fp32, dense and laid
        out as its parameter, and no parameter is listed twice."""
        seen = set()
        for params in bucket.groups:
            for p in params:
                if id(p) in seen:
                    return False
                seen.add(id(p))
                g = p.grad
                if g is not None and (g.dtype != torch.float32 or g.layout != torch.strided
                                      or g.device != p.device or g.stride() != p.stride()):
                    return False
        return True

    @torch.no_grad()
    def step(self, bucket) -> None:
        """torch.optim.Adam.step on the bucket's parameters, one kernel per parameter."""
        stream = _stream(bucket.params[0])
        for group, params in zip(self.optimizer.param_groups, bucket.groups):
            lr, (beta1, beta2) = group["lr"], group["betas"]
            wd, eps = group["weight_decay"], group["eps"]
            for p in params:
                if p.grad is None:
                    continue
                state = self.optimizer.state[p]
                named = dict(self.binding.forms(p))
                m, v = named["exp_avg"], named["exp_avg_sq"]
                # _multi_tensor_adam's host arithmetic, expression for expression.
                state["step"].add_(_ONE, alpha=1.0)
                step = state["step"].item()
                bias_correction1 = 1 - beta1 ** step
                bias_correction2 = 1 - beta2 ** step
                step_size = (lr / bias_correction1) * -1
                _C.kernels.adamw_step(
                    flat_view(p), flat_view(p.grad), _stored(m), _stored(v), m.fmt,
                    1 - lr * wd if wd != 0 else None, 1 - beta1, beta2, 1 - beta2,
                    bias_correction2 ** 0.5, eps, step_size, stream)


def _kernels_for(p: torch.Tensor) -> bool:
    """True when p's device runs the kernels (a CUDA tensor, kernels built and on)."""
    return codecs.kernels_used(p)


def _stream(p: torch.Tensor) -> int:
    return torch.cuda.current_stream(p.device).cuda_stream


def _stored(form) -> list:
    """A moment's stored tensors as the kernel takes them (flat; q8 codes as uint8)."""
    if form.fmt == "fp32":
        return [flat_view(form.working)]
    if form.fmt == "q8":
        return [form.tensors[0].view(torch.uint8).view(-1), form.tensors[1].view(-1)]
    return [t.view(-1) for t in form.tensors]

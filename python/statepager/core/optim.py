"""PagedAdamW: mixed-precision AdamW whose fp32 masters and moments live in a Pager."""
from __future__ import annotations

import torch

from statepager import _C
from statepager.core import args, defaults, slices
from statepager.util.flat import flat_view
from statepager.core.hooks import Hooks
from statepager.core.pager import Pager


class PagedAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of a bf16/fp16 model, all state in `pager`.

    The model's parameters stay where they are. Each step streams the masters and
    moments bucket by bucket: the bucket's grads are upcast (fp32 grads are used as they
    are), AdamW steps the masters, and the model parameters get the updated masters,
    rounded to their dtype. Construction fills the masters bucket by bucket, so the
    pager never holds more than one bucket of them.

    moments: "fp32" (exact), "bf16" or "q8" on disk; mains: "fp32", or "residual" for a
    bf16 model: only the 16 bits the bf16 parameter lacks are stored, losslessly.
    atomic: how a step that fails leaves the state (Pager.attach's atomic).
    """

    def __init__(self, params, *, pager: Pager, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, amsgrad=False, foreach=None, fused=None,
                 bucket_size: int | None = None, depth: int | None = None,
                 log_steps: bool = False,
                 moments: str = "fp32", mains: str = "fp32", atomic="bucket",
                 stationary_bytes: int = 0):
        # Every argument is checked before the masters (pager tensors) are made.
        if not isinstance(pager, Pager):
            raise _C.UsageError(f"pager must be a statepager.Pager, not "
                                f"{type(pager).__name__} {pager!r}")
        pager.services.check_not_paused("PagedAdamW()")
        bucket_size, depth = args.bucketing(bucket_size, depth)
        log_steps, atomic = args.flag("log_steps", log_steps), args.atomicity(atomic)
        moments, mains = args.formats(moments, mains)
        stationary_bytes = args.stationary(stationary_bytes, atomic)
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                     amsgrad=args.flag("amsgrad", amsgrad),
                     foreach=args.optional_flag("foreach", foreach),
                     fused=args.optional_flag("fused", fused))
        groups = _param_groups(params)
        _check_hyperparameters(groups, pager.device, hyper)
        self._model_of: dict[int, torch.nn.Parameter] = {}
        # What fails from here on (a bucket the budget cannot hold) leaves the masters
        # to this object: the pager frees them when it is let go.
        # The masters' pieces follow the bucket size attach starts from (statepager.core.
        # defaults): one it lowers to fit the budget steps a larger master whole.
        bucket = defaults.bucketing(pager.page_size, pager.hbm_budget, bucket_size, depth)[0]
        master_groups = self._make_masters(pager, groups, bucket)
        if mains == "fp32":
            self._fill_masters(pager, [m for g in master_groups for m in g["params"]], bucket)
        # "residual": a master equal to its bf16 parameter has residual zero, which is what
        # a fresh (ZERO) stored form already holds.
        super().__init__(master_groups, **hyper)
        self.binding = pager.attach(
            self, bucket_size=bucket_size, depth=depth, log_steps=log_steps, moments=moments,
            mains=mains, atomic=atomic, stationary_bytes=stationary_bytes, hooks=Hooks(
                before_bucket=self._load_grads, after_bucket=self._store_params,
                model_param=self.model_param, before_chunk=self._load_grads_of_chunk,
                after_chunk=self._store_chunk))

    def _make_masters(self, pager: Pager, groups: list[dict], bucket_size: int) -> list[dict]:
        """The param groups over fp32 masters of the model's parameters (ZERO: no memory,
        no I/O), each laid out as its parameter, in pieces where it may step in chunks."""
        master_groups = []
        for group in groups:
            masters = []
            for p in group["params"]:
                pieces = slices.pieces(p.numel(), 4) \
                    if slices.may_step_in_chunks(p.numel(), bucket_size) else None
                m = pager.empty_like(p, dtype=torch.float32, pieces=pieces)
                m.requires_grad_(p.requires_grad)
                self._model_of[id(m)] = p
                masters.append(m)
            master_groups.append({**group, "params": masters})
        return master_groups

    def _fill_masters(self, pager: Pager, masters, bucket_size: int) -> None:
        """Each master from its model parameter, in buckets of about bucket_size (a master
        made of pieces piece by piece)."""
        parts = [(m, start, view.numel()) for m in masters
                 for start, view in _starts(pager.services.piece_views(m))]
        bucket, nbytes = [], 0
        for part in parts + [None]:
            if part is None or (bucket and nbytes + part[2] * 4 > bucket_size):
                views = [flat_view(m)[start:start + n] for m, start, n in bucket]
                pager.page_in(views)
                with torch.no_grad():
                    for view, (m, start, n) in zip(views, bucket):
                        view.copy_(flat_view(self._model_of[id(m)])[start:start + n])
                pager.page_out(views)
                bucket, nbytes = [], 0
            if part is not None:
                bucket.append(part)
                nbytes += part[2] * 4

    def _load_grads_of_chunk(self, master, start: int, stop: int) -> None:
        if start == 0:  # its first chunk in this step: the grad, whole (not a pager tensor)
            self._load_grads([master])

    @torch.no_grad()
    def _store_chunk(self, master, start: int, stop: int) -> None:
        if master.grad is not None:
            flat_view(self._model_of[id(master)])[start:stop].copy_(flat_view(master)[start:stop])
        if stop == master.numel():
            master.grad = None

    def model_param(self, master: torch.Tensor) -> torch.nn.Parameter:
        return self._model_of[id(master)]

    def _load_grads(self, masters) -> None:
        for m in masters:
            g = self._model_of[id(m)].grad
            m.grad = None if g is None else g if g.dtype == torch.float32 else g.float()

    @torch.no_grad()
    def _store_params(self, masters) -> None:
        for m in masters:
            if m.grad is not None:
                self._model_of[id(m)].copy_(m)
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._model_of.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()


def _starts(views):
    """(start element, view) of consecutive 1-D views."""
    at = 0
    for v in views:
        yield at, v
        at += v.numel()


def _param_groups(params) -> list[dict]:
    """`params` as torch.optim takes it (an iterable of tensors, or of param group dicts),
    as a list of param groups whose "params" are lists of tensors."""
    if isinstance(params, (torch.Tensor, str, bytes)) or not hasattr(params, "__iter__"):
        raise _C.UsageError(f"params must be an iterable of parameters or of param group "
                            f"dicts (as torch.optim takes), not {type(params).__name__}")
    groups = list(params)
    if not groups or not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for g, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise _C.UsageError(f"params: param group {g} must be a dict with 'params', not "
                                f"{type(group).__name__}")
        tensors = group["params"]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for i, p in enumerate(tensors):
            if not isinstance(p, torch.Tensor):
                raise _C.UsageError(f"param group {g} params[{i}] must be a torch.Tensor, "
                                    f"not {type(p).__name__} {p!r}")
        out.append({**group, "params": tensors})
    if not any(group["params"] for group in out):
        raise _C.UsageError("params is empty: PagedAdamW needs parameters to optimize")
    return out


def _check_hyperparameters(groups: list[dict], device: torch.device, hyper: dict) -> None:
    """torch's own checks of AdamW's arguments (lr, betas, eps, fused, ...), run on
    stand-in parameters of the masters' kind (fp32 on the pager's device)."""
    stand_in = [{**g, "params": [torch.empty(0, device=device)]} for g in groups]
    try:
        torch.optim.AdamW(stand_in, **hyper)
    except (ValueError, TypeError, RuntimeError) as e:
        raise _C.UsageError(f"PagedAdamW: {e}") from None

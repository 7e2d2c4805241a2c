"""PagedAdamW: mixed-precision AdamW whose fp32 masters and moments live in a Pager."""
from __future__ import annotations

import torch

from statepager.core import args, slices
from statepager.core.flat import flat_view
from statepager.core.pager import MiB, Pager


class PagedAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of a bf16/fp16 model, all state in `pager`.

    The model's parameters stay where they are. Each step streams the masters and
    moments bucket by bucket: the bucket's grads are upcast (fp32 grads are used as they
    are), AdamW steps the masters, and the model parameters get the updated masters,
    rounded to their dtype. Construction fills the masters bucket by bucket, so the
    pager never holds more than one bucket of them.

    moments: "fp32" (exact), "bf16" or "q8" on disk; mains: "fp32", or "residual" for a
    bf16 model: only the 16 bits the bf16 parameter lacks are stored, losslessly.
    """

    def __init__(self, params, *, pager: Pager, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, amsgrad=False, foreach=None, fused=None,
                 bucket_size: int = 256 * MiB, depth: int = 3, log_steps: bool = False,
                 moments: str = "fp32", mains: str = "fp32"):
        bucket_size, depth = args.bucketing(bucket_size, depth)  # before filling masters
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._model_of: dict[int, torch.nn.Parameter] = {}
        master_groups = []
        for group in groups:
            masters = []
            for p in group["params"]:
                # p's memory layout, in pieces where it may step in chunks
                pieces = slices.pieces(p.numel(), 4) \
                    if slices.may_step_in_chunks(p.numel(), bucket_size) else None
                m = pager.empty_like(p, dtype=torch.float32, pieces=pieces)
                m.requires_grad_(p.requires_grad)
                self._model_of[id(m)] = p
                masters.append(m)
            master_groups.append({**group, "params": masters})
        if mains == "fp32":
            self._fill_masters(pager, [m for g in master_groups for m in g["params"]],
                               bucket_size)
        # "residual": a master equal to its bf16 parameter has residual zero, which is what
        # a fresh (ZERO) stored form already holds.
        super().__init__(master_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, foreach=foreach, fused=fused)
        self.binding = pager.attach(self, bucket_size=bucket_size, depth=depth,
                                    log_steps=log_steps, before_bucket=self._load_grads,
                                    after_bucket=self._store_params, moments=moments,
                                    mains=mains, model_param=self.model_param,
                                    before_chunk=self._load_grads_of_chunk,
                                    after_chunk=self._store_chunk)

    def _fill_masters(self, pager: Pager, masters, bucket_size: int) -> None:
        """Each master from its model parameter, in buckets of about bucket_size (a master
        made of pieces piece by piece)."""
        parts = [(m, start, view.numel()) for m in masters
                 for start, view in _starts(pager.piece_views(m))]
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

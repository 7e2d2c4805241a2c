"""One parameter's optimizer step on slices: no bucket above bucket_size.

A parameter larger than a bucket steps in chunks of consecutive elements, in memory
order: each chunk's step is the optimizer's own step on views of the parameter, its
gradient and each parameter-shaped state tensor (exp_avg, exp_avg_sq, max_exp_avg_sq).
Adam's arithmetic is per element (weight decay and amsgrad included), but for the step
count, which is one scalar for the whole parameter: each chunk steps a copy of the count
as it was before the step, and the count itself is set once, after the last chunk, so
that it advances once per step whatever the number of chunks (fused, foreach and
for-loop variants alike: each adds 1 to the count it is given). The bits are those of
the whole-tensor step (tests/python/test_slices.py holds them to it).

Chunk boundaries (chunk_bounds) fall on multiples of CHUNK_ALIGN elements: there every
stored format splits into contiguous slices starting on 4 KiB file blocks, q8's codes
and scales in whole blocks (formats.stored.StoredForm.chunk).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from statepager import _C
from statepager.core import support
from statepager.util.flat import flat_view
from statepager.formats import codecs
from statepager.core.fused_adamw import applies_to

# Elements per alignment unit: 4 KiB of q8 scales (one per Q8_BLOCK elements), and so a
# multiple of 4 KiB of codes (1 byte), bf16 and int16 (2) and fp32 (4) elements too.
CHUNK_ALIGN = codecs.Q8_BLOCK * 4096 // 4


@dataclass(frozen=True, eq=False)
class Chunk:
    """Elements [start, stop), in memory order, of a parameter that steps in chunks, in
    param group `group`."""

    param: torch.Tensor
    group: int
    start: int
    stop: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This chunk's elements of t, a tensor shaped and laid out as the parameter."""
        return flat_view(t)[self.start:self.stop]


def chunk_bounds(numel: int, max_elements: int) -> list[tuple[int, int]]:
    """(start, stop) of consecutive chunks covering `numel` elements, each at most
    max_elements rounded down to CHUNK_ALIGN (one CHUNK_ALIGN at least), all starting
    on a multiple of CHUNK_ALIGN."""
    size = max(CHUNK_ALIGN, max_elements // CHUNK_ALIGN * CHUNK_ALIGN)
    return [(start, min(start + size, numel)) for start in range(0, numel, size)]


# The most bytes per element a parameter's state takes in a bucket (an fp32 main and two
# bf16 moments with their fp32 working tensors, a residual and an undo copy: 20).
MOST_BYTES_PER_ELEMENT = 24


def may_step_in_chunks(numel: int, bucket_size: int) -> bool:
    """True when a parameter of numel elements may step in chunks with this bucket_size:
    its masters are then made of pieces (pieces()); False when its state always fits."""
    return numel > CHUNK_ALIGN and numel * MOST_BYTES_PER_ELEMENT > bucket_size


def pieces(numel: int, element_size: int) -> list[int] | None:
    """Pager.empty's pieces for a tensor of `numel` elements of a parameter that steps in
    chunks: one per CHUNK_ALIGN elements, so that the elements of any chunk_bounds are
    whole pieces; None (one piece) for a tensor of one CHUNK_ALIGN or less."""
    if numel <= CHUNK_ALIGN:
        return None
    full, rest = divmod(numel, CHUNK_ALIGN)
    return [CHUNK_ALIGN * element_size] * full + ([rest * element_size] if rest else [])


def sliceable(optimizer: torch.optim.Optimizer) -> bool:
    """True when the optimizer's step may run on slices of a parameter: torch's Adam step
    (Adam, AdamW and subclasses that keep it), whose only shared state is the count."""
    return applies_to(optimizer)


def check_sliceable(optimizer: torch.optim.Optimizer, what: str) -> None:
    """UsageError naming `what` (a parameter larger than a bucket) when the optimizer's
    step cannot run on slices."""
    if not sliceable(optimizer):
        raise _C.UsageError(
            f"{what} is larger than bucket_size, and a {type(optimizer).__name__} step "
            "cannot run on slices of a parameter (only torch's Adam step, as Adam, AdamW "
            "and PagedAdamW run it, is known to act per element). Raise bucket_size above "
            "the largest parameter's state, or use Adam/AdamW.")


def counters(state: dict) -> dict:
    """Copies of a parameter's scalar tensor state (Adam's "step"), as step_in_slices
    takes them: the values of before the step."""
    return {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 0}


@torch.no_grad()
def step_in_slices(optimizer: torch.optim.Optimizer, step: Callable, group_index: int,
                   p: torch.Tensor, bounds: list[tuple[int, int]],
                   before: dict | None = None) -> None:
    """optimizer's step (`step(optimizer)`, its algorithm without hooks) of parameter p of
    param group `group_index`, chunk by chunk over `bounds` (chunk_bounds). p's state
    exists (its first step is whole, or created beforehand). Every param group's "params"
    is replaced while a chunk steps and put back after. p's counters are set once every
    chunk stepped, each chunk stepping from `before` (counters(), taken before the step's
    first chunk of p: so a step whose chunks are stepped in several calls still counts
    once), or from their values now."""
    if p.grad is None:
        return  # torch steps nothing, and counts nothing, for it
    state = optimizer.state[p]
    grad = _in_layout_of(p, p.grad)
    before = counters(state) if before is None else before
    sliced = [k for k, v in state.items() if support.pageable(v, p)]
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    stepped = {}
    try:
        for g in groups:
            g["params"] = []
        for start, stop in bounds:
            view = flat_view(p.detach())[start:stop]
            view.grad = flat_view(grad)[start:stop]
            chunk = dict(state)
            chunk.update({k: v.clone() for k, v in before.items()})
            chunk.update({k: flat_view(state[k])[start:stop] for k in sliced})
            optimizer.state[view] = chunk
            groups[group_index]["params"] = [view]
            try:
                step(optimizer)
            finally:
                del optimizer.state[view]
            stepped = chunk
    finally:
        for g, params in zip(groups, saved):
            g["params"] = params
    for k in before:
        state[k].copy_(stepped[k])


def _in_layout_of(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """grad, or a copy of it laid out as p (their flat views then match element for
    element)."""
    if grad.stride() == p.stride() and grad.layout == torch.strided:
        return grad
    return torch.empty_like(p, dtype=grad.dtype).copy_(grad)

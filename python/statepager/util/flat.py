"""flat_view: a dense tensor's elements as one 1-D view, in memory order (what the
stored forms move byte for byte); copy_each and zero_each: many element-for-element copies,
or zero fills, at once."""
from __future__ import annotations

import torch

from statepager import _C


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """t's elements as a 1-D view in memory order. t must be dense (contiguous, or a
    permutation of that: channels_last, a transpose), as every pager tensor is."""
    if t.is_contiguous():
        return t.view(-1)
    if not torch.ops.aten.is_non_overlapping_and_dense.default(t):
        raise _C.UsageError(f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} "
                            "has gaps or overlaps in memory: it has no flat view (clone it)")
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def copy_each(targets: list, sources: list) -> None:
    """targets[i].copy_(sources[i]) for every i, as torch's multi-tensor copy: on CUDA a
    few kernels for all (dtypes converted as copy_ converts them), not one per pair. The
    pairs go in groups of one (device, dtype) each way: torch copies a list that mixes
    them pair by pair."""
    groups = {}
    for t, s in zip(targets, sources):
        lists = groups.setdefault((t.device, t.dtype, s.device, s.dtype), ([], []))
        lists[0].append(t)
        lists[1].append(s)
    for group_targets, group_sources in groups.values():
        torch._foreach_copy_(group_targets, group_sources)


def zero_each(tensors: list) -> None:
    """t.zero_() for every t: contiguous tensors that lie end to end in one storage (a
    grad buffer's views) as one flat view each run, one fill kernel (torch's multi-tensor
    zero of a 1.34 B GPT's bucket of grads took 0.27 ms of the host's time on an H100);
    the rest as that multi-tensor zero, grouped by (device, dtype) as copy_each groups
    its pairs."""
    runs, rest = _runs(tensors)
    for first, numel in runs:
        first.as_strided((numel,), (1,)).zero_()
    groups = {}
    for t in rest:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for group in groups.values():
        torch._foreach_zero_(group)


def _runs(tensors: list) -> tuple[list, list]:
    """([(first tensor, elements)] of each run of contiguous tensors end to end in one
    storage, by address; [the others]): what zero_each fills as one view per run. A tensor
    autograd tracks is one of the others: a run's fill would be recorded on its first."""
    keyed, rest = [], []
    for t in tensors:
        if t.is_contiguous() and t.numel() and not t.requires_grad:
            # Storages of one start and size: a run within one lies within each.
            storage = t.untyped_storage()
            keyed.append(((storage.data_ptr(), storage.nbytes()), t.data_ptr(), t))
        elif t.numel():
            rest.append(t)
    keyed.sort(key=lambda k: (k[0], k[1]))
    runs, end = [], None  # end: (storage, address) just past the last run
    for storage, at, t in keyed:
        if runs and end == (storage, at) and t.dtype == runs[-1][0].dtype:
            runs[-1][1] += t.numel()
        else:
            runs.append([t, t.numel()])
        end = (storage, at + t.numel() * t.element_size())
    return runs, rest

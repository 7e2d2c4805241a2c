"""same(a, b): whether two nested captures (tensors, dicts, lists, tuples, plain values)
are bit-identical: tensors of the same dtype with equal values (on any device), the rest
equal."""
import torch


def same(a, b):
    if isinstance(a, torch.Tensor):
        # A paged state_dict() holds host copies where torch's holds device tensors.
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b

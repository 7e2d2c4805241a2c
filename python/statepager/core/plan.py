"""Which parameters step together: a streamed step's buckets (statepager.core.binding).

plan() puts an optimizer's parameters into buckets of about bucket_size bytes each, in
param-group order; a parameter larger than a bucket steps in chunks over consecutive
buckets; small parameters are dealt over the buckets in runs rather than packed in
order. The binding says how many bytes a parameter's step maps, whether it can step in
chunks and whether it may be dealt; plan() knows nothing of pagers or formats.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from statepager import _C
from statepager.core.slices import Chunk

if TYPE_CHECKING:
    from statepager.core.fused_adamw import FusedCalls
    from statepager.formats.codecs import ResidualMasters

# A parameter planned at most bucket_size / SMALL_SHARE bytes is small: dealt over the
# buckets (_deal).
SMALL_SHARE = 64


@dataclass
class Bucket:
    params: list                                 # distinct parameters, in param_groups order
    groups: list = field(default_factory=list)   # per param group: its params in this bucket
    chunks: list = field(default_factory=list)   # Chunks of parameters that step in chunks
    chunk_forms: list = field(default_factory=list)  # per chunk: its StoredForms by name
    stored: list = field(default_factory=list)   # paged tensors that persist (moved by I/O)
    working: list = field(default_factory=list)  # scratch fp32 tensors of narrow formats
    forms: list = field(default_factory=list)    # StoredForm of every paged tensor
    undo: list = field(default_factory=list)     # host copies of what a step overwrites
                                                 # outside the pager (statepager.atomic)
    nbytes: int = 0                              # bytes mapped while the bucket steps
    planned: int = 0                             # bytes planned for it (state to come included)
    # As of its forms (StateLayout.fill): fused_forms(), residency.incoming() and the bytes
    # of `stored`; a step finds them again unless the fused step's choice changed.
    fused: list | None = None
    incoming: list = field(default_factory=list)
    stored_bytes: int = 0
    # Gathered once for its forms (Note [A bucket keeps what its forms fix]): its residual
    # forms' masters and UndoCopies.targets of its parameters (by StateLayout.fill), the
    # fused step's calls for the moment forms it has.
    masters: ResidualMasters | None = None
    undo_targets: list = field(default_factory=list)
    fused_calls: FusedCalls | None = None
    # residency's split of its forms by format, for the forms a step skips (made again
    # for other forms or another skip): (forms, skip, (bf16 and q8, residual)).
    coded: tuple | None = None


def plan(groups: list, bucket_size: int, planned_bytes: Callable, chunking: Callable,
         dealable: Callable, order: Callable | None = None) -> tuple[list[Bucket], dict]:
    """(buckets, split) for the param groups `groups`: buckets of about bucket_size over
    their parameters, in order (param-group order, or by order(p) where given: the
    forward's, statepager.core.overlap; a parameter listed twice steps twice, as in
    torch, in one bucket); a parameter larger than a bucket in chunks, over consecutive buckets;
    small parameters dealt over the buckets (_deal). Within a bucket, its parameters keep
    the param groups' order. split: id(param) -> its chunks' (start, stop) bounds.

    planned_bytes(p, group): the bytes p's step maps. chunking(p, nbytes): p's chunk
    bounds, or None when it steps whole. dealable(p, group): whether p, when small, may
    join any bucket without changing how that bucket steps (a resident parameter, or one
    the fused step cannot run, would turn a bucket's fused step off: those stay in
    order). UsageError when a parameter that steps in chunks is listed twice."""
    buckets, home, small, split = [], {}, [], {}

    def room(nbytes: int) -> Bucket:
        """The last bucket, or a new one when nbytes more would pass bucket_size;
        nbytes are counted in it."""
        cur = buckets[-1] if buckets else None
        if cur is None or ((cur.params or cur.chunks)
                           and cur.planned + nbytes > bucket_size):
            cur = _new_bucket(buckets, len(groups))
        cur.planned += nbytes
        return cur

    listed = [(gi, p) for gi, group in enumerate(groups) for p in group["params"]]
    if order is not None:
        listed.sort(key=lambda item: order(item[1]))  # stable: ties keep group order
    for gi, p in listed:
        group = groups[gi]
        if id(p) in home:
            continue
        nbytes = planned_bytes(p, group)
        bounds = chunking(p, nbytes)
        if bounds:
            split[id(p)] = bounds
            for start, stop in bounds:
                part = -(-nbytes * (stop - start) // p.numel())
                room(part).chunks.append(Chunk(p, gi, start, stop))
            home[id(p)] = None
        elif nbytes * SMALL_SHARE <= bucket_size and dealable(p, group):
            small.append((p, nbytes))
            home[id(p)] = None
        else:
            home[id(p)] = b = room(nbytes)
            b.params.append(p)
    _deal(small, buckets, home, len(groups), bucket_size)
    _list_members(buckets, groups, home)
    return buckets, split


def _deal(small: list, buckets: list, home: dict, ngroups: int, bucket_size: int) -> None:
    """Deals the small parameters, (param, planned bytes) in order, over the buckets in
    order, a run to each: an equal share of what is left, as far as the bucket has room;
    what none has room for fills new buckets at the end.

    Why deal: a bucket's host work (launches, per-tensor bookkeeping) grows with its
    tensors, not its bytes. Packed in order, the small parameters (norms, biases: Megatron
    lists them in a param group of their own, last) made one bucket of hundreds of
    tensors whose step took the host 11 ms while the copy engines idled at the step's end
    (the 1.34 B GPT's q8 step on the H200, 1 ms for the others); dealt, each bucket's
    share hides under its copies. Why runs: a pager makes the masters in parameter order,
    so the small ones lie together; a run is one stretch of them, and the buckets in
    flight, consecutive, map consecutive stretches, their pages once. Dealt one by one,
    every bucket touched every page of that stretch, past the window
    (StreamedOptimizer.window_bytes) that bounds a step."""
    i = 0
    for k, b in enumerate(buckets):
        share = -(-(len(small) - i) // (len(buckets) - k))
        for p, nbytes in small[i:i + share]:
            if b.planned + nbytes > bucket_size:
                break
            _take(b, p, nbytes, home)
            i += 1
    cur = None
    for p, nbytes in small[i:]:
        if cur is None or cur.planned + nbytes > bucket_size:
            cur = _new_bucket(buckets, ngroups)
        _take(cur, p, nbytes, home)


def _take(b: Bucket, p, nbytes: int, home: dict) -> None:
    b.planned += nbytes
    b.params.append(p)
    home[id(p)] = b


def _new_bucket(buckets: list, ngroups: int) -> Bucket:
    b = Bucket(params=[], groups=[[] for _ in range(ngroups)])
    buckets.append(b)
    return b


def _list_members(buckets: list, groups: list, home: dict) -> None:
    """Puts each bucket's params (placed by plan and _deal) in the param groups' order and
    lists its per-group members (a parameter listed twice steps twice); home: id(param)
    -> its bucket, None for one that steps in chunks."""
    first = {}
    for gi, group in enumerate(groups):
        for p in group["params"]:
            b = home[id(p)]
            if b is None and id(p) in first:
                raise _C.UsageError(
                    f"param group {gi} lists a parameter again that steps in chunks (its "
                    "state is larger than bucket_size): list it once, or raise bucket_size")
            first.setdefault(id(p), len(first))
            if b is not None:
                b.groups[gi].append(p)
    for b in buckets:
        b.params.sort(key=lambda p: first[id(p)])

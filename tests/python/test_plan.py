"""statepager.core.plan: which parameters step together, without a pager."""
import pytest
import torch

from statepager import _C
from statepager.core import plan


def params(*sizes):
    return [torch.zeros(n) for n in sizes]


def bytes_of(p, group):
    return p.numel()


def whole(p, nbytes):
    return None


def anyone(p, group):
    return True


def members(buckets, everything):
    index = {id(p): i for i, p in enumerate(everything)}
    return [[index[id(p)] for p in b.params] for b in buckets]


def test_small_parameters_are_dealt_in_runs_in_the_groups_order():
    big, small = params(60, 60, 60), params(1, 1, 1, 1, 1, 1, 1)
    groups = [{"params": big}, {"params": small}]
    buckets, split = plan.plan(groups, 64, bytes_of, whole, anyone)
    assert split == {}
    # A run each, an equal share of what is left: 3, then 2 and 2 (60 + 4 fit in 64).
    assert members(buckets, big + small) == [[0, 3, 4, 5], [1, 6, 7], [2, 8, 9]]
    assert [b.planned for b in buckets] == [63, 62, 62]
    assert [len(b.groups[1]) for b in buckets] == [3, 2, 2]


def test_small_parameters_open_a_bucket_when_none_has_room():
    big, small = params(64, 64), params(1, 1, 1)
    buckets, _ = plan.plan([{"params": big + small}], 64, bytes_of, whole, anyone)
    assert members(buckets, big + small) == [[0], [1], [2, 3, 4]]


def test_a_small_parameter_that_may_not_be_dealt_stays_in_order():
    a, s, b, t = params(40, 1, 40, 1)
    buckets, _ = plan.plan([{"params": [a, s, b, t]}], 64, bytes_of, whole,
                           lambda p, group: p is not s)
    assert members(buckets, [a, s, b, t]) == [[0, 1, 3], [2]]  # s in order, t dealt
    buckets, _ = plan.plan([{"params": [a, b, s, t]}], 64, bytes_of, whole,
                           lambda p, group: p is not s)
    assert members(buckets, [a, b, s, t]) == [[0, 3], [1, 2]]


def test_a_bucket_lists_its_parameters_in_the_groups_order():
    a, s, b, t = params(40, 1, 40, 1)
    buckets, _ = plan.plan([{"params": [s, a]}, {"params": [t, b]}], 64, bytes_of, whole, anyone)
    assert members(buckets, [a, s, b, t]) == [[1, 0], [3, 2]]
    assert buckets[0].groups == [[s, a], []] and buckets[1].groups == [[], [t, b]]


def test_a_parameter_listed_twice_steps_twice_in_one_bucket():
    a, s = params(40, 1)
    buckets, _ = plan.plan([{"params": [a, s, a, s]}], 64, bytes_of, whole, anyone)
    assert len(buckets) == 1 and buckets[0].params == [a, s]
    assert buckets[0].groups == [[a, s, a, s]] and buckets[0].planned == 41


def test_chunks_fill_consecutive_buckets_and_a_chunked_parameter_twice_is_refused():
    big, s = params(100, 1)

    def halves(p, nbytes):
        return [(0, 50), (50, 100)] if nbytes > 64 else None

    buckets, split = plan.plan([{"params": [big, s]}], 64, bytes_of, halves, anyone)
    assert split == {id(big): [(0, 50), (50, 100)]}
    assert [[(c.start, c.stop) for c in b.chunks] for b in buckets] == [[(0, 50)], [(50, 100)]]
    assert [b.params for b in buckets] == [[s], []]
    with pytest.raises(_C.UsageError, match="lists a parameter again that steps in chunks"):
        plan.plan([{"params": [big, big]}], 64, bytes_of, halves, anyone)

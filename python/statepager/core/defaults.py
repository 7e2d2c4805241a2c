"""What a Pager and attach() choose where the caller leaves a knob to them: the page size
from the device and the HBM budget, the bucket size and depth from the page size and the
budget (see Note [Defaults from what is known] in docs/design.md). Explicit arguments
always win; attach then only checks that the step's window fits (Planner.fit).
"""
from __future__ import annotations

from statepager.util.units import KiB, MiB

GRANULARITY = {"cuda": 2 * MiB, "cpu": 4 * KiB}  # the smallest page each backend maps
# Pages as large as a bucket's stored tensors stream fastest on the H200 measured (a map
# call costs about 1 ms while copies run), and no larger than this one helps; on the host
# backend a map is an mmap, and smaller pages waste less of a small pool.
LARGEST_PAGE = {"cuda": 256 * MiB, "cpu": 32 * MiB}
# A budget holds this many pages at least: the window of a few buckets, each rounded to
# its pages per tensor, then loses little to the rounding.
PAGES_IN_A_BUDGET = 32
LARGEST_BUCKET = 512 * MiB  # half the per-bucket work of 256 MiB per byte moved
DEPTHS = (4, 3, 2)          # 4: two page-ins in flight, one's mapping under another's copy


def page_size(device_type: str, hbm_budget: int | None) -> int:
    """The largest power-of-two page, a multiple of the device's granularity, of at most
    LARGEST_PAGE and hbm_budget / PAGES_IN_A_BUDGET."""
    granularity, largest = GRANULARITY[device_type], LARGEST_PAGE[device_type]
    if hbm_budget is not None:
        largest = min(largest, hbm_budget // PAGES_IN_A_BUDGET)
    page = granularity
    while page * 2 <= largest:
        page *= 2
    return page


def bucketing(page: int, hbm_budget: int | None, bucket_size: int | None,
              depth: int | None) -> tuple[int, int]:
    """attach()'s bucket_size and depth where given, else: unbounded, LARGEST_BUCKET at
    depth 4; within a budget, the largest power-of-two bucket (at most LARGEST_BUCKET,
    at least a page) of which `depth` buckets with two pages of rounding each fit, at the
    largest of DEPTHS that leaves one; the smallest at depth 2 where none does (attach
    then refuses, naming the budget it needs)."""
    depths = (depth,) if depth is not None else DEPTHS
    if bucket_size is not None:
        return bucket_size, depths[0] if hbm_budget is None else _deepest(
            page, hbm_budget, bucket_size, depths)
    if hbm_budget is None:
        return LARGEST_BUCKET, depths[0]
    for d in depths:
        room = hbm_budget // d - 2 * page
        bucket = LARGEST_BUCKET
        while bucket > page and bucket > room:
            bucket //= 2
        if bucket <= room:
            return bucket, d
    return page, depths[-1]


def _deepest(page: int, hbm_budget: int, bucket_size: int, depths: tuple) -> int:
    """The largest of `depths` at which buckets of bucket_size fit the budget (the last
    where none does)."""
    for d in depths:
        if d * (bucket_size + 2 * page) <= hbm_budget:
            return d
    return depths[-1]

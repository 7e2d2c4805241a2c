"""An attached optimizer's buckets (statepager.core.binding): planned by
statepager.core.plan over what statepager.core.layout says each parameter maps, which
parameters step in chunks, and the window of physical bytes the step's pipeline maps."""
from __future__ import annotations

from statepager import _C
from statepager.core import slices
from statepager.core import plan as planning
from statepager.core.hooks import Hooks
from statepager.core.late_reads import ExceptionCounts
from statepager.core.layout import StateLayout
from statepager.core.state_access import held
from statepager.core.plan import Bucket
from statepager.core.residency import nbytes
from statepager.util.units import MiB


def page_ins_ahead(depth: int) -> int:
    """Page-ins a step keeps in flight beyond the next bucket to step, at most, with a
    window of `depth` consecutive buckets: the rest of it is the bucket stepping and
    those paging out (statepager.core.pipeline)."""
    return max(1, depth - 2)


class Planner:
    """The plan of one binding: its buckets, filled (StateLayout.fill), and the param
    groups' layout they were made for."""

    def __init__(self, layout: StateLayout, *, bucket_size: int, depth: int, hooks: Hooks,
                 stationary_bytes: int = 0):
        self.layout = layout
        self.bucket_size, self.depth = bucket_size, depth
        # The first buckets whose stored forms take at most this many bytes at rest stay
        # mapped between steps (Note [Stationary buckets]); `stationary` of them in the plan.
        self.stationary_bytes = stationary_bytes
        self.stationary = 0
        self._stationary_pages = 0  # stationary_pages() as last counted
        self.hooks = hooks  # chunks need chunk hooks beside bucket hooks
        self.buckets: list[Bucket] = []
        # None: buckets in param-group order, small parameters dealt over them
        # (plan._deal); else order(p) ranks the parameters, the forward's order, where it
        # waits for each bucket in turn (statepager.core.overlap), and none is dealt.
        self.order = None
        self._planned_for: list = []  # groups_layout() of the last plan
        self._pages_of: dict = {}  # id(bucket) -> its pages as last counted (_pages)

    def groups_layout(self) -> list:
        """What a plan is made for: the parameters of each param group, by identity."""
        return [[id(p) for p in g["params"]] for g in self.layout.optimizer.param_groups]

    def changed(self) -> bool:
        """True when the param groups changed since the last plan, or the order did."""
        return self.groups_layout() != self._planned_for

    def set_order(self, order) -> None:
        """Sets order (see __init__); the next planned() plans anew."""
        self.order, self._planned_for = order, []

    def plan(self, to_store: bool = True) -> list[Bucket]:
        """Plans the buckets for the param groups as they are now (statepager.core.plan),
        filled (their stored tensors moved to the binding's store unless to_store=False),
        and returns them. Small parameters are dealt unless resident; where the fused step
        runs some, only those it runs (another would turn off the fused step of each
        bucket it joined)."""
        layout = self.layout
        groups = layout.optimizer.param_groups
        fused = layout.fused and {id(p) for g in groups for p in g["params"]
                                  if layout.fused.may_step(g, p)}

        def dealable(p, group: dict) -> bool:
            return self.order is None and not layout.resident(p) and \
                (not fused or id(p) in fused)

        buckets, layout.split = planning.plan(groups, self.bucket_size, layout.planned_bytes,
                                              self._chunking, dealable, self.order)
        for b in buckets:
            layout.fill(b, to_store)
        self._planned_for = self.groups_layout()
        self.buckets = buckets
        self.stationary = self._stationary_count(buckets)
        self._pages_of = {}
        return buckets

    def _stationary_count(self, buckets: list[Bucket]) -> int:
        """How many of the first buckets take at most stationary_bytes at rest (state yet
        to be created estimated as the plan estimates it)."""
        layout, total, count = self.layout, 0, 0
        groups = layout.optimizer.param_groups
        for b in buckets if self.stationary_bytes else ():
            total += sum(layout.planned_bytes(p, groups[g], at_rest=True)
                         for g, params in enumerate(b.groups) for p in params)
            total += sum(layout.planned_bytes(c.param, groups[c.group], at_rest=True)
                         * (c.stop - c.start) // c.param.numel() for c in b.chunks)
            if total > self.stationary_bytes:
                break
            count += 1
        return count

    def stationary_buckets(self) -> list[Bucket]:
        """The plan's first `stationary` buckets, which stay mapped between steps."""
        return self.buckets[:self.stationary]

    def _chunking(self, p, nbytes: int) -> list[tuple[int, int]] | None:
        """The chunks p steps in when its `nbytes` are more than a bucket and it can: the
        optimizer's step is Adam's, bucket hooks have chunk hooks beside them, and p's
        pager tensors (the parameter when the pager owns it, and its state) are made of
        pieces (slices.pieces) or not made yet. None: p is a bucket of its own."""
        layout, hooks = self.layout, self.hooks
        if nbytes <= self.bucket_size or p.numel() <= slices.CHUNK_ALIGN or layout.resident(p):
            return None
        if not slices.sliceable(layout.optimizer) or layout.deferred is None:
            return None
        if (hooks.before_bucket and not hooks.before_chunk) or \
                (hooks.after_bucket and not hooks.after_chunk):
            return None
        if layout.stored_whole(p):
            return None
        pager = layout.pager
        made = [p] if pager.owns(p) else []
        made += [v for v in held(layout.optimizer, p, {}).values() if pager.owns(v)]
        if not all(pager.services.pieces(t) == slices.pieces(t.numel(), t.element_size())
                   for t in made):
            return None
        bounds = slices.chunk_bounds(p.numel(), self.bucket_size * p.numel() // nbytes)
        return bounds if len(bounds) > 1 else None

    def fit(self, budget: int | None, bucket_given: bool, depth_given: bool) -> None:
        """Plans (to_store=False), then, while the window is over `budget`, lowers what
        attach left to its defaults (statepager.core.defaults): the depth down to 3, then
        the bucket size by halves (down to a page, the depth back up), then the depth to
        2. What still does not fit, attach refuses."""
        page = self.layout.pager.page_size
        self.plan(to_store=False)
        deepest = self.depth
        while budget is not None and self.window() > budget:
            if not depth_given and self.depth > 3:
                self.depth -= 1
            elif not bucket_given and self.bucket_size // 2 >= page:
                self.bucket_size, self.depth = self.bucket_size // 2, deepest
                self.plan(to_store=False)
            elif not depth_given and self.depth > 2:
                self.depth -= 1
            else:
                return

    def whole(self, buckets: list[Bucket]):
        """`buckets`, each parameter that steps in chunks as a bucket of its own, whole
        (filled here: their stored forms in the binding's store)."""
        groups = self.layout.optimizer.param_groups
        for b in buckets:
            if not b.chunks:
                yield b
                continue
            if b.params:
                whole = Bucket(params=b.params, groups=b.groups)
                self.layout.fill(whole)
                yield whole
            for c in b.chunks:
                if c.start == 0:
                    whole = Bucket(params=[c.param], groups=[[] for _ in groups])
                    whole.groups[c.group].append(c.param)
                    self.layout.fill(whole)
                    yield whole

    def window(self) -> int:
        """Physical bytes the step's pipeline maps at most (window_parts), the stationary
        buckets' stored forms included."""
        bucket, held_bytes = self.window_parts()
        return bucket + held_bytes + self.stationary_pages() * self.layout.pager.page_size

    def stationary_pages(self) -> int:
        """The pages the stationary buckets' stored forms map (state yet to be created
        counted as _pages counts it)."""
        page = self.layout.pager.page_size
        try:
            self._stationary_pages = _held([(page_runs(b.stored, page), self.new_pages(b))
                                            for b in self.stationary_buckets()])
        except RuntimeError:  # a closed Pager's tensors have no data: as last counted
            pass
        return self._stationary_pages

    def refuse_a_window_over(self, budget: int | None) -> None:
        """UsageError when the pipeline's window is more than hbm_budget (None: none)."""
        (buckets, held), window = self.window_parts(), self.window()
        if budget is None or window <= budget:
            return
        residual = (f" + the residual masters' scratch of {ExceptionCounts.LAG} buckets, "
                    f"held until their exceptions are counted ({held / MiB:.0f} MiB)"
                    if held else "")
        stationary = window - buckets - held
        if stationary:
            residual += (f" + the stored forms of the {self.stationary} stationary buckets "
                         f"({stationary / MiB:.0f} MiB: lower stationary_bytes)")
        raise _C.UsageError(
            f"hbm_budget {budget / MiB:.0f} MiB cannot hold the step's pipeline: the pages "
            f"of {self.depth} consecutive buckets of {self.bucket_size / MiB:g} MiB, each "
            f"tensor's rounded to pages of {self.layout.pager.page_size / MiB:g} MiB "
            f"({buckets / MiB:.0f} MiB){residual} = {window / MiB:.0f} MiB. Give hbm_budget "
            f"{-(-window // MiB)} MiB at least, or lower depth, bucket_size or the Pager's "
            "page_size (a parameter whose state is larger than bucket_size "
            "steps in chunks of at most bucket_size, of 262144 elements at least; it is a "
            "bucket of its own when its optimizer is not Adam's, when bucket hooks come "
            "without chunk hooks, or when its pager tensor was made without "
            "Pager.empty(pieces=...)).")

    def window_parts(self) -> tuple[int, int]:
        """The pages `depth` consecutive buckets map at most, each page they share counted
        once (see Note [The window counts the pages its buckets touch]; a stationary
        bucket's stored forms counted apart, stationary_pages), and the residual
        masters' scratch of the last ExceptionCounts.LAG buckets stepped."""
        page = self.layout.pager.page_size
        pages = [self._pages(b, i < self.stationary) for i, b in enumerate(self.buckets)]
        depth = min(self.depth, len(pages))
        window = max((_held(pages[i:i + depth]) for i in range(len(pages) - depth + 1)),
                     default=0)
        scratch = max((nbytes(f.working for f in b.forms if f.fmt == "residual")
                       for b in self.buckets), default=0)
        held_bytes = ExceptionCounts.LAG * (scratch + 2 * page) if scratch else 0
        return window * page, held_bytes

    def _pages(self, b: Bucket, stationary: bool = False) -> tuple[list, int]:
        """The pages bucket b's step maps: (the runs of pages its incoming tensors touch,
        by address, as sorted disjoint (first, last) pairs; the pages of state yet to be
        created, planned beyond them: its bytes in whole pages and two more, as the arena
        makes a bucket's new state in one or two runs, its tensors one after another or
        around a hole); of a stationary bucket, its scratch's alone. Counted anew each
        time (one call into C++), kept for a closed Pager, whose tensors have no data."""
        try:
            counted = ((page_runs(b.incoming[len(b.stored):], self.layout.pager.page_size), 0)
                       if stationary else
                       (page_runs(b.incoming, self.layout.pager.page_size), self.new_pages(b)))
        except RuntimeError:
            if id(b) not in self._pages_of:
                raise
            return self._pages_of[id(b)]
        self._pages_of[id(b)] = counted
        return counted

    def new_pages(self, b: Bucket) -> int:
        """The pages bucket b's state yet to be created maps, at most (see _pages)."""
        extra = max(0, b.planned - b.nbytes)
        return -(-extra // self.layout.pager.page_size) + 2 if extra else 0


def page_runs(tensors, page: int) -> list:
    """The pages `tensors` touch, by address, as sorted disjoint (first, last) runs."""
    return _C.page_runs(list(tensors), page)


def _merged(runs: list) -> list:
    """Runs of pages (first, last), merged into sorted disjoint runs."""
    out = []
    for first, last in sorted(runs):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


def _held(pages: list) -> int:
    """The pages the buckets counted by Planner._pages map together: a page two of them
    touch is mapped once (the pool counts references per page), state yet to be created
    is counted for each."""
    runs = _merged([r for touched, _ in pages for r in touched])
    return sum(last - first + 1 for first, last in runs) + sum(new for _, new in pages)

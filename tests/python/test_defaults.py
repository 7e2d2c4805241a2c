"""What Pager and attach() choose when left to their defaults (statepager.core.defaults),
and the step's window counted per tensor's pages: a window attach accepts holds every
step, and attach's refusal names the budget that fits."""
import itertools
import re

import pytest
import torch

import statepager
from statepager import Pager
from statepager.core import defaults

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def test_the_page_follows_the_device_and_the_budget():
    assert defaults.page_size("cuda", None) == 256 * MiB
    assert defaults.page_size("cuda", 8 * GiB) == 256 * MiB
    assert defaults.page_size("cuda", 256 * MiB) == 8 * MiB
    assert defaults.page_size("cuda", 32 * MiB) == 2 * MiB  # the granularity at least
    assert defaults.page_size("cpu", None) == 32 * MiB
    assert defaults.page_size("cpu", 1 * MiB) == 32 * KiB


def test_buckets_follow_the_page_and_the_budget():
    assert defaults.bucketing(256 * MiB, None, None, None) == (512 * MiB, 4)
    # 4 x (512 MiB + 2 pages of 256 MiB) > 3 GiB: the depth first, then halves.
    assert defaults.bucketing(256 * MiB, 3 * GiB, None, None) == (256 * MiB, 4)
    assert defaults.bucketing(8 * MiB, 256 * MiB, None, None) == (32 * MiB, 4)
    assert defaults.bucketing(8 * MiB, 256 * MiB, 64 * MiB, None) == (64 * MiB, 3)
    assert defaults.bucketing(8 * MiB, 256 * MiB, None, 2) == (64 * MiB, 2)
    assert defaults.bucketing(8 * MiB, 20 * MiB, None, None) == (8 * MiB, 2)  # none fits


def params(n: int = 24):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5000 + 700 * i).bfloat16()) for i in range(n)] + \
        [torch.nn.Parameter(torch.randn(300_000).bfloat16())]  # one steps in chunks


def run(directory, budget, steps=3, begun=None, **options):
    """PagedAdamW over params() through a Pager of `budget`: (the window attach counted,
    the peak mapped, the params after `steps` steps). begun: a list, each step begun
    (begin_step) before step(), and its pipeline appended."""
    ps, options = params(), dict(options)
    with Pager(directory, page_size=options.pop("page_size", None), hbm_budget=budget) as p:
        opt = statepager.PagedAdamW(ps, pager=p, lr=1e-2, **options)
        window = opt.binding.window_bytes  # as attach counted it
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            for q in ps:
                q.grad = torch.randn(q.shape, generator=g).bfloat16()
            if begun is not None:
                opt.binding.begin_step()
                begun.append(opt.binding._steps._begun)
            opt.step()
        return window, p.stats()["peak_mapped_bytes"], \
            [q.detach().clone() for q in ps]


def test_attach_left_to_its_defaults_streams_the_largest_buckets(store_dir):
    with Pager(store_dir) as p:
        assert p.page_size == 32 * MiB
        b = p.attach(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1000))]))
        assert (b.bucket_size, b.depth) == (512 * MiB, 4)


@pytest.mark.parametrize("moments, mains", [("fp32", "fp32"), ("q8", "residual")])
def test_defaults_fit_a_tight_budget_and_step_as_without_one(tmp_path, moments, mains):
    budget = 16 * MiB  # a chunk of the large parameter maps 3 MiB and more
    window, peak, got = run(str(tmp_path / "tight"), budget, moments=moments, mains=mains)
    assert window <= budget and peak <= budget
    _, _, want = run(str(tmp_path / "free"), None, moments=moments, mains=mains)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("page, bucket, formats", list(itertools.product(
    (16 * KiB, 64 * KiB), (64 * KiB, 256 * KiB),
    (("fp32", "fp32"), ("q8", "residual"), ("bf16", "fp32")))))
def test_a_window_attach_accepts_holds_every_step(tmp_path, page, bucket, formats):
    """The window counts the pages each bucket's tensors touch: given exactly that as
    hbm_budget, attach accepts and every step runs within it."""
    moments, mains = formats
    options = dict(page_size=page, bucket_size=bucket, depth=3, moments=moments, mains=mains)
    window, _, want = run(str(tmp_path / "free"), None, **options)
    got_window, peak, got = run(str(tmp_path / "exact"), window, **options)
    assert got_window == window and peak <= window
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("page, depth", [(16 * KiB, 3), (64 * KiB, 3), (16 * KiB, 6)])
def test_a_begun_step_fills_the_window_within_the_budget(tmp_path, page, depth):
    """begin_step() pages in past the buckets a step keeps in flight, as far as the
    window's pages hold. Under an hbm_budget of exactly the window, steps begun so run
    within it and step as without."""
    options = dict(page_size=page, bucket_size=64 * KiB, depth=depth, moments="q8",
                   mains="residual")
    window, _, want = run(str(tmp_path / "free"), None, steps=4, **options)
    begun = []
    _, peak, got = run(str(tmp_path / "exact"), window, steps=4, begun=begun, **options)
    assert peak <= window
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(pipeline is not None for pipeline in begun)
    first = max(1, depth - 2) + 1  # what a step that is not begun pages in first
    assert max(pipeline.page_ins.due for pipeline in begun[1:]) > first


@pytest.mark.parametrize("page, formats", [(16 * KiB, ("q8", "residual")),
                                           (64 * KiB, ("q8", "residual")),
                                           (16 * KiB, ("fp32", "fp32"))])
def test_page_ins_are_admitted_by_pages_with_page_outs_held_back(tmp_path, monkeypatch,
                                                                 page, formats):
    """Every page-out held back until the pipeline waits for it: each page-in waits for
    room by the pages held, so the step maps at most its window (hbm_budget exactly the
    window: a page more would fail a page-in, no page-out being in flight to make room)
    and steps as without. With q8 moments a stepped bucket holds its stored forms' pages
    alone (its fp32 scratch dropped), so more stepped buckets await their page-outs at a
    page-in than a count of `depth` buckets resident or in flight would allow."""
    from held_page_outs import hold_page_outs
    from statepager.core.page_ins import PageIns

    moments, mains = formats
    options = dict(page_size=page, bucket_size=64 * KiB, depth=3, moments=moments, mains=mains)
    window, _, want = run(str(tmp_path / "free"), None, **options)
    gate = hold_page_outs(monkeypatch)
    gate["held"] = True
    awaiting = []  # at each page-in the pipeline issues: buckets awaiting their page-outs
    page_in = PageIns._page_in

    def counting(self, j, *args):
        awaiting.append(sum(not h.issued for h in gate["made"] if h.page_out))
        return page_in(self, j, *args)
    monkeypatch.setattr(PageIns, "_page_in", counting)
    got_window, peak, got = run(str(tmp_path / "exact"), window, **options)
    assert got_window == window and peak <= window
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert max(awaiting) >= 1
    if moments == "q8":
        assert max(awaiting) >= options["depth"]


def test_the_window_counts_a_page_that_neighbouring_buckets_share_once(tmp_path):
    """Buckets of 64 KiB over pages of 64 KiB: neighbours share pages, which the pool maps
    once. The window is the largest union of the pages `depth` consecutive buckets touch,
    less than those pages counted per bucket (a budget of exactly it holds every step:
    above)."""
    ps = params()
    with Pager(str(tmp_path / "s"), page_size=64 * KiB) as p:
        opt = statepager.PagedAdamW(ps, pager=p, lr=1e-2, bucket_size=64 * KiB, depth=3)
        for q in ps:
            q.grad = torch.ones_like(q)
        opt.step()  # the moments made: every page known by address

        def touched(bucket) -> set:
            return {page for t in bucket.incoming if t.numel()
                    for page in range(t.data_ptr() // p.page_size,
                                      (t.data_ptr() + t.numel() * t.element_size() - 1)
                                      // p.page_size + 1)}

        pages = [touched(b) for b in opt.binding.buckets]
        runs = [pages[i:i + 3] for i in range(len(pages) - 2)]
        union = max(len(set().union(*run)) for run in runs)
        alone = max(sum(len(s) for s in run) for run in runs)
        assert opt.binding.window_bytes == union * p.page_size
        assert union < alone


def test_explicit_settings_win_and_the_refusal_names_a_budget_that_fits(tmp_path):
    """bucket_size and depth given are kept, not lowered to fit: attach refuses, naming
    the budget they need, and accepts that budget."""
    def attach(directory, budget):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
        opt = torch.optim.AdamW(model.parameters())
        with Pager(directory, page_size=64 * KiB, hbm_budget=budget) as p:
            b = p.attach(opt, bucket_size=1 * MiB, depth=4)
            assert (b.bucket_size, b.depth) == (1 * MiB, 4)
            model(torch.randn(2, 256)).sum().backward()
            opt.step()
            return p.stats()["peak_mapped_bytes"]
    with pytest.raises(statepager.UsageError, match="cannot hold the step's pipeline") as e:
        attach(str(tmp_path / "small"), 2 * MiB)
    needed = re.search(r"Give hbm_budget (\d+) MiB at least", str(e.value))
    assert needed is not None, str(e.value)
    assert attach(str(tmp_path / "fits"), int(needed.group(1)) * MiB) <= \
        int(needed.group(1)) * MiB

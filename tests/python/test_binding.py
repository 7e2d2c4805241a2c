"""The bucket-streamed step on the host backend: bit-exact parity with the unpaged
optimizer, bounded memory, state_dict round trips, PagedAdamW."""
import copy
import os
import time

import pytest
import torch

import statepager
from statepager import checkpoint
from statepager import PagedAdamW, Pager
from statepager.core.atomic import AtomicStep

KiB, MiB = 1 << 10, 1 << 20
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make_model(seed=0, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(37, 301), torch.nn.GELU(), torch.nn.LayerNorm(301),
        torch.nn.Linear(301, 129), torch.nn.GELU(), torch.nn.Linear(129, 7))
    return model.to(dtype=dtype, device=device)


def groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0,
                                                     "lr": 2e-3}]


def train(model, opt, sched, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    p0 = next(model.parameters())
    for _ in range(steps):
        x = torch.randn(16, 37, generator=gen).to(dtype=p0.dtype, device=p0.device)
        y = torch.randn(16, 7, generator=gen).to(x.dtype).to(x.device)
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses


OPTIMIZERS = {
    "adamw-fused": lambda g: torch.optim.AdamW(g, lr=1e-3, fused=True),
    "adamw-foreach": lambda g: torch.optim.AdamW(g, lr=1e-3, foreach=True),
    "adam-foreach": lambda g: torch.optim.Adam(g, lr=1e-3, foreach=True, weight_decay=0.01),
    "adam-loop-amsgrad": lambda g: torch.optim.Adam(g, lr=1e-3, foreach=False, amsgrad=True),
    "sgd-momentum": lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9, foreach=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_parity_with_unpaged_optimizer(store_dir, name, device):
    ref_model, model = make_model(device=device), make_model(device=device)
    ref_opt, opt = OPTIMIZERS[name](groups(ref_model)), OPTIMIZERS[name](groups(model))
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    page = 64 * KiB if device == "cpu" else 2 * MiB
    with Pager(store_dir, device=device, page_size=page) as pager:
        # 100 KB buckets split the 160 KB of state of the first layer's group unevenly.
        binding = pager.attach(opt, bucket_size=100 * KiB, depth=3)
        assert len(binding.buckets) >= 3
        ref_losses = train(ref_model, ref_opt, ref_sched, 12)
        losses = train(model, opt, sched, 12)
        assert losses == ref_losses
        for a, b in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(a, b)
        for b in binding.buckets:
            assert all(pager.residency(t) == "file" for t in b.stored)
        for (pa, pb) in zip(ref_model.parameters(), model.parameters()):
            sa, sb = ref_opt.state[pa], opt.state[pb]
            assert sa.keys() == sb.keys()
            pager.page_in([v for v in sb.values() if pager.owns(v)])
            for k in sa:
                assert torch.equal(sa[k], sb[k]), k
        assert binding.last.bytes_read > 0 and binding.last.bytes_written > 0


def test_adam_moments_are_deferred_until_first_step(store_dir):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Pager(store_dir, page_size=64 * KiB) as pager:
        binding = pager.attach(opt, bucket_size=64 * KiB)
        assert pager.stats()["mapped_bytes"] == 0
        train(model, opt, None, 1)
        assert binding.last.bytes_read == 0  # first step: zero moments, nothing read
        train(model, opt, None, 1)
        moment_bytes = sum(2 * 4 * p.numel() for p in model.parameters())
        assert binding.last.bytes_read == moment_bytes
        # (the params' undo copies, statepager.atomic, are in host memory)
        assert binding.last.bytes_written == moment_bytes


@pytest.mark.parametrize("how", ["atomic", "begun", "in-place"])
def test_a_step_times_its_parts(store_dir, how, monkeypatch):
    """StepStats: the host's set-up before the bucket loop (at begin_step() too, when
    begun), the loop and the commit, each inside the step's own time; the gap between
    begin_step() and step() in `seconds` but in no part."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Pager(store_dir, page_size=64 * KiB) as pager:
        binding = pager.attach(opt, bucket_size=64 * KiB, atomic=how != "in-place")
        train(model, opt, None, 2)
        loss = model(torch.randn(8, 37)).square().mean()
        loss.backward()
        steps = binding._steps  # statepager.core.steps
        start = steps.start  # the pipeline's start: set-up, where begun in begin_step()
        others = steps._end_others_begun  # among step()'s first acts: set-up too

        def slow_start(*args, **kwargs):
            time.sleep(0.05)
            return start(*args, **kwargs)

        def slow_others():
            time.sleep(0.05)
            others()
        monkeypatch.setattr(steps, "start", slow_start)
        monkeypatch.setattr(steps, "_end_others_begun", slow_others)
        t0 = time.monotonic()
        if how == "begun":
            binding.begin_step()
            assert binding.begun
            time.sleep(0.1)
        opt.step()
        took = time.monotonic() - t0
        s = binding.last
        assert s.setup_seconds >= 0.1 and s.loop_seconds > 0
        assert (s.commit_seconds > 0) == (how != "in-place")
        assert s.setup_seconds + s.loop_seconds + s.commit_seconds <= took
        assert s.loop_seconds <= s.seconds
        if how == "begun":
            assert s.setup_seconds + s.loop_seconds + s.commit_seconds <= took - 0.1
            assert s.seconds >= 0.1


def test_a_bucket_s_waits_are_each_counted_once(store_dir, monkeypatch):
    """StepStats: the wait for the residual exception counts of the bucket stepped LAG
    before (the device's work on it) is wait_device_seconds, neither the page-in's wait
    nor the stepping."""
    from statepager.core.late_reads import ExceptionCounts

    read = ExceptionCounts.read

    def slow_read(self, keep=ExceptionCounts.LAG - 1):
        time.sleep(0.05)
        return read(self, keep)
    model = make_model().bfloat16()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-3, mains="residual",
                         bucket_size=64 * KiB)
        for _ in range(2):  # the second: every bucket's state made
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            monkeypatch.setattr(ExceptionCounts, "read", slow_read)
            opt.step()
            monkeypatch.undo()
        s = opt.binding.last
        slept = 0.05 * s.buckets  # advance() reads once a bucket
        assert s.buckets > 1 and s.wait_device_seconds >= slept
        assert s.wait_in_seconds < slept / 2


def test_step_memory_bounded_by_depth_times_bucket(store_dir):
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    page = 64 * KiB
    with Pager(store_dir, page_size=page) as pager:
        binding = pager.attach(opt, bucket_size=600 * KiB, depth=3)
        train_steps = 3
        x = torch.randn(8, 256)
        for _ in range(train_steps):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        largest = max(b.nbytes for b in binding.buckets)
        total = sum(b.nbytes for b in binding.buckets)
        assert len(binding.buckets) >= 6
        bound = 3 * (largest + 2 * page)
        assert 0 < binding.last.peak_mapped_bytes <= bound < total


def test_small_parameters_are_dealt_over_the_buckets(store_dir):
    """Norms and biases in a param group of their own, last (as Megatron lists them): each
    bucket steps its share of them (their host work hides under its copies) instead of
    the last bucket stepping all of them, every bucket within bucket_size, each bucket's
    parameters in the param groups' order, and the steps bit-exact with unpaged."""
    def model_and_groups():
        torch.manual_seed(0)
        layers = [m for _ in range(8) for m in (torch.nn.Linear(128, 128), torch.nn.LayerNorm(128))]
        model = torch.nn.Sequential(*layers)
        matrices = [p for p in model.parameters() if p.dim() == 2]
        small = [p for p in model.parameters() if p.dim() == 1]
        return model, [{"params": matrices}, {"params": small, "weight_decay": 0.0}]

    ref_model, ref_groups = model_and_groups()
    model, param_groups = model_and_groups()
    ref_opt = torch.optim.AdamW(ref_groups, lr=1e-3, foreach=True)
    opt = torch.optim.AdamW(param_groups, lr=1e-3, foreach=True)
    bucket = 300 * KiB  # two matrices' moments (2 x 128 KiB) a bucket; 1 KiB per small one
    with Pager(store_dir, page_size=64 * KiB) as pager:
        binding = pager.attach(opt, bucket_size=bucket)
        order = {id(p): i for i, p in enumerate(binding.params_in_order())}
        small = {id(p) for p in param_groups[1]["params"]}
        assert [sum(id(p) in small for p in b.params) for b in binding.buckets] == [6, 6, 6, 6]
        for b in binding.buckets:
            assert b.planned <= bucket
            assert [order[id(p)] for p in b.params] == sorted(order[id(p)] for p in b.params)
            assert b.groups[1] == [p for p in param_groups[1]["params"] if any(p is q for q in b.params)]
        x = torch.randn(8, 128)
        for m, o in ((ref_model, ref_opt), (model, opt)):
            for _ in range(3):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
        for p, q in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(p, q)
        ref_sd, sd = ref_opt.state_dict(), opt.state_dict()
        for i in ref_sd["state"]:
            for k in ref_sd["state"][i]:
                assert torch.equal(sd["state"][i][k], ref_sd["state"][i][k])
    # Resident ones are not dealt: in a bucket of paged ones they would turn off its fused
    # step (on CUDA), which needs every member's moments paged.
    model, param_groups = model_and_groups()
    opt = torch.optim.AdamW(param_groups, lr=1e-3, foreach=True)
    small = {id(p) for p in param_groups[1]["params"]}
    with Pager(store_dir, page_size=64 * KiB) as pager:
        binding = pager.attach(opt, bucket_size=bucket,
                               hooks=statepager.Hooks(keep_resident=lambda p: id(p) in small))
        assert [sum(id(p) in small for p in b.params) for b in binding.buckets] == [0, 0, 0, 24]


def test_dealt_small_masters_keep_the_step_within_its_window(tmp_path):
    """PagedAdamW makes its masters in parameter order, so the small ones lie together: a
    bucket's share of them is one run, and the buckets in flight map those pages once.
    The step runs under an hbm_budget of its window and a page (dealt one by one, every
    bucket touched every page of them: it needed 64 pages of 64 KiB here)."""
    torch.manual_seed(0)
    big = [torch.nn.Parameter(torch.randn(50_000)) for _ in range(8)]
    small = [torch.nn.Parameter(torch.randn(1_300)) for _ in range(256)]
    groups = [{"params": big}, {"params": small, "weight_decay": 0.0}]
    page = 64 * KiB

    def window():
        with Pager(str(tmp_path / "plan"), page_size=page) as pager:
            opt = PagedAdamW(groups, pager=pager, bucket_size=MiB, depth=3, foreach=True)
            return opt.binding.window_bytes

    budget = (-(-window() // page) + 1) * page
    with Pager(str(tmp_path / "run"), page_size=page, hbm_budget=budget) as pager:
        opt = PagedAdamW(groups, pager=pager, bucket_size=MiB, depth=3, foreach=True)
        masters = {id(m) for m in opt.param_groups[1]["params"]}
        assert sum(id(m) in masters for m in opt.binding.buckets[0].params) > 1  # dealt
        for _ in range(3):
            for p in big + small:
                p.grad = torch.randn_like(p)
            opt.step()
        assert opt.binding.last.peak_mapped_bytes <= budget



def test_page_runs_are_the_pages_the_tensors_touch():
    """planner.page_runs (one call into C++) against the pages counted one by one: views
    anywhere in a buffer, overlapping and adjacent ones merged, empty ones touch none."""
    from statepager.core.planner import page_runs
    torch.manual_seed(0)
    buffer = torch.empty(1 << 16, dtype=torch.float32)
    page = 4 * KiB
    for _ in range(50):
        starts = torch.randint(0, buffer.numel(), (int(torch.randint(0, 9, ())),))
        views = [buffer[s:s + int(torch.randint(0, 5_000, ()))] for s in starts.tolist()]
        views.append(buffer[::7][:100].view(-1))  # strided: numel x size from data_ptr
        pages = sorted({q for v in views if v.numel()
                        for q in range(v.data_ptr() // page,
                                       (v.data_ptr() + v.numel() * 4 - 1) // page + 1)})
        runs = page_runs(views, page)
        assert runs == sorted(runs)
        assert all(a[1] + 1 < b[0] for a, b in zip(runs, runs[1:]))  # disjoint, not adjacent
        assert [q for first, last in runs for q in range(first, last + 1)] == pages
    assert page_runs([], page) == []
    with pytest.raises(statepager.UsageError, match="page must be positive"):
        page_runs([buffer], 0)

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("depth", [2, 3, 4])
def test_a_begun_step_fills_the_window(store_dir, depth, device):
    """begin_step() maps the window's pages (here `depth` buckets), which begun_step_bytes
    counts, and no more: what page-ins begun during a backward must find room for (Note
    [Page-ins during backward])."""
    torch.manual_seed(0)
    page = 2 * MiB if device == "cuda" else 64 * KiB
    params = [torch.nn.Parameter(torch.randn(page, device=device)) for _ in range(8)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    with Pager(store_dir, device, page_size=page) as pager:
        binding = pager.attach(opt, bucket_size=12 * page, depth=depth)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        assert len(binding.buckets) == 8  # a param each: its two moments, 8 pages
        before = pager.stats()["mapped_bytes"]
        binding.begin_step()
        assert binding.begun
        assert binding.begun_step_bytes == depth * 8 * page
        assert pager.stats()["mapped_bytes"] - before == binding.begun_step_bytes
        binding.end_begun_step()
        assert pager.stats()["mapped_bytes"] == before


def test_state_dict_round_trip_and_resume(store_dir, tmp_path):
    ref_model, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(groups(ref_model), lr=1e-3)
    opt = torch.optim.AdamW(groups(model), lr=1e-3)
    with Pager(store_dir, page_size=64 * KiB) as pager:
        pager.attach(opt, bucket_size=100 * KiB)
        train(ref_model, ref_opt, None, 5)
        train(model, opt, None, 5)
        sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
        assert sd["param_groups"] == ref_sd["param_groups"]
        for i in ref_sd["state"]:
            for k in ref_sd["state"][i]:
                assert torch.equal(sd["state"][i][k], ref_sd["state"][i][k])
        torch.save({"model": model.state_dict(), "opt": sd}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt")
    model2 = make_model(seed=5)
    model2.load_state_dict(ckpt["model"])
    opt2 = torch.optim.AdamW(groups(model2), lr=1e-3)
    with Pager(store_dir + "-2", page_size=64 * KiB) as pager:
        pager.attach(opt2, bucket_size=100 * KiB)
        opt2.load_state_dict(ckpt["opt"])
        assert pager.stats()["mapped_bytes"] == 0
        assert train(model2, opt2, None, 4, seed=9) == train(ref_model, ref_opt, None, 4, seed=9)
        for a, b in zip(ref_model.parameters(), model2.parameters()):
            assert torch.equal(a, b)


def batch(gen, device):
    x = torch.randn(16, 37, generator=gen).bfloat16().to(device)
    y = torch.randn(16, 7, generator=gen).bfloat16().to(device)
    return x, y


def reference_mixed_precision(model, steps, **kw):
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, **kw)
    gen = torch.Generator().manual_seed(1)
    losses = []
    device = next(model.parameters()).device
    for _ in range(steps):
        x, y = batch(gen, device)
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        for p in model.parameters():
            p.grad = None
        loss.backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
        losses.append(loss.item())
    return losses, masters, opt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [True, False])
def test_paged_adamw_matches_mixed_precision_reference(store_dir, fused, device):
    ref_model = make_model(dtype=torch.bfloat16, device=device)
    model = make_model(dtype=torch.bfloat16, device=device)
    ref_losses, ref_masters, ref_opt = reference_mixed_precision(
        ref_model, 10, lr=1e-3, weight_decay=0.05, fused=fused)
    page = 64 * KiB if device == "cpu" else 2 * MiB
    with Pager(store_dir, device=device, page_size=page) as pager:
        opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-3, weight_decay=0.05,
                         fused=fused, bucket_size=90 * KiB)
        assert pager.stats()["mapped_bytes"] == 0
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(10):
            x, y = batch(gen, device)
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses == ref_losses
        for a, b in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(a, b)
        masters = [m for g in opt.param_groups for m in g["params"]]
        pager.page_in(masters)
        for a, b in zip(ref_masters, masters):
            assert torch.equal(a, b)
        for a, b in zip(ref_masters, masters):
            pager.page_in([opt.state[b]["exp_avg"], opt.state[b]["exp_avg_sq"]])
            assert torch.equal(ref_opt.state[a]["exp_avg"], opt.state[b]["exp_avg"])
            assert torch.equal(ref_opt.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])


def test_attach_twice_is_refused(store_dir):
    opt = torch.optim.AdamW(make_model().parameters())
    with Pager(store_dir) as pager:
        pager.attach(opt)
        with pytest.raises(statepager.UsageError, match="already attached"):
            pager.attach(opt)


def test_step_log_line(store_dir, caplog, monkeypatch):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    commit = AtomicStep.commit

    def slow_commit(step):
        time.sleep(0.01)
        commit(step)
    monkeypatch.setattr(AtomicStep, "commit", slow_commit)
    with Pager(store_dir, page_size=64 * KiB) as pager:
        binding = pager.attach(opt, bucket_size=100 * KiB, log_steps=True, atomic=True)
        with caplog.at_level("INFO", logger="statepager"):
            train(model, opt, None, 2)
    lines = [r.getMessage() for r in caplog.records if "statepager step" in r.getMessage()]
    assert len(lines) == 2 and "GB/s" in lines[1]
    assert binding.last.commit_seconds >= 0.01
    assert lines[1] == f"statepager {binding.last.summary()}"  # logged once committed


class GroupCountedSGD(torch.optim.SGD):
    """Keeps its step count in the param group, as TE's and apex's FusedAdam do."""

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            if not g["params"]:
                continue
            g["step"] = g.get("step", 0) + 1
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"] / g["step"])
                    buf = self.state[p].setdefault("momentum_like", torch.zeros_like(p))
                    buf.add_(p.grad)


def test_group_step_counters_advance_once_per_step(store_dir):
    runs = []
    for paged in (False, True):
        model = make_model()
        opt = GroupCountedSGD(groups(model), lr=1e-2)
        pager = Pager(store_dir + str(paged), page_size=64 * KiB) if paged else None
        if pager:
            binding = pager.attach(opt, bucket_size=40 * KiB)
            assert len(binding.buckets) > 1
        train(model, opt, None, 5)
        runs.append(([p.detach().clone() for p in model.parameters()],
                     [g["step"] for g in opt.param_groups]))
        if pager:
            pager.close()
    assert runs[0][1] == runs[1][1] == [5, 5]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))


def test_keep_resident_params_step_unpaged(store_dir):
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-3)
    opt = torch.optim.AdamW(groups(model), lr=1e-3)
    small = {id(p) for p in model.parameters() if p.dim() == 1}
    with Pager(store_dir, page_size=64 * KiB) as pager:
        pager.attach(opt, bucket_size=40 * KiB,
                     hooks=statepager.Hooks(keep_resident=lambda p: id(p) in small))
        train(ref_model, ref, None, 4)
        train(model, opt, None, 4)
        for p in model.parameters():
            paged = [pager.owns(v) for v in opt.state[p].values() if v.dim() > 0]
            assert paged == [id(p) not in small] * 2
        for a, b in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(a, b)


def test_each_attached_optimizer_has_its_own_store(store_dir):
    dense_model, expert_model = make_model(seed=0), make_model(seed=1, dtype=torch.bfloat16)
    with Pager(store_dir, page_size=64 * KiB) as pager:
        dense = torch.optim.AdamW(dense_model.parameters(), lr=1e-3)
        pager.attach(dense, name="0-dense", bucket_size=128 * KiB)
        # PagedAdamW attaches as "opt1"; its masters are filled in the default store
        # before that, and move to opt1's on their first page-in.
        expert = PagedAdamW(expert_model.parameters(), pager=pager, bucket_size=128 * KiB)
        train(dense_model, dense, None, 1)
        train(expert_model, expert, None, 1)
        stores = {}
        for name, opt in (("0-dense", dense), ("opt1", expert)):
            paged = [t for p in opt.state for t in [p, *opt.state[p].values()]
                     if isinstance(t, torch.Tensor) and pager.owns(t)]
            assert paged and {pager.services.store_of(t) for t in paged} == {name}
            stores[name] = sum(t.numel() * t.element_size() for t in paged)
        for name, nbytes in stores.items():
            path = os.path.join(store_dir, name, "state.bin")
            assert os.path.getsize(path) >= nbytes, name
        with pytest.raises(statepager.UsageError, match="optimizer name '../elsewhere' names"):
            pager.attach(torch.optim.AdamW(make_model().parameters()), name="../elsewhere")


# -- what an attached optimizer refuses, and where ----------------------------------------

def test_attach_refuses_what_it_cannot_page(store_dir):
    model = make_model()
    lbfgs = torch.optim.LBFGS(model.parameters())
    differentiable = torch.optim.Adam(model.parameters(), differentiable=True)
    sparse = torch.optim.SGD([torch.zeros(4, 3).to_sparse().requires_grad_()], lr=0.1)
    with Pager(store_dir, page_size=64 * KiB) as pager:
        with pytest.raises(statepager.UsageError, match="LBFGS cannot be attached.*first-order"):
            pager.attach(lbfgs)
        with pytest.raises(statepager.UsageError,
                           match="differentiable=True.*differentiable=False"):
            pager.attach(differentiable)
        with pytest.raises(statepager.UsageError, match="sparse_coo tensor.*keep_resident"):
            pager.attach(sparse)
        for opt in (lbfgs, differentiable, sparse):  # left as they were given
            assert "step" not in vars(opt) and getattr(opt, "_statepager", None) is None
            assert not opt.state


def test_add_param_group_refused_is_undone(store_dir):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Pager(store_dir, page_size=64 * KiB) as pager:
        pager.attach(opt, bucket_size=100 * KiB)
        with pytest.raises(statepager.UsageError, match="differentiable=True"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))],
                                 "differentiable": True})
        assert len(opt.param_groups) == 1
        train(model, opt, None, 2)


def test_group_added_after_attach_is_streamed_from_its_next_step(store_dir):
    runs = []
    for paged in (False, True):
        model = make_model()
        layers = list(model)
        opt = torch.optim.AdamW(layers[0].parameters(), lr=1e-2)
        pager = Pager(f"{store_dir}-{paged}", page_size=64 * KiB) if paged else None
        if pager:
            binding = pager.attach(opt, bucket_size=40 * KiB)
        train(model, opt, None, 2)
        opt.add_param_group({"params": list(layers[3].parameters()), "lr": 1e-3})
        train(model, opt, None, 2, seed=3)
        if pager:
            added = list(layers[3].parameters())
            assert all(pager.owns(opt.state[p]["exp_avg"]) for p in added)
            assert {id(p) for b in binding.buckets for p in b.params} >= set(map(id, added))
        runs.append(([p.detach().clone() for p in model.parameters()], opt.state_dict()))
        if pager:
            pager.close()
    (ref_params, ref_sd), (params, sd) = runs
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i in ref_sd["state"]:
        for k, v in ref_sd["state"][i].items():
            assert torch.equal(sd["state"][i][k], v), (i, k)


def test_no_state_for_parameters_without_grads(store_dir):
    model = make_model()
    frozen = list(model[0].parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)  # no momentum: no state at all
    with Pager(store_dir, page_size=64 * KiB) as pager:
        pager.attach(opt, bucket_size=40 * KiB)
        pager.attach(sgd, bucket_size=40 * KiB)
        for p in frozen:
            p.requires_grad_(False)
        train(model, opt, None, 2)
        train(model, sgd, None, 1)
        assert all(p not in opt.state for p in frozen)
        assert len(opt.state) == len(list(model.parameters())) - len(frozen)
        assert len(sgd.state) == 0
        # Moments of the trained only (the undo copies of the unowned params that atomic
        # steps keep are in host memory: statepager.atomic).
        assert pager.stats()["extents"] == 2 * len(opt.state)


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
@pytest.mark.parametrize("name", ["Adam", "Adagrad", "SGD"])
def test_fused_state_keeps_the_parameter_layout(store_dir, layout, name):
    def params():
        gen = torch.Generator().manual_seed(0)
        if layout == "channels_last":
            t = torch.randn(4, 6, 5, 5, generator=gen).contiguous(memory_format=torch.channels_last)
        else:
            t = torch.randn(40, 30, generator=gen).t()
        return [torch.nn.Parameter(t)]

    kwargs = {"momentum": 0.9} if name == "SGD" else {}
    ref_p, p = params(), params()
    ref = getattr(torch.optim, name)(ref_p, lr=0.1, fused=True, **kwargs)
    opt = getattr(torch.optim, name)(p, lr=0.1, fused=True, **kwargs)
    with Pager(store_dir, page_size=64 * KiB) as pager:
        pager.attach(opt, bucket_size=64 * KiB)
        for k in range(3):
            g = torch.randn(ref_p[0].shape, generator=torch.Generator().manual_seed(k))
            ref_p[0].grad = torch.empty_like(ref_p[0]).copy_(g)
            p[0].grad = torch.empty_like(p[0]).copy_(g)
            ref.step()
            opt.step()
        assert torch.equal(ref_p[0], p[0])
        for k, v in ref.state[ref_p[0]].items():
            t = opt.state[p[0]][k]
            if v.dim():
                assert pager.owns(t) and t.stride() == v.stride() == p[0].stride(), k
                pager.page_in(t)
            assert torch.equal(t, v), k


# -- state_dict() and load_state_dict() of an attached optimizer ---------------------------

def test_state_dict_never_replaces_the_live_state(store_dir, tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(groups(model), lr=1e-3)
    with Pager(store_dir, page_size=64 * KiB) as pager:
        pager.attach(opt, bucket_size=100 * KiB)
        train(model, opt, None, 2)
        live = {id(p): dict(st) for p, st in opt.state.items()}
        checkpoint.save(pager, tmp_path / "good")
        sd = opt.state_dict()
        assert {id(p): dict(st) for p, st in opt.state.items()} == live  # the same objects
        assert all(pager.owns(v) for st in opt.state.values() for v in st.values() if v.dim())
        assert all(v.device.type == "cpu" and not pager.owns(v)
                   for st in sd["state"].values() for v in st.values())
        checkpoint.save(pager, tmp_path / "after")  # the moments are still paged: a full checkpoint
        assert checkpoint.load(pager, tmp_path / "after") and checkpoint.load(pager, tmp_path / "good")
        train(model, opt, None, 1)


@pytest.mark.parametrize("source", ["attached", "unattached"])
def test_load_state_dict_copies_into_the_paged_tensors(store_dir, source):
    ref_model, model = make_model(), make_model()
    ref = torch.optim.Adam(groups(ref_model), lr=1e-3, amsgrad=True)
    opt = torch.optim.Adam(groups(model), lr=1e-3, amsgrad=True)
    with Pager(store_dir, page_size=64 * KiB) as pager:
        binding = pager.attach(opt, bucket_size=100 * KiB)
        train(ref_model, ref, None, 3)
        train(model, opt, None, 2, seed=5)  # other state, to be overwritten
        live = {id(p): dict(st) for p, st in opt.state.items()}
        sd = copy.deepcopy(ref.state_dict())
        if source == "attached":
            other = make_model(seed=3)
            other_opt = torch.optim.Adam(groups(other), lr=1e-3, amsgrad=True)
            pager.attach(other_opt, bucket_size=100 * KiB)
            other_opt.load_state_dict(sd)
            sd = other_opt.state_dict()
        with torch.no_grad():
            for a, b in zip(ref_model.parameters(), model.parameters()):
                b.copy_(a)
        before = pager.stats()["buckets_in"]
        opt.load_state_dict(sd)
        assert pager.stats()["buckets_in"] - before <= len(binding.buckets)  # one pass
        assert pager.stats()["mapped_bytes"] == 0
        for p, st in opt.state.items():  # loaded in place: the same paged tensors
            assert all(st[k] is v for k, v in live[id(p)].items() if v.dim())
        assert train(model, opt, None, 3, seed=9) == train(ref_model, ref, None, 3, seed=9)
        for a, b in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(a, b)


def test_an_attached_optimizer_is_freed_with_its_binding(store_dir):
    """Nothing of statepager keeps an attached optimizer (or its binding and Pager)
    alive: a leak would hold each Pager's address reservation until the host runs out."""
    import gc
    import weakref

    pager = Pager(store_dir, page_size=64 * KiB)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    binding = pager.attach(opt, bucket_size=40 * KiB)
    train(model, opt, None, 1)
    pager.close()
    refs = [weakref.ref(o) for o in (opt, binding, pager)]
    del opt, binding, pager
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_whole_counts_reads_only_scalar_float_counts_holding_whole_numbers():
    """_C.whole_counts: the number of each 0-dim float32 or float64 CPU tensor holding a
    whole number (its sign of zero kept); None for fractions, infinities, NaNs, other
    dtypes and shapes, and negated views (whose bytes are not their value)."""
    nan = torch.tensor(0x7FC00123, dtype=torch.int32).view(torch.float32)
    values = [torch.tensor(3.0), torch.tensor(2 ** 40, dtype=torch.float64),
              torch.tensor(-0.0), torch.tensor(2.5), torch.tensor(float("inf")), nan,
              torch.tensor([1.0]), torch.tensor(4), torch.tensor(1.0, dtype=torch.bfloat16),
              torch._neg_view(torch.tensor(3.0))]
    got = statepager._C.whole_counts(values)
    assert got[:3] == [3.0, 2.0 ** 40, 0.0] and str(got[2]) == "-0.0"
    assert got[3:] == [None] * 7
    assert statepager._C.whole_counts([]) == []


def test_state_key_names_each_entry_and_where_its_bytes_are():
    """_C.state_key (what StateLayout.forms() finds forms from): the parameter's and each
    entry's (id, data_ptr), in the entries' order, None for what is not a strided tensor;
    data set anew changes the key, a value changed in place does not."""
    from statepager import _C
    p, m, step = torch.zeros(4), torch.zeros(4), torch.tensor(3.0)
    sparse = torch.zeros(4).to_sparse()
    state = {"step": step, "exp_avg": m, "lr": 0.5, "sparse": sparse}
    key = _C.state_key(p, state)
    assert key == ((id(p), p.data_ptr()),
                   (("step", (id(step), step.data_ptr())), ("exp_avg", (id(m), m.data_ptr())),
                    ("lr", None), ("sparse", None)))
    m.add_(1.0)
    assert _C.state_key(p, state) == key
    m.data = torch.ones(4)
    assert _C.state_key(p, state) != key
    assert _C.state_key(p, {}) == ((id(p), p.data_ptr()), ())
    meta = torch.empty(4, device="meta")
    assert _C.state_key(meta, {})[0][0] == id(meta)


def test_forms_follow_the_state_entries(store_dir):
    """A parameter's stored forms are found again from its state entries each step (the
    pager asked only when an entry is another tensor, or its data was set anew): an entry
    removed, replaced by another pager tensor, or given ordinary memory, is seen."""
    model = make_model()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        binding = pager.attach(opt, bucket_size=64 * KiB, moments="q8")
        train(model, opt, None, 1)
        p = next(model.parameters())
        state = opt.state[p]

        def named():
            return {name: form.working for name, form in binding.forms(p)}

        assert set(named()) == {"exp_avg", "exp_avg_sq"}
        assert named()["exp_avg"] is state["exp_avg"]
        fresh = pager.empty_like(state["exp_avg"])
        state["exp_avg"] = fresh
        assert named()["exp_avg"] is fresh
        state["exp_avg"].data = torch.zeros_like(p)  # ordinary memory: no longer paged
        assert set(named()) == {"exp_avg_sq"}
        del state["exp_avg_sq"]
        assert named() == {}

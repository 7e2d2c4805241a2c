"""Steps under the next forward (binding.overlap_forward(model)): step() returns with
its buckets not stepped; each steps before the first module of the next forward that
uses its parameters runs, the rest when the forward ends. Training so is bit-identical
to training without it, whatever reads the state in between (state_dict(), reads,
checkpoints) completes the step first, and a bucket that fails under the forward raises
from the forward, the step pending as a failed step() leaves it. With step_thread
(overlap "thread" below) the buckets step on a thread of their own, and the same holds."""
import os
import threading
import time

import pytest
import torch

from statepager import Pager, checkpoint
from statepager import _C

from held_page_outs import hold_page_outs, let_land
from small_jobs import KiB, bits

WIDTH, LAYERS = 96, 6


def model_and_opt(pager, overlap, split_groups=False, depth=3, **attach):
    """split_groups: weights and biases in param groups of their own, as Megatron's
    decay / no-decay groups (not the forward's order)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    model = model.to(pager.device)
    groups = ([{"params": [m.weight for m in model]},
               {"params": [m.bias for m in model], "weight_decay": 0.0}]
              if split_groups else model.parameters())
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    binding = pager.attach(opt, bucket_size=48 * KiB, depth=depth, **attach)
    handle = (binding.overlap_forward(model, step_thread=overlap == "thread") if overlap
              else None)
    return model, opt, binding, handle


def train(model, opt, steps, first=0, watch=None, scheduler=None):
    """`steps` iterations of zero_grad, forward, backward, step (and the LR scheduler's
    step, which sets another lr before the next forward); the losses."""
    losses = []
    for i in range(first, first + steps):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(i))
        x = x.to(next(model.parameters()).device)
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if watch is not None:
            watch(i)
        losses.append(loss.item())
    return losses


def result(model, opt):
    state = opt.state_dict()["state"]
    return ([bits(p) for p in model.parameters()],  # bits: host copies
            [bits(v) for k in sorted(state) for _, v in sorted(state[k].items())])


def same(a, b):
    return all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def run(tmp_path, name, overlap, steps=5, watch=None, device="cpu", lr_decay=None, **attach):
    page = 2 << 20 if device == "cuda" else 16 * KiB
    with Pager(str(tmp_path / name), device, page_size=page) as pager:
        model, opt, binding, _ = model_and_opt(pager, overlap, **attach)
        scheduler = (torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=lr_decay)
                     if lr_decay else None)
        losses = train(model, opt, steps, watch=watch and (lambda i: watch(binding, i)),
                       scheduler=scheduler)
        return losses, result(model, opt), binding


UNDER = [True, "thread"]  # overlap_forward(model), and with step_thread=True


@pytest.mark.parametrize("overlap", UNDER)
@pytest.mark.parametrize("atomic, lr_decay", [("bucket", None), (False, None), ("bucket", 0.5)])
def test_steps_under_the_forward_are_bit_identical(tmp_path, atomic, lr_decay, overlap):
    """With an LR scheduler too: its step between step() and the forward sets the next
    step's lr, which the buckets stepped under the forward do not take."""
    base = run(tmp_path, "base", False, atomic=atomic, lr_decay=lr_decay)
    left = []
    paged = run(tmp_path, "under", overlap, atomic=atomic, lr_decay=lr_decay,
                watch=lambda binding, i: left.append(
                    binding.step_in_flight is not None
                    and binding.step_in_flight.stepped == 0))
    assert paged[2].last.buckets > 2, "several buckets"
    assert all(left), "step() returned with its buckets left to the forward"
    assert base[0] == paged[0]
    assert same(base[1], paged[1])


def long_enough(binding, seconds: float = 30) -> bool:
    """binding.can_begin_step(), once true or after `seconds` (a backward that lasts
    until the step in flight can hand over to the next)."""
    deadline = time.monotonic() + seconds
    while not binding.can_begin_step() and time.monotonic() < deadline:
        time.sleep(0.001)
    return binding.can_begin_step()


def test_steps_begun_in_the_backward_before_them_are_bit_identical(tmp_path):
    """The next step's first page-ins begun in the backward, once the step in flight has
    nothing left to wait for (as the Megatron integration begins them: Note [Page-ins
    during backward]): step() takes the begun step up, and training is bit-identical."""
    base = run(tmp_path, "base", False)
    with Pager(str(tmp_path / "early"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, True)
        seen = []

        def begin(param):  # the first layer's grad: the backward's last
            settled = long_enough(binding)
            if settled:
                binding.begin_step()
            seen.append((settled, binding.begun))
        model[0].weight.register_post_accumulate_grad_hook(begin)
        taken = []
        losses = train(model, opt, 5, watch=lambda i: taken.append(
            not binding.begun and binding.step_in_flight is not None))
        early = losses, result(model, opt)
    assert seen == [(True, True)] * 5 and all(taken)
    assert base[0] == early[0]
    assert same(base[1], early[1])


@pytest.mark.parametrize("moments", ["q8", "bf16", "fp32"])
def test_steps_begun_in_the_backward_map_no_more_than_the_window(tmp_path, moments):
    """Steps begun at each of several grads of the backward (filling the window, following
    the step in flight) and stepped under the forward, at depth 6: the pages mapped never
    exceed the window of the plan as it is (the first step's plan, with its state yet to
    be created, is larger: a window shared with the step followed is sized anew), and
    training is bit-identical. Formats with fp32 scratch page in their stored forms alone
    (the scratch mapped as each bucket steps), so more buckets than `depth` come in."""
    base = run(tmp_path, "base", False, depth=6, moments=moments)
    with Pager(str(tmp_path / "begun"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, True, depth=6, moments=moments)
        dues = []

        def begin(param):
            if binding.can_begin_step():
                binding.begin_step()
                dues.append(binding._steps._begun.page_ins.due)
        for m in list(model)[::2]:
            m.weight.register_post_accumulate_grad_hook(begin)
        losses = train(model, opt, 5)
        assert pager.stats()["peak_mapped_bytes"] <= binding.window_bytes
        early = losses, result(model, opt)
    assert max(dues) > 5, "past the 5 buckets a step not begun pages in first"
    if moments != "fp32":
        assert max(dues) > 8, "stored forms alone: past the window's 6 whole buckets"
    assert base[0] == early[0]
    assert same(base[1], early[1])


def watch_following_page_ins(monkeypatch) -> list:
    """Per page-in that a step following the step in flight issues (Pipeline follows=),
    whether that step had let go of its bucket then: appended to the list returned."""
    from statepager.core.page_ins import PageIns

    issued = []
    page_in = PageIns._page_in

    def watched(self, j, *args):
        if self.follows is not None:
            issued.append(self.follows.released(self.buckets[j]))
        return page_in(self, j, *args)
    monkeypatch.setattr(PageIns, "_page_in", watched)
    return issued


def test_a_step_begun_while_the_one_in_flight_pages_out_follows_its_page_outs(
        tmp_path, monkeypatch):
    """Page-outs held back until the backward's end (but those the forward's buckets
    waited for to make room): begin_step() in the backward does not wait for the step
    in flight (it has stepped every bucket), pages in only buckets that step has let go
    of, and, called again once the rest landed, the page-ins they made room for; a
    window of 8 buckets' pages, so that the forward waits for few. Training is
    bit-identical."""
    base = run(tmp_path, "base", False)
    issued = watch_following_page_ins(monkeypatch)
    with Pager(str(tmp_path / "early"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, True, depth=8)
        gate = hold_page_outs(monkeypatch)
        seen = []

        def begin(param):  # the first layer's grad: the backward's last
            if binding.step_in_flight is None:  # the first backward
                return
            can = binding.can_begin_step()
            binding.begin_step()
            held = len(issued)
            landed = let_land(gate)
            binding.begin_step()
            seen.append((can, binding.begun, landed, len(issued) > held))
            gate["held"] = True  # again for the next forward's page-outs

        model[0].weight.register_post_accumulate_grad_hook(begin)
        gate["held"] = True
        losses = train(model, opt, 5)
        let_land(gate)
        early = losses, result(model, opt)
    assert seen == [(True, True, True, True)] * 4
    assert issued and all(issued)
    assert base[0] == early[0]
    assert same(base[1], early[1])


@pytest.mark.parametrize("failure", [_C.NoSpaceError, KeyboardInterrupt])
def test_a_page_in_failing_in_a_later_begin_step_ends_the_begun_step(tmp_path, monkeypatch,
                                                                    failure):
    """A page-in that a later begin_step() issues for the following step fails: the begun
    step ends, nothing of it left in flight (an error is left to step(), an interrupt
    raises), and step() then steps as if none had begun: training is bit-identical."""
    base = run(tmp_path, "base", False)
    with Pager(str(tmp_path / "early"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, True, depth=8)
        gate = hold_page_outs(monkeypatch)
        page_in, seen = pager.page_in_async, []

        def failing(*args, **kwargs):
            raise failure("injected: a page-in of the begun step")

        def begin(param):  # the first layer's grad: the backward's last
            if binding.step_in_flight is None:  # the first backward
                return
            binding.begin_step()  # the page-outs held: some page-ins left for later
            monkeypatch.setattr(pager, "page_in_async", failing)
            let_land(gate)
            try:
                binding.begin_step()
                seen.append(("returned", binding.begun))
            except KeyboardInterrupt:
                seen.append(("raised", binding.begun))
            monkeypatch.setattr(pager, "page_in_async", page_in)
            gate["held"] = True

        model[0].weight.register_post_accumulate_grad_hook(begin)
        gate["held"] = True
        losses = train(model, opt, 5)
        let_land(gate)
        early = losses, result(model, opt)
    how = "raised" if failure is KeyboardInterrupt else "returned"
    assert seen == [(how, False)] * 4
    assert base[0] == early[0]
    assert same(base[1], early[1])


def test_a_page_out_failing_under_a_following_step_fails_step_as_without_it(
        monkeypatch, sized_tmpfs):
    """The store's filesystem full while the step in flight pages out (its buckets'
    first state: fresh file ranges): the begun step that follows it pages in none of
    the buckets whose page-outs failed, step() raises the error, and from there on
    training is bit-identical to the same run without page-ins begun in the backward."""
    issued = watch_following_page_ins(monkeypatch)

    def train_filling(root, early):
        with Pager(os.path.join(root, "store"), "cpu", page_size=16 * KiB) as pager:
            model, opt, binding, _ = model_and_opt(pager, True, depth=16)
            unreleased, failed, losses = [], [], []

            def begin(param):  # the first layer's grad: the backward's last
                if early and binding.step_in_flight is not None:
                    run_ = binding.step_in_flight
                    binding.begin_step()
                    unreleased.append(sum(not run_.released(b) for b in run_.buckets))
            model[0].weight.register_post_accumulate_grad_hook(begin)
            ballast = os.path.join(root, "ballast")
            for i in range(6):
                x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(i))
                opt.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                try:
                    opt.step()
                except _C.NoSpaceError:
                    failed.append((i, binding.pending))
                    os.remove(ballast)
                losses.append(loss.item())
                if i == 0:  # the state is made (and first written) under the next forward
                    free = os.statvfs(root)
                    with open(ballast, "wb") as f:
                        f.write(b"\1" * (free.f_bavail * free.f_frsize - 160 * KiB))
            model(torch.zeros(1, WIDTH))  # the last step's buckets
            return losses, result(model, opt), failed, unreleased

    plain = train_filling(sized_tmpfs(4, "a store that fills up"), False)
    early = train_filling(sized_tmpfs(4, "a store that fills up"), True)
    assert plain[2] == early[2] == [(1, True)], "the step in flight's page-outs failed"
    assert early[3][0] > 0, "buckets not let go of when the next step began"
    assert issued and all(issued)
    assert plain[0] == early[0]
    assert same(plain[1], early[1])


def test_megatron_page_ins_during_backward_begin_at_a_grad_sync_start(tmp_path):
    """PageInsDuringBackward (the Megatron integration's) over stand-ins of DDP's bucket
    groups, whose grad syncs start in the backward as each layer's grads are ready: each
    step's first page-ins begin at one of them once the step in flight has nothing left
    to wait for (on the host backend no device memory is counted), and training is
    bit-identical."""
    from statepager.integrations.megatron import PageInsDuringBackward

    class BucketGroup:  # megatron.core's _ParamAndGradBucketGroup, as far as it is used
        def start_grad_sync(self, force_all_reduce=False):
            return "started"

    class Chunk:
        bucket_groups = [BucketGroup() for _ in range(LAYERS)]
        expert_parallel_bucket_groups = []

    base = run(tmp_path, "base", False)
    with Pager(str(tmp_path / "early"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, True)
        early = PageInsDuringBackward(binding, [Chunk])
        for layer, group in zip(model, Chunk.bucket_groups):
            def synced(param, group=group):
                long_enough(binding)
                assert group.start_grad_sync() == "started"
            layer.weight.register_post_accumulate_grad_hook(synced)
        step = opt.step

        def megatron_step():  # MegatronBinding.step re-arms it
            early.next_backward()
            step()
        opt.step = megatron_step
        losses = train(model, opt, 5)
        done = losses, result(model, opt)
    assert early.steps_begun == 5
    assert base[0] == done[0]
    assert same(base[1], done[1])


class ParamGatherGroup:
    """megatron.core's _ParamAndGradBucketGroup as far as overlap_param_gather goes: its
    all-gather, dispatched by the first module using its params (and the next group's
    after it), sends this rank's params as they are at dispatch; once waited for, the
    param buffer holds what was sent (at DP > 1, other ranks' too)."""

    def __init__(self, params):
        self.params, self._order = set(params), list(params)
        self.next, self.dispatched, self._sent = None, False, None

    def start_param_sync(self, force_sync=False):
        self._sent = [p.detach().clone() for p in self._order]
        self.dispatched = True

    def finish_param_sync(self):
        if not self.dispatched:
            self.start_param_sync()
        if self._sent is None:  # waited for by an earlier module of the group
            return
        with torch.no_grad():
            for p, sent in zip(self._order, self._sent):
                p.copy_(sent)
        self._sent = None
        if self.next is not None and not self.next.dispatched:
            self.next.start_param_sync()


@pytest.mark.parametrize("overlap", UNDER)
def test_megatron_param_gathers_in_the_forward_read_stepped_params(tmp_path, overlap):
    """Megatron's overlap_param_gather over stand-ins of DDP's bucket groups (two layers
    each, in the reverse of the forward's order, as DDP builds them; not the step's
    buckets): each group's all-gather is dispatched by a forward pre-hook, the next
    group's ahead of the forward. Hooked as MegatronBinding.overlap_forward hooks them
    (megatron_internals.before_param_gather), every dispatch finds its params stepped,
    and training is bit-identical."""
    from statepager.integrations import megatron_internals

    base = run(tmp_path, "base", False)
    with Pager(str(tmp_path / "gather"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, handle = model_and_opt(pager, overlap)
        groups = [ParamGatherGroup([p for m in model[i:i + 2] for p in m.parameters()])
                  for i in reversed(range(0, LAYERS, 2))]
        for earlier, later in zip(groups[1:], groups):  # the forward's order
            earlier.next = later

        class Chunk:  # a DDP model chunk
            bucket_groups, expert_parallel_bucket_groups = groups, []
        megatron_internals.before_param_gather(
            [Chunk], lambda params: handle.before_reading(params, key=params))
        of = {id(p): g for g in groups for p in g.params}
        for m in model:  # DDP's pre-hooks: after statepager's, which it prepends
            m.register_forward_pre_hook(
                lambda module, inputs: of[id(module.weight)].finish_param_sync())

        def next_iteration(binding, i):  # finish_grad_sync resets them each backward
            for g in groups:
                g.dispatched = False
        losses = train(model, opt, 5, watch=lambda i: next_iteration(binding, i))
        gathered = losses, result(model, opt)
    assert base[0] == gathered[0]
    assert same(base[1], gathered[1])


@pytest.mark.parametrize("overlaps_param_gather", [False, True])
def test_megatron_hooks_the_param_gathers_only_with_overlap_param_gather(
        monkeypatch, overlaps_param_gather):
    """MegatronBinding.overlap_forward wraps the bucket groups' param all-gathers only
    where a member overlaps them: at one rank without overlap_param_gather, Megatron
    dispatches every group's all-gather at the end of step(), each gathering a param onto
    itself, and a hook there would step every bucket inside step()."""
    from types import SimpleNamespace
    from statepager.integrations import megatron, megatron_internals

    hooked = []
    monkeypatch.setattr(megatron_internals, "before_param_gather",
                        lambda chunks, before: hooked.append(chunks))
    view = SimpleNamespace(buffers=lambda: [object()], data_parallel_size=lambda: 1,
                           overlaps_param_gather=lambda: overlaps_param_gather)
    member_binding = SimpleNamespace(
        overlap_forward=lambda *chunks, forward_param, step_thread: "overlap")
    member = SimpleNamespace(megatron=view, binding=member_binding, model_param_of=None)
    binding = megatron.MegatronBinding(optimizer=None, members=[member])
    assert binding.overlap_forward("chunk", page_in_during_backward=False) == ["overlap"]
    assert hooked == ([("chunk",)] if overlaps_param_gather else [])


@pytest.mark.parametrize("overlap", UNDER)
def test_a_bucket_failing_in_a_param_gather_raises_from_the_forward_and_the_step_resumes(
        tmp_path, overlap):
    """A bucket stepped for the next group's all-gather (dispatched ahead of the forward,
    by the first module's pre-hook) fails: the forward raises before any module ran, the
    group's all-gather is not dispatched, the step is pending and finishes exactly."""
    from statepager.integrations import megatron_internals

    base = run(tmp_path, "base", False, steps=4)
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, handle = model_and_opt(pager, overlap)
        groups = [ParamGatherGroup([p for m in model[i:i + 2] for p in m.parameters()])
                  for i in reversed(range(0, LAYERS, 2))]
        for earlier, later in zip(groups[1:], groups):
            earlier.next = later

        class Chunk:
            bucket_groups, expert_parallel_bucket_groups = groups, []
        megatron_internals.before_param_gather(
            [Chunk], lambda params: handle.before_reading(params, key=params))
        of = {id(p): g for g in groups for p in g.params}
        ran = []
        for m in model:
            m.register_forward_pre_hook(
                lambda module, inputs: of[id(module.weight)].finish_param_sync())
            m.register_forward_pre_hook(lambda module, inputs: ran.append(module))

        def reset(i):
            for g in groups:
                g.dispatched = False
        losses = train(model, opt, 2, watch=reset)
        second = groups[-2]  # layers 2 and 3: the first module dispatches it

        def failing(params):
            if any(p is model[2].bias for p in params):
                raise RuntimeError("injected failure in a param gather")
        binding.before_bucket = failing
        opt.zero_grad()
        ran.clear()
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(2))
        with pytest.raises(RuntimeError, match="injected failure in a param gather"):
            model(x)
        binding.before_bucket = None
        assert ran == [] and not second.dispatched
        assert binding.step_in_flight is None and binding.pending
        opt.zero_grad()  # finishes the pending step
        assert not binding.pending
        reset(None)
        losses += train(model, opt, 2, first=2, watch=reset)
        assert losses == base[0]
        assert same(base[1], result(model, opt))


def test_a_step_in_flight_is_settled_once_the_forward_has_stepped_it(tmp_path):
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, True)
        assert binding.can_begin_step(), "no step in flight"
        train(model, opt, 1)
        assert not binding.can_begin_step(), "its buckets left to the forward"
        model(torch.zeros(2, WIDTH))
        assert long_enough(binding), "stepped, its page-outs done"
        assert binding.step_in_flight is not None


@pytest.mark.parametrize("overlap", UNDER)
def test_the_grads_a_step_kept_go_once_the_forward_stepped_them(tmp_path, overlap):
    """The grads step() kept for the forward's buckets are let go as their buckets step:
    after zero_grad() and the next forward no grad of the step before is alive, and the
    param groups hold their options alone."""
    import gc
    import weakref
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, handle = model_and_opt(pager, overlap, split_groups=True)
        train(model, opt, 2)
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        keys = [set(g) for g in opt.param_groups]
        opt.zero_grad()
        model(torch.zeros(2, WIDTH))
        handle.remove()  # a thread's step joined
        gc.collect()
        assert [g() is None for g in grads] == [True] * len(grads)
        assert [set(g) for g in opt.param_groups] == keys


@pytest.mark.parametrize("split_groups", [False, True])
def test_each_module_runs_after_its_bucket_stepped(tmp_path, split_groups):
    """Buckets follow the modules' order, whatever the param groups' order."""
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, True, split_groups)
        train(model, opt, 1)
        run_ = binding.step_in_flight
        bucket_of = {id(p): i for i, b in enumerate(run_.buckets) for p in b.params}
        seen = []

        def check(module, inputs):  # runs after statepager's pre-hook (it is prepended)
            need = max(bucket_of[id(p)] for p in module.parameters(recurse=False))
            seen.append((binding.step_in_flight.stepped, need))

        hooks = [m.register_forward_pre_hook(check) for m in model]
        model(torch.zeros(2, WIDTH))
        for h in hooks:
            h.remove()
        assert all(stepped > need for stepped, need in seen)
        assert seen[0][0] <= 2 < len(run_.buckets), "the first module ran after 2 buckets"
        assert binding.step_in_flight is run_, "its page-outs left to what comes next"
        opt.state_dict()
        assert binding.step_in_flight is None


def left(run_) -> bool:
    """Whether a page-in due is not issued (left for room by a hook that did not wait)."""
    return run_.page_ins.due <= min(run_.stepped + run_.ahead, len(run_.buckets) - 1)


def test_a_forward_hook_returns_without_waiting_for_room_and_a_later_one_pages_in(
        tmp_path, monkeypatch):
    """A pre-hook that steps buckets waits for room for the next page-in only while more
    buckets of its own remain: after its last it returns to the forward, and a later hook
    issues the page-in once the page-out that makes room has landed. What the step maps
    stays within the window, page-outs held; training on is still bit-identical."""
    base = run(tmp_path, "base", False, steps=3)
    gate = hold_page_outs(monkeypatch)
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, True)  # depth 3: one page-in ahead
        losses = train(model, opt, 2)
        run_ = binding.step_in_flight
        n = len(run_.buckets)
        assert n >= 5
        page_ins = []
        page_in = pager.page_in_async
        monkeypatch.setattr(pager, "page_in_async", lambda ts, **k: (
            page_ins.append(1), page_in(ts, **k))[1])
        gate["held"] = True
        # Hooks of a bucket each, page-outs held: the window fills, and the hook whose
        # bucket finds it full leaves the next page-in without waiting.
        while not left(run_) and run_.stepped < n - 2:
            binding.step_in_flight_to(run_.stepped + 1, lazy=True)
        assert left(run_) and gate["waited"] == 0
        issued = len(page_ins)
        binding.step_in_flight_to(run_.stepped, lazy=True)  # a later hook: still no room
        assert (len(page_ins), gate["waited"]) == (issued, 0)
        assert let_land(gate)
        binding.step_in_flight_to(run_.stepped, lazy=True)  # landed: the page-in goes
        assert len(page_ins) > issued and not left(run_)
        gate["held"] = True
        binding.step_in_flight_to(n, lazy=True)  # buckets not its last waited for room
        assert run_.stepped == n and gate["waited"] > 0
        assert pager.stats()["peak_mapped_bytes"] <= binding.window_bytes
        gate["held"] = False
        losses += train(model, opt, 1, first=2)
        assert losses == base[0]
        assert same(base[1], result(model, opt))


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_a_page_in_left_for_room_is_issued_by_its_bucket_within_the_window(
        tmp_path, monkeypatch, depth):
    """Hooks that left page-ins for room, then a bucket whose own page-in was left: it
    issues it, waiting, and tops up without waiting only as far as the window holds: the
    pages mapped, page-outs held, never more than the window's; bit-identical
    throughout."""
    base = run(tmp_path, "base", False, steps=3)
    gate = hold_page_outs(monkeypatch)
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, True, depth=depth)
        losses = train(model, opt, 2)
        run_ = binding.step_in_flight
        n = len(run_.buckets)
        gate["held"] = True
        while run_.page_ins.due > run_.stepped and run_.stepped < n - 1:
            binding.step_in_flight_to(run_.stepped + 1, lazy=True)
        assert run_.page_ins.due == run_.stepped, "the next bucket's own page-in was left"
        assert gate["waited"] == 0
        binding.step_in_flight_to(run_.stepped + 1, lazy=True)
        assert gate["waited"] > 0, "it waited for room for its own page-in"
        assert let_land(gate)
        binding.step_in_flight_to(n, lazy=True)
        assert pager.stats()["peak_mapped_bytes"] <= binding.window_bytes
        losses += train(model, opt, 1, first=2)
        assert losses == base[0]
        assert same(base[1], result(model, opt))


def test_a_page_in_failing_in_a_later_hook_raises_from_the_forward_and_the_step_resumes(
        tmp_path, monkeypatch):
    """A page-in left for room and issued by a later hook (Pipeline.pump) that fails:
    the forward raises, the step is pending, what did not step has its grads back."""
    base = run(tmp_path, "base", False, steps=4)
    gate = hold_page_outs(monkeypatch)
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, True)
        losses = train(model, opt, 2)
        run_ = binding.step_in_flight
        opt.zero_grad()  # the next iteration's: the step in flight keeps its grads
        gate["held"] = True
        binding.step_in_flight_to(2, lazy=True)  # past the first module's buckets
        while not left(run_) and run_.stepped < len(run_.buckets) - 2:
            binding.step_in_flight_to(run_.stepped + 1, lazy=True)
        assert left(run_), "a page-in left for room"
        stepped = run_.stepped
        assert let_land(gate)
        page_in = pager.page_in_async

        def failing(ts, **k):
            raise _C.NoSpaceError("injected: no room for a page-in")
        monkeypatch.setattr(pager, "page_in_async", failing)
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(2))
        with pytest.raises(_C.NoSpaceError, match="injected"):
            model(x)  # its first module's buckets stepped: its hook issues the page-in
        assert run_.stepped == stepped, "it failed in the hook's page-in, not in a bucket"
        monkeypatch.setattr(pager, "page_in_async", page_in)
        assert binding.step_in_flight is None and binding.pending
        assert all(p.grad is not None for b in run_.buckets[stepped:] for p in b.params)
        opt.zero_grad()  # finishes the pending step with them
        assert not binding.pending
        losses += train(model, opt, 2, first=2)
        assert losses == base[0]
        assert same(base[1], result(model, opt))


@pytest.mark.parametrize("reader", ["state_dict", "read", "save", "zero_grad_in_place",
                                    "remove", "begin_step", "pause"])
def test_what_needs_the_state_completes_the_step_first(tmp_path, reader):
    """Between step() and the forward, whatever reads or pages the state completes the
    step in flight; training on is still bit-identical."""
    base = run(tmp_path, "base", False, steps=4)
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, handle = model_and_opt(pager, True)
        losses = train(model, opt, 2)
        assert binding.step_in_flight is not None
        if reader == "state_dict":
            opt.state_dict()
        elif reader == "read":
            p = next(model.parameters())
            assert opt.state[p]["exp_avg"].shape == p.shape
        elif reader == "save":
            checkpoint.save(pager, str(tmp_path / "ckpt"))
        elif reader == "zero_grad_in_place":
            opt.zero_grad(set_to_none=False)  # zeroes the grads the step needs
        elif reader == "remove":
            handle.remove()
        elif reader == "begin_step":  # the next step's page-ins, after this one's page-outs
            binding.begin_step()
        elif reader == "pause":
            pager.pause()
            pager.resume()
        assert binding.step_in_flight is None
        losses += train(model, opt, 2, first=2)
        assert losses == base[0]
        assert same(base[1], result(model, opt))


@pytest.mark.parametrize("overlap", UNDER)
@pytest.mark.parametrize("failing_bucket", [2, 1])
def test_a_bucket_failing_under_the_forward_raises_from_it_and_the_step_resumes(
        tmp_path, failing_bucket, overlap):
    """The step is owed since step() returned, whether some bucket stepped (2: the second
    fails) or none (1): it is pending, what did not step has its grads back, and the next
    zero_grad() finishes it."""
    base = run(tmp_path, "base", False, steps=4)
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, overlap)
        losses = train(model, opt, 2)
        calls = []

        def failing(params):
            calls.append(params)
            if len(calls) == failing_bucket:
                raise RuntimeError("injected failure under the forward")

        binding.before_bucket = failing
        opt.zero_grad()  # the next iteration's: the step in flight keeps its grads
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(2))
        with pytest.raises(RuntimeError, match="injected failure under the forward"):
            model(x)
        binding.before_bucket = None
        assert binding.step_in_flight is None and binding.pending
        stepped = {id(p) for params in calls[:-1] for p in params}
        assert all(p.grad is not None for p in model.parameters() if id(p) not in stepped), \
            "what did not step has its grads back, for the step that finishes it"
        opt.zero_grad()  # finishes the pending step with them, then sets them to None
        assert not binding.pending
        losses += train(model, opt, 2, first=2)
        assert losses == base[0]
        assert same(base[1], result(model, opt))


def test_refusals(tmp_path):
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, handle = model_and_opt(pager, True)
        with pytest.raises(_C.UsageError, match="remove"):
            binding.overlap_forward(model)
        with pytest.raises(_C.UsageError, match="atomic='step' cannot step under"):
            binding.atomic = "step"
        handle.remove()
        binding.atomic = "step"
        with pytest.raises(_C.UsageError, match="atomic='bucket'"):
            binding.overlap_forward(model)
        binding.atomic = "bucket"
        with pytest.raises(_C.UsageError, match="torch.nn.Module"):
            binding.overlap_forward()
        with pytest.raises(_C.UsageError, match="torch.nn.Module"):
            binding.overlap_forward(opt)
        assert os.path.isdir(str(tmp_path / "s"))


def _case(case, pager):
    """(model, optimizer, binding, scheduler or None, zero_grad after the forward, x)."""
    torch.manual_seed(0)
    scheduler, late_zero = None, False
    if case in ("paged-adamw", "paged-adamw-chunks"):
        from statepager.core.optim import PagedAdamW
        layers = ([torch.nn.Linear(512, 16), torch.nn.Linear(16, 65536)]
                  if case == "paged-adamw-chunks" else
                  [torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        model = torch.nn.Sequential(*layers).to(torch.bfloat16)
        opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-2,
                         bucket_size=(3 << 20) + (512 << 10) if case == "paged-adamw-chunks"
                         else 48 * KiB, depth=3)
        binding = opt.binding
        late_zero = case == "paged-adamw-chunks"  # zero_grad between forward and backward
        shape = (4, 512) if case == "paged-adamw-chunks" else (8, WIDTH)
    else:
        if case == "transformer":  # MultiheadAttention reads out_proj without calling it
            model = torch.nn.TransformerEncoder(
                torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True),
                2, enable_nested_tensor=False)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            shape = (2, 5, 64)
        else:  # a tensor lr, which an LR scheduler fills in place
            model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
            opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), foreach=False)
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            shape = (8, WIDTH)
        binding = pager.attach(opt, bucket_size=32 * KiB, depth=3)
    dtype = next(model.parameters()).dtype
    return model, opt, binding, scheduler, late_zero, shape, dtype


@pytest.mark.parametrize("overlap", UNDER)
@pytest.mark.parametrize("case", ["paged-adamw", "paged-adamw-chunks", "transformer",
                                  "tensor-lr"])
def test_models_and_optimizers_under_the_forward_are_bit_identical(tmp_path, case, overlap):
    """PagedAdamW (it reads the model params' grads, which zero_grad() sets to None before
    the forward), a parameter stepping in chunks over buckets that earlier modules'
    hooks step in part, a module reading a child's parameters without calling it, and a
    tensor lr that an LR scheduler changes in place before the forward."""
    out = []
    for under in (False, overlap):
        with Pager(str(tmp_path / f"s{under}"), "cpu", page_size=16 * KiB) as pager:
            model, opt, binding, scheduler, late_zero, shape, dtype = _case(case, pager)
            if under:
                binding.overlap_forward(model, step_thread=under == "thread")
            losses = []
            for i in range(3):
                x = torch.randn(*shape, generator=torch.Generator().manual_seed(i)).to(dtype)
                if not late_zero:
                    opt.zero_grad()
                loss = model(x).float().square().mean()
                if late_zero:
                    opt.zero_grad()
                loss.backward()
                opt.step()
                if scheduler is not None:
                    scheduler.step()
                losses.append(loss.item())
            if under:
                assert binding.step_in_flight is not None and binding.last.buckets > 1
            binding.complete_step_in_flight()
            out.append((losses, [bits(p) for p in model.parameters()]))
    assert out[0][0] == out[1][0]
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def test_state_dict_by_reference_keeps_steps_under_the_forward(tmp_path):
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, handle = model_and_opt(pager, True)
        with binding.state_dict_by_reference():
            opt.state_dict()
        assert binding.overlap is handle
        train(model, opt, 1)
        assert binding.step_in_flight is not None


@pytest.mark.parametrize("saved_under_the_forward", [True, False])
def test_checkpoints_load_across_the_forwards_order_and_the_groups(tmp_path,
                                                                   saved_under_the_forward):
    """With weights and biases in groups of their own, a binding under the forward steps
    (and a checkpoint lists) its buckets in the forward's order, one without in the
    groups': a checkpoint of either loads into the other, training on bit-identically."""
    base = run(tmp_path, "base", False, steps=4, split_groups=True)
    orders = []
    for name, overlap in (("saved", saved_under_the_forward),
                          ("loaded", not saved_under_the_forward)):
        with Pager(str(tmp_path / name), "cpu", page_size=16 * KiB) as pager:
            model, opt, binding, _ = model_and_opt(pager, overlap, split_groups=True)
            if name == "saved":
                losses = train(model, opt, 2)
                checkpoint.save(pager, str(tmp_path / "ckpt"))
                params = [p.detach().clone() for p in model.parameters()]
            else:
                with torch.no_grad():
                    for p, q in zip(model.parameters(), params):
                        p.copy_(q)
                checkpoint.load(pager, str(tmp_path / "ckpt"))
                losses += train(model, opt, 2, first=2)
                binding.complete_step_in_flight()
                assert losses == base[0]
                assert same(base[1], result(model, opt))
            index = {id(p): i for i, p in enumerate(model.parameters())}
            orders.append([index[id(p)] for b in binding.params_by_bucket() for p in b])
    assert orders[0] != orders[1]  # the two orders differ


def test_a_resumable_step_under_the_forward_copies_each_bucket_on_the_device_as_it_steps(
        tmp_path, monkeypatch):
    """Residual masters under the forward, resumable: no host undo copies exist and none
    is taken (between steps or within one); each bucket's model params are copied as it
    steps, once per step, on the pager's device. Bit-identical to steps without it."""
    from statepager.core import resumable
    from statepager.core.atomic import UndoCopies
    from statepager.core.optim import PagedAdamW
    monkeypatch.setattr(UndoCopies, "take", lambda *a: pytest.fail("a host undo copy"))
    undo_copies, copies = resumable.undo_copies, []

    def logged(targets):
        run = binding.step_in_flight
        taken = undo_copies(targets)
        copies.append((None if run is None else run.stepped,
                       [(t.data_ptr(), c.device) for t, c in taken.pairs()]))
        return taken
    monkeypatch.setattr(resumable, "undo_copies", logged)
    out = []
    for overlap in (False, True):
        with Pager(str(tmp_path / f"s{overlap}"), "cpu", page_size=16 * KiB) as pager:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                *[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(torch.bfloat16)
            opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-2, bucket_size=16 * KiB,
                             depth=3, mains="residual", moments="q8")
            binding = opt.binding
            if overlap:
                binding.overlap_forward(model)
            losses = []
            for i in range(4):
                x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(i))
                opt.zero_grad()
                loss = model(x.to(torch.bfloat16)).float().square().mean()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            binding.complete_step_in_flight()
            n = len(binding.buckets)
            assert n >= 3 and all(not b.undo for b in binding.buckets)
            last = copies[-n:]  # the last step's: one per bucket, as it stepped
            if overlap:
                assert [k for k, _ in last] == list(range(1, n + 1))
            params = {p.data_ptr() for p in model.parameters()}
            copied = [ptr for _, pairs in last for ptr, _ in pairs]
            assert sorted(copied) == sorted(params)
            assert all(d == pager.device for _, pairs in last for _, d in pairs)
            out.append((losses, [bits(p) for p in model.parameters()]))
    assert out[0][0] == out[1][0]
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def residual_pager(tmp_path, name: str, device: str) -> Pager:
    return Pager(str(tmp_path / name), device, page_size=2 << 20 if device == "cuda" else 16 * KiB)


def residual_model_and_opt(pager, device, overlap):
    """A bf16 model and its PagedAdamW with residual masters and q8 moments, the buckets
    small, stepped under the forward (overlap: one of UNDER)."""
    from statepager.core.optim import PagedAdamW
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(device, torch.bfloat16)
    opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-2, bucket_size=16 * KiB,
                     depth=3, mains="residual", moments="q8")
    opt.binding.overlap_forward(model, step_thread=overlap == "thread")
    return model, opt


def residual_input(i, device):
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(i)).to(
        device, torch.bfloat16)


def residual_backward(model, opt, i, device):
    """zero_grad, the forward of input i and its backward; the loss."""
    opt.zero_grad()
    loss = model(residual_input(i, device)).float().square().mean()
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("overlap", UNDER)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_residual_bucket_failing_under_the_forward_is_put_back_from_the_copies(
        tmp_path, device, overlap):
    """Residual masters under the forward: the second bucket's after_bucket has written its
    model params, then raises. Its undo copies put them back (on CUDA, before what the
    forward's stream reads next), the step is pending, and training finishes it
    bit-identical to one that never failed."""
    def iteration(model, opt, i):
        loss = residual_backward(model, opt, i, device)
        opt.step()
        return loss

    results = []
    for fail in (False, True):
        with residual_pager(tmp_path, f"s{fail}", device) as pager:
            model, opt = residual_model_and_opt(pager, device, overlap)
            binding = opt.binding
            losses = [iteration(model, opt, i) for i in range(3)]
            if fail:
                before = [bits(p) for p in model.parameters()]
                written, calls = binding.after_bucket, []

                def failing(params):
                    written(params)  # the model params are written
                    calls.append([bits(p) for p in model.parameters()])
                    if len(calls) == 2:
                        raise RuntimeError("injected after the second bucket's write")
                binding.after_bucket = failing
                opt.zero_grad()
                with pytest.raises(RuntimeError, match="injected after the second bucket"):
                    model(residual_input(3, device))
                binding.after_bucket = written
                assert binding.pending
                # As the first bucket left them: the second's put back.
                first, second = calls
                assert not all(map(torch.equal, first, second))  # the second bucket wrote
                assert not all(map(torch.equal, first, before))  # ... and so did the first
                now = [bits(p) for p in model.parameters()]
                assert all(map(torch.equal, now, first)), "the failed bucket was put back"
                opt.zero_grad()  # finishes the pending step
                assert not binding.pending
            losses += [iteration(model, opt, i) for i in range(3, 5)]
            binding.complete_step_in_flight()
            results.append((losses, [bits(p) for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.parametrize("overlap", UNDER)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_changed_model_param_fails_the_step_from_the_forward(tmp_path, device, overlap):
    """Residual masters under the forward: step() queues the check of every model param
    against its master's fingerprint and returns without reading it; the first bucket reads
    it. A param changed behind the optimizer's back (in the last bucket) then fails the
    step from the forward, before any bucket steps: the step, owed since step() returned,
    is pending with nothing of it stepped, no param changed. Put back, the next step()
    finishes it as if nothing had happened: params and state bit-identical to training
    that never failed."""
    results = []
    for change in (False, True):
        with residual_pager(tmp_path, f"s{change}", device) as pager:
            model, opt = residual_model_and_opt(pager, device, overlap)
            binding = opt.binding
            losses = []
            for i in range(3):
                losses.append(residual_backward(model, opt, i, device))
                opt.step()
            losses.append(residual_backward(model, opt, 3, device))
            if change:
                binding.complete_step_in_flight()
                bucket = binding.buckets[-1]
                param = next(f for f in bucket.forms if f.fmt == "residual").flat_model_param
                kept = param.detach().clone()
                with torch.no_grad():
                    param.add_(1.0)
                params = [bits(p) for p in model.parameters()]
                opt.step()  # returns: the check is queued, not read
                with pytest.raises(ValueError, match="no longer matches"):
                    model(residual_input(4, device))
                assert binding.step_in_flight is None
                assert binding.pending and binding._steps.pending.stepped_count == 0
                assert all(map(torch.equal, params, [bits(p) for p in model.parameters()]))
                with torch.no_grad():
                    param.copy_(kept)
            opt.step()  # finishes the pending step, or steps
            for i in range(4, 6):
                losses.append(residual_backward(model, opt, i, device))
                opt.step()
            state = opt.state_dict()["state"]
            results.append((losses, [bits(p) for p in model.parameters()],
                             [bits(v) for k in sorted(state) for _, v in sorted(state[k].items())]))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2]))

"""Resumable steps (attach(atomic="bucket"), the default): a step that fails leaves every
bucket stepped or not, never torn; the binding says it is pending, and the next step()
finishes it, so that the retry steps each bucket once and the result is bit-identical to
a run that never failed. What would lose its grads or read its state (zero_grad(),
state_dict(), saves, pause()) finishes it first; a load forgets it. No second copy of the
state is kept: at a host tier of the state's size, a step moves no file byte (see
tests/python/test_host_tier.py, test_cyclic_steps_keep_the_budget_in_the_host_tier)."""
import copy
import os

import pytest
import torch

import statepager
from statepager import checkpoint
from statepager import Hooks, Pager

from compare import same
from small_jobs import KiB, bits, set_grads
from test_fault_step import CONFIGS, FAULTS, skip_what_cannot_fail

RESUMABLE_FAULTS = ("before-hook", "after-hook", "optimizer", "out-of-memory",
                    "unreadable-store", "no-space", "counts-unread")


def state_bytes(pager, binding) -> list:
    """Per bucket, its stored tensors' bytes, read without writing anything: those at rest
    paged in for a read and handed back, those left resident (a failed page-out) as they
    are."""
    out = []
    for b in binding.buckets:
        rest = [t for t in b.stored if pager.residency(t) != "resident"]
        pager.page_in_async(rest, for_read=True).wait()
        out.append([bits(t) for t in b.stored])
        pager.services.release_unchanged_async(rest).wait()
    return out


def snapshot(model, pager, opt, binding) -> dict:
    return {"stored": state_bytes(pager, binding),
            "model": [bits(p) for p in model.parameters()],
            "steps": [int(v["step"]) for v in (dict.get(opt.state, p) or {} for g in
                      opt.param_groups for p in g["params"]) if "step" in v]}


def run(config, device, store, warm, fault=None, tmp=None, begun=False, retry="step",
        prepared=False):
    """Steps `warm` times, then once with `fault` armed (it raises), then finishes the step
    (retry: "step", "zero_grad" or "state_dict"). prepared: zero_grad() before that
    step. Returns the snapshots before the failing step,
    after it failed, and after the finish."""
    setup, _ = CONFIGS[config]
    model, pager, opt, binding = setup(store, device, atomic="bucket")
    try:
        for i in range(warm):
            set_grads(model, i)
            opt.step()
        if prepared:
            opt.zero_grad()
        set_grads(model, warm)
        before = snapshot(model, pager, opt, binding)
        failed = None
        if fault is not None:
            f = fault(model, pager, opt, binding, tmp)
            f.arm()
            with pytest.raises(f.raises):
                if begun:
                    binding.begin_step()
                opt.step()
            f.disarm()
            failed = snapshot(model, pager, opt, binding)
            failed["pending"] = binding.pending
        {"step": opt.step, "zero_grad": opt.zero_grad, "state_dict": opt.state_dict}[retry]()
        assert not binding.pending
        return before, failed, snapshot(model, pager, opt, binding)
    finally:
        pager.close()


def check_never_torn(clean_before, clean_after, failed) -> None:
    """Each bucket's state and each model parameter as before the step or as after it;
    pending exactly when some bucket stepped."""
    stepped = []
    for k, (a, b, now) in enumerate(zip(clean_before["stored"], clean_after["stored"],
                                        failed["stored"])):
        assert same(now, a) or same(now, b), f"bucket {k} is torn"
        stepped.append(not same(now, a))
    for i, (a, b, now) in enumerate(zip(clean_before["model"], clean_after["model"],
                                        failed["model"])):
        assert same(now, a) or same(now, b), f"model parameter {i} is torn"
    assert failed["pending"] == any(stepped)


@pytest.mark.parametrize("begun", [False, True], ids=["called", "begun"])
@pytest.mark.parametrize("fault", RESUMABLE_FAULTS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_failed_step_is_never_torn_and_its_retry_steps_once(tmp_path, request, config,
                                                              fault, begun):
    _, warm = CONFIGS[config]
    skip_what_cannot_fail(config, fault)
    if fault == "no-space":
        warm = 0  # steps write in place: only the first one grows the store
    root = (request.getfixturevalue("sized_tmpfs")(4, "the out-of-space case")
            if fault == "no-space" else str(tmp_path))
    clean_before, _, clean_after = run(config, "cpu", str(tmp_path / "clean"), warm)
    before, failed, after = run(config, "cpu", os.path.join(root, "store"), warm,
                                FAULTS[fault], tmp_path, begun)
    assert same(clean_before, before)
    check_never_torn(clean_before, clean_after, failed)
    assert same(clean_after, after), "the finished step differs from a clean one"


@pytest.mark.gpu
@pytest.mark.parametrize("fault", ["after-hook", "out-of-memory", "no-space", "counts-unread"])
@pytest.mark.parametrize("config", ["adamw", "paged-fp32", "paged-residual-q8"])
@pytest.mark.parametrize("begun", [False, True], ids=["called", "begun"])
def test_a_failed_step_on_the_gpu_is_never_torn(tmp_path, request, config, fault, begun):
    """The same on CUDA memory: buckets handed back after their kernels were queued, undo
    copies copied back on the stream that took them."""
    skip_what_cannot_fail(config, fault)
    warm = 0 if fault == "no-space" else CONFIGS[config][1]
    root = (request.getfixturevalue("sized_tmpfs")(4, "the out-of-space case")
            if fault == "no-space" else str(tmp_path))
    clean_before, _, clean_after = run(config, "cuda", str(tmp_path / "clean"), warm)
    _, failed, after = run(config, "cuda", os.path.join(root, "store"), warm, FAULTS[fault],
                           tmp_path, begun)
    check_never_torn(clean_before, clean_after, failed)
    assert same(clean_after, after)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fault", ["after-hook", "optimizer", "counts-unread"])
def test_a_failed_step_puts_back_params_from_the_copies_on_the_device(tmp_path, monkeypatch,
                                                                     device, fault):
    """Residual masters, zero_grad() before the step: no host undo copy is made or taken;
    the bucket that fails is put back from its undo copies on the device (the
    after-hook's has written its params); the finished step is bit-identical to a clean
    one."""
    from statepager.core.atomic import UndoCopies
    monkeypatch.setattr(UndoCopies, "take", lambda *a: pytest.fail("a host undo copy"))
    config = "paged-residual-q8"
    skip_what_cannot_fail(config, fault)
    warm = CONFIGS[config][1]
    clean_before, _, clean_after = run(config, device, str(tmp_path / "clean"), warm,
                                       prepared=True)
    _, failed, after = run(config, device, str(tmp_path / "store"), warm, FAULTS[fault],
                           tmp_path, prepared=True)
    check_never_torn(clean_before, clean_after, failed)
    assert same(clean_after, after)


@pytest.mark.parametrize("retry", ["zero_grad", "state_dict"])
def test_zero_grad_and_state_dict_finish_a_pending_step(tmp_path, retry):
    """The after-hook fails at the third bucket: two buckets stepped. zero_grad() steps
    the rest with the grads they have, then zeroes them; state_dict() reads it whole."""
    clean_before, _, clean_after = run("paged-fp32", "cpu", str(tmp_path / "clean"), 2)
    _, failed, after = run("paged-fp32", "cpu", str(tmp_path / "store"), 2,
                           FAULTS["after-hook"], tmp_path, retry=retry)
    assert failed["pending"]
    check_never_torn(clean_before, clean_after, failed)
    assert same(clean_after, after)


class WithPlaceholder(torch.nn.Module):
    """A linear layer beside an empty parameter (a common placeholder)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.placeholder = torch.nn.Parameter(torch.empty(0))
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.linear(x) + self.placeholder.sum()


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "under-the-forward"])
def test_a_parameter_without_elements_steps_as_unpaged(tmp_path, overlap):
    """A parameter without elements has nothing to copy back: resumable steps (under the
    forward too) step the model as torch's AdamW does unpaged, and a bucket that fails
    after its hook wrote the params is put back."""
    results = []
    for paged in (False, True):
        pager = Pager(str(tmp_path / f"store{paged}"), page_size=64 * KiB) if paged else None
        model = WithPlaceholder()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if paged:
            binding = pager.attach(opt, bucket_size=64 * KiB)
            if overlap:
                binding.overlap_forward(model)
        for i in range(4):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            model(x).square().mean().backward()
            if paged and i == 2:
                before = [bits(p) for p in model.parameters()]
                binding.after_bucket = fail_after_writing
                with pytest.raises(RuntimeError, match="injected"):
                    opt.step()
                    model(x)  # under the forward: the bucket steps here
                binding.after_bucket = None  # its one bucket put back: nothing stepped
                assert binding.pending == overlap  # owed since step() returned
                assert same(before, [bits(p) for p in model.parameters()])
            opt.step()
        if paged:
            binding.complete_step_in_flight()
        results.append([bits(p) for p in model.parameters()])
        if paged:
            pager.close()
    assert same(results[0], results[1])


def fail_after_writing(params):
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    raise RuntimeError("injected after writing the bucket's params")


def test_undo_copies_hold_each_target_and_put_it_back():
    """undo_copies: dense targets (contiguous, transposed, channels_last, of any dtype)
    share one buffer, each at a 64-byte boundary; one with gaps, and a lazily conjugated
    or negated view (its bytes are not its values), get copies of their own; one without
    elements none (nor does a list of only such: no buffer). Copied back, each target has
    its bits again. A parameter's view and copy record nothing for autograd. A target
    resized since its copy was taken has no pair: its copy no longer fits it."""
    from statepager.core.resumable import undo_copies
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    targets = [torch.randn(5, 7, generator=g), base.t(),
               torch.randn(2, 3, 4, 5, generator=g).contiguous(
                   memory_format=torch.channels_last),
               torch.randn(9, generator=g).to(torch.bfloat16), torch.arange(3) > 1,
               base[:, ::2],  # gaps
               torch.randn(3, dtype=torch.complex64, generator=g).conj(),
               torch.randn(4, generator=g)._neg_view(),
               torch.empty(0), torch.empty(4, 0)]
    before = [t.clone() for t in targets]
    copies = undo_copies(targets)
    pairs = copies.pairs()
    assert len(copies) == len(pairs) == 8
    buffer = pairs[0][1].untyped_storage().data_ptr()
    shared = [c for t, c in pairs if c.untyped_storage().data_ptr() == buffer]
    assert len(shared) == 5 and all((c.data_ptr() - buffer) % 64 == 0 for c in shared)
    for t in targets:
        t.zero_() if t.dtype != torch.bool else t.logical_not_()
    for t, c in pairs:
        t.copy_(c)
    assert all(torch.equal(a, b) for a, b in zip(targets, before))
    assert len(undo_copies([torch.empty(0), torch.empty(3, 0)])) == 0
    leaf = torch.nn.Parameter(torch.randn(4, 4, generator=g))  # copied in grad mode
    (view, copy), = undo_copies([leaf.t()]).pairs()
    assert view.grad_fn is None and not copy.requires_grad  # autograd records nothing
    grown = torch.arange(10.0)
    copies = undo_copies([grown, torch.arange(5.0)])
    grown.resize_(20)
    with pytest.raises(statepager.UsageError, match="resized"):
        copies.pairs()


def test_a_state_snapshot_copies_each_unpaged_tensor_as_it_is_now(tmp_path):
    """UndoCopies.copy_state, called per bucket step after step: each unpaged tensor's copy
    holds its value of now, whether it is the tensor of the step before (changed in
    place), a new one in its entry, or one resized in place; the pager's tensors are kept,
    never copied (one whose bytes were set elsewhere is copied); restored, the state is its
    tensors with those values, in its order."""
    from statepager.core.atomic import UndoCopies, restore_state
    with Pager(str(tmp_path / "s"), page_size=16 * KiB) as pager:
        p = torch.nn.Parameter(torch.zeros(4))
        paged = pager.empty(4, dtype=torch.float32)
        step = torch.tensor(1.0)
        state = {p: {"step": step, "exp_avg": paged}}
        undo = UndoCopies(pager)

        def snapshot_then_change(change):
            saved = undo.copy_state(state, part=True)
            ours = pager.owns(paged)
            want = {n: v.clone() for n, v in state[p].items() if not (ours and v is paged)}
            assert (saved[p]["exp_avg"] == (paged, None)) == ours
            change()
            restore_state(state, saved, [p])
            assert list(state[p]) == ["step", "exp_avg"] and state[p]["exp_avg"] is paged
            assert all(torch.equal(state[p][n], w) for n, w in want.items())

        snapshot_then_change(lambda: step.add_(1))
        step.add_(5)  # the same tensor, another value
        snapshot_then_change(lambda: step.add_(1))
        state[p]["step"] = torch.tensor(9.0)  # another tensor in its entry
        snapshot_then_change(lambda: state[p]["step"].add_(1))
        state[p]["step"] = torch.tensor([3.0, 4.0])
        snapshot_then_change(lambda: state[p]["step"].add_(1))
        state[p]["step"].resize_(1)  # resized in place: same tensor and bytes, new shape
        snapshot_then_change(lambda: state[p]["step"].add_(1))
        assert state[p]["step"].shape == (1,)
        paged.data = torch.full((4,), 2.0)  # the same tensor, its bytes no longer the pager's
        snapshot_then_change(lambda: paged.add_(1))


def chunked(store, atomic="bucket"):
    """AdamW over one parameter of 3 x 2^18 elements stepping in chunks of 2^18 (three
    buckets), with chunk hooks."""
    pager = Pager(store, page_size=64 * KiB)
    p = torch.nn.Parameter(torch.randn(3 << 18, generator=torch.Generator().manual_seed(0)))
    q = torch.nn.Parameter(torch.randn(1000, generator=torch.Generator().manual_seed(1)))
    opt = torch.optim.AdamW([p, q], lr=1e-2)
    calls = []
    binding = pager.attach(opt, bucket_size=3 << 20, atomic=atomic, hooks=Hooks(
        before_chunk=lambda *c: calls.append(c), after_chunk=lambda *c: None))
    return pager, opt, binding, [p, q], calls


def test_a_parameter_failing_between_its_chunks_steps_once(tmp_path):
    """The second chunk of a parameter fails; the retry steps the second and third only,
    each from the step count of before the step: the count advances once and every bit
    is that of an uninterrupted step."""
    results = []
    for name, fail in (("clean", False), ("failed", True)):
        pager, opt, binding, params, calls = chunked(str(tmp_path / name))
        with pager:
            for step in range(3):
                for i, t in enumerate(params):
                    t.grad = torch.randn(t.shape, generator=torch.Generator().manual_seed(
                        10 * step + i))
                if fail and step == 2:
                    hook = binding.before_chunk

                    def failing(p, start, stop):
                        if start > 0 and not failing.done:
                            failing.done = True
                            raise RuntimeError("injected chunk failure")
                        hook(p, start, stop)
                    failing.done = False
                    binding.before_chunk = failing
                    with pytest.raises(RuntimeError, match="injected chunk failure"):
                        opt.step()
                    assert binding.pending
                    chunks_before = len(calls)
                    opt.step()
                    assert not binding.pending
                    assert [c[1] for c in calls[chunks_before:]] == [1 << 18, 2 << 18]
                else:
                    opt.step()
            sd = opt.state_dict()
            results.append(([t.detach().clone() for t in params],
                            {k: {n: v.clone() for n, v in s.items()}
                             for k, s in sd["state"].items()}))
    (p_clean, s_clean), (p_failed, s_failed) = results
    assert all(torch.equal(a, b) for a, b in zip(p_clean, p_failed))
    assert same(s_clean, s_failed)
    assert int(s_failed[0]["step"]) == 3


def stepped_twice(tmp_path):
    """The adamw configuration with resumable steps, after two steps."""
    setup, _ = CONFIGS["adamw"]
    model, pager, opt, binding = setup(str(tmp_path / "store"), "cpu", atomic="bucket")
    for i in range(2):
        set_grads(model, i)
        opt.step()
    return model, pager, opt, binding


def test_a_finish_that_fails_again_stays_pending(tmp_path):
    clean_before, _, clean_after = run("adamw", "cpu", str(tmp_path / "clean"), 2)
    model, pager, opt, binding = stepped_twice(tmp_path)
    with pager:
        set_grads(model, 2)
        fault = FAULTS["after-hook"](model, pager, opt, binding, tmp_path)
        fault.arm()
        with pytest.raises(RuntimeError):
            opt.step()
        assert binding.pending
        fault.disarm()
        stepped = snapshot(model, pager, opt, binding)["stored"]
        hook = binding.before_bucket

        def failing(params):
            raise RuntimeError("injected failure of the finish")
        binding.before_bucket = failing
        with pytest.raises(RuntimeError, match="of the finish"):
            opt.zero_grad()
        assert binding.pending
        assert same(snapshot(model, pager, opt, binding)["stored"], stepped)
        binding.before_bucket = hook
        opt.step()
        assert not binding.pending
        assert same(snapshot(model, pager, opt, binding)["stored"], clean_after["stored"])
        assert not same(stepped, clean_after["stored"])


def test_a_load_forgets_a_pending_step_and_a_save_finishes_it(tmp_path):
    model, pager, opt, binding = stepped_twice(tmp_path)
    with pager:
        checkpoint.save(pager, str(tmp_path / "two"))
        loaded = copy.deepcopy(opt.state_dict())  # its step counters are the live ones
        set_grads(model, 2)
        for load in ("checkpoint", "load_state_dict"):
            fault = FAULTS["after-hook"](model, pager, opt, binding, tmp_path)
            fault.arm()
            with pytest.raises(RuntimeError):
                opt.step()
            fault.disarm()
            assert binding.pending
            if load == "checkpoint":
                checkpoint.load(pager, str(tmp_path / "two"))
            else:
                opt.load_state_dict(loaded)
            assert not binding.pending
            assert same(opt.state_dict()["state"], loaded["state"])
        fault.arm()
        with pytest.raises(RuntimeError):
            opt.step()
        fault.disarm()
        checkpoint.save(pager, str(tmp_path / "three"))
        assert not binding.pending
        assert {int(v["step"]) for v in opt.state_dict()["state"].values()} == {3}


def test_pause_finishes_a_pending_step(tmp_path):
    setup, _ = CONFIGS["paged-fp32"]
    model, pager, opt, binding = setup(str(tmp_path / "store"), "cpu", atomic="bucket")
    with pager:
        set_grads(model, 0)
        opt.step()
        fault = FAULTS["after-hook"](model, pager, opt, binding, tmp_path)
        fault.arm()
        with pytest.raises(RuntimeError):
            opt.step()
        fault.disarm()
        pager.pause()
        assert not binding.pending
        pager.resume()
        assert {int(v["step"]) for v in opt.state_dict()["state"].values()} == {2}

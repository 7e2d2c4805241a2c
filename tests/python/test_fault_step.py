"""A step that fails changes nothing, and its retry steps once.

For each kind of failure (an exception in a bucket hook before or after the optimizer
stepped the bucket, the optimizer's own error, the pager out of memory, a store that
cannot be read, a store out of space; with residual masters, a model parameter changed
behind the optimizer's back and a failure listing a bucket's exceptions) and each kind of binding (a torch optimizer over
ordinary parameters, PagedAdamW with fp32 or residual masters, SGD creating its state in
the failing step): every parameter, every stored state tensor (bytes and residency),
every unpaged state value (step counters) and every param-group value is bit-identical
to before the step, and the retry, once the fault is gone, gives bit-identical results
to a run that never failed."""
import os

import pytest
import torch

import statepager
from statepager import checkpoint
from statepager import PagedAdamW, Pager
from statepager.core.atomic import KEPT_BYTES, UndoCopies, restore_state
from statepager.formats import codecs

from compare import same
from small_jobs import BUDGET, KiB, bits, make_model, make_pager, set_grads, stored_bits

# The setups attach all-or-nothing steps (atomic=True) unless told otherwise.

def adamw(store, device="cpu", atomic=True, **kw):
    model = make_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    pager = make_pager(store, device)
    return model, pager, opt, pager.attach(opt, bucket_size=100 * KiB, atomic=atomic, **kw)


def paged(store, device="cpu", mains="fp32", moments="fp32", atomic=True):
    model = make_model(device, torch.bfloat16)
    pager = make_pager(store, device)
    opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-3, bucket_size=100 * KiB,
                     mains=mains, moments=moments, atomic=atomic)
    return model, pager, opt, opt.binding


def sgd(store, device="cpu", atomic=True):
    model = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=True)
    pager = make_pager(store, device)
    return model, pager, opt, pager.attach(opt, bucket_size=100 * KiB, atomic=atomic)


# name -> (setup, steps before the failing one). Out of space needs a step that grows
# the store: the first one to write its state, and the first copy-on-write (the second).
CONFIGS = {
    "adamw": (adamw, 2),
    "paged-fp32": (paged, 2),
    "paged-residual-q8": (lambda s, d, **kw: paged(s, d, mains="residual", moments="q8",
                                                   **kw), 2),
    "sgd-first-step": (sgd, 0),  # its momentum is created (and paged) in the failing step
}


def capture(model, pager, opt, binding):
    """Everything a step may change, read without changing anything (stored tensors are
    paged in inside an epoch that is then aborted: no writes, residency as it was)."""
    stored = stored_bits(pager, binding)
    params = [p for g in opt.param_groups for p in g["params"]]
    small = {(i, name): bits(v) if isinstance(v, torch.Tensor) else v
             for i, p in enumerate(params) for name, v in opt.state.get(p, {}).items()
             if not (isinstance(v, torch.Tensor) and pager.owns(v))}
    return {"model": [bits(p) for p in model.parameters()], "stored": stored, "small": small,
            "state_keys": [sorted(opt.state[p].keys()) if p in opt.state else None
                           for p in params],
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}


# -- faults: arm() before the step, disarm() before the retry --------------------------

class Fault:
    raises = Exception

    def __init__(self, model, pager, opt, binding, tmp):
        self.model, self.pager, self.opt, self.binding, self.tmp = model, pager, opt, binding, tmp

    def arm(self):
        pass

    def disarm(self):
        pass


class HookFault(Fault):
    """An exception in a bucket hook on the third bucket; after_bucket runs once the
    optimizer has stepped the bucket (and PagedAdamW's has written its model params)."""
    raises = RuntimeError
    hook = None

    def arm(self):
        self.saved = getattr(self.binding, self.hook)
        calls = []

        def failing(params):
            calls.append(1)
            if len(calls) == 3:
                if self.hook == "after_bucket" and self.saved:
                    self.saved(params)  # half done: the model params are written
                raise RuntimeError("injected hook failure")
            if self.saved:
                self.saved(params)

        setattr(self.binding, self.hook, failing)

    def disarm(self):
        setattr(self.binding, self.hook, self.saved)


class BeforeHook(HookFault):
    hook = "before_bucket"


class AfterHook(HookFault):
    hook = "after_bucket"


class OptimizerError(Fault):
    """The optimizer's own error in the last bucket: AdamW refuses a sparse grad."""
    raises = RuntimeError

    def arm(self):
        self.p = list(self.model.parameters())[-1]
        self.grad = self.p.grad
        self.p.grad = self.grad.to_sparse()

    def disarm(self):
        self.p.grad = self.grad


class OutOfMemory(Fault):
    """The pager out of memory in the middle of the step: the second bucket's hook pages
    in a tensor as large as the whole budget."""
    raises = statepager.OutOfMemoryError

    def arm(self):
        self.saved = self.binding.before_bucket
        self.hog = self.pager.empty(BUDGET[self.pager.device.type] // 4)
        calls = []

        def hog(params):
            calls.append(1)
            if len(calls) == 2:
                self.pager.page_in(self.hog)
            if self.saved:
                self.saved(params)

        self.binding.before_bucket = hog

    def disarm(self):
        self.binding.before_bucket = self.saved
        del self.hog


class UnreadableStore(Fault):
    """The store file cut short under the pager: its page-ins fail. Disarming writes its
    bytes back."""
    raises = statepager.CorruptStoreError

    def arm(self):
        self.path = os.path.join(self.pager.directory, self.binding.name, "state.bin")
        with open(self.path, "rb") as f:
            self.data = f.read()
        os.truncate(self.path, 4096)

    def disarm(self):
        with open(self.path, "r+b") as f:
            f.write(self.data)


class NoSpace(Fault):
    """The store's filesystem (a small tmpfs) is full: page-outs fail midway. Disarming
    deletes the ballast that filled it, as a user would free space."""
    raises = statepager.NoSpaceError

    def arm(self):
        self.ballast = os.path.join(os.path.dirname(self.pager.directory), "ballast")
        free = os.statvfs(self.ballast.rsplit("/", 1)[0])
        left = 160 * KiB  # less than a step writes, more than a bucket
        with open(self.ballast, "wb") as f:
            f.write(b"\1" * max(0, free.f_bavail * free.f_frsize - left))

    def disarm(self):
        os.remove(self.ballast)


class ChangedParam(Fault):
    """A model parameter changed behind the optimizer's back (residual masters): the
    checks, read after the last bucket stepped, fail the step. Disarming puts it back."""
    raises = ValueError

    def arm(self):
        self.p = next(self.model.parameters())
        self.kept = self.p.detach().clone()
        with torch.no_grad():
            self.p.add_(1.0)

    def disarm(self):
        with torch.no_grad():
            self.p.copy_(self.kept)


class CountsUnread(Fault):
    """Listing a bucket's residual exceptions, read two buckets after its step, fails
    once (the third bucket's: while later buckets have stepped)."""
    raises = RuntimeError

    def arm(self):
        self.finish, calls = codecs.PendingExceptions.finish, []

        def failing(pending, count):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected failure listing exceptions")
            return self.finish(pending, count)

        codecs.PendingExceptions.finish = failing

    def disarm(self):
        codecs.PendingExceptions.finish = self.finish


FAULTS = {"before-hook": BeforeHook, "after-hook": AfterHook, "optimizer": OptimizerError,
          "out-of-memory": OutOfMemory, "unreadable-store": UnreadableStore,
          "no-space": NoSpace, "changed-param": ChangedParam, "counts-unread": CountsUnread}
RESIDUAL_ONLY = ("changed-param", "counts-unread")


def run(setup, device, store, warm, fault=None, tmp=None, begun=False):
    """Steps `warm` times, then once with `fault` armed (it must fail and change
    nothing), then once more: returns (state before the failing step, after the retry).
    begun: each step begun first (StreamedOptimizer.begin_step), the fault armed before."""
    model, pager, opt, binding = setup(store, device)

    def step():
        if begun:
            binding.begin_step()
            assert binding.begun
        opt.step()

    try:
        for i in range(warm):
            set_grads(model, i)
            step()
        set_grads(model, warm)
        before = capture(model, pager, opt, binding)
        if fault is not None:
            f = fault(model, pager, opt, binding, tmp)
            f.arm()
            with pytest.raises(f.raises):
                step()
            f.disarm()
            after = capture(model, pager, opt, binding)
            for key in before:
                assert same(before[key], after[key]), f"the failed step changed {key}"
        step()
        return before, capture(model, pager, opt, binding)
    finally:
        pager.close()


def skip_what_cannot_fail(config, fault) -> None:
    """Skips a (config, fault) pair whose fault cannot happen in that configuration."""
    if config == "sgd-first-step" and fault in ("optimizer", "unreadable-store"):
        pytest.skip("SGD takes sparse grads, and its first step reads nothing from the store")
    if fault in RESIDUAL_ONLY and "residual" not in config:
        pytest.skip("only residual masters have model-parameter checks and exception counts")


def check_fault(tmp_path, request, config, fault, device="cpu", begun=False):
    setup, warm = CONFIGS[config]
    skip_what_cannot_fail(config, fault)
    if fault == "no-space":
        warm = min(warm, 1)
    root = (request.getfixturevalue("sized_tmpfs")(4, "the out-of-space case")
            if fault == "no-space" else str(tmp_path))
    clean_before, clean_after = run(setup, device, os.path.join(str(tmp_path), "clean"), warm)
    before, after = run(setup, device, os.path.join(root, "store"), warm, FAULTS[fault],
                        tmp_path, begun)
    assert same(clean_before, before)
    for key in clean_after:
        assert same(clean_after[key], after[key]), f"the retry differs from a clean step: {key}"
    assert not same(clean_before["stored"], clean_after["stored"])  # the step did step


@pytest.mark.parametrize("begun", [False, True], ids=["called", "begun"])
@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_failed_step_changes_nothing_and_retry_steps_once(tmp_path, request, config, fault,
                                                          begun):
    """begun: the step's page-ins started before step() (begin_step), as the Megatron
    adapter starts them."""
    check_fault(tmp_path, request, config, fault, begun=begun)


@pytest.mark.gpu
@pytest.mark.parametrize("fault", ["after-hook", "out-of-memory", "no-space", "changed-param",
                                   "counts-unread"])
@pytest.mark.parametrize("config", ["adamw", "paged-fp32", "paged-residual-q8"])
@pytest.mark.parametrize("begun", [False, True], ids=["called", "begun"])
def test_failed_step_on_the_gpu(tmp_path, request, config, fault, begun):
    """The same on CUDA memory: the abort waits for the device before it unmaps (and,
    with residual masters, the checks and counts read late are those of the kernels)."""
    check_fault(tmp_path, request, config, fault, "cuda", begun)


def test_store_file_stays_bounded_over_many_steps(store_dir):
    """Copy-on-write steps reuse the ranges the previous step freed: fifty steps keep
    the store within about twice the state (the undo copies of the parameters are in host
    memory, not in the store)."""
    model, pager, opt, binding = adamw(store_dir)
    with pager:
        sizes = []
        for step in range(50):
            set_grads(model, step)
            opt.step()
            path = os.path.join(store_dir, binding.name, "state.bin")
            sizes.append(os.path.getsize(path))
        state = sum(t.numel() * t.element_size() for b in binding.buckets for t in b.stored)
        assert max(sizes) <= 2 * state + 256 * KiB, (sizes, state)
        assert sizes[-1] == sizes[10]


def test_a_step_never_waits_for_a_background_save(store_dir, tmp_path):
    """Steps write fresh ranges, never the ones a save is still copying."""
    model, pager, opt, binding = adamw(store_dir)
    with pager:
        for step in range(2):
            set_grads(model, step)
            opt.step()
        h = checkpoint.save(pager, str(tmp_path / "ckpt"), background=True)
        for step in range(2, 5):
            set_grads(model, step)
            opt.step()
        h.wait()
        assert pager.stats()["buckets_held"] == 0


def test_undo_copies_are_taken_a_bucket_ahead_once_each(store_dir, monkeypatch):
    """Residual masters' undo copies (of their bf16 params) are taken before the bucket
    ahead of theirs steps, so that its after_bucket does not wait for them; once per step
    each, and a failed step still puts every parameter back."""
    model, pager, opt, binding = paged(store_dir, mains="residual", moments="q8")
    with pager:
        set_grads(model, 0)
        opt.step()
        n = len(binding.buckets)
        assert n >= 3
        index = {id(b.undo): i for i, b in enumerate(binding.buckets)}
        order = {id(b): i for i, b in enumerate(binding.buckets)}
        undo, stepper = binding._steps.undo, binding._stepper
        events, take, step_bucket = [], undo.take, stepper.step
        monkeypatch.setattr(undo, "take", lambda copies, targets: (
            events.append(("take", index[id(copies)])), take(copies, targets))[1])
        monkeypatch.setattr(stepper, "step", lambda b, *a, **k: (
            events.append(("step", order[id(b)])), step_bucket(b, *a, **k))[1])
        set_grads(model, 1)
        opt.step()
        taken = [i for kind, i in events if kind == "take"]
        assert sorted(taken) == list(range(n))
        assert events[:2] == [("take", 0), ("take", 1)]  # the first bucket's own first
        for i in range(1, n):
            assert events.index(("take", i)) < events.index(("step", i - 1)), events
        before = [bits(p) for p in model.parameters()]
        fault = AfterHook(model, pager, opt, binding, None)
        fault.arm()
        set_grads(model, 2)
        with pytest.raises(RuntimeError):
            opt.step()
        assert same(before, [bits(p) for p in model.parameters()])


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_undo_copies_taken_at_zero_grad_serve_the_step(store_dir, monkeypatch, device):
    """All or nothing: optimizer.zero_grad() takes the next step's undo copies of residual
    masters' model params (while forward and backward run): the step takes none of its
    own, and a step that fails puts every parameter back from them; its retry takes its
    own."""
    model, pager, opt, binding = paged(store_dir, device, mains="residual", moments="q8")
    with pager:
        set_grads(model, 0)
        opt.step()
        takes, take = [], binding._steps.undo.take
        monkeypatch.setattr(binding._steps.undo, "take", lambda copies, targets: (
            takes.append(1), take(copies, targets))[1])
        opt.zero_grad()
        opt.zero_grad()  # once per step
        assert len(takes) == len(binding.buckets) >= 3
        set_grads(model, 1)
        del takes[:]
        opt.step()
        assert takes == []
        opt.zero_grad()
        set_grads(model, 2)
        before = capture(model, pager, opt, binding)
        fault = AfterHook(model, pager, opt, binding, None)
        fault.arm()
        with pytest.raises(RuntimeError):
            opt.step()
        fault.disarm()
        after = capture(model, pager, opt, binding)
        for key in before:
            assert same(before[key], after[key]), f"the failed step changed {key}"
        del takes[:]
        opt.step()
        assert len(takes) == len(binding.buckets)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("failing", ["the-check", "the-first-bucket", "the-check-begun"])
def test_a_param_changed_after_zero_grad_fails_the_step_and_keeps_its_change(
        store_dir, device, failing):
    """A model parameter changed between zero_grad() and step() (residual masters): the
    copies zero_grad() took no longer hold it, so the step takes its own before writing
    any; it fails (the masters cannot be rebuilt, or the first bucket's hook raises before
    that is known) and every parameter keeps the value it was given. Begun (begin_step()
    before the change): the copies are checked when step() starts, not when it began."""
    model, pager, opt, binding = paged(store_dir, device, mains="residual", moments="q8")
    with pager:
        set_grads(model, 0)
        opt.step()
        opt.zero_grad()
        set_grads(model, 1)
        if failing == "the-check-begun":
            binding.begin_step()
            assert binding.begun
        p = next(model.parameters())
        with torch.no_grad():
            p.add_(1.0)
        changed = [bits(q) for q in model.parameters()]
        if failing == "the-first-bucket":
            def failing_hook(params):
                raise RuntimeError("injected before the first bucket steps")
            binding.before_bucket = failing_hook
        with pytest.raises(RuntimeError if failing == "the-first-bucket" else ValueError):
            opt.step()
        assert same(changed, [bits(q) for q in model.parameters()])


def test_atomic_false_steps_in_place(store_dir):
    """atomic=False: no second copy in the store, and a failed step is left partly done
    (the trade-off the option documents)."""
    model, pager, opt, binding = adamw(store_dir, atomic=False)
    with pager:
        for step in range(3):
            set_grads(model, step)
            opt.step()
        state = sum(t.numel() * t.element_size() for b in binding.buckets for t in b.stored)
        assert os.path.getsize(os.path.join(store_dir, binding.name, "state.bin")) \
            <= state + 64 * KiB
        assert all(not b.undo for b in binding.buckets)
        before = [bits(p) for p in model.parameters()]
        fault = AfterHook(model, pager, opt, binding, None)
        fault.arm()
        with pytest.raises(RuntimeError):
            opt.step()
        assert not same(before, [bits(p) for p in model.parameters()])


# -- a step begun before step() (StreamedOptimizer.begin_step) ----------------------------

BEGUN_CONFIGS = ["adamw", "paged-residual-q8"]


def stepped_twice(setup, device, store, between=None):
    """Two steps (the second begun, then `between(model, pager, opt, binding)` run before
    its step() when given, which must end it): the state captured after each, the
    pager's bytes moved by the begun step and what ran with it, its StepStats, and
    whether it had begun."""
    model, pager, opt, binding = setup(store, device)
    with pager:
        set_grads(model, 0)
        opt.step()
        first = capture(model, pager, opt, binding)
        set_grads(model, 1)
        stats = pager.stats()
        binding.begin_step()
        began = binding.begun
        if between is not None:
            between(model, pager, opt, binding)
            assert not binding.begun or between is _new_group  # that one ends at step()
        opt.step()
        moved = {k: pager.stats()[k] - stats[k] for k in ("bytes_read", "bytes_written")}
        assert all(pager.residency(t) == "file" for b in binding.buckets for t in b.stored)
        return first, capture(model, pager, opt, binding), moved, binding.last, began


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", BEGUN_CONFIGS)
def test_a_begun_step_is_the_step_it_would_have_been(tmp_path, device, config):
    """begin_step() then step(): the bits of a step called plainly, the same bytes read
    and written (one pass: the page-ins begun are the step's own), counted in its stats."""
    setup = CONFIGS[config][0]
    plain = stepped_twice(lambda s, d: _unbegun(setup(s, d)), device, str(tmp_path / "a"))
    begun = stepped_twice(setup, device, str(tmp_path / "b"))
    assert begun[4] and not plain[4]
    assert same(plain[1], begun[1]) and not same(begun[0], begun[1])
    assert plain[2] == begun[2]
    assert begun[3].bytes_read == begun[2]["bytes_read"] > 0


def _unbegun(made):
    """A setup whose binding's begin_step() does nothing (the step pages in itself)."""
    made[3].begin_step = lambda: None
    return made


def _end(model, pager, opt, binding):
    binding.end_begun_step()


def _zero_grad(model, pager, opt, binding):
    """A skipped step: the training loop goes on to its next iteration's zero_grad()."""
    grads = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    for p, g in zip(model.parameters(), grads):
        p.grad = g


def _state_dict(model, pager, opt, binding):
    opt.state_dict()


def _save(model, pager, opt, binding):
    checkpoint.save(pager, os.path.join(pager.directory + "-ckpt"))


def _pause(model, pager, opt, binding):
    pager.pause()
    pager.resume()


def _new_group(model, pager, opt, binding):
    """A param group added: the step plans its buckets anew."""
    extra = torch.nn.Parameter(torch.zeros(3, device=pager.device,
                                           dtype=next(model.parameters()).dtype))
    opt.add_param_group({"params": [extra]})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("between", [_end, _zero_grad, _state_dict, _save, _pause, _new_group],
                         ids=["end_begun_step", "zero_grad", "state_dict", "save", "pause",
                              "add_param_group"])
def test_what_comes_between_a_begun_step_and_step_ends_it(tmp_path, device, between):
    """A begun step that something else comes before (a skipped step's next zero_grad(),
    state_dict(), a checkpoint, pause(), a new param group) is ended first, its pages
    dropped without a byte written; step() then begins anew, with the bits of a step
    called plainly."""
    # PagedAdamW steps the model's own parameters: a group of others goes to torch's AdamW.
    setup = CONFIGS["adamw" if between is _new_group else "paged-residual-q8"][0]
    plain = stepped_twice(lambda s, d: _unbegun(setup(s, d)), device, str(tmp_path / "a"),
                          between if between is _new_group else None)
    ended = stepped_twice(setup, device, str(tmp_path / "b"), between)
    assert ended[4]
    assert same(plain[1]["model"], ended[1]["model"])
    assert same(plain[1]["stored"][:len(ended[1]["stored"])],
                ended[1]["stored"][:len(plain[1]["stored"])])
    # Ended: the begun page-ins (the first buckets', all of them where the window holds
    # every bucket, as with CUDA's default depth) were read, and dropped unwritten.
    if between in (_end, _zero_grad):
        assert ended[2]["bytes_written"] == plain[2]["bytes_written"]
        assert plain[2]["bytes_read"] < ended[2]["bytes_read"] <= 2 * plain[2]["bytes_read"]


# How a begin_step() is refused at its second page-in: the setup, and what is raised.
REFUSALS = {
    "out-of-memory": (lambda s, d: paged(s, d, mains="residual", moments="q8"),
                      lambda: statepager.OutOfMemoryError("injected: no room for the second "
                                                          "bucket")),
    "interrupt": (adamw, KeyboardInterrupt),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_begin_step_refused_midway_changes_nothing(store_dir, device, monkeypatch, refusal):
    """begin_step() whose second page-in is refused: out of memory, which it leaves to
    step(), or an interrupt, which propagates. Either way the page-in that started is
    waited for and dropped unwritten, the epoch closed, nothing begun and nothing
    changed; step() then pages in itself and steps as ever."""
    setup, error = REFUSALS[refusal]
    model, pager, opt, binding = setup(store_dir, device)
    with pager:
        set_grads(model, 0)
        opt.step()
        set_grads(model, 1)
        before = capture(model, pager, opt, binding)
        page_in_async, calls = pager.page_in_async, []

        def refusing(tensors, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise error()
            return page_in_async(tensors, **kw)

        monkeypatch.setattr(pager, "page_in_async", refusing)
        written = pager.stats()["bytes_written"]
        if refusal == "interrupt":
            with pytest.raises(KeyboardInterrupt):
                binding.begin_step()
        else:
            binding.begin_step()
        assert len(calls) == 2 and not binding.begun
        assert all(pager.residency(t) == "file" for b in binding.buckets for t in b.stored)
        assert pager.stats()["bytes_written"] == written
        monkeypatch.undo()
        after = capture(model, pager, opt, binding)
        for key in before:
            assert same(before[key], after[key]), f"the begun step changed {key}"
        opt.step()
        assert not same(before["stored"], capture(model, pager, opt, binding)["stored"])


def test_begin_step_does_nothing_for_steps_in_place(store_dir):
    """atomic=False: no epoch to drop a begun step's pages unwritten, so none begins."""
    model, pager, opt, binding = adamw(store_dir, atomic=False)
    with pager:
        set_grads(model, 0)
        opt.step()
        stats = pager.stats()
        binding.begin_step()
        assert pager.stats()["bytes_read"] == stats["bytes_read"]


@pytest.mark.parametrize("to", ["bucket", False])
def test_a_binding_no_longer_all_or_nothing_lets_its_host_undo_copies_go(store_dir, to):
    """Residual masters: all-or-nothing steps keep host undo copies of the model params
    between steps (taken at zero_grad()); set to resumable or in place, the binding lets
    them go and steps on."""
    model, pager, opt, binding = paged(store_dir, mains="residual", moments="q8")
    with pager:
        set_grads(model, 0)
        opt.step()
        opt.zero_grad()
        undo = binding._steps.undo
        assert undo._copies and undo._before is not None
        binding.atomic = to
        assert not undo._copies and undo._before is None
        assert all(not b.undo for b in binding.buckets)
        set_grads(model, 1)
        opt.step()


def test_a_step_begun_atomic_and_taken_in_place_begins_again(tmp_path):
    """atomic set to False between begin_step() and step(): the begun step (in an epoch)
    ends unwritten and the step runs in place, as a plain one."""
    def in_place(opt, binding):
        binding.atomic = False

    plain = _changed_before_step(adamw, str(tmp_path / "a"), "cpu", False, in_place)
    begun = _changed_before_step(adamw, str(tmp_path / "b"), "cpu", True, in_place)
    assert same(plain, begun)


def _changed_before_step(setup, store, device, begin, change):
    """Steps once, then again with `change(opt, binding)` made just before step() (after
    begin_step() when `begin`): what capture() sees after."""
    model, pager, opt, binding = setup(store, device)
    with pager:
        set_grads(model, 0)
        opt.step()
        set_grads(model, 1)
        if begin:
            binding.begin_step()
            assert binding.begun
        change(opt, binding)
        opt.step()
        return capture(model, pager, opt, binding)


def test_another_binding_s_step_ends_a_begun_one(tmp_path):
    """Two optimizers on one Pager: B's step (or begin_step) ends A's begun step first, so
    each step's stats count its own bytes, and A then steps as a plain step would."""
    torch.manual_seed(0)
    with make_pager(str(tmp_path / "s"), "cpu") as pager:
        models = [make_model("cpu") for _ in range(2)]
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for m in models]
        a, b = [pager.attach(o, bucket_size=100 * KiB) for o in opts]
        for step in range(2):
            for m in models:
                set_grads(m, step)
            a.begin_step()
            assert a.begun
            opts[1].step()
            assert not a.begun
            b.begin_step()
            opts[0].step()  # ends B's begun step, begins its own anew
            assert not b.begun
            opts[1].step()
        stored = [sum(t.numel() * t.element_size() for bk in x.buckets for t in bk.stored)
                  for x in (a, b)]
        assert [a.last.bytes_read, b.last.bytes_read] == stored
        assert [a.last.bytes_written, b.last.bytes_written] == stored


@pytest.mark.parametrize("device", DEVICES)
def test_a_group_changed_after_begin_step_steps_as_changed(tmp_path, device):
    """A param group's options changed between begin_step() and step() (here Adam's
    weight decay, which decides whether the fused step applies): the step runs with the
    new options, as a plain step would."""
    def adam(store, device):
        model = make_model(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
        pager = make_pager(store, device)
        return model, pager, opt, pager.attach(opt, bucket_size=100 * KiB)

    def decay(opt, binding):
        opt.param_groups[0]["weight_decay"] = 0.1  # Adam's coupled L2: no fused step

    assert same(_changed_before_step(adam, str(tmp_path / "a"), device, False, decay),
                _changed_before_step(adam, str(tmp_path / "b"), device, True, decay))


def test_the_snapshot_copies_unpaged_state_keeping_small_copies(store_dir):
    """UndoCopies.copy_state: each unpaged state tensor is copied with its bits: a count
    on the host (a float32 or float64 scalar holding a whole number) as its number, others
    (a NaN with a payload, a fraction, an int64) as tensors; a copy of at most KEPT_BYTES
    is kept and reused by the next snapshot while its tensor's shape, dtype and device
    stay; larger ones and sparse ones are new each time; paged tensors and other values
    are not copied; a parameter gone lets its copies go; restore_state puts every bit
    back in the same tensors."""
    with Pager(store_dir, page_size=64 * 1024) as pager:
        undo = UndoCopies(pager)
        a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
        paged = pager.empty(16)
        pager.page_in(paged)
        large = torch.randn(KEPT_BYTES // 4 + 1)
        nan = torch.tensor(0x7FC00123, dtype=torch.int32).view(torch.float32)  # a payload
        state = {a: {"step": torch.tensor(3.0), "exp_avg": paged, "large": large, "lr": 0.1,
                     "sparse": torch.eye(3).to_sparse(), "small": torch.tensor([1.0, 2.0]),
                     "nan": nan, "count": torch.tensor(7, dtype=torch.int64),
                     "half": torch.tensor(0.5), "f64": torch.tensor(-0.0, dtype=torch.float64)},
                 b: {"step": torch.tensor(5.0)}}

        def bits(t):
            return t.to_dense().reshape(-1).view(torch.uint8)

        def snapshot():
            saved = undo.copy_state(state)
            for p, values in state.items():
                for name, v in values.items():
                    value, copy = saved[p][name]
                    assert value is v
                    if name in ("exp_avg", "lr"):
                        assert copy is None
                    elif name in ("step", "f64") and v.dim() == 0:
                        assert type(copy) is float and copy == v.item()
                    else:
                        assert copy is not v and torch.equal(bits(copy), bits(v))
            return saved

        first = snapshot()
        state[a]["small"].add_(1)  # as a step does, in place
        state[b]["step"] = torch.tensor([5.0, 6.0])  # another shape
        second = snapshot()
        assert second[a]["small"][1] is first[a]["small"][1]  # kept: refilled
        assert second[a]["small"][1].tolist() == [2.0, 3.0]
        assert isinstance(second[b]["step"][1], torch.Tensor)
        assert second[a]["large"][1] is not first[a]["large"][1]
        assert second[a]["sparse"][1] is not first[a]["sparse"][1]
        before = {n: bits(v).clone() for n, v in state[a].items() if isinstance(v, torch.Tensor)
                  and n != "exp_avg"}
        for name in ("step", "small", "nan", "count", "large", "half", "f64"):
            state[a][name].add_(1)
        restore_state(state, second)
        assert all(torch.equal(bits(state[a][n]), w) for n, w in before.items())
        assert state[a]["nan"] is nan and state[a]["count"].dtype == torch.int64
        state[b]["step"] = torch.tensor([5.0, 6.0], dtype=torch.float64)  # another dtype
        del state[a]
        third = snapshot()
        assert third[b]["step"][1].dtype == torch.float64
        assert set(third) == {b}
        state[a] = {"small": torch.tensor([9.0, 9.0])}
        assert snapshot()[a]["small"][1] is not second[a]["small"][1]  # let go with a

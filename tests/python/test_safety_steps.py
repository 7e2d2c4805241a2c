"""Steps against other threads, interrupts, and reads of the state between them.

- One thread steps while another saves, calls state_dict() or pauses and resumes: the
  Pager's lock serializes them, and the result is bit-exact with the same steps run alone.
- A KeyboardInterrupt (raised there, or a real SIGINT) at any point of a step (just after
  its epoch opens, after any bucket, in its commit) or of begin_step() is a failure like
  any other: the step is whole or not at all, and the Pager steps and saves afterwards.
  Real SIGINTs sent at random times to a process stepping in a loop never tear a step.
- pause() interrupted after paging out is paused with resume() working, or not paused
  with everything back; never tensors out and resume() refused.
- opt.state[p][name] read between steps gives its values (paged in on access), for
  fp32, bf16 and q8 moments, within the pager's budget, and changes nothing.

Paths that could crash or hang run in their own process
(`python test_safety_steps.py PATH DEVICE STORE`) with a timeout; each checks its own
result and prints "ok".
"""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import statepager
from statepager import checkpoint
from statepager import PagedAdamW, Pager
from statepager.core import pager as pager_module
from statepager.core.bucket_step import BucketStepper
from statepager.core.pipeline import Pipeline
from statepager.core.steps import Steps

from compare import same
from small_jobs import (KiB, MiB, PAGE, bits, make_model, make_pager, set_grads,
                        stored_bits)


# -- setups ---------------------------------------------------------------------------------

# All-or-nothing steps (atomic=True) unless the setup's name says resumable.

def adamw(store, device="cpu", moments="fp32", atomic=True, **kw):
    model = make_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    pager = make_pager(store, device, **kw)
    return model, pager, opt, pager.attach(opt, bucket_size=100 * KiB, moments=moments,
                                           atomic=atomic)


def paged(store, device="cpu", moments="fp32", mains="fp32", atomic=True, **kw):
    model = make_model(device, torch.bfloat16)
    pager = make_pager(store, device, **kw)
    opt = PagedAdamW(model.parameters(), pager=pager, lr=1e-3, bucket_size=100 * KiB,
                     moments=moments, mains=mains, atomic=atomic)
    return model, pager, opt, opt.binding


SETUPS = {
    "adamw": adamw,
    "adamw-q8": lambda s, d="cpu", **kw: adamw(s, d, moments="q8", **kw),
    "paged-bf16": lambda s, d="cpu", **kw: paged(s, d, moments="bf16", **kw),
    "paged-residual-q8": lambda s, d="cpu", **kw: paged(s, d, "q8", "residual", **kw),
    "adamw-resumable": lambda s, d="cpu", **kw: adamw(s, d, atomic="bucket", **kw),
    "paged-residual-q8-resumable": lambda s, d="cpu", **kw: paged(
        s, d, "q8", "residual", atomic="bucket", **kw),
}


def capture(model, pager, opt, binding):
    """Everything a step changes, read without changing anything (each bucket's stored
    tensors in an epoch then aborted), the state as held (PagedState.as_held)."""
    stored = stored_bits(pager, binding)
    held = opt.state.as_held()
    small = sorted((i, name, bits(v).tolist() if isinstance(v, torch.Tensor) else v)
                   for i, p in enumerate(binding.params_in_order())
                   for name, v in held.get(p, {}).items()
                   if not (isinstance(v, torch.Tensor) and pager.owns(v)))
    return {"model": [bits(p) for p in model.parameters()], "stored": stored, "small": small,
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}


def clean_run(setup, store, device, steps):
    """capture() after `steps` uninterrupted steps (fixed grads)."""
    model, pager, opt, binding = SETUPS[setup](store, device)
    try:
        set_grads(model)
        for _ in range(steps):
            opt.step()
        return capture(model, pager, opt, binding)
    finally:
        pager.close()


# -- C1/C2/C3: another thread --------------------------------------------------------------

def run_child(path: str, device: str, store: str, timeout: int = 300, extra=()):
    r = subprocess.run([sys.executable, os.path.abspath(__file__), path, device, store, *extra],
                       capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{path} on {device}: exit code {r.returncode}\n{out[-3000:]}"
    assert r.stdout.rstrip().endswith("ok"), out[-3000:]
    return r.stdout


PATHS = {}


def path(f):
    PATHS[f.__name__] = f
    return f


STEPS = 12


def threads(store, device, other):
    """STEPS steps on this thread while `other(pager, opt, i)` runs in a loop on another;
    then the result against the same steps run alone."""
    model, pager, opt, binding = SETUPS["adamw"](store, device)
    set_grads(model)
    opt.step()
    done, errors, calls = threading.Event(), [], [0]

    def loop():
        try:
            while not done.is_set():
                other(pager, opt, calls[0])
                calls[0] += 1
                time.sleep(0.002)  # the lock is not fair: let steps in
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=loop)
    worker.start()
    stepped, refused = 1, 0
    try:
        while stepped < STEPS:
            try:
                opt.step()
                stepped += 1
            except statepager.UsageError as e:  # paused meanwhile: refused, nothing changed
                assert "paused" in str(e), e
                refused += 1
            time.sleep(0.001)
    finally:
        done.set()
        worker.join()
    assert not errors, errors
    assert calls[0] > 0
    if pager.paused:
        pager.resume()
    got = capture(model, pager, opt, binding)
    pager.close()
    want = clean_run("adamw", store + "-alone", device, STEPS)
    assert same(got, want), "the steps differ from the same steps run alone"
    print(f"{calls[0]} calls on the other thread, {refused} steps refused while paused")


@path
def thread_save(store, device):
    threads(store, device, lambda pager, opt, i: checkpoint.save(pager, f"{store}-ckpt/{i}"))


@path
def thread_background_save(store, device):
    threads(store, device,
            lambda pager, opt, i: checkpoint.save(pager, f"{store}-ckpt/{i}", background=True).wait())


@path
def thread_state_dict(store, device):
    def read(pager, opt, i):
        sd = opt.state_dict()
        counts = {float(s["step"]) for s in sd["state"].values()}
        assert len(counts) == 1, counts  # one whole step's state, never a torn one

    threads(store, device, read)


@path
def thread_pause(store, device):
    def pause(pager, opt, i):
        pager.pause()
        pager.resume()

    threads(store, device, pause)


THREADS = ["thread_save", "thread_background_save", "thread_state_dict", "thread_pause"]


@pytest.mark.parametrize("what", THREADS)
def test_another_thread_waits_for_the_step(tmp_path, what):
    run_child(what, "cpu", str(tmp_path / "store"))


def test_a_step_holds_the_lock_its_hooks_reenter(store_dir):
    """Hooks run on the step's thread inside it: paging from them goes on (re-entrant),
    and another thread's save waits until the step ends."""
    model, pager, opt, binding = adamw(store_dir)
    set_grads(model)
    order, started = [], threading.Event()

    def before(params):
        if not started.is_set():
            started.set()
            t = threading.Thread(target=lambda: (checkpoint.save(pager, store_dir + "-ckpt"),
                                                 order.append("save")))
            t.start()
            time.sleep(0.2)
            before.thread = t
        pager.page_in([])  # re-entrant: the hook's thread holds the lock
        order.append("bucket")

    binding.before_bucket = before
    opt.step()
    order.append("step done")
    before.thread.join(30)
    assert order[-2:] == ["step done", "save"], order
    pager.close()


# -- S3/S4/S5: interrupts ------------------------------------------------------------------

class Interrupt:
    """At the n-th call of `target` (an attribute of `owner`), an interrupt before or after
    the original runs: a KeyboardInterrupt raised there, or a real SIGINT (delivered at
    the next point Python checks for signals, unless a section defers it)."""

    def __init__(self, owner, target: str, n: int = 1, after: bool = True, real: bool = False):
        self.owner, self.target, self.n, self.after, self.real = owner, target, n, after, real
        self.calls = 0

    def fire(self):
        if self.real:
            signal.raise_signal(signal.SIGINT)
        else:
            raise KeyboardInterrupt

    def __enter__(self):
        original = getattr(self.owner, self.target)
        self.original = original

        def patched(*args, **kwargs):
            self.calls += 1
            hit = self.calls == self.n
            if hit and not self.after:
                self.fire()
            result = original(*args, **kwargs)
            if hit and self.after:
                self.fire()
            return result

        setattr(self.owner, self.target, patched)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.target, self.original)


# point -> (owner, attribute, n, after): where the interrupt comes.
POINTS = {
    "epoch-opened": (pager_module.Epoch, "__init__", 1, True),
    "snapshot-taken": (statepager.core.atomic.AtomicStep, "snapshot", 1, True),
    "first-bucket": (BucketStepper, "step", 1, True),
    "third-bucket": (BucketStepper, "step", 3, True),
    "last-bucket-out": (Pipeline, "step_all", 1, True),
    "commit": (pager_module.Epoch, "commit", 1, False),
}


def interrupted(tmp_path, setup, point, real, begun):
    """Two steps, then one interrupted at `point`, then a retry: the interrupted step
    changes nothing (a real SIGINT in its commit is held until the step is whole: it
    then comes after it); save() and the retry work, the retry as a clean step."""
    model, pager, opt, binding = SETUPS[setup](str(tmp_path / "store"))
    set_grads(model)
    for _ in range(2):
        opt.step()
    before = capture(model, pager, opt, binding)
    owner, target, n, after = POINTS[point]
    with Interrupt(owner, target, n, after, real) as hit:
        with pytest.raises(KeyboardInterrupt):
            if begun:
                binding.begin_step()
            opt.step()
    assert hit.calls >= n
    assert not binding.begun
    checkpoint.save(pager, str(tmp_path / "ckpt"))  # never "a step is running"
    now = capture(model, pager, opt, binding)
    whole = point == "commit" and real
    if whole:
        assert same(now, clean_run(setup, str(tmp_path / "clean3"), "cpu", 3))
    else:
        assert same(before, now), f"the interrupted step changed the state ({point})"
    opt.step()
    after_retry = capture(model, pager, opt, binding)
    pager.close()
    assert same(after_retry, clean_run(setup, str(tmp_path / "clean"), "cpu", 3 + whole))


@pytest.mark.parametrize("begun", [False, True], ids=["called", "begun"])
@pytest.mark.parametrize("real", [False, True], ids=["raised", "sigint"])
@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("setup", ["adamw", "paged-residual-q8"])
def test_an_interrupted_step_changes_nothing(tmp_path, setup, point, real, begun):
    interrupted(tmp_path, setup, point, real, begun)


def test_a_sigint_in_the_commit_comes_once_the_step_is_whole(tmp_path):
    model, pager, opt, binding = adamw(str(tmp_path / "store"))
    set_grads(model)
    opt.step()
    with Interrupt(pager_module.Epoch, "commit", 1, after=True, real=True):
        with pytest.raises(KeyboardInterrupt):
            opt.step()
    assert binding.last.step == 2  # the step's bookkeeping is done
    got = capture(model, pager, opt, binding)
    checkpoint.save(pager, str(tmp_path / "ckpt"))
    pager.close()
    assert same(got, clean_run("adamw", str(tmp_path / "clean"), "cpu", 2))


@pytest.mark.parametrize("real", [False, True], ids=["raised", "sigint"])
def test_an_interrupted_begin_step_changes_nothing(tmp_path, real):
    """An interrupt just after begin_step() opened its epoch: nothing begun, nothing
    open; step() then steps once."""
    model, pager, opt, binding = adamw(str(tmp_path / "store"))
    set_grads(model)
    opt.step()
    before = capture(model, pager, opt, binding)
    for point in ("epoch-opened", "first-page-in"):
        owner, target, n, after = POINTS.get(point, (Steps, "start", 1, True))
        with Interrupt(owner, target, n, after, real):
            with pytest.raises(KeyboardInterrupt):
                binding.begin_step()
        assert not binding.begun
        assert same(before, capture(model, pager, opt, binding))
    opt.step()
    got = capture(model, pager, opt, binding)
    pager.close()
    assert same(got, clean_run("adamw", str(tmp_path / "clean"), "cpu", 2))


def test_without_a_python_sigint_handler_nothing_is_deferred(tmp_path):
    """SIG_IGN stays: a SIGINT in the step is ignored, as the program asked."""
    model, pager, opt, binding = adamw(str(tmp_path / "store"))
    set_grads(model)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with Interrupt(pager_module.Epoch, "__init__", 1, True, real=True):
            opt.step()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    pager.close()


@path
def random_sigints(store, device):
    """Steps in a loop (plain and begun) while the parent sends SIGINTs at random times
    (a Python handler raising KeyboardInterrupt while a step runs);
    on the parent's word ("stop" file), checks: the state is that of the number of
    steps its counters say, bit-exact, and the Pager saves and steps on."""
    setup = sys.argv[4]
    model, pager, opt, binding = SETUPS[setup](store, device)
    set_grads(model)
    opt.step()
    stop = store + "-stop"
    attempts = interrupts = 0
    stepping = [False]

    def on_sigint(signum, frame):  # a KeyboardInterrupt in the step; the loop's own
        if stepping[0]:            # bytecodes (outside any try) let it pass
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    print("ready", flush=True)
    while not os.path.exists(stop):
        attempts += 1
        try:
            stepping[0] = True
            if attempts % 2:
                binding.begin_step()
            opt.step()
        except KeyboardInterrupt:
            interrupts += 1
        finally:
            stepping[0] = False
        with open(store + "-progress", "w") as f:  # for the parent
            f.write(f"{interrupts} {attempts - interrupts}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # late ones from the parent
    counts = {int(v["step"]) for v in opt.state_dict()["state"].values()}
    assert len(counts) == 1, f"step counters differ: {counts}"
    steps = counts.pop()
    assert not binding.begun
    checkpoint.save(pager, store + "-ckpt")
    opt.step()
    got = capture(model, pager, opt, binding)
    pager.close()
    assert same(got, clean_run(setup, store + "-clean", device, steps + 1)), \
        f"the state is not that of {steps} whole steps"
    print(json.dumps({"attempts": attempts, "interrupts": interrupts, "steps": steps}))


@pytest.mark.parametrize("setup", ["adamw", "paged-residual-q8", "adamw-resumable",
                                   "paged-residual-q8-resumable"])
def test_random_sigints_never_tear_a_step(tmp_path, setup):
    """Resumable setups: an interrupted step is pending, and the next step() (or the
    state_dict() that reads the counters) finishes it."""
    store = str(tmp_path / "store")
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "random_sigints",
                              "cpu", store, setup], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    def progress() -> tuple[int, int]:  # the child's steps interrupted, and whole
        try:
            with open(store + "-progress") as f:
                interrupted, whole = f.read().split()
            return int(interrupted), int(whole)
        except (FileNotFoundError, ValueError):  # not written yet, or being written
            return 0, 0

    try:
        assert child.stdout.readline().strip() == "ready"
        rng = random.Random(0)
        deadline = time.monotonic() + 120
        i = 0  # until 20 steps were interrupted and some went whole, however slow the machine
        while (progress()[0] < 20 or progress()[1] < 3) and time.monotonic() < deadline:
            if i % 10 == 9:  # now and then a pause until a whole step
                whole = progress()[1]
                while progress()[1] == whole and time.monotonic() < deadline:
                    time.sleep(0.05)
            time.sleep(rng.uniform(0.0005, 0.02))
            child.send_signal(signal.SIGINT)
            i += 1
        open(store + "-stop", "w").close()
        out, err = child.communicate(timeout=300)
    finally:
        child.kill()
    assert child.returncode == 0, f"exit code {child.returncode}\n{(out + err)[-3000:]}"
    assert out.rstrip().endswith("ok"), (out + err)[-3000:]
    result = json.loads(out.strip().splitlines()[-2])
    assert result["interrupts"] >= 20 and result["steps"] > 1, result


# -- S6: pause interrupted -----------------------------------------------------------------

class CoreWith:
    """The pager's _C.Pager with an interrupt after each of the first n calls of `method`
    (page_all: pause's paging out, then its paging back in; trim: after paging out)."""

    def __init__(self, core, method: str, n: int, real: bool):
        self._core, self._method, self._n, self._real, self._calls = core, method, n, real, 0

    def __getattr__(self, name):
        original = getattr(self._core, name)
        if name != self._method:
            return original

        def interrupted(*args):
            result = original(*args)
            self._calls += 1
            if self._calls <= self._n:
                if self._real:
                    signal.raise_signal(signal.SIGINT)
                raise KeyboardInterrupt
            return result
        return interrupted


@pytest.mark.parametrize("real", [False, True], ids=["raised", "sigint"])
@pytest.mark.parametrize("method,n", [("page_all", 1), ("trim", 1), ("page_all", 2)],
                         ids=["after-paging-out", "after-trim", "after-paging-back"])
def test_an_interrupted_pause_is_paused_or_not_never_half(store_dir, method, n, real):
    with Pager(store_dir, page_size=PAGE["cpu"]) as pager:
        t = pager.empty(100_000)
        pager.page_in(t)
        t.copy_(torch.arange(100_000.0))
        core = pager._core
        pager._core = CoreWith(core, method, n, real)
        try:
            with pytest.raises(KeyboardInterrupt):
                pager.pause()
        finally:
            pager._core = core
        if pager.paused:  # paused: resume() brings back what went out
            pager.resume()
        assert not pager.paused and pager.is_resident(t)
        assert torch.equal(t, torch.arange(100_000.0))
        pager.pause()
        pager.resume()
        assert torch.equal(t, torch.arange(100_000.0))


# -- C4: the state read between steps ------------------------------------------------------

def state_copies(opt):
    """{(param index, name): host copy} of the state, from state_dict()."""
    return {(i, name): v.clone() for i, s in opt.state_dict()["state"].items()
            for name, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0}


def read_all(opt, binding):
    """What logging does: every state tensor read through opt.state (keyed as
    state_dict() numbers the parameters)."""
    index = {id(p): i for i, p in enumerate(binding.params_in_order())}
    out = {}
    for p, s in opt.state.items():
        i = index[id(p)]
        for name, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[(i, name)] = v.sum().item()
                out[(i, name, "copy")] = v.cpu().clone()
    return out


@path
def read_between_steps(store, device):
    for setup in ("adamw", "adamw-q8", "paged-bf16", "paged-residual-q8"):
        model, pager, opt, binding = SETUPS[setup](f"{store}-{setup}", device, budget=False)
        set_grads(model)
        opt.step()
        want = state_copies(opt)
        p = binding.params_in_order()[0]
        assert torch.equal(opt.state[p]["exp_avg"].cpu(), want[(0, "exp_avg")])
        assert torch.equal(opt.state[p].get("exp_avg_sq").cpu(), want[(0, "exp_avg_sq")])
        got = read_all(opt, binding)
        for key, v in want.items():
            assert torch.equal(got[key + ("copy",)], v), (setup, key)
        print(opt.state[p])  # the values, paged in
        opt.step()  # the reads let go: a step as without them
        after = capture(model, pager, opt, binding)
        pager.close()
        assert same(after, clean_run(setup, f"{store}-{setup}-clean", device, 2)), setup


@path
def read_within_budget(store, device):
    """Reading every entry with an hbm_budget that holds the step's window, not the whole
    state: the earliest reads go first, the pool stays within the budget."""
    torch.manual_seed(0)
    width, budget, bucket = (256, 2 * MiB, 64 * KiB) if device == "cpu" else \
        (1024, 32 * MiB, 2 * MiB)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pager = Pager(store, device=device, page_size=PAGE[device], hbm_budget=budget)
    binding = pager.attach(opt, bucket_size=bucket)
    model(torch.randn(4, width, device=device)).sum().backward()
    opt.step()
    total = sum(v.numel() * 4 for s in opt.state.as_held().values() for v in s.values()
                if pager.owns(v))
    assert total > budget  # the whole state is more than the pool may hold
    want = state_copies(opt)
    pager.reset_peak()
    got = read_all(opt, binding)
    assert all(torch.equal(got[k + ("copy",)], v) for k, v in want.items())
    assert pager.stats()["peak_mapped_bytes"] <= budget
    pager.close()


@path
def read_then_refusals(store, device):
    """Reads while paused are refused with what to do; writes to a read tensor are not
    kept; after load_state_dict() (torch sets opt.state anew) reads still page in."""
    model, pager, opt, binding = adamw(store, device)
    set_grads(model)
    opt.step()
    p = binding.params_in_order()[0]
    want = state_copies(opt)
    opt.state[p]["exp_avg"].zero_()  # not kept: reads never write
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], want[(0, "exp_avg")])
    pager.pause()
    try:
        opt.state[p]["exp_avg"]
        raise AssertionError("a read while paused was not refused")
    except statepager.UsageError as e:
        assert "resume()" in str(e), e
    pager.resume()
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert type(opt.state).__name__ == "PagedState"
    assert torch.equal(opt.state[p]["exp_avg"].cpu(), want[(0, "exp_avg")])
    pager.close()


READS = ["read_between_steps", "read_within_budget", "read_then_refusals"]


@pytest.mark.parametrize("what", READS)
def test_state_read_between_steps_gives_its_values(tmp_path, what):
    run_child(what, "cpu", str(tmp_path / "store"))


def test_statepager_code_sees_the_state_as_held(store_dir):
    """Inside the Pager's entry points (the step's hooks here) opt.state is the plain
    state: nothing is paged in on access there."""
    model, pager, opt, binding = adamw(store_dir)
    set_grads(model)
    opt.step()
    seen = []

    def hook(params):
        state = opt.state[params[0]]
        seen.append(type(state) is dict and pager.services.reads._open == {})

    binding.before_bucket = hook
    opt.step()
    assert seen and all(seen)
    assert type(opt.state[binding.params_in_order()[0]]).__name__ == "ParamState"
    pager.close()


if __name__ == "__main__":
    PATHS[sys.argv[1]](sys.argv[3], sys.argv[2])
    print("ok")

"""Steps under the forward on a thread of their own (overlap_forward(model,
step_thread=True); Note [A thread steps the buckets under the forward]): the thread steps
the buckets while the forward's hooks only wait for theirs, what reads the state during
the forward waits for the whole step, a bucket failing on the thread raises on the
training thread, and training is bit-identical throughout (tests/python/test_overlap.py
holds the rest of the steps under the forward to the same, with and without the thread)."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from statepager import Pager

from small_jobs import KiB
from test_overlap import WIDTH, model_and_opt, result, run, same, train


def until(test, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while not test() and time.monotonic() < deadline:
        time.sleep(0.001)
    return test()


def x_of(i: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(i))


def finish_like(base, model, opt, losses, loss) -> None:
    """The third iteration's backward and step after its forward gave `loss`, a fourth,
    then losses and state held to `base`, the run without steps under the forward."""
    loss.backward()
    opt.step()
    losses.append(loss.item())
    losses += train(model, opt, 1, first=3)
    assert losses == base[0]
    assert same(base[1], result(model, opt))


def test_the_thread_steps_every_bucket_while_the_forward_waits_at_its_first_layer(tmp_path):
    """A pre-hook of the first layer (after statepager's) holds the forward until every
    bucket has stepped: the thread steps them without the forward's hooks, each on it.
    Training on is bit-identical."""
    base = run(tmp_path, "base", False, steps=4)
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, "thread")
        losses = train(model, opt, 2)
        run_ = binding.step_in_flight
        n = len(run_.buckets)
        assert n > 2 and run_.stepped == 0
        threads, seen = [], []
        binding.before_bucket = lambda params: threads.append(threading.current_thread())

        def hold(module, inputs):
            seen.append(until(lambda: run_.stepped == n))
        held = model[0].register_forward_pre_hook(hold)
        opt.zero_grad()
        loss = model(x_of(2)).square().mean()
        held.remove()
        binding.before_bucket = None
        assert seen == [True], "every bucket stepped while the forward waited"
        assert len(threads) == n
        assert all(t is not threading.main_thread() for t in threads)
        finish_like(base, model, opt, losses, loss)
        # Its stats: when the thread started after step(), and its own CPU time; none
        # for the last step, completed without a forward.
        stats = run_.stats
        assert 0 < stats.thread_start_seconds < stats.loop_seconds
        assert 0 < stats.thread_cpu_seconds < stats.loop_seconds
        assert "its thread started" in stats.summary()
        assert binding.last.thread_cpu_seconds == 0
        assert "its thread" not in binding.last.summary()


@pytest.mark.parametrize("reader", ["state_dict", "read"])
def test_a_read_of_the_state_in_the_forward_waits_for_the_whole_step(tmp_path, reader):
    """A read from a middle layer's pre-hook (the training thread, the step's thread still
    stepping) waits for the step's thread, then completes the step; training on is
    bit-identical."""
    base = run(tmp_path, "base", False, steps=4)
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, "thread")
        losses = train(model, opt, 2)
        p = model[-1].weight
        run_, seen = binding.step_in_flight, []
        binding.before_bucket = lambda params: time.sleep(0.02)  # a slow thread

        def read(module, inputs):
            seen.append(run_.stepped < len(run_.buckets))  # the thread stepping still
            if reader == "state_dict":
                opt.state_dict()
            else:
                assert opt.state[p]["exp_avg"].shape == p.shape
            seen.append(binding.step_in_flight)
        hook = model[2].register_forward_pre_hook(read)
        opt.zero_grad()
        loss = model(x_of(2)).square().mean()
        hook.remove()
        binding.before_bucket = None
        assert seen == [True, None], "the read, while the thread stepped, completed the step"
        finish_like(base, model, opt, losses, loss)


def test_remove_waits_for_the_thread_and_completes_the_step(tmp_path):
    """remove() from the forward (the thread stepping): the step completes, the hooks come
    off, and training on without them is bit-identical."""
    base = run(tmp_path, "base", False, steps=4)
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, handle = model_and_opt(pager, "thread")
        losses = train(model, opt, 2)
        hook = model[1].register_forward_pre_hook(lambda module, inputs: handle.remove())
        opt.zero_grad()
        loss = model(x_of(2)).square().mean()
        hook.remove()
        assert binding.step_in_flight is None and binding.overlap is None
        finish_like(base, model, opt, losses, loss)
        assert binding.step_in_flight is None, "stepped in step(), without the forward"


def test_a_failure_on_the_thread_raises_once_on_the_training_thread(tmp_path):
    """The error a bucket fails with on the thread is the one the forward raises, on the
    training thread; the next forward does not raise it again, and the pending step
    finishes bit-identically."""
    base = run(tmp_path, "base", False, steps=4)
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, "thread")
        losses = train(model, opt, 2)
        error = RuntimeError("injected on the step's thread")
        raised_on = []

        def failing(params):
            raised_on.append(threading.current_thread())
            raise error
        binding.before_bucket = failing
        opt.zero_grad()
        with pytest.raises(RuntimeError) as info:
            model(x_of(2))
        binding.before_bucket = None
        assert info.value is error and raised_on[0] is not threading.main_thread()
        assert binding.step_in_flight is None and binding.pending
        opt.zero_grad()  # finishes the pending step
        assert not binding.pending
        losses += train(model, opt, 2, first=2)
        assert losses == base[0]
        assert same(base[1], result(model, opt))


CHILD_FORWARD = """
import os, sys, time, warnings, torch
warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
sys.path.insert(0, sys.argv[2])
from statepager import Pager
from test_overlap import WIDTH, model_and_opt, train
with Pager(sys.argv[1], "cpu", page_size=16 << 10) as pager:
    model, opt, binding, handle = model_and_opt(pager, "thread")
    train(model, opt, 2)
    forked = []

    def fork(module, inputs):  # the step's thread stepping meanwhile
        if forked:
            return
        pid = os.fork()
        if pid == 0:
            forked.append(0)
            try:  # what a forward's hook does (torch's own compute may hang in a child)
                handle.before_reading(list(model.parameters()))
                print("child: the hook returned")
            except Exception as error:
                print("child: the hook raised", type(error).__name__)
            try:
                opt.state_dict()
                print("child: read the state")
            except Exception as error:
                print("child: reading raised", type(error).__name__)
            sys.stdout.flush()
            os._exit(0)
        forked.append(pid)
    model[2].register_forward_pre_hook(fork)
    model(torch.zeros(2, WIDTH))
    _, status = os.waitpid(forked[0], 0)
    print("child exit", os.waitstatus_to_exitcode(status))
    binding.complete_step_in_flight()
    print("parent: done")
"""


def test_a_child_forked_while_the_thread_steps_does_not_wait_for_it(tmp_path):
    """A child forked while the step's thread runs has no such thread: a forward's hook
    there does not wait for it (it goes on as without the thread: what it needs stepped
    may have been before the fork), and what needs the Pager meets its refusal of a
    child's calls; the parent goes on."""
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", CHILD_FORWARD, str(tmp_path / "s"), here],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "child exit 0" in lines and "parent: done" in lines, done.stdout
    child = [line for line in lines if line.startswith("child:")]
    assert len(child) == 2 and child[0] in ("child: the hook returned",
                                            "child: the hook raised UsageError"), done.stdout
    assert child[1] == "child: reading raised UsageError", done.stdout


UNDER_THE_LOCK = """
import sys
sys.path.insert(0, sys.argv[2])
from statepager import Pager
from statepager.core.serial import lock_of
from test_overlap import model_and_opt, train
with Pager(sys.argv[1], "cpu", page_size=16 << 10) as pager:
    model, opt, binding, handle = model_and_opt(pager, "thread")
    train(model, opt, 2)
    n = len(binding.step_in_flight.buckets)
    with lock_of(binding):
        handle.before_reading(list(model[1].parameters()))
        handle.remove()
    print(binding.step_in_flight is None, binding.overlap is None, binding.last.buckets == n)
"""


def test_a_hook_under_the_pagers_lock_steps_its_buckets_itself(tmp_path):
    """A hook run by an entry point that holds the Pager's lock (Megatron's step dispatching
    a param all-gather, remove() under it) steps what it needs itself: the thread could
    never take the lock (in a process of its own: a hook that waited would hang)."""
    done = subprocess.run([sys.executable, "-c", UNDER_THE_LOCK, str(tmp_path / "s"),
                           os.path.dirname(os.path.abspath(__file__))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True", "True"]


def test_a_thread_that_cannot_start_leaves_no_hook_waiting(tmp_path, monkeypatch):
    """threading.Thread.start() failing (no thread left to the process): the forward
    raises, and the next one steps the buckets without a thread of their own."""
    base = run(tmp_path, "base", False, steps=4)
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, "thread")
        losses = train(model, opt, 2)

        def cannot(self):
            raise RuntimeError("can't start new thread")
        with monkeypatch.context() as m:
            m.setattr(threading.Thread, "start", cannot)
            opt.zero_grad()
            with pytest.raises(RuntimeError, match="can't start new thread"):
                model(x_of(2))
        worker = threading.Thread(target=lambda: seen.append(model(x_of(2))), daemon=True)
        seen = []
        worker.start()
        worker.join(30)
        assert seen, "the forward after it waited for a thread that never ran"
        opt.zero_grad()
        loss = model(x_of(2)).square().mean()
        finish_like(base, model, opt, losses, loss)


def test_a_failure_superseded_by_a_finished_step_is_logged_not_raised(tmp_path, caplog):
    """The forward raised its own error before a hook waited for the thread's failure;
    zero_grad() then finished the pending step. The next forward does not raise the old
    failure (it is logged), and training is bit-identical."""
    base = run(tmp_path, "base", False, steps=4)
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, "thread")
        losses = train(model, opt, 2)
        n = len(binding.step_in_flight.buckets)
        calls = []

        def failing(params):
            calls.append(1)
            if len(calls) == n - 1:
                raise RuntimeError("injected on the step's thread")

        def own(module, inputs):
            raise ValueError("the model's own error")
        binding.before_bucket = failing
        hook = model[0].register_forward_pre_hook(own)
        opt.zero_grad()
        with pytest.raises(ValueError, match="own error"):
            model(x_of(2))
        hook.remove()
        assert until(lambda: len(calls) == n - 1), "the thread steps on to the failure"
        binding.before_bucket = None
        opt.zero_grad()  # waits for the thread, then finishes the pending step
        assert len(calls) == n - 1 and not binding.pending
        with caplog.at_level("WARNING", logger="statepager"):
            loss = model(x_of(2)).square().mean()
        assert "injected on the step's thread" in caplog.text
        finish_like(base, model, opt, losses, loss)


def test_an_option_set_in_the_forward_is_kept(tmp_path):
    """The thread puts a param group's options back after each bucket only where nobody
    set them meanwhile: an lr set by the training thread in the forward stays."""
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, "thread")
        train(model, opt, 2)
        binding.before_bucket = lambda params: time.sleep(0.01)

        def set_lr(module, inputs):
            opt.param_groups[0]["lr"] = 0.123
        model[1].register_forward_pre_hook(set_lr)
        model(x_of(2))
        assert opt.param_groups[0]["lr"] == 0.123


def test_a_member_with_no_step_in_flight_does_not_wait_for_anothers_thread(tmp_path):
    """Two optimizers on one Pager (a Megatron chain's members), each stepping under the
    forward on a thread: the one whose step completed as the other's began holds the
    forward back for nothing, not until the other's thread has stepped its last bucket."""
    with Pager(str(tmp_path / "s"), "cpu", page_size=16 * KiB) as pager:
        model, _, _, _ = model_and_opt(pager, False)  # its optimizer never steps
        weights = torch.optim.AdamW([m.weight for m in model], lr=1e-2)
        biases = torch.optim.AdamW([m.bias for m in model], lr=1e-2)
        members = [pager.attach(o, bucket_size=48 * KiB, depth=3) for o in (biases, weights)]
        for m in members:
            m.overlap_forward(model, step_thread=True)
        for i in range(2):
            model(x_of(i)).square().mean().backward()
            biases.step()
            weights.step()  # completes the biases' step in flight, as a chain does
        run_ = members[1].step_in_flight
        assert members[0].step_in_flight is None and run_ is not None
        members[1].before_bucket = lambda params: time.sleep(0.02)
        seen = []
        model[0].register_forward_pre_hook(
            lambda module, inputs: seen.append(run_.stepped < len(run_.buckets)))
        model(x_of(2))
        members[1].before_bucket = None
        assert seen == [True], "the first layer ran while the thread stepped"

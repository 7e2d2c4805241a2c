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
        seen = []

        def read(module, inputs):
            if reader == "state_dict":
                opt.state_dict()
            else:
                assert opt.state[p]["exp_avg"].shape == p.shape
            seen.append(binding.step_in_flight)
        hook = model[2].register_forward_pre_hook(read)
        opt.zero_grad()
        loss = model(x_of(2)).square().mean()
        hook.remove()
        assert seen == [None], "the read completed the step"
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
                print("child:", type(error).__name__)
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
    there does not wait for it, and meets the Pager's refusal of a child's calls; the
    parent goes on."""
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", CHILD_FORWARD, str(tmp_path / "s"), here],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "child exit 0" in lines and "parent: done" in lines, done.stdout
    child = [line for line in lines if line.startswith("child:")]
    assert child and child[0] != "child: the hook returned", done.stdout

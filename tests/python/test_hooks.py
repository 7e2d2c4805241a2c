"""attach(hooks=Hooks(...)): every hook of a binding in one object, fixed at attach
(statepager.core.hooks), the step hooks included."""
import pytest
import torch

from statepager import Pager, _C
from statepager.core.hooks import Hooks

KiB = 1 << 10


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, opt):
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()


def test_step_hooks_run_around_the_buckets_and_not_after_a_failed_step(store_dir):
    events = []
    fail = []

    def before_bucket(params):
        events.append("bucket")
        if fail:
            raise RuntimeError("planted")

    hooks = Hooks(before_bucket=before_bucket, before_step=lambda: events.append("before"),
                  after_step=lambda: events.append("after"))
    model, opt = model_and_optimizer()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        binding = pager.attach(opt, bucket_size=16 * KiB, hooks=hooks)
        assert binding.hooks is hooks and binding.before_step is hooks.before_step
        step(model, opt)
        n = len(binding.buckets)
        assert n >= 2
        assert events == ["before"] + ["bucket"] * n + ["after"]
        del events[:]
        fail.append(True)
        with pytest.raises(RuntimeError, match="planted"):
            step(model, opt)
        assert events == ["before", "bucket"]


def test_hooks_are_refused_when_not_a_hooks_or_not_callable(store_dir):
    model, opt = model_and_optimizer()
    with Pager(store_dir, page_size=64 * KiB) as pager:
        with pytest.raises(_C.UsageError, match="Hooks"):
            pager.attach(opt, hooks={"before_step": print})
        with pytest.raises(_C.UsageError, match="after_step"):
            Hooks(after_step=1)
        assert pager.bindings == ()
        pager.attach(opt, hooks=Hooks(after_step=print))  # refused ones attached nothing

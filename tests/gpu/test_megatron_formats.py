"""Megatron's own optimizer checkpoints (dist_checkpointing, each sharding type of
DistributedOptimizer.sharded_state_dict) on an attached optimizer: saved by a paged or
an unpaged run after 3 steps, loaded by a fresh paged or unpaged one, whose 3 next steps
are the uninterrupted unpaged run's, bit for bit (losses, params, mains, moments)."""
import contextlib
import os
import sys

import pytest
import torch

from statepager import Pager

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))
from test_megatron import assert_same, gpt, run, snapshot  # noqa: E402, F401

MiB = 1 << 20
# Not fully_sharded_model_space: megatron-core 0.19.2 builds its tensors with a
# flattened_range, which its own ShardedTensor then refuses, paged or not.
FORMATS = ["dp_reshardable", "fully_reshardable"]


def sharded(model, optimizer, fmt: str, is_loading: bool) -> dict:
    model_sd = model.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": fmt})}


@contextlib.contextmanager
def built(gpt, setup, paged: bool, directory: str, mains: str = "fp32"):
    with contextlib.ExitStack() as stack:
        pager = stack.enter_context(Pager(directory, "cuda", page_size=2 * MiB)) \
            if paged else None
        yield gpt.build(setup, pager, bucket_size=1 * MiB, mains=mains)


# Loaded into paged runs, fresh ones: with torch's AdamW, megatron-core 0.19.2 cannot
# load into an unpaged optimizer that has not stepped (its sharded_state_dict reads the
# step count from the state), and its load_state_dict gives all params one shared "step"
# tensor, which AdamW then advances once per param; statepager makes the state first and
# gives each param its own counter (integrations/megatron_states.py).
# Residual mains load too: encoded against the model params, which the load sets first.
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("saver", ["paged", "unpaged"])
@pytest.mark.parametrize("mains", ["fp32", "residual"])
def test_a_megatron_checkpoint_resumes_exactly(gpt, store_dir, tmp_path, fmt, saver, mains):
    from megatron.core import dist_checkpointing

    setup = gpt.Setup(steps=6)
    base = run(gpt, setup)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with built(gpt, setup, saver == "paged", store_dir + "-save") as (model, opt, sched, _):
        losses = [gpt.train_step(setup, model, opt, sched, i) for i in range(3)]
        gpt.finish(model)
        dist_checkpointing.save(sharded(model, opt, fmt, is_loading=False), str(ckpt))
        sched_state = sched.state_dict()
    with built(gpt, setup, True, store_dir + "-load", mains) as (model, opt, sched, binding):
        loaded = dist_checkpointing.load(sharded(model, opt, fmt, is_loading=True), str(ckpt))
        model.module.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        sched.load_state_dict(sched_state)
        losses += [gpt.train_step(setup, model, opt, sched, i) for i in range(3, 6)]
        gpt.finish(model)
        resumed = (losses, [p.detach().cpu() for p in model.parameters()],
                   snapshot(opt, binding), None)
    assert_same(base, resumed)


def test_a_save_reads_the_state_through_one_window(gpt, store_dir, tmp_path):
    """A paged save's device peak: the pager's window, not the state."""
    from megatron.core import dist_checkpointing

    setup = gpt.Setup(steps=2, layers=4, hidden=512, heads=8)  # state: 10 x the window
    with built(gpt, setup, True, store_dir) as (model, opt, sched, binding):
        for i in range(2):
            gpt.train_step(setup, model, opt, sched, i)
        pager = binding.bindings[0].pager
        state = sum(s.stored_bytes() for s in binding.bindings)
        window = max(s.window_bytes for s in binding.bindings)
        mapped = pager.stats()["mapped_bytes"]
        pager.reset_peak()
        dist_checkpointing.save(sharded(model, opt, "dp_reshardable", is_loading=False),
                                str(tmp_path))
        assert window < state
        assert pager.stats()["peak_mapped_bytes"] <= mapped + window

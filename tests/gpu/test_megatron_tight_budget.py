"""A 0.116 B Megatron GPT (12 layers, hidden 768, vocab 32000, sequences of 512, bf16
grads) under hbm_budget 256 MiB, everything else left to the Pager's and attach's
defaults: 20 steps bit-exact with unpaged Megatron, then the optimizer's state_dict(), a
save, a load and pause/resume, each within the budget. Prints the step time against the
same run without a budget. Skips without megatron-core."""
import os
import sys
import time

import torch

from statepager import Pager, checkpoint

sys.path.insert(0, os.path.dirname(__file__))
# test_megatron's marks (gpu; skipped without megatron-core) and its module-wide GPT.
from test_megatron import assert_same, gpt, members, pytestmark, snapshot  # noqa: E402,F401

MiB = 1 << 20
BUDGET = 256 * MiB


def snapshot_in_pieces(optimizer, binding):
    """test_megatron.snapshot's rows, read through StreamedOptimizer.state_in_pieces: a
    main that steps in chunks comes chunk by chunk, within the budget (whole, the
    embedding's main and moments are more than 256 MiB)."""
    out = []
    for d, member_binding in zip(members(optimizer), binding.bindings):
        inner, got = d.optimizer, {}
        for p, start, stop, entries in member_binding.state_in_pieces():
            rows = got.setdefault(id(p), {})
            for name, v in entries.items():
                rows.setdefault(name, torch.empty(p.numel(), dtype=v.dtype))[start:stop] = \
                    v.cpu()
        rows = []
        for p in (p for g in inner.param_groups for p in g["params"]):
            if id(p) in got:  # paged: the main, then its state entries by name
                named = got[id(p)]
                rows.append([named["param"].view(p.shape)] + [
                    named[k].view(p.shape) for k in sorted(named) if k != "param"])
            else:  # resident
                rows.append([p.detach().cpu()] + [
                    v.cpu() for k, v in sorted(inner.state[p].items())
                    if isinstance(v, torch.Tensor) and v.dim() > 0])
        out.append(rows)
    return out


def train(gpt, setup, pager=None):
    """(losses, params, state, (model, optimizer, binding), seconds per step after 5)."""
    model, optimizer, scheduler, binding = gpt.build(setup, pager, bucket_size=None,
                                                     depth=None)
    losses, times = [], []
    for i in range(setup.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(gpt.train_step(setup, model, optimizer, scheduler, i))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    gpt.finish(model)
    params = [p.detach().cpu() for p in model.parameters()]
    step = sorted(times[5:])[len(times[5:]) // 2]
    state = snapshot(optimizer) if binding is None else snapshot_in_pieces(optimizer, binding)
    return losses, params, state, (model, optimizer, binding), step


def within_budget(pager, what: str, action) -> None:
    pager.reset_peak()
    action()
    peak = pager.stats()["peak_mapped_bytes"]
    assert peak <= BUDGET, f"{what} mapped {peak / MiB:.0f} MiB"
    print(f"  {what}: peak mapped {peak / MiB:.0f} MiB of {BUDGET / MiB:.0f}")


def test_the_small_gpt_under_256_mib_left_to_the_defaults(gpt, tmp_path, capsys):
    setup = gpt.Setup(layers=12, hidden=768, heads=12, vocab=32000, seq=512, batch=4,
                      steps=20, ddp_bucket=40_000_000)
    base = train(gpt, setup)
    with Pager(str(tmp_path / "free"), "cuda") as pager:
        free = train(gpt, setup, pager)
    with Pager(str(tmp_path / "tight"), "cuda", hbm_budget=BUDGET) as pager:
        tight = train(gpt, setup, pager)
        first = pager.bindings[0]
        with capsys.disabled():
            print(f"\n0.116 B GPT, hbm_budget {BUDGET / MiB:.0f} MiB: pages of "
                  f"{pager.page_size / MiB:g} MiB, buckets of {first.bucket_size / MiB:g} MiB "
                  f"x depth {first.depth}, window {first.window_bytes / MiB:.0f} MiB, "
                  f"{len(first.buckets)} buckets; step (median of 6-20) "
                  f"{tight[4] * 1e3:.1f} ms, without a budget {free[4] * 1e3:.1f} ms "
                  f"({tight[4] / free[4]:.2f} x), unpaged {base[4] * 1e3:.1f} ms")
            assert pager.stats()["peak_mapped_bytes"] <= BUDGET
            assert_same(base[:4], tight[:4])
            within_budget(pager, "state_dict()", first.optimizer.state_dict)
            path = str(tmp_path / "ckpt")
            within_budget(pager, "save", lambda: checkpoint.save(pager, path))
            within_budget(pager, "load", lambda: checkpoint.load(pager, path))
            within_budget(pager, "pause/resume", lambda: (pager.pause(), pager.resume()))
        assert_same(base[:4], (tight[0], tight[1],
                               snapshot_in_pieces(tight[3][1], tight[3][2]), None))

"""Under an hbm_budget smaller than one parameter's state, what attach accepts runs: the
steps (that parameter in chunks) equal torch's unpaged AdamW bit for bit, and
state_dict(), load_state_dict() (into the same optimizer and into a fresh one), save
through the store and through the device, load and pause each bring the state in the
step's pieces, never more than the budget at once. Reading one whole state entry larger
than the budget between steps is refused with the way to read it."""
import os

import pytest
import torch

import statepager
from statepager import checkpoint
from statepager import Pager

from compare import same

KiB, MiB = 1 << 10, 1 << 20
NUMEL = 4 * MiB  # 16 MiB a state entry, 32 MiB of moments: more than the budget
BUDGET = 12 * MiB


@pytest.fixture
def device():
    return "cpu"  # tests/gpu/test_cuda_tight_budget.py: "cuda"


def grads(w, step):
    return torch.randn(w.shape, generator=torch.Generator().manual_seed(step)).to(w.device)


def unpaged(steps, device="cpu"):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(NUMEL).to(device))
    opt = torch.optim.AdamW([w], lr=1e-3)
    for i in range(steps):
        w.grad = grads(w, i)
        opt.step()
    return w, opt


def paged(directory, steps, device="cpu"):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(NUMEL).to(device))
    opt = torch.optim.AdamW([w], lr=1e-3)
    page = 2 * MiB if device == "cuda" else 64 * KiB
    pager = Pager(directory, device, page_size=page, hbm_budget=BUDGET)
    binding = pager.attach(opt, bucket_size=2 * MiB)
    assert binding.window_bytes <= BUDGET
    for i in range(steps):
        w.grad = grads(w, i)
        opt.step()
    return pager, w, opt


def steps_two_more_as(w, opt, w0, opt0):
    """Steps 2 and 3 from the state of step 2: then w and opt are as unpaged()'s w0 and
    opt0 after 4 steps."""
    for i in (2, 3):
        w.grad = grads(w, i)
        opt.step()
    assert torch.equal(w, w0)
    assert same(opt.state_dict(), opt0.state_dict())


def test_steps_and_state_dict_within_the_budget(store_dir, device):
    w0, opt0 = unpaged(3, device)
    pager, w, opt = paged(store_dir, 3, device)
    with pager:
        assert torch.equal(w, w0)
        assert same(opt.state_dict(), opt0.state_dict())
        with pytest.raises(statepager.OutOfMemoryError, match="state_dict"):
            opt.state[w]["exp_avg"]  # one entry, whole, is more than the budget


@pytest.mark.parametrize("fresh", [False, True], ids=["same-optimizer", "fresh-optimizer"])
def test_load_state_dict_within_the_budget(store_dir, device, fresh):
    w0, opt0 = unpaged(4, device)
    w2, early = unpaged(2, device)
    pager, w, opt = paged(store_dir, 2 if not fresh else 0, device)
    with pager:
        if fresh:  # no state yet: the load makes it, in pieces
            with torch.no_grad():
                w.copy_(w2)
        opt.load_state_dict(early.state_dict())
        assert same(opt.state_dict(), early.state_dict())
        steps_two_more_as(w, opt, w0, opt0)


def test_save_load_and_pause_within_the_budget(store_dir, tmp_path, device):
    w0, opt0 = unpaged(4, device)
    pager, w, opt = paged(store_dir, 2, device)
    with pager:
        path = str(tmp_path / "ckpt")
        checkpoint.save(pager, path).wait()
        pager.pause()
        pager.resume()
        other, w2, opt2 = paged(store_dir + "-other", 0, device)
        with other:
            with torch.no_grad():
                w2.copy_(w)
            assert checkpoint.load(other, path)
            assert same(opt2.state_dict(), opt.state_dict())
            steps_two_more_as(w2, opt2, w0, opt0)
        assert os.path.isdir(path)


@pytest.mark.parametrize("moments, mains", [("q8", "residual"), ("bf16", "fp32")])
def test_narrow_formats_read_and_load_in_pieces(store_dir, device, moments, mains):
    """PagedAdamW's stored forms (decoded for the read, encoded after the load), chunk by
    chunk under the budget: a state_dict() loaded back in place changes nothing."""
    def run(directory, steps, budget, reload_at=None):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(NUMEL).to(device, torch.bfloat16))
        page = 2 * MiB if device == "cuda" else 64 * KiB
        pager = Pager(directory, device, page_size=page, hbm_budget=budget)
        opt = statepager.PagedAdamW([w], pager=pager, lr=1e-3, bucket_size=2 * MiB,
                                    moments=moments, mains=mains)
        for i in range(steps):
            if i == reload_at:
                opt.load_state_dict(opt.state_dict())
            w.grad = grads(w, i).to(torch.bfloat16)
            opt.step()
        return pager, w, opt.state_dict()

    whole, w0, sd0 = run(store_dir + "-whole", 4, None)
    # CUDA's 2 MiB pages round a q8 chunk's tensors and the residual scratch up: 30 MiB.
    tight, w, sd = run(store_dir, 4, (32 if device == "cuda" else 20) * MiB, reload_at=2)
    with whole, tight:
        assert torch.equal(w, w0)
        assert same(sd, sd0)

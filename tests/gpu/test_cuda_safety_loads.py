"""load_state_dict() on CUDA, all or nothing: a load failing midway (after torch's part
replaced the optimizer's state, with buckets copied into CUDA pager tensors and paged
out) leaves the optimizer as it was; it then steps exactly as one that never saw it."""
import copy

import pytest
import torch

import statepager
from statepager import Pager

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def job(store, seed=0, moments="fp32"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pager = Pager(store, device="cuda", page_size=2 * MiB)
    # q8 state is a quarter of fp32's: smaller buckets, so that a load pages out several
    pager.attach(opt, bucket_size=(1 if moments == "q8" else 4) * MiB, moments=moments)
    return model, opt, pager


def train(model, opt, steps, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(32, 256, device="cuda", generator=gen)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def values(opt) -> list:
    sd = opt.state_dict()
    return [(k, name, v.clone()) for k, st in sd["state"].items() for name, v in st.items()]


@pytest.mark.parametrize("moments", ["fp32", "q8"])
def test_a_load_state_dict_failing_midway_leaves_the_optimizer(store_dir, tmp_path,
                                                                monkeypatch, moments):
    model, opt, pager = job(store_dir, moments=moments)
    ref_model, ref_opt, ref_pager = job(str(tmp_path / "ref"), moments=moments)
    try:
        train(model, opt, 2)
        train(ref_model, ref_opt, 2)
        src_model, src_opt, src_pager = job(str(tmp_path / "src"), seed=3, moments=moments)
        train(src_model, src_opt, 3, seed=4)
        sd = copy.deepcopy(src_opt.state_dict())
        src_pager.close()
        for st in sd["state"].values():  # new pager tensors for the 2-D moments
            for k, v in st.items():
                if k != "step" and v.dim() == 2:
                    st[k] = v.t().contiguous().t()
        before = values(opt)
        entries = {id(p): {k: id(v) for k, v in dict.items(st)}
                   for p, st in dict.items(opt.state)}
        calls = []
        page_out_async = pager.page_out_async

        def failing(*args, **kwargs):  # a page-out past the first bucket's
            calls.append(1)
            if len(calls) == 3:
                raise statepager.NoSpaceError("injected")
            return page_out_async(*args, **kwargs)
        with monkeypatch.context() as m:
            m.setattr(pager, "page_out_async", failing)
            with pytest.raises(statepager.NoSpaceError, match="injected"):
                opt.load_state_dict(sd)
        assert {id(p): {k: id(v) for k, v in dict.items(st)}
                for p, st in dict.items(opt.state)} == entries  # the same tensors
        after = values(opt)
        assert [(k, n) for k, n, _ in after] == [(k, n) for k, n, _ in before]
        assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(after, before))
        train(model, opt, 2, seed=5)
        train(ref_model, ref_opt, 2, seed=5)
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b)
    finally:
        pager.close()
        ref_pager.close()

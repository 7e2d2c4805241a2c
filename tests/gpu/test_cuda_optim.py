"""Attached torch optimizers on the CUDA backend behave as torch's own, bit for bit: fused
and foreach implementations over channels_last, transposed and bf16 parameters, grads
that are None, a param group added after attach, state_dict() and load_state_dict()."""
import copy

import pytest
import torch

from statepager import Pager

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    conv = torch.randn(16, 8, 3, 3, generator=gen).contiguous(memory_format=torch.channels_last)
    return [torch.nn.Parameter(t.to("cuda", dtype)) for t in
            (conv, torch.randn(64, 48, generator=gen).t(), torch.randn(300, generator=gen),
             torch.randn(40, 40, generator=gen))]


def set_grads(ps, step):
    for i, p in enumerate(ps):
        if (i + step) % 3 == 0:  # some parameters have no gradient some steps
            p.grad = None
            continue
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        p.grad = torch.empty_like(p).copy_(g)


def state_equal(ref, opt):
    """opt.state_dict() (host copies) against torch's, entry for entry."""
    a, b = ref.state_dict(), opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert [list(s) for s in a["state"].values()] == [list(s) for s in b["state"].values()]
    for i, st in a["state"].items():
        for k, v in st.items():
            got = b["state"][i][k]
            assert got.stride() == v.stride() and torch.equal(got.cpu(), v.cpu()), (i, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,kwargs", [
    ("AdamW", {"fused": True}), ("Adam", {"foreach": True, "amsgrad": True}),
    ("SGD", {"foreach": True, "momentum": 0.9, "nesterov": True}),
    ("RMSprop", {"foreach": True, "momentum": 0.5}),
    ("Adam", {"fused": True, "capturable": True})])
def test_attached_is_torch_bit_for_bit(store_dir, name, kwargs, dtype):
    cls = getattr(torch.optim, name)
    ref_p, p = params(dtype), params(dtype)
    extra_ref, extra = [torch.nn.Parameter(torch.ones(77, device="cuda", dtype=dtype))
                        for _ in range(2)]
    ref, opt = cls(ref_p[:3], lr=1e-2, **kwargs), cls(p[:3], lr=1e-2, **kwargs)
    with Pager(store_dir, device="cuda", page_size=2 * MiB) as pager:
        pager.attach(opt, bucket_size=64 << 10)
        for k in range(6):
            if k == 2:  # streamed from its next step
                ref.add_param_group({"params": [ref_p[3], extra_ref], "lr": 1e-3})
                opt.add_param_group({"params": [p[3], extra], "lr": 1e-3})
            set_grads(ref_p + [extra_ref], k)
            set_grads(p + [extra], k)
            ref.step()
            opt.step()
            for a, b in zip(ref_p + [extra_ref], p + [extra]):
                assert torch.equal(a, b)
        assert pager.stats()["mapped_bytes"] == 0
        state_equal(ref, opt)
        # load_state_dict of torch's own (on the device) into the paged tensors, in place
        live = {id(q): dict(st) for q, st in opt.state.items()}
        opt.load_state_dict(copy.deepcopy(ref.state_dict()))
        assert all(opt.state[q][n] is v for q in p + [extra] if id(q) in live
                   for n, v in live[id(q)].items() if v.dim())
        assert all(v.is_cuda for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim())
        for k in range(6, 8):
            set_grads(ref_p + [extra_ref], k)
            set_grads(p + [extra], k)
            ref.step()
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ref_p + [extra_ref], p + [extra]))
        state_equal(ref, opt)

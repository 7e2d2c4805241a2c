"""Parameters split into chunks on the GPU (no bucket above bucket_size):
torch's Adam variants (fused and capturable included) step on slices bit for bit, and
a 0.116 B GPT (4 layers, hidden 1024, vocab 32000: the embedding's main and moments are
3 x 131 MB) trains under hbm_budget 256 MiB with 16 MiB buckets bit for bit as
Megatron without the pager, the pool's peak within the budget. Whole, its embedding's
bucket (439 MiB) is refused under that budget."""
import collections
import importlib.util
import os
import sys

import pytest
import torch

from statepager import Pager
from statepager.core import slices

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

pytestmark = [pytest.mark.gpu]
MiB = 1 << 20
BUDGET, BUCKET = 256 * MiB, 16 * MiB


def raw_step(opt):
    step = type(opt).step
    return getattr(step, "__wrapped__", step)(opt)


@pytest.mark.parametrize("kwargs", [dict(foreach=True), dict(foreach=False), dict(fused=True),
                                    dict(fused=True, amsgrad=True, weight_decay=0.1),
                                    dict(foreach=True, capturable=True),
                                    dict(foreach=False, capturable=True, amsgrad=True)],
                         ids=str)
def test_sliced_step_on_cuda(kwargs):
    def train(sliced):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(3 * slices.CHUNK_ALIGN + 1000, device="cuda"))
        opt = torch.optim.AdamW([p], lr=1e-2, **kwargs)
        for i in range(4):
            g = torch.Generator(device="cuda").manual_seed(i)
            p.grad = torch.randn(p.shape, device="cuda", generator=g)
            if sliced and opt.state.get(p):
                slices.step_in_slices(opt, raw_step, 0, p,
                                      slices.chunk_bounds(p.numel(), slices.CHUNK_ALIGN))
            else:
                opt.step()
        return p, opt.state[p]
    a, sa = train(False)
    b, sb = train(True)
    assert torch.equal(a, b)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope="module")
def gpt():
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (the GPU suite carries it)")
    import megatron_gpt

    megatron_gpt.init()
    return megatron_gpt


def flat_copies(optimizer, pager=None, binding=None):
    """Per member, per main: the main and its moments as flat host copies; paged state
    read bucket by bucket, a split main chunk by chunk (whole it would not fit)."""
    out = []
    members = getattr(optimizer, "chained_optimizers", [optimizer])
    member_bindings = binding.bindings if binding else [None] * len(members)
    for d, member_binding in zip(members, member_bindings):
        inner = d.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]

        # Paged state as held: its buckets are paged in here, chunk by chunk.
        state = inner.state if member_binding is None else inner.state.as_held()

        def tensors(p):
            return [p] + [v for _, v in sorted(state[p].items())
                          if isinstance(v, torch.Tensor) and v.dim() > 0]
        parts = collections.defaultdict(list)
        if member_binding is None:
            for p in params:
                parts[id(p)] = [[t.reshape(-1).cpu()] for t in tensors(p)]
        else:
            for b in member_binding.buckets:
                pager.page_in(b.stored)
                for p in b.params:
                    parts[id(p)] = [[t.reshape(-1).cpu()] for t in tensors(p)]
                for c in b.chunks:
                    ts = tensors(c.param)
                    got = parts[id(c.param)] or [[] for _ in ts]
                    for pieces, t in zip(got, ts):
                        pieces.append(c.of(t).cpu())
                    parts[id(c.param)] = got
                pager.page_out(b.stored)
        out.append([[torch.cat(x) for x in parts[id(p)]] for p in params])
    return out


def run(gpt, setup, pager=None, **attach):
    model, optimizer, scheduler, binding = gpt.build(setup, pager, **attach)
    losses, peaks = [], []
    for i in range(setup.steps):
        losses.append(gpt.train_step(setup, model, optimizer, scheduler, i))
        if binding is not None:
            peaks.append(max(st.peak_mapped_bytes for st in binding.last))
    gpt.finish(model)
    params = [p.detach().cpu() for p in model.parameters()]
    return losses, params, flat_copies(optimizer, pager, binding), binding, peaks


@pytest.mark.parametrize("grad_fp32", [False, True], ids=["bf16-grads", "fp32-grads"])
def test_gpt_0_116b_in_chunks_under_256_mib(gpt, store_dir, grad_fp32, capsys):
    setup = gpt.Setup(layers=4, hidden=1024, heads=16, vocab=32000, steps=20,
                      grad_fp32=grad_fp32)
    base = run(gpt, setup)
    with Pager(store_dir, "cuda", page_size=2 * MiB, hbm_budget=BUDGET) as pager:
        paged = run(gpt, setup, pager, bucket_size=BUCKET)
        binding = paged[3]
        buckets = [b for s in binding.bindings for b in s.buckets]
        chunks = sum(len(b.chunks) for b in buckets)
        largest = max(max(b.nbytes, b.planned) for b in buckets)
        peak = max(paged[4])
        window = max(s.window_bytes for s in binding.bindings)
        with capsys.disabled():
            print(f"\nsplit GPT ({'fp32' if grad_fp32 else 'bf16'} grads): "
                  f"{type(binding.bindings[0].optimizer).__name__}, {len(buckets)} buckets, "
                  f"{chunks} chunks, largest bucket {largest / MiB:.1f} MiB, window "
                  f"{window / MiB:.0f} MiB, peak mapped {peak / MiB:.0f} MiB of "
                  f"{BUDGET / MiB:.0f}, "
                  f"losses {paged[0][0]:.3f} -> {paged[0][-1]:.3f}")
        assert chunks > 0, "the embedding steps in chunks"
        assert largest <= BUCKET
        assert peak <= BUDGET
    la, pa, sa, *_ = base
    lb, pb, sb, *_ = paged
    assert la == lb, f"losses differ:\n{la}\n{lb}"
    assert all(torch.equal(x, y) for x, y in zip(pa, pb)), "model params differ"
    for ma, mb in zip(sa, sb):
        for ta, tb in zip(ma, mb):
            assert len(ta) == len(tb) == 3 and all(torch.equal(x, y) for x, y in zip(ta, tb))
    # Trained, not learned: over 20 steps this GPT's loss rises from 10.57 to 10.77
    # unpaged as paged (H200, 2026-12-01); equal bits are what the test asks.
    assert all(torch.isfinite(torch.tensor(lb)))

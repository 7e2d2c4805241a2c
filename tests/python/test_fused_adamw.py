"""The fused AdamW step's place in the streamed step, on the CPU: with the kernel stood in
for by torch's own foreach ops on the decoded moments (what kernels/adamw.cu computes;
tests/gpu/test_codec_kernels.py holds the real kernel to them), a fused run is the
unfused run bit for bit (params, moments in every format, step counts), the moments are
neither decoded nor encoded, and the fused step stays off where it does not apply."""
import types

import pytest
import torch

import statepager
from statepager import PagedAdamW, Pager, _C
from statepager.util.flat import flat_view
from statepager.core import fused_adamw
from statepager.formats import codecs as C

KiB = 1 << 10


def decoded(tensors, fmt, kind):
    if fmt == "fp32":
        return tensors[0]
    if fmt == "bf16":
        return tensors[0].float()
    out = torch.empty(tensors[0].numel())
    C.q8_decode(tensors[0], tensors[1], out, kind)
    return out


def encode(x, tensors, fmt, kind):
    if fmt == "bf16":
        tensors[0].copy_(x)
    elif fmt == "q8":
        C.q8_encode(x, tensors[0], tensors[1], kind)


def stand_in(calls):
    """adamw_step_many as torch's foreach ops between a decode and an encode, with the
    scalars _multi_tensor_adam computes on the host (what the binding computes in C++)."""
    def adamw_step_many(params, grads, exp_avgs, exp_avg_sqs, formats, hypers, steps, stream):
        for p, g, mt, vt, fmt, (lr, beta1, beta2, eps, wd), step in zip(
                params, grads, exp_avgs, exp_avg_sqs, formats, hypers, steps):
            calls.append(fmt)
            p, g = flat_view(p), flat_view(g)
            mt, vt = [flat_view(t) for t in mt], [flat_view(t) for t in vt]
            m, v = decoded(mt, fmt, "signed"), decoded(vt, fmt, "nonneg")
            if wd != 0:
                torch._foreach_mul_([p], 1 - lr * wd)
            torch._foreach_lerp_([m], [g], 1 - beta1)
            torch._foreach_mul_([v], beta2)
            torch._foreach_addcmul_([v], [g], [g], 1 - beta2)
            d = torch._foreach_sqrt([v])
            torch._foreach_div_(d, [(1 - beta2 ** step) ** 0.5])
            torch._foreach_add_(d, eps)
            torch._foreach_addcdiv_([p], [m], d, [(lr / (1 - beta1 ** step)) * -1])
            encode(m, mt, fmt, "signed")
            encode(v, vt, fmt, "nonneg")
    return adamw_step_many


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused step applies to CPU tensors, its kernel stood in for; returns the list of
    its calls (their formats) and of q8 decodes."""
    calls, decodes = [], []
    monkeypatch.setattr(fused_adamw, "_param_fusable", lambda p: p.dtype == torch.float32)
    if getattr(statepager._C, "kernels", None) is None:  # built without nvcc
        monkeypatch.setattr(statepager._C, "kernels", types.SimpleNamespace(), raising=False)
    monkeypatch.setattr(statepager._C.kernels, "adamw_step_many", stand_in(calls),
                        raising=False)
    real = C.q8_decode
    monkeypatch.setattr(C, "q8_decode", lambda *a, **k: (decodes.append(1), real(*a, **k)))
    return calls, decodes


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.GELU(),
                               torch.nn.Linear(300, 6)).bfloat16()


def train(moments, mains, store_dir, steps=4, foreach=True, drop=None, **kwargs):
    """drop: (step, parameter index) whose grad is None at that step."""
    m = model()
    with Pager(store_dir, device="cpu", page_size=64 * KiB) as pager:
        opt = PagedAdamW(m.parameters(), pager=pager, lr=1e-2, weight_decay=0.1,
                         bucket_size=64 * KiB, moments=moments, mains=mains, foreach=foreach,
                         **kwargs)
        for i in range(steps):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(8, 40, generator=g).bfloat16(), torch.randn(8, 6, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x).float(), y).backward()
            if drop is not None and drop[0] == i:
                list(m.parameters())[drop[1]].grad = None
            opt.step()
        sd = opt.state_dict()
    return [p.detach().clone() for p in m.parameters()], sd


def same(run_a, run_b):
    (pa, sa), (pb, sb) = run_a, run_b
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(pa, pb))
    for i, st in sa["state"].items():
        for k, v in st.items():
            w = sb["state"][i][k]
            assert torch.equal(v.view(torch.int32), w.view(torch.int32)) if v.is_floating_point() \
                else torch.equal(v, w), (i, k)


@pytest.mark.parametrize("moments,mains", [("q8", "residual"), ("bf16", "fp32"),
                                           ("fp32", "residual"), ("q8", "fp32")])
def test_fused_run_is_the_unfused_run(tmp_path, moments, mains, fused_on_cpu):
    calls, decodes = fused_on_cpu
    fused_adamw.use_fused(False)
    try:
        unfused = train(moments, mains, str(tmp_path / "a"))
    finally:
        fused_adamw.use_fused(True)
    assert not calls
    decodes.clear()
    fused = train(moments, mains, str(tmp_path / "b"))
    # Every step fused (4 parameters each), the first too: the binding creates the state,
    # zero, before it.
    assert calls == [moments] * 4 * 4
    if moments == "q8":
        # Decoded: the stand-in's own (2 per call) and state_dict()'s; not by the step.
        assert len(decodes) == 2 * len(calls) + 2 * 4
    same(unfused, fused)


def test_a_parameter_without_a_grad_keeps_its_state_and_count(tmp_path, fused_on_cpu):
    """A parameter whose grad is None at a step is left out of its bucket's fused call, as
    torch's step leaves it: its moments and step count stay, the others step, bit for bit
    the unfused run."""
    calls, _ = fused_on_cpu
    fused_adamw.use_fused(False)
    try:
        unfused = train("q8", "residual", str(tmp_path / "a"), drop=(2, 1))
    finally:
        fused_adamw.use_fused(True)
    fused = train("q8", "residual", str(tmp_path / "b"), drop=(2, 1))
    assert calls == ["q8"] * (4 * 4 - 1)
    assert fused[1]["state"][1]["step"].item() == 3.0 and fused[1]["state"][0]["step"] == 4.0
    same(unfused, fused)


# With 4 MiB buckets the first parameter steps in chunks (of 262144 elements), its last
# ones in the bucket of the two small parameters.
MIXED_SHAPES = [(5 * 262144 + 131072,), (77,), (300, 7)]


def train_shapes(moments, mains, store_dir, steps=3):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in MIXED_SHAPES]
    with Pager(store_dir, device="cpu", page_size=64 * KiB) as pager:
        opt = PagedAdamW(ps, pager=pager, lr=1e-2, weight_decay=0.1, bucket_size=4096 * KiB,
                         moments=moments, mains=mains)
        for i in range(steps):
            for j, p in enumerate(ps):
                p.grad = torch.randn(p.shape, generator=g).bfloat16()
            opt.step()
        buckets = [(len(b.params), len(b.chunks)) for b in opt.binding.buckets]
        sd = opt.state_dict()
    return ([p.detach().clone() for p in ps], sd), buckets


@pytest.mark.parametrize("moments,mains", [("q8", "residual"), ("fp32", "fp32")])
def test_a_bucket_of_chunks_and_whole_parameters_steps_fused(tmp_path, moments, mains,
                                                             fused_on_cpu):
    """Megatron's buckets hold whole parameters beside chunks of a larger one (q8 here:
    two chunks of it): one fused call steps the bucket, bit for bit the unfused step."""
    calls, _ = fused_on_cpu
    fused_adamw.use_fused(False)
    try:
        unfused, _ = train_shapes(moments, mains, str(tmp_path / "a"))
    finally:
        fused_adamw.use_fused(True)
    fused, buckets = train_shapes(moments, mains, str(tmp_path / "b"))
    assert any(whole and chunks for whole, chunks in buckets), buckets
    assert calls == [moments] * 3 * sum(whole + chunks for whole, chunks in buckets)
    same(unfused, fused)


def test_fused_step_off_where_it_does_not_apply(tmp_path, fused_on_cpu):
    calls, _ = fused_on_cpu
    train("q8", "fp32", str(tmp_path / "a"), amsgrad=True)
    train("q8", "fp32", str(tmp_path / "b"), foreach=False)  # torch's for-loop step
    m = model()
    with Pager(str(tmp_path / "c"), device="cpu", page_size=64 * KiB) as pager:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        pager.attach(opt, bucket_size=64 * KiB)
        for _ in range(3):
            for p in m.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
    assert not calls


def test_a_refused_call_leaves_the_step_counts(tmp_path, fused_on_cpu, monkeypatch):
    """The kernels' binding refuses a bucket (UsageError, before any launch): the step
    counts stay as they were, even in a step that is not atomic."""
    m = model().float()
    with Pager(str(tmp_path), device="cpu", page_size=64 * KiB) as pager:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
        pager.attach(opt, bucket_size=64 * KiB, moments="q8", atomic=False)
        m(torch.randn(8, 40)).sum().backward()
        opt.step()
        counts = [float(opt.state[p]["step"]) for p in m.parameters()]

        def refuse(*a, **k):
            raise statepager.UsageError("statepager kernels: refused")
        monkeypatch.setattr(statepager._C.kernels, "adamw_step_many", refuse)
        with pytest.raises(statepager.UsageError, match="refused"):
            opt.step()
        assert [float(opt.state[p]["step"]) for p in m.parameters()] == counts == [1.0] * 4


def test_step_counts_are_added_and_set_as_torch_adds_them():
    """_C.counts_after: each float32 or float64 counter plus one, rounded as torch's add of
    a float32 one rounds it (in the counter's dtype), every value bit for bit; None where
    any counter is of another dtype, has more than one element, lies off the host or is an
    inference tensor (torch refuses to write those in place).
    _C.set_counts writes each in place (its version bumped, as an in-place op's), after
    checking all of them: a bad one refuses the call with nothing written."""
    one = torch.tensor(1.0)
    values = [0.0, 1.0, 3.5, 2.0 ** 24, 2.0 ** 24 - 1, 1.0000001, 2.0 ** 53, -1.0, 1e38]
    counts = [torch.tensor(v, dtype=dt) for v in values for dt in (torch.float32, torch.float64)]
    after = _C.counts_after(counts)
    want = [a.item() for a in torch._foreach_add(counts, one, alpha=1.0)]
    assert after == want and all(type(a) is float for a in after)
    assert _C.counts_after([]) == []
    with torch.inference_mode():
        inference = torch.tensor(1.0)
    for other in (torch.tensor(3), torch.tensor(3.0, dtype=torch.bfloat16),
                  torch.tensor([1.0, 2.0]), torch.tensor(1.0, device="meta"), inference):
        assert _C.counts_after([torch.tensor(1.0), other]) is None
    versions = [c._version for c in counts]
    _C.set_counts(counts, after)
    assert [c.item() for c in counts] == want
    assert all(c._version > v for c, v in zip(counts, versions))
    kept = [c.clone() for c in counts]
    for bad, values in (([counts[0], torch.tensor(5)], [1.0, 2.0]), (counts[:2], [1.0]),
                        ([counts[0], inference], [1.0, 2.0])):
        with pytest.raises(statepager.UsageError, match="set_counts"):
            _C.set_counts(bad, values)
    assert all(torch.equal(c, k) for c, k in zip(counts, kept))

"""The CUDA codec kernels (kernels/codecs.cu) give the CPU reference's bits (codecs.py's
torch ops on CPU tensors) for every input: random data, NaN/Inf/subnormals, all-zero
blocks, odd tails, misaligned tensors; the fused AdamW step (kernels/adamw.cu) gives
torch's foreach AdamW's bits; and a streamed step with the kernels on is the step with
them off, bit for bit. The store checksums' kernel (kernels/store_crc.cu) gives the CPU's
crc32c for every range: empty, odd lengths and offsets, tiles' edges, many at once."""
import warnings

import pytest
import torch

import statepager
from statepager import PagedAdamW, Pager
from statepager.core import fused_adamw
from statepager.formats import codecs as C

pytestmark = pytest.mark.gpu
MiB = 1 << 20
SIZES = [1, 7, 255, 256, 257, 4096 * 3 + 17, (1 << 20) + 3]


@pytest.fixture(autouse=True)
def kernels_built():
    if not statepager._C.KERNELS_BUILT:
        pytest.fail("the extension was built without the codec kernels (no nvcc at build "
                    "time): rebuild it where nvcc is on PATH")
    previous = C.use_kernels(True)
    yield
    C.use_kernels(previous)


def bits(t):
    t = t.contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]).cpu()


def same_values(a, b):
    """Bit for bit, but any NaN matches any NaN: arithmetic that makes a NaN gives the
    canonical 0x7fffffff on a GPU and the operand's payload on a CPU."""
    a, b = a.cpu(), b.cpu()
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(bits(a[~nan]), bits(b[~nan]))


def rebuild(params, residuals, exceptions, mains_out, fingerprints):
    """The masters rebuilt as the step rebuilds them (ResidualMasters.rebuild)."""
    return C.ResidualMasters(mains_out, params, residuals).rebuild(exceptions, fingerprints)


def misaligned(t, offset):
    """t's values in CUDA memory that starts `offset` elements past an aligned address."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device="cuda")
    out = buf[offset:]
    out.copy_(t.reshape(-1))
    return out


def moments(kind, n, seed):
    """Blocks of magnitudes 1e-42 .. 3e38, exact zeros, a zero block, and edge values."""
    g = torch.Generator().manual_seed(seed)
    nb = C.q8_num_blocks(n)
    exps = torch.empty(nb).uniform_(-42, 38, generator=g)
    x = torch.randn(n, generator=g, dtype=torch.float64) * (10 ** exps).repeat_interleave(256)[:n]
    x = x.clamp(-3.4e38, 3.4e38).float()
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    if kind == "nonneg":
        x = x.abs()
    x[256:512] = 0.0
    special = [float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, -0.0,
               3.4028234663852886e38, -5.0]  # -5: a negative "nonneg" value
    for i, v in enumerate(special):
        at = 1024 + 256 * 3 * i + 17
        if at < n:
            x[at] = v
    if n > 600:
        x[-3] = -float("nan")  # a NaN with the sign bit, in the (odd) tail
    return x


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["signed", "nonneg"])
def test_q8_kernels_are_the_reference(kind, n, offset):
    x = moments(kind, n, seed=n)
    codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(C.q8_num_blocks(n))
    C.q8_encode(x, codes, scales, kind)  # CPU: the reference
    xd = misaligned(x, offset)
    codes_d, scales_d = misaligned(torch.zeros(n, dtype=torch.uint8), offset), \
        torch.empty(C.q8_num_blocks(n), device="cuda")
    C.q8_encode(xd, codes_d, scales_d, kind)
    assert torch.equal(bits(scales_d), bits(scales))
    assert torch.equal(codes_d.cpu(), codes)
    out = torch.empty(n)
    C.q8_decode(codes, scales, out, kind)
    out_d = misaligned(torch.zeros(n), offset)
    C.q8_decode(codes_d, scales_d, out_d, kind)
    assert same_values(out_d, out)
    # The torch reference on CUDA is the same bits too (the kernels off).
    C.use_kernels(False)
    C.q8_encode(xd, codes_d, scales_d, kind)
    assert torch.equal(bits(scales_d), bits(scales)) and torch.equal(codes_d.cpu(), codes)
    C.q8_decode(codes_d, scales_d, out_d, kind)
    assert same_values(out_d, out)


def masters(n, seed):
    """fp32 masters with RNE ties, NaN (with payloads), Inf, subnormals, +-0, near max."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64)
    b = b & ~(0xFF << 23) | ((torch.randint(100, 150, (n,), generator=g) << 23))  # sane exponents
    b = torch.where(b >= 2**31, b - 2**32, b)
    m = b.to(torch.int32).view(torch.float32).clone()
    ties = torch.rand(n, generator=g) < 0.01
    m.view(torch.int32)[ties] = m.view(torch.int32)[ties] & ~0xFFFF | 0x8000
    special = [float("nan"), float("inf"), -float("inf"), 1e-45, -0.0, 0.0,
               3.4028234663852886e38, 3.3961e38]
    for i, v in enumerate(special):
        if 3 * i < n:
            m[3 * i] = v
    if n > 30:
        m.view(torch.int32)[30] = 0x7FA12345  # a NaN payload
    return m


def params_for(m, seed, changed=0.0):
    """bf16 RNE(m), with a share `changed` of the elements one ulp off."""
    p = m.to(torch.bfloat16)
    if changed:
        g = torch.Generator().manual_seed(seed)
        off = torch.rand(m.numel(), generator=g) < changed
        p.view(torch.int16)[off] += 1
    return p


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("changed", [0.0, 0.3])  # 0.3: exceptions overflow the kernel's list
def test_residual_kernels_are_the_reference(n, offset, changed):
    m = masters(n, seed=n)
    p = params_for(m, n, changed)
    r = torch.empty(n, dtype=torch.int16)
    idx, exc_bits = C.residual_encode(m, p, r)
    md, pd = misaligned(m, offset), misaligned(p, offset)
    rd = misaligned(torch.ones(n, dtype=torch.int16), offset)
    idx_d, exc_bits_d = C.residual_encode(md, pd, rd)
    assert torch.equal(rd.cpu(), r)
    assert torch.equal(idx_d.cpu(), idx) and torch.equal(exc_bits_d.cpu(), exc_bits)
    # Rebuild: exact masters, consistent.
    out_d = misaligned(torch.zeros(n), offset)
    assert not bool(C.residual_rebuild(pd, rd, (idx_d, exc_bits_d), out_d))
    assert torch.equal(bits(out_d), bits(m))
    # A changed param is noticed exactly where the reference notices it.
    for change in ("ulp", "nan", "none"):
        p2 = p.clone()
        if change == "ulp":
            p2.view(torch.int16)[n // 2] += 1
        elif change == "nan":
            p2[n - 1] = float("nan")
        out = torch.empty(n)
        ref = bool(C.residual_rebuild(p2, r, (idx, exc_bits), out))
        got = bool(C.residual_rebuild(misaligned(p2, offset), rd, (idx_d, exc_bits_d), out_d))
        assert got == ref, change
        assert torch.equal(bits(out_d), bits(out))


def test_a_bucket_of_masters_in_one_call_is_the_reference():
    """encode_residuals/decode_residuals' one call for many masters (sizes from 0 up,
    misaligned ones, one whose exceptions overflow the kernel's room) gives each master
    the reference's residual, exceptions and fingerprint, rebuilds every master exactly,
    and tells a changed param (any one element of any one) as the reference does."""
    sizes = [0, 1, 257, 4096 * 3 + 17, (1 << 20) + 3, 5000]
    masters_ = [masters(n, seed=i) for i, n in enumerate(sizes)]
    params = [params_for(m, i, 0.3 if i == 5 else 0.0) for i, m in enumerate(masters_)]
    refs = [C.residual_encode(m, p, torch.empty(len(m), dtype=torch.int16))
            for m, p in zip(masters_, params)]
    md = [misaligned(m, i % 2) for i, m in enumerate(masters_)]
    pd = [misaligned(p, i % 2) for i, p in enumerate(params)]
    rd = [misaligned(torch.ones(n, dtype=torch.int16), i % 2) for i, n in enumerate(sizes)]
    pending = C.PendingExceptions(C.ResidualMasters(md, pd, rd), fingerprints=True)
    got = C.finish_exceptions([pending])
    assert [int(c) for c in pending.count.cpu()][5] > pending.capacities[5]  # overflowed
    for i, (m, p) in enumerate(zip(masters_, params)):
        r = torch.empty(len(m), dtype=torch.int16)
        C.residual_encode(m, p, r)
        assert torch.equal(rd[i].cpu(), r), i
        listed = C.in_index_order(got[i])  # the kernel lists them in any order
        assert torch.equal(listed[0].cpu(), refs[i][0]), i
        assert torch.equal(listed[1].cpu(), refs[i][1]), i
        assert int(pending.fingerprints[i]) == int(C.param_checksum(p)), i
    outs = [misaligned(torch.zeros(n), i % 2) for i, n in enumerate(sizes)]
    changed = rebuild(pd, rd, got, outs, pending.fingerprints)
    assert not bool(changed)
    for m, out in zip(masters_, outs):
        assert torch.equal(bits(out), bits(m))
    for i in (1, 4):  # a change the rounding check alone misses too
        p2 = [p.clone() for p in pd]
        p2[i].view(torch.int16)[-1] ^= 1
        assert bool(rebuild(p2, rd, got, outs, pending.fingerprints)), i
        # Without fingerprints, the rounding check alone: the kernels' verdict is the
        # reference's.
        ref = rebuild([x.cpu() for x in p2], [x.cpu() for x in rd],
                                  [(a.cpu(), b.cpu()) for a, b in got],
                                  [torch.empty(n) for n in sizes], [None] * len(sizes))
        assert bool(rebuild(p2, rd, got, outs, [None] * len(sizes))) == bool(ref)


def test_more_masters_than_one_launch_takes_are_each_the_reference():
    """A call launches its tensors in batches of a few dozen (kernels/batch.cuh): 150
    masters, sizes 0 to ~9000 at both alignments, are each encoded, fingerprinted and
    rebuilt as alone, and a change to any one param (one past the first batch too) is
    told."""
    sizes = [(i * 997) % 9001 if i % 37 else 0 for i in range(150)]
    masters_ = [masters(n, seed=100 + i) for i, n in enumerate(sizes)]
    params = [params_for(m, i, 0.001) for i, m in enumerate(masters_)]
    md = [misaligned(m, i % 2) for i, m in enumerate(masters_)]
    pd = [misaligned(p, (i // 2) % 2) for i, p in enumerate(params)]
    rd = [misaligned(torch.ones(n, dtype=torch.int16), int(i % 3 == 0)) for i, n in enumerate(sizes)]
    pending = C.PendingExceptions(C.ResidualMasters(md, pd, rd), fingerprints=True)
    got = C.finish_exceptions([pending])
    for i, (m, p) in enumerate(zip(masters_, params)):
        r = torch.empty(len(m), dtype=torch.int16)
        idx, exc_bits = C.residual_encode(m, p, r)
        assert torch.equal(rd[i].cpu(), r), i
        listed = C.in_index_order(got[i])
        assert torch.equal(listed[0].cpu(), idx) and torch.equal(listed[1].cpu(), exc_bits), i
        assert int(pending.fingerprints[i]) == int(C.param_checksum(p)), i
    assert sum(len(i) for i, _ in got) > 0  # some exceptions were scattered back
    outs = [misaligned(torch.zeros(n), (i + 1) % 2) for i, n in enumerate(sizes)]
    assert not bool(rebuild(pd, rd, got, outs, pending.fingerprints))
    for i, (m, out) in enumerate(zip(masters_, outs)):
        assert torch.equal(bits(out), bits(m)), i
    assert not C.params_changed(pd, pending.fingerprints).item()
    for i in (1, 70, 149):
        p2 = list(pd)
        p2[i] = pd[i].clone()
        p2[i].view(torch.int16)[-1] ^= 1
        assert C.params_changed(p2, pending.fingerprints).item(), i
        assert bool(rebuild(p2, rd, got, outs, pending.fingerprints)), i


def test_adamw_of_many_params_in_one_call_is_each_alone():
    """adamw_step_many over 120 parameters of the three moment formats interleaved
    (launched per format, in batches) gives each the bits of a call for it alone."""
    fmts = ["fp32", "bf16", "q8"]
    hyper = [1e-3, 0.9, 0.999, 1e-8, 0.01]
    stream = torch.cuda.current_stream().cuda_stream
    sizes = [1 + (i * 1231) % 6000 for i in range(120)]
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(7)
        run_ = []
        for i, n in enumerate(sizes):
            p = misaligned(torch.randn(n, generator=gen), i % 2)
            g = misaligned(torch.randn(n, generator=gen), i % 2)
            m = stored_moment(moments("signed", n, seed=i).cuda(), fmts[i % 3], "signed")[0]
            v = stored_moment(moments("nonneg", n, seed=i).cuda().abs(), fmts[i % 3], "nonneg")[0]
            run_.append((p, g, m, v, fmts[i % 3]))
        runs.append(run_)
    together, alone = runs
    statepager._C.kernels.adamw_step_many(*[list(x) for x in zip(*together)],
                                          [hyper] * len(sizes), [3.0] * len(sizes), stream)
    for p, g, m, v, fmt in alone:
        statepager._C.kernels.adamw_step_many([p], [g], [m], [v], [fmt], [hyper], [3.0], stream)
    for i, (a, b) in enumerate(zip(together, alone)):
        for x, y in zip([a[0], *a[2], *a[3]], [b[0], *b[2], *b[3]]):
            assert torch.equal(bits(x), bits(y)), i


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 4096 * 5 + 77, (1 << 20) + 3])
def test_checksum_kernel_is_the_reference(n, offset):
    g = torch.Generator().manual_seed(n)
    p = torch.randint(-2**15, 2**15, (n,), generator=g, dtype=torch.int16).view(torch.bfloat16)
    if n:
        p.view(torch.int16)[0] = -1  # 0xFFFF: the largest x
    ref = int(C.param_checksum(p))
    assert int(C.param_checksum(misaligned(p, offset))) == ref


def test_params_changed_kernel_is_the_reference():
    """params_changed in one call on the device: False while every param matches its
    fingerprint (taken on the CPU, the same value), True once any one element changes."""
    g = torch.Generator().manual_seed(5)
    cpu = [torch.randint(-2**15, 2**15, (n,), generator=g, dtype=torch.int16)
           .view(torch.bfloat16) for n in SIZES]
    fingerprints = [C.param_checksum(p).cuda() for p in cpu]
    params = [p.cuda() for p in cpu]
    assert not C.params_changed(params, fingerprints).item()
    assert not C.params_changed(cpu, [f.cpu() for f in fingerprints]).item()
    for i in (0, len(params) - 1):
        changed = [p.clone() for p in params]
        changed[i].view(torch.int16)[-1] ^= 1
        assert C.params_changed(changed, fingerprints).item()
        assert C.params_changed([p.cpu() for p in changed], [f.cpu() for f in fingerprints]).item()


# ------------------------------------------------------------------ the fused AdamW step

def stored_moment(x, fmt, kind):
    """x (fp32, CUDA) in `fmt` as the kernel takes it, and its decoded fp32 value."""
    if fmt == "fp32":
        return [x.clone()], x.clone()
    if fmt == "bf16":
        b = x.to(torch.bfloat16)
        return [b], b.float()
    codes = torch.empty(x.numel(), dtype=torch.uint8, device="cuda")
    scales = torch.empty(C.q8_num_blocks(x.numel()), device="cuda")
    C.q8_encode(x, codes, scales, kind)
    out = torch.empty_like(x)
    C.q8_decode(codes, scales, out, kind)
    return [codes, scales], out


def foreach_adamw(p, g, m, v, lr, beta1, beta2, eps, wd, step):
    """_multi_tensor_adam's ops for one parameter (decoupled weight decay), in place."""
    if wd != 0:
        torch._foreach_mul_([p], 1 - lr * wd)
    torch._foreach_lerp_([m], [g], 1 - beta1)
    torch._foreach_mul_([v], beta2)
    torch._foreach_addcmul_([v], [g], [g], 1 - beta2)
    bias_correction1, bias_correction2 = 1 - beta1 ** step, 1 - beta2 ** step
    d = torch._foreach_sqrt([v])
    torch._foreach_div_(d, [bias_correction2 ** 0.5])
    torch._foreach_add_(d, eps)
    torch._foreach_addcdiv_([p], [m], d, [(lr / bias_correction1) * -1])


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("n", [1, 255, 256, 4096 * 3 + 17, (1 << 20) + 3])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "q8"])
@pytest.mark.parametrize("hyper", [(1e-3, 0.9, 0.999, 1e-8, 0.01, 7.0),
                                   (0.5, 0.2, 0.0, 1e-3, 0.0, 1.0)])
def test_adamw_kernel_is_torch_foreach(fmt, n, offset, hyper):
    """One fused step: the bits of torch's foreach ops on the decoded moments, then
    encoded (q8/bf16 as the codecs encode)."""
    lr, beta1, beta2, eps, wd, step = hyper
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen).cuda()
    g = (torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-30, 3, generator=gen)).cuda()
    m0 = moments("signed", n, seed=n + 1).cuda().clamp(-1e30, 1e30)
    v0 = moments("nonneg", n, seed=n + 2).cuda().clamp(0, 1e30)
    if n > 600:
        g[5], g[300] = float("nan"), float("inf")
    m_t, m = stored_moment(m0, fmt, "signed")
    v_t, v = stored_moment(v0, fmt, "nonneg")
    ref_p = p.clone()
    foreach_adamw(ref_p, g, m, v, lr, beta1, beta2, eps, wd, step)
    want_m, want_v = stored_moment(m, fmt, "signed")[0], stored_moment(v, fmt, "nonneg")[0]
    pd, gd = misaligned(p, offset), misaligned(g, offset)
    m_d = [misaligned(t, offset) if i == 0 else t for i, t in enumerate(m_t)]
    v_d = [misaligned(t, offset) if i == 0 else t for i, t in enumerate(v_t)]
    statepager._C.kernels.adamw_step_many(
        [pd], [gd], [m_d], [v_d], [fmt], [[lr, beta1, beta2, eps, wd]], [step],
        torch.cuda.current_stream().cuda_stream)
    assert torch.equal(bits(pd), bits(ref_p))
    for got, want in zip(m_d + v_d, want_m + want_v):
        assert torch.equal(bits(got), bits(want))


# ------------------------------------------------------------------ the streamed step

SHAPES = [(512, 384), (1000,), (3, 5, 7), (257, 129), (4096 * 3 + 1,)]
# Larger than the 1 MiB buckets: they step in chunks (of 262144 elements).
BIG_SHAPES = [(3 * 262144 + 1000,), (77,), (640, 1024)]


def model(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to("cuda", torch.bfloat16))
            for s in shapes]


@pytest.fixture
def fused_calls(monkeypatch):
    """How many fused AdamW kernels ran (a list that grows by one per launch)."""
    calls, launch = [], statepager._C.kernels.adamw_step_many
    monkeypatch.setattr(statepager._C.kernels, "adamw_step_many",
                        lambda *a, **k: (calls.extend(a[4] if len(a) > 4 else k["formats"]),
                                         launch(*a, **k)))
    return calls


def run(store_dir, moments, mains, kernels, steps=6, fused=True, shapes=SHAPES,
        bucket_size=1 * MiB):
    """Params and state_dict after `steps` steps, and per bucket (whole parameters, chunks):
    where the fused step runs, a kernel for each."""
    C.use_kernels(kernels)
    fused_adamw.use_fused(fused)
    ps = model(shapes=shapes)
    with Pager(store_dir, device="cuda", page_size=2 * MiB) as pager:
        opt = PagedAdamW(ps, pager=pager, lr=1e-2, weight_decay=0.1, bucket_size=bucket_size,
                         moments=moments, mains=mains)
        for k in range(steps):
            for i, p in enumerate(ps):
                g = torch.Generator().manual_seed(100 * k + i)
                p.grad = torch.randn(p.shape, generator=g).to("cuda", torch.bfloat16)
                if k == 2 and i == 0:
                    p.grad.view(-1)[:5] = float("inf")  # a non-finite block in the moments
            opt.step()
        state = opt.state_dict()
        buckets = [(len(b.params), len(b.chunks)) for b in opt.binding.buckets]
        return [p.detach().cpu() for p in ps], state, buckets


def flat_state(state):
    return [(i, k, bits(v) if isinstance(v, torch.Tensor) else v)
            for i, s in sorted(state["state"].items()) for k, v in sorted(s.items())]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("moments,mains", [("q8", "residual"), ("q8", "fp32"),
                                           ("bf16", "residual"), ("fp32", "residual")])
def test_streamed_step_with_kernels_is_without(tmp_path, moments, mains, fused, fused_calls):
    ref_params, ref_state, _ = run(str(tmp_path / "ref"), moments, mains, kernels=False)
    assert not fused_calls
    try:
        params, state, _ = run(str(tmp_path / "k"), moments, mains, kernels=True, fused=fused)
    finally:
        fused_adamw.use_fused(True)
    # Every step fused, the first too (the binding creates the state, zero, before it).
    assert fused_calls == ([moments] * 6 * len(params) if fused else [])
    same_run(params, state, ref_params, ref_state)


@pytest.mark.parametrize("moments,mains", [("q8", "residual"), ("fp32", "fp32"),
                                           ("bf16", "residual")])
def test_fused_step_on_chunks_is_torch_on_chunks(tmp_path, moments, mains, fused_calls):
    """Parameters larger than a bucket: one fused kernel per chunk, each from the count of
    before the step, give the bits of torch's step on the same chunks."""
    ref_params, ref_state, _ = run(str(tmp_path / "ref"), moments, mains, kernels=False,
                                   shapes=BIG_SHAPES)
    params, state, buckets = run(str(tmp_path / "k"), moments, mains, kernels=True,
                                 shapes=BIG_SHAPES)
    launches = sum(w + c for w, c in buckets)
    assert launches > len(BIG_SHAPES)  # chunks
    assert fused_calls == [moments] * 6 * launches
    same_run(params, state, ref_params, ref_state)
    assert [s["step"].item() for s in state["state"].values()] == [6.0] * len(BIG_SHAPES)


# With 4 MiB buckets the first parameter's last chunk shares its bucket with the others,
# whatever the formats' bytes per element.
MIXED_SHAPES = [(5 * 262144 + 131072,), (77,), (300, 7)]


@pytest.mark.parametrize("moments,mains", [("q8", "residual"), ("fp32", "fp32")])
def test_fused_step_on_a_bucket_of_chunks_and_whole_params(tmp_path, moments, mains,
                                                           fused_calls):
    """One fused call steps a bucket holding whole parameters and a chunk of another
    (Megatron's buckets do), with torch's bits and counts."""
    ref_params, ref_state, _ = run(str(tmp_path / "ref"), moments, mains, kernels=False,
                                   shapes=MIXED_SHAPES, bucket_size=4 * MiB)
    params, state, buckets = run(str(tmp_path / "k"), moments, mains, kernels=True,
                                 shapes=MIXED_SHAPES, bucket_size=4 * MiB)
    assert any(w and c for w, c in buckets), buckets
    assert fused_calls == [moments] * 6 * sum(w + c for w, c in buckets)
    same_run(params, state, ref_params, ref_state)
    assert [s["step"].item() for s in state["state"].values()] == [6.0] * len(MIXED_SHAPES)


def same_run(params, state, ref_params, ref_state):
    for a, b in zip(params, ref_params):
        assert torch.equal(bits(a), bits(b))
    got, want = flat_state(state), flat_state(ref_state)
    assert [x[:2] for x in got] == [x[:2] for x in want]
    for (i, k, a), (_, _, b) in zip(got, want):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), (i, k)


class TruncatingAdamW(PagedAdamW):
    """Writes each bf16 param as its master truncated, not rounded: about half of every
    master's elements are then residual exceptions, past the kernel's room."""

    @torch.no_grad()
    def _store_params(self, masters):
        for m in masters:
            if m.grad is not None:
                self.model_param(m).copy_((m.view(torch.int32) & -65536).view(torch.float32))
            m.grad = None


def run_truncating(store_dir, kernels, depth, steps=4):
    C.use_kernels(kernels)
    ps = model()
    with Pager(store_dir, device="cuda", page_size=2 * MiB) as pager:
        opt = TruncatingAdamW(ps, pager=pager, lr=1e-2, bucket_size=256 << 10, moments="q8",
                              mains="residual", depth=depth)  # 4 buckets
        for k in range(steps):
            for i, p in enumerate(ps):
                g = torch.Generator().manual_seed(100 * k + i)
                p.grad = torch.randn(p.shape, generator=g).to("cuda", torch.bfloat16)
            opt.step()
        exceptions = [len(f.exceptions[0]) for b in opt.binding.buckets for f in b.forms
                      if f.fmt == "residual"]
        return [p.detach().cpu() for p in ps], opt.state_dict(), exceptions


@pytest.mark.parametrize("depth", [2, 3])
def test_streamed_step_exceptions_past_the_kernels_room(tmp_path, depth):
    """Read two buckets later, exceptions that overflow the kernel's list are listed again
    from the scratch kept for them: the step's bits are the reference's."""
    ref_params, ref_state, ref_exc = run_truncating(str(tmp_path / "ref"), False, depth)
    params, state, exc = run_truncating(str(tmp_path / "k"), True, depth)
    assert exc == ref_exc and max(exc) > 1024 + (512 * 384) // 2048  # past the room
    for a, b in zip(params, ref_params):
        assert torch.equal(bits(a), bits(b))
    for (i, k, a), (_, _, b) in zip(flat_state(state), flat_state(ref_state)):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), (i, k)


@pytest.mark.parametrize("shapes,bucket_size", [(SHAPES, 256 << 10), (BIG_SHAPES, 1 << 20)])
@pytest.mark.parametrize("zero_grad", [False, True])
@pytest.mark.parametrize("atomic", [True, False])
def test_streamed_step_syncs_once_per_step(store_dir, monkeypatch, shapes, bucket_size,
                                           zero_grad, atomic):
    """q8 moments and residual mains, fused: the host waits for the device as a whole once
    per step (the residual checks: after the last bucket when atomic, before the first
    in place), never per bucket, chunk or tensor: each bucket's exception counts are
    waited for alone (an event), two buckets later, and a chunk keeps its own exceptions.
    Undo copies taken at zero_grad() are checked the same way (an event)."""
    ps = model(shapes=shapes)
    with Pager(store_dir, device="cuda", page_size=2 * MiB) as pager:
        opt = PagedAdamW(ps, pager=pager, lr=1e-2, bucket_size=bucket_size, moments="q8",
                         mains="residual")  # 4 buckets; BIG_SHAPES: chunks
        opt.binding.atomic = atomic
        takes, take = [], opt.binding._steps.undo.take
        monkeypatch.setattr(opt.binding._steps.undo, "take", lambda copies, targets: (
            takes.append(1), take(copies, targets))[1])
        for k in range(3):  # the first creates the state
            if zero_grad:
                opt.zero_grad()
            for p in ps:
                p.grad = torch.randn_like(p)
            if k == 2:
                del takes[:]
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        assert len(opt.binding.buckets) >= 3 and len(syncs) == 1, [str(w.message) for w in syncs]
        # Undo copies in that step: none in place, none left to it after zero_grad().
        assert len(takes) == (0 if zero_grad or not atomic else len(opt.binding.buckets))
        assert shapes is SHAPES or any(b.chunks for b in opt.binding.buckets)


def fp32_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(16, 8, 3, 3, generator=g).contiguous(memory_format=torch.channels_last)
    return [torch.nn.Parameter(t.cuda()) for t in
            (conv, torch.randn(300, 257, generator=g), torch.randn(1001, generator=g),
             torch.randn(256, generator=g))]


@pytest.mark.parametrize("name,kwargs", [
    ("AdamW", {}), ("AdamW", {"weight_decay": 0.0, "foreach": True}),
    ("AdamW", {"betas": (0.3, 0.0), "eps": 1e-3}),  # lerp's other branch; addcmul alpha 1
    ("Adam", {"lr": 3e-3, "weight_decay": 0.0}), ("Adam", {"weight_decay": 0.1, "decoupled_weight_decay": True})])
def test_fused_adamw_is_torch_foreach(store_dir, name, kwargs, fused_calls):
    """fp32 state: the fused step on the pager's tensors gives what torch's own foreach
    AdamW gives unpaged, bit for bit (params, moments, step counts)."""
    cls = getattr(torch.optim, name)
    ref_p, p = fp32_params(), fp32_params()
    kwargs = {"lr": 1e-2, "weight_decay": 0.05, **kwargs}
    ref, opt = cls(ref_p, **kwargs), cls(p, **kwargs)
    with Pager(store_dir, device="cuda", page_size=2 * MiB) as pager:
        pager.attach(opt, bucket_size=256 << 10)
        for k in range(5):
            for i, (a, b) in enumerate(zip(ref_p, p)):
                if (i + k) % 4 == 3 and k > 0:  # no gradient this step
                    a.grad = b.grad = None
                    continue
                g = torch.randn(a.shape, generator=torch.Generator().manual_seed(10 * k + i))
                a.grad = torch.empty_like(a).copy_(g)
                b.grad = torch.empty_like(b).copy_(g)
            ref.step()
            opt.step()
        for a, b in zip(ref_p, p):
            assert torch.equal(bits(a.detach()), bits(b.detach()))
        a, b = ref.state_dict(), opt.state_dict()
        for i, st in a["state"].items():
            for key, v in st.items():
                assert torch.equal(bits(v), bits(b["state"][i][key])), (i, key)
    assert fused_calls, "the fused step never ran"


def test_fused_step_stays_off_where_it_does_not_apply(store_dir, fused_calls):
    """fused=True (torch's fused kernel) and amsgrad run torch's own step."""
    for kwargs in ({"fused": True}, {"amsgrad": True}, {"foreach": False}):
        ps = fp32_params()
        opt = torch.optim.AdamW(ps, lr=1e-2, **kwargs)
        with Pager(store_dir + str(len(kwargs)) + next(iter(kwargs)), device="cuda") as pager:
            pager.attach(opt, bucket_size=256 << 10)
            for _ in range(3):
                for p in ps:
                    p.grad = torch.ones_like(p)
                opt.step()
    assert not fused_calls


def test_store_crc_kernel_gives_the_cpus_crc32c():
    g = torch.Generator().manual_seed(5)
    host = torch.randint(0, 256, (9 * MiB,), dtype=torch.uint8, generator=g)
    x = host.cuda()
    edges = [0, 1, 7, 8, 15, 16, 17, 255, 256, 257, 511, 512, 513, 4096, 65535, 65536, 65537,
             131071, 131072, 131073, 3 * 131072 + 5, 50 * 131072 + 1, 8 * MiB + 3]
    ranges = [(offset, length) for offset in (0, 1, 4096, 12345) for length in edges]
    ranges += [(k * 1000, 999 + k) for k in range(600)]  # more than a launch takes
    got = statepager._C.kernels.crc32c(x, ranges, torch.cuda.current_stream().cuda_stream)
    raw = host.numpy().tobytes()
    want = [statepager._C.crc32c(raw[o:o + n]) for o, n in ranges]
    assert got == want
    with pytest.raises(statepager.UsageError, match="within x"):
        statepager._C.kernels.crc32c(x, [(9 * MiB, 1)], torch.cuda.current_stream().cuda_stream)


def test_undo_copies_kernel_copies_every_byte_of_every_target():
    """The undo copies' batched copy (kernels/copies.cu): targets of every alignment the
    copy words take (16, 4 and 1 bytes), sizes around its chunks (64 KiB), more than one
    launch takes, dense ones transposed, one with gaps, on a stream of their own: each
    copy holds the target's bytes, and copied back each target has them again."""
    from statepager.core.resumable import undo_copies
    g = torch.Generator().manual_seed(6)
    raw = torch.randint(0, 256, (3 * MiB,), dtype=torch.uint8, generator=g).cuda()
    targets = [raw[o:o + n] for o in (0, 1, 4, 16, 4099)
               for n in (1, 3, 15, 16, 17, 65535, 65536, 65537, 200_001)]
    targets += [raw[k * 97:k * 97 + 33 + k] for k in range(160)]  # past one launch's entries
    targets += [torch.randn(300, 500, generator=g).cuda().t(),  # dense, not contiguous
                torch.randn(40, 60, generator=g).cuda()[:, ::3]]  # gaps
    before = [t.clone() for t in targets]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        copies = undo_copies(targets)
    torch.cuda.current_stream().wait_stream(stream)
    pairs = copies.pairs()
    assert len(pairs) == len(targets)
    assert all(torch.equal(view, copy) for view, copy in pairs)  # the targets' views, as taken
    for t in targets:
        t.zero_()
    for t, c in pairs:
        t.copy_(c)
    assert all(torch.equal(t, b) for t, b in zip(targets, before))
    # Copies end to end (align 1): a word past a range's end would land in the next copy,
    # at every offset a destination may have.
    odd = [raw[o:o + n] for o in (0, 3, 16) for n in (1, 5, 17, 4099, 65537)]
    adjacent = statepager._C.dense_copies(odd, 1, torch.cuda.current_stream().cuda_stream)
    assert all(torch.equal(view, copy) for view, copy in adjacent.pairs())


def test_late_reads_take_a_spare_that_fits():
    """LateRead(values, spare): the values as the work queued before it left them (a
    fill behind a long kernel), copied into the spare's pinned buffer where they fit, into
    a new one where they do not; the spare is the LateRead's own again once read."""
    from statepager.core.late_reads import LateRead
    x = torch.zeros(5, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(50_000_000)  # the fill lands well after the copy is queued
    x.fill_(3)
    first = LateRead(x)
    assert first.get().tolist() == [3] * 5
    spare = first.spare
    second = LateRead(torch.arange(10, 20, device="cuda"), spare)
    assert second.spare is spare and second.get().data_ptr() == spare[0].data_ptr()
    assert second.get().tolist() == list(range(10, 20))
    third = LateRead(torch.arange(spare[0].numel() + 1, device="cuda"), spare)
    assert third.spare is not spare
    assert third.get().tolist() == list(range(spare[0].numel() + 1))

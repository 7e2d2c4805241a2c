"""statepager.formats.codecs: the residual format is bit-exact over a dense sample of fp32 bit
patterns and (with param_checksum) detects a changed parameter; q8 stays within each
scheme's error bound."""
import pytest
import torch

from statepager.formats import codecs as C

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def f32(bits) -> torch.Tensor:
    """fp32 tensor with the given unsigned 32-bit patterns (int64 tensor or list)."""
    b = torch.as_tensor(bits, dtype=torch.int64)
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def ubits(t: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit patterns of an fp32 tensor, as int64."""
    return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


SPECIAL = [
    0x00000000, 0x80000000,              # +-0
    0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00008000, 0x00018000,  # subnormals
    0x00800000, 0x3F800000, 0x3F808000, 0x3F818000, 0xBF808000,  # normals, ties
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # max finite; rounds to inf / ties
    0x7F7F806F, 0x7F7F7E82,              # 3.3962e38 (bf16 inf), 3.3961e38 (not inf)
    0x7F800000, 0xFF800000,              # +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0x7FC00001, 0x7FFFFFFF, 0xFFFFFFFF,
    0xFF800001, 0x7FFF8000, 0x7F808000,  # NaNs with assorted payloads
]


def dense_sample() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    stride = torch.arange(0, 2**32, 997, dtype=torch.int64)
    rand = torch.randint(0, 2**32, (2**22,), generator=g, dtype=torch.int64)
    # The patterns around 4096 bf16 values' rounding points, edges of the ranges included.
    hi = torch.cat([torch.randint(0, 2**16, (4064,), generator=g),
                    torch.tensor([0x0000, 0x0001, 0x007F, 0x0080, 0x3F7F, 0x3F80, 0x7F7E, 0x7F7F,
                                  0x7F80, 0x7FC0, 0x7FFF, 0x8000, 0x8001, 0x807F, 0x8080,
                                  0xBF7F, 0xBF80, 0xFF7E, 0xFF7F, 0xFF80, 0xFFC0, 0xFFFF,
                                  0x0002, 0x0003, 0x8002, 0x8003, 0x4000, 0x4001, 0xC000,
                                  0xC001, 0x0100, 0x8100])])
    lo = torch.tensor([0x7FFF, 0x8000, 0x8001, 0x0000, 0xFFFF])
    ties = (hi[:, None] * 65536 + lo[None, :]).view(-1)
    return f32(torch.cat([stride, rand, ties, torch.tensor(SPECIAL)]))


def roundtrip(main, param):
    residual = torch.empty(main.shape, dtype=torch.int16, device=main.device)
    exc = C.residual_encode(main, param, residual)
    out = torch.full_like(main, float("nan"))
    C.residual_decode(param, residual, exc, out)
    return exc, out


@pytest.mark.parametrize("device", DEVICES)
def test_residual_bit_exact_dense(device):
    main = dense_sample().to(device)
    big = torch.tensor([3.3962e38, 3.3961e38])
    assert torch.equal(big.view(torch.int32), f32([0x7F7F806F, 0x7F7F7E82]).view(torch.int32))
    assert big.to(torch.bfloat16)[0] == float("inf") and big.to(torch.bfloat16)[1] < float("inf")
    param = main.to(torch.bfloat16)
    exc, out = roundtrip(main, param)
    assert torch.equal(out.view(torch.int32), main.view(torch.int32))

    # The fact the format rests on: this device's bf16 cast is RNE on the top 16 bits.
    b = ubits(main.cpu())
    finite = torch.isfinite(main.cpu())
    rne = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    pbits = param.cpu().view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(pbits[finite], rne[finite])
    # So the exceptions are exactly the non-finite values and the ties RNE rounded to
    # the even value below (residual +32768); the ties rounded up (-32768) fit.
    expect = ~finite | (((b & 0xFFFF) == 0x8000) & ((b >> 16) & 1 == 0))
    assert torch.equal(exc[0].cpu(), expect.nonzero().view(-1))
    assert torch.equal(exc[1].cpu(), main.cpu().view(torch.int32)[expect])


def test_residual_specials_and_shapes():
    main = f32(SPECIAL).view(-1, 1).expand(-1, 3).contiguous()
    exc, out = roundtrip(main, main.to(torch.bfloat16))
    assert torch.equal(out.view(torch.int32), main.view(torch.int32))
    # Finite values that round to bf16 inf are ordinary residuals, not exceptions.
    to_inf = torch.isfinite(main.view(-1)) & torch.isinf(main.view(-1).to(torch.bfloat16))
    assert to_inf.sum() == 3 * 4 and not torch.isin(exc[0], to_inf.nonzero()).any()
    empty = torch.empty(0)
    _, out = roundtrip(empty, empty.to(torch.bfloat16))
    assert out.numel() == 0


def test_residual_lossless_even_for_a_param_that_is_not_rne():
    # Params rounded some other way (truncated; ties away from zero) are not what the
    # optimizer keeps; encoding stays lossless by taking those elements as exceptions,
    # and decoding them does not report a change.
    g = torch.Generator().manual_seed(1)
    b = ubits(torch.randn(10000, generator=g))
    b[:5000] = b[:5000] & ~0xFFFF | 0x8000  # ties
    main = f32(b)
    for param_hi in (b >> 16, (b + 0x8000) >> 16):
        param = torch.where(param_hi >= 2**15, param_hi - 2**16, param_hi).to(torch.int16)
        exc, out = roundtrip(main, param.view(torch.bfloat16))
        assert torch.equal(out.view(torch.int32), main.view(torch.int32))
        assert 0 < exc[0].numel() < main.numel()


@pytest.mark.parametrize("device", DEVICES)
def test_residual_detects_changed_param(device):
    main = torch.randn(10000, generator=torch.Generator().manual_seed(2)).to(device) * 1e-3
    param = main.to(torch.bfloat16)
    residual = torch.empty(main.shape, dtype=torch.int16, device=device)
    exc = C.residual_encode(main, param, residual)
    checksum = C.param_checksum(param)
    out = torch.empty_like(main)
    C.residual_decode(param, residual, exc, out, checksum=checksum)  # unchanged: fine
    assert torch.equal(out.view(torch.int32), main.view(torch.int32))

    one_ulp = param.clone()
    one_ulp.view(torch.int16)[9999] += 1
    with pytest.raises(ValueError, match=r"no longer matches its master.*checksum"):
        C.residual_decode(one_ulp, residual, exc, out, checksum=checksum)
    # Without the checksum a finite change cannot be seen: any (param, residual) decodes
    # to a master that rounds to that param. That is why decode takes the checksum.
    C.residual_decode(one_ulp, residual, exc, out)
    assert not torch.equal(out.view(torch.int32), main.view(torch.int32))

    stepped = param.clone()
    stepped[:3] -= 1.0  # e.g. an optimizer step applied to the bf16 params directly
    with pytest.raises(ValueError, match=r"no longer matches its master.*checksum"):
        C.residual_decode(stepped, residual, exc, out, checksum=checksum)
    # A param turned NaN is caught by the RNE check alone, with a count.
    stepped[7], stepped[8] = float("nan"), -float("nan")
    with pytest.raises(ValueError, match=r"no longer matches.*: 2 of 10000 elements differ"):
        C.residual_decode(stepped, residual, exc, out)


@pytest.mark.parametrize("device", DEVICES)
def test_param_checksum(device):
    g = torch.Generator().manual_seed(4)
    for n in (0, 1, 4095, 4096, 3 * 4096 + 5):
        param = torch.randn(n, generator=g).to(torch.bfloat16)
        ref = int(C.param_checksum(param))
        assert int(C.param_checksum(param.to(device))) == ref  # same on every device
        assert 0 <= ref < 2**31 - 1
        changed = []
        for i in {0, n // 2, n - 1} if n else ():
            p = param.clone()
            p.view(torch.int16)[i] ^= 1
            changed.append(p)
        if n > 4096:
            p = param.clone()  # swap two elements
            p[[1, 4098]] = param[[4098, 1]]
            changed.append(p)
            p = param.clone()  # opposite changes at the same column of two rows
            p.view(torch.int16)[[5, 4096 + 5]] += torch.tensor([1, -1], dtype=torch.int16)
            changed.append(p)
            p = param.clone()  # changes that cancel in a plain sum
            p.view(torch.int16)[[5, 6]] += torch.tensor([1, -1], dtype=torch.int16)
            changed.append(p)
        for p in changed:
            if not torch.equal(p.view(torch.int16), param.view(torch.int16)):
                assert int(C.param_checksum(p)) != ref


# ---------------------------------------------------------------------------------- q8

SCHEMES = [(kind, s) for kind, schemes in C.Q8_SCHEMES.items() for s in schemes]


def q8_roundtrip(x, kind, scheme, block, codes_dtype=torch.uint8):
    codes = torch.empty(x.shape, dtype=codes_dtype, device=x.device)
    scales = torch.empty(C.q8_num_blocks(x.numel(), block), device=x.device)
    C.q8_encode(x, codes, scales, kind, block=block, scheme=scheme)
    out = torch.full_like(x, float("nan"))
    C.q8_decode(codes, scales, out, kind, block=block, scheme=scheme)
    return out, scales


def error_bound(x, s, kind, scheme):
    """Largest |decoded - x| the scheme allows, given each element's block absmax s."""
    if scheme in ("sqrt", "e4m3_sqrt"):
        a = (x / torch.where(s > 0, s, 1)).sqrt()  # the quantity coded, in [0, 1]
        # Half a code step: linear codes step 1/255; e4m3 steps 1/8 relative above its
        # smallest normal and 2**-9 / 448 below it.
        h = 0.5 / 255 if scheme == "sqrt" else torch.maximum(a / 16, torch.tensor(2**-10 / 448))
        bound = s * h * (2 * a + h)  # |a'^2 - a^2| = |a' - a| * (a' + a)
    elif scheme == "e4m3":
        bound = torch.maximum(x.abs() / 16, s * 2**-10 / 448)
    else:
        bound = s * (0.5 / 127 if kind == "signed" else 0.5 / 255)
    if kind == "nonneg":  # a positive value may come back as the smallest positive code
        q1 = {"linear": 1 / 255, "sqrt": (1 / 255)**2, "e4m3": 2**-9 / 448,
              "e4m3_sqrt": (2**-9 / 448)**2}[scheme]
        bound = torch.maximum(bound, torch.where(x > 0, s * q1, 0))
    # fp32 rounding of the scaling arithmetic, and subnormal results.
    return bound * (1 + 1e-5) + s * 2**-22 + 2**-147


def moment_like(kind, n, block, device="cpu", seed=0):
    """Blocks of very different magnitudes (1e-40 .. 3e38), exact zeros, a zero block."""
    g = torch.Generator().manual_seed(seed)
    nb = C.q8_num_blocks(n, block)
    exps = torch.empty(nb).uniform_(-40, 38, generator=g)
    exps[3 % nb] = -42  # a block of subnormals only
    x = torch.randn(n, generator=g, dtype=torch.float64) * (10 ** exps).repeat_interleave(block)[:n]
    x = x.clamp(-3e38, 3e38).float()
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    x[block:2 * block] = 0.0
    if nb > 3:
        x[2 * block + 5] = -3.4028234663852886e38  # max finite magnitude
    return (x.abs() if kind == "nonneg" else x).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [256, 1024])
@pytest.mark.parametrize("kind,scheme", SCHEMES)
def test_q8_error_bound(kind, scheme, block, device):
    n = 7 * block + 37  # partial last block
    x = moment_like(kind, n, block, device)
    out, scales = q8_roundtrip(x, kind, scheme, block)
    x, out, scales = x.cpu(), out.cpu(), scales.cpu()
    assert torch.isfinite(out).all()
    s = scales.repeat_interleave(block)[:n]
    assert torch.equal(s, torch.stack([b.abs().max() for b in x.split(block)]).repeat_interleave(block)[:n])
    bound = error_bound(x, s, kind, scheme)
    err = (out.double() - x.double()).abs()
    assert (err <= bound.double()).all(), f"worst excess {(err / bound).max()}"
    assert (out[x == 0] == 0).all() and (out[block:2 * block] == 0).all()
    assert (torch.sign(out) * torch.sign(x) >= 0).all()
    if kind == "nonneg":
        assert torch.equal(out > 0, x > 0)  # a tiny v never becomes 0
    # The block absmax itself comes back exactly (code = the extreme of its range).
    absmax_at = torch.stack([b.abs().argmax() + i * block for i, b in enumerate(x.split(block))])
    assert torch.equal(out[absmax_at].abs(), x[absmax_at].abs())


@pytest.mark.parametrize("kind,scheme", SCHEMES)
def test_q8_all_zero_and_small_inputs(kind, scheme):
    for n in (0, 1, 5, 1024):
        out, scales = q8_roundtrip(torch.zeros(n), kind, scheme, 256)
        assert torch.equal(out, torch.zeros(n)) and torch.equal(scales, torch.zeros(len(scales)))
    x = torch.tensor([1e-45, 0.0, 3e-42] if kind == "nonneg" else [-1e-45, 0.0, 3e-42])
    out, _ = q8_roundtrip(x, kind, scheme, 1024, codes_dtype=torch.int8)  # int8 buffer too
    assert torch.isfinite(out).all() and out[1] == 0 and out[2] == x[2]


def test_q8_defaults_and_sizes():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    for kind, scheme, data in (("signed", C.Q8_SIGNED_SCHEME, x),
                               ("nonneg", C.Q8_NONNEG_SCHEME, x.square())):
        codes = torch.empty(5000, dtype=torch.int8)
        scales = torch.empty(C.q8_num_blocks(5000))
        C.q8_encode(data, codes, scales, kind)  # defaults: scheme and Q8_BLOCK
        out = torch.empty_like(data)
        C.q8_decode(codes, scales, out, kind)
        ref, _ = q8_roundtrip(data, kind, scheme, C.Q8_BLOCK)
        assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="unknown q8"):
        C.q8_encode(x, codes, scales, "signed", scheme="sqrt")
    nb = C.q8_num_blocks(5000)
    assert nb == -(-5000 // C.Q8_BLOCK)
    assert C.encoded_bytes(5000, "fp32") == 20000 and C.encoded_bytes(5000, "bf16") == 10000
    assert C.encoded_bytes(5000, "q8") == 5000 + 4 * nb
    assert C.encoded_bytes(5000, "q8", block=256) == 5000 + 4 * 20
    assert C.encoded_bytes(5000, "residual") == 10000
    assert C.encoded_bytes(5000, "residual", n_exceptions=2) == 10024
    with pytest.raises(ValueError):
        C.encoded_bytes(1, "fp16")


@pytest.mark.parametrize("device", DEVICES)
def test_residual_bit_exact_for_all_2_32_patterns(device):
    """Every fp32 bit pattern round-trips exactly through the residual format against its
    own bf16 cast; the exceptions are exactly the non-finite values and the ties that
    round to the even value below. (About 3 minutes on 2 CPU cores.)"""
    chunk = 1 << (28 if device == "cuda" else 26)
    exceptions = 0
    for start in range(0, 1 << 32, chunk):
        bits = torch.arange(start, start + chunk, dtype=torch.int64, device=device)
        main = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
        del bits
        exc, out = roundtrip(main, main.to(torch.bfloat16))
        assert torch.equal(out.view(torch.int32), main.view(torch.int32)), hex(start)
        exceptions += exc[0].numel()
        del main, out, exc
    # 2 x (2^23 - 1) NaNs + 2 infinities; ties below: 2^16 even high halves x 1 low half,
    # less the NaN/inf ones already counted (high halves 0x7F80.. / 0xFF80.., 2 x 64 even).
    non_finite = 2 * (1 << 23)
    ties_down = (1 << 15) - 2 * (1 << 6)
    assert exceptions == non_finite + ties_down


@pytest.mark.parametrize("kind", ["signed", "nonneg"])
def test_q8_codes_defined_for_non_finite_input(kind):
    """Codes and scales of every input are defined (the CUDA kernels give the same bits):
    a block with a NaN gets the one NaN scale 0x7fc00000 whatever the input's payload, a
    non-finite block codes 0 (1 for a positive value of "nonneg"), a negative "nonneg"
    value codes 0; such blocks decode to non-finite values, the others as before."""
    x = torch.rand(5 * 256 + 9) + 0.5
    x[3] = -float("nan")
    x[256 + 4] = float("inf")
    x[2 * 256 + 5] = -2.0  # negative: "nonneg" codes it 0
    x[4 * 256 + 7] = float("nan")  # in the partial last block
    codes = torch.full(x.shape, 77, dtype=torch.uint8)
    scales = torch.empty(C.q8_num_blocks(x.numel()))
    C.q8_encode(x, codes, scales, kind)
    assert scales.view(torch.int32)[0] == 0x7FC00000 and scales.view(torch.int32)[4] == 0x7FC00000
    assert scales[1] == float("inf") and scales[2] == 2.0
    for b in (0, 1, 4):
        block = codes[b * 256:(b + 1) * 256]
        positive = torch.nan_to_num(x[b * 256:(b + 1) * 256]) > 0
        expect = (positive & (kind == "nonneg")).to(torch.uint8)
        assert torch.equal(block, expect)
    if kind == "nonneg":
        assert codes[2 * 256 + 5] == 0
    out = torch.empty_like(x)
    C.q8_decode(codes, scales, out, kind)
    for b in (0, 1, 4):
        assert not torch.isfinite(out[b * 256:(b + 1) * 256]).any()
    assert torch.isfinite(out[3 * 256:4 * 256]).all()


def test_residual_nan_rule():
    """A rebuilt master that is NaN is judged by its residual (a NaN cast to bf16 gives
    device-dependent bits): an exception (residual 0) is consistent, a param turned NaN
    under a nonzero residual is not."""
    main = torch.tensor([1.0, float("nan"), 2.5, 3.0])
    param = main.to(torch.bfloat16)
    residual = torch.empty(4, dtype=torch.int16)
    exc = C.residual_encode(main, param, residual)
    assert exc[0].tolist() == [1]
    out = torch.empty(4)
    assert not bool(C.residual_rebuild(param, residual, exc, out))
    assert torch.equal(out.view(torch.int32), main.view(torch.int32))
    main2 = torch.tensor([1.0 + 2**-12, 0.0, 2.5, 3.0])  # a nonzero residual at 0
    param2 = main2.to(torch.bfloat16)
    exc2 = C.residual_encode(main2, param2, residual)
    assert residual[0] != 0
    param2[0] = float("nan")
    assert bool(C.residual_rebuild(param2, residual, exc2, out))


def test_kernels_switch():
    """use_kernels() returns the previous setting; CPU tensors never use the kernels."""
    previous = C.use_kernels(False)
    try:
        assert C.use_kernels(True) is False
        assert not C.kernels_used(torch.zeros(1))
    finally:
        C.use_kernels(previous)


@pytest.mark.parametrize("device", DEVICES)
def test_listed_exceptions_are_copied_out_of_their_rooms(device):
    """_C.listed_exceptions (PendingExceptions.finish on CUDA): each master with 0 < count
    <= its room gets copies of the first `count` entries of its room, in order; a master
    with none, or more than its room, gets None; the rooms' buffers may then change."""
    from statepager import _C
    capacities = [4, 3, 5, 2, 0, 6]
    counts = [2, 0, 5, 3, 0, 1]  # 5: the room filled; 3 > 2: past the room
    room = sum(capacities)
    idx = torch.arange(100, 100 + room, dtype=torch.int64, device=device)
    bits = torch.arange(-room, 0, dtype=torch.int32, device=device)
    listed = _C.listed_exceptions(idx, bits, capacities, counts)
    assert [x is None for x in listed] == [False, True, False, True, True, False]
    expect = {0: (0, 2), 2: (7, 5), 5: (14, 1)}  # master -> (its room's offset, count)
    idx_before, bits_before = idx.clone(), bits.clone()
    idx.fill_(-1)
    bits.fill_(7)
    for i, (at, n) in expect.items():
        got_idx, got_bits = listed[i]
        assert (got_idx.dtype, got_bits.dtype) == (torch.int64, torch.int32)
        assert torch.equal(got_idx, idx_before[at:at + n])
        assert torch.equal(got_bits, bits_before[at:at + n])
    assert _C.listed_exceptions(idx, bits, [3, 4], [0, 0]) == [None, None]
    with pytest.raises(_C.UsageError, match="differ in length"):
        _C.listed_exceptions(idx, bits, [3, 4], [0])
    with pytest.raises(_C.UsageError, match="capacities' sum"):
        _C.listed_exceptions(idx, bits, [room + 1], [1])
    with pytest.raises(_C.UsageError, match="capacities' sum"):
        _C.listed_exceptions(idx, bits[:-1], [2], [1])
    with pytest.raises(_C.UsageError, match="capacities' sum"):
        _C.listed_exceptions(idx, bits, [-1, 2], [0, 0])

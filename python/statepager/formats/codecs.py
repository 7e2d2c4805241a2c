"""Narrow on-disk formats for optimizer state: the step is bound by the bytes it moves.

* residual: fp32 master weights stored losslessly as 16 bits per element, given the
  bf16 model parameters (which are RNE(master) after every step), plus a short list of
  exceptions kept at full width. Keep param_checksum(param) from encode time to detect
  a parameter changed before decode (the residual alone cannot).
* q8: Adam moments as 8-bit codes in blocks of Q8_BLOCK elements with one fp32 scale
  (the block's absmax) per block. Lossy; schemes and block size were chosen by
  scripts/measure_codecs.py.

The torch ops here are the reference: they run on CPU and CUDA tensors alike and give
the same bits on both. On CUDA tensors the default formats run as the extension's
kernels instead (kernels/codecs.cu: one pass over the bytes, a launch or two per tensor),
which give the reference's bits exactly (tests/gpu/test_codec_kernels.py);
use_kernels(False) turns them off. Outputs go into caller-preallocated tensors so they
can be paged memory. All tensors must be contiguous; shapes are ignored (elements are
taken in flat order).
"""
from __future__ import annotations

import functools
import os

import torch

from statepager import _C
from statepager.util import streams

# Chosen by scripts/measure_codecs.py (tiny LM, AdamW, 300 steps with moments re-coded
# every step; held-out loss vs exact moments): linear m + sqrt v at block 256 cost +0.002
# (bf16 moments: +0.001); at 1024 +0.005; e4m3 m +0.0025; e4m3 v +0.003, e4m3_sqrt +0.004,
# linear v +0.006. (e4m3 m has 3x lower update-direction error, but trained no better.)
Q8_SIGNED_SCHEME = "linear"
Q8_NONNEG_SCHEME = "sqrt"
Q8_BLOCK = 256  # 1.0156 bytes/element with scales; every scheme trained better than at 1024

Q8_SCHEMES = {"signed": ("linear", "e4m3"), "nonneg": ("linear", "sqrt", "e4m3", "e4m3_sqrt")}
_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_CHECKSUM_ROW = 4096  # param_checksum's row length: keeps x * (column + 1) < 2**29
_NAN = float("nan")  # as fp32: 0x7fc00000, the one NaN a non-finite q8 block's scale is

# ------------------------------------------------------------------------- the kernels

_kernels_on = _C.KERNELS_BUILT and os.environ.get("STATEPAGER_CODEC_KERNELS", "1") != "0"


def use_kernels(enabled: bool) -> bool:
    """Whether CUDA tensors use the extension's kernels (the default when it was built
    with them; STATEPAGER_CODEC_KERNELS=0 turns them off at import) or the torch
    reference. Returns the previous setting. Both give the same bits."""
    global _kernels_on
    previous, _kernels_on = _kernels_on, bool(enabled) and _C.KERNELS_BUILT
    return previous


def kernels_on() -> bool:
    """Whether codecs on CUDA tensors run as the kernels now (use_kernels)."""
    return _kernels_on


def kernels_used(t: torch.Tensor) -> bool:
    """True when codecs on tensors of t's device run as kernels."""
    return _kernels_on and t.is_cuda


# ----------------------------------------------------------------------- residual format

def _bf16_bits_hi(param: torch.Tensor) -> torch.Tensor:
    """The bf16 bits moved to the top of an int32 (i.e. the fp32 whose top half they are).

    Multiplying the sign-extended int16 by 2**16 gives the right 32-bit pattern for the
    unsigned 16-bit value too, and never overflows (-2**15 * 2**16 == -2**31)."""
    return param.view(torch.int16).reshape(-1).to(torch.int32).mul_(65536)


def residual_encode(main: torch.Tensor, param: torch.Tensor,
                    residual_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store fp32 `main` as int16 residuals against its bf16 `param` (== RNE(main)).

    residual_out[i] = main_bits[i] - (param_bits[i] << 16), as a signed 32-bit difference.
    With param = RNE(main), that lies in [-32768, 32768]; +32768 is the one value int16
    cannot hold: it is a tie (low half 0x8000) that RNE rounded toward zero because the
    truncated bf16 was even. (-32768 is the tie rounded away from zero; it fits.)

    Returns the exceptions (flat int64 indices, int32 full main bits): elements whose
    residual does not fit, non-finite mains (NaN payloads survive bit-exactly; the bf16
    cast of a NaN is device-dependent), and elements whose param is not RNE(main) --
    these stay exact but would fail residual_decode's consistency check otherwise. For
    a param that really is RNE(main), only the ties and non-finite values are exceptions.
    Exception slots in residual_out are written as 0. The exceptions are sorted by index
    (a step's encodes, PendingExceptions, leave them in the kernel's order).
    """
    pending = PendingExceptions(ResidualMasters([main], [param], [residual_out]))
    return in_index_order(finish_exceptions([pending])[0])


def _residual_encode_reference(main, param, residual_out):
    r, exc = _residuals(main, param)
    residual_out.view(-1).copy_(r.masked_fill_(exc, 0))  # in range now: exact narrowing
    return _exception_list(main, exc)


def _residuals(main, param) -> tuple[torch.Tensor, torch.Tensor]:
    """The int32 residuals of residual_encode and its exception mask (the reference)."""
    bits = main.view(torch.int32).reshape(-1)
    # Sign-matched pairs (every legitimate one) cannot overflow here; a mismatched pair
    # may wrap, which still lands outside int16 or is caught by the RNE comparison below.
    r = _bf16_bits_hi(param)
    torch.sub(bits, r, out=r)
    exc = (r > 32767) | (r < -32768) | ~torch.isfinite(main.reshape(-1))
    exc |= main.reshape(-1).to(torch.bfloat16).view(torch.int16) != param.view(torch.int16).reshape(-1)
    return r, exc


def _exception_list(main, exc) -> tuple[torch.Tensor, torch.Tensor]:
    idx = exc.nonzero().reshape(-1)
    return idx, main.view(torch.int32).reshape(-1)[idx]


class ResidualMasters:
    """Residual masters rebuilt and encoded together (a bucket's, kept with its forms by
    StateLayout.fill): fp32 mains, bf16 model params, int16 residuals, checked once."""

    def __init__(self, mains: list, params: list, residuals: list):
        for main, param, out in zip(mains, params, residuals, strict=True):
            assert (main.dtype, param.dtype, out.dtype) == (torch.float32, torch.bfloat16,
                                                            torch.int16)
            assert main.numel() == param.numel() == out.numel()
            assert main.is_contiguous() and param.is_contiguous() and out.is_contiguous()
        self.mains, self.params, self.residuals = list(mains), list(params), list(residuals)
        self.device = mains[0].device if mains else torch.device("cpu")
        # The encode kernel's room for each master's exceptions; RNE ties: ~1 in 2**17.
        self.capacities = [1024 + m.numel() // 2048 for m in mains]

    def rebuild(self, exceptions: list, fingerprints: list) -> torch.Tensor:
        """residual_rebuild of every master into its main, each param also checked against
        its fingerprint (its param_checksum when the residual was encoded; None: not
        checked): a 0-dim device bool, True when some param changed. One kernel call."""
        if not kernels_used(self.mains[0]):
            flags = [_rebuild_reference(*x) for x in
                     zip(self.params, self.residuals, exceptions, self.mains, strict=True)]
            flags += [param_checksum(p) != f for p, f in zip(self.params, fingerprints)
                      if f is not None]
            return torch.stack(flags).any()
        device = self.device
        return _C.kernels.residual_rebuild_many(
            self.params, self.residuals, self.mains, [_on(i, device) for i, _ in exceptions],
            [_on(b, device) for _, b in exceptions], fingerprints, streams.current(device))


class PendingExceptions:
    """residual_encode of many masters (a ResidualMasters), their exceptions not yet
    listed on the host: the encodes are queued at construction and `count` (an int64
    tensor on the mains' device, one element per master) holds how many each has.
    finish_exceptions() reads the counts of many at once, with one device sync, or the
    caller reads `count` when it likes (a copy to host memory it waits for) and calls
    finish(). The mains and params must stay as they are until then. Given
    fingerprints=True, `fingerprints` are the params' checksums (param_checksum, 0-dim
    tensors) taken with the encode; else None.

    With the kernels (CUDA tensors, kernels on) the encodes are one call and the counts
    are still being counted on the device; the reference (CPU, or kernels off) lists the
    exceptions at once, and finish() returns them: both take the same way through the
    step (statepager.core.binding)."""

    def __init__(self, masters: ResidualMasters, fingerprints: bool = False):
        mains, params = masters.mains, masters.params
        self._mains, self._params = mains, params  # for a count past the room
        device = masters.device
        if not mains or not kernels_used(mains[0]):
            self._listed = [_residual_encode_reference(m, p, r)
                            for m, p, r in zip(mains, params, masters.residuals)]
            self.fingerprints = [param_checksum(p) for p in params] if fingerprints else None
            self.count = torch.tensor([len(i) for i, _ in self._listed], dtype=torch.int64,
                                      device=device)
            return
        self._listed = None
        self.capacities = masters.capacities
        self._idx, self._bits, self.count, sums = _C.kernels.residual_encode_many(
            mains, params, masters.residuals, self.capacities, fingerprints,
            streams.current(device))
        self.fingerprints = list(sums.unbind()) if fingerprints else None

    def finish(self, counts: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each master's exceptions, given the counts' values: the reference's, in the
        order the kernel listed them (in_index_order() sorts them as the reference's;
        a rebuild takes them in any order). More than the kernel had room for (a param
        far from RNE(main)): the reference lists them again from main and param.
        residual_out is not written again: the kernel wrote it whole, with the
        reference's bits, and it may be paging out."""
        if self._listed is not None:
            return self._listed
        # The listed ones are copied out of the kernel's room together, two copies for
        # all (_C.listed_exceptions): per master, a sort here took ~1 ms of the host's time
        # per bucket of the 1.34 B GPT (on the H200), which the step waited for.
        listed = _C.listed_exceptions(self._idx, self._bits, self.capacities, counts)
        out = []
        for main, param, room, count, exceptions in zip(self._mains, self._params,
                                                        self.capacities, counts, listed):
            if count > room:
                out.append(_exception_list(main, _residuals(main, param)[1]))
            elif exceptions is None:  # the usual case: no buffer kept alive
                out.append(_no_exceptions(main.device))
            else:
                out.append(exceptions)
        return out


def in_index_order(exceptions: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A master's exceptions (indices, bits) sorted by index, as the reference lists them."""
    idx, bits = exceptions
    if idx.numel() < 2:
        return exceptions
    idx, order = idx.sort()
    return idx, bits[order]


@functools.cache
def _no_exceptions(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The empty exception list of `device`, shared (exception lists are never written)."""
    return (torch.empty(0, dtype=torch.int64, device=device),
            torch.empty(0, dtype=torch.int32, device=device))


def params_changed(params: list, fingerprints: list) -> torch.Tensor:
    """A 0-dim device bool, True when some param's param_checksum differs from its
    fingerprint (a 0-dim int64 of param's device). With the kernels, one call for all."""
    if not params:
        return torch.zeros((), dtype=torch.bool)
    if not kernels_used(params[0]):
        return torch.stack([param_checksum(p) != f for p, f in zip(params, fingerprints,
                                                                    strict=True)]).any()
    return _C.kernels.params_changed_many(params, fingerprints, streams.current(params[0].device))


def finish_exceptions(pending: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The exceptions of each master of each PendingExceptions, in order; one device sync
    for all."""
    counts = torch.cat([p.count for p in pending]).tolist() if pending else []
    out, at = [], 0
    for p in pending:
        k = len(p.count)
        out += p.finish(counts[at:at + k])
        at += k
    return out


def param_checksum(param: torch.Tensor) -> torch.Tensor:
    """A position-sensitive checksum of the bf16 bits (0-dim int64 tensor, param's device).

    residual_decode needs it to notice a changed param: any (param, residual) pair
    decodes to a master whose RNE is that param, so the residual itself cannot tell.
    Any one changed element always changes the checksum; other changes collide with
    probability ~2**-31. Exact integer arithmetic: the same value on CPU and CUDA.
    """
    if kernels_used(param):
        param = param.contiguous()
        rows = torch.empty(-(-param.numel() // _CHECKSUM_ROW), dtype=torch.int64,
                           device=param.device)
        out = torch.empty((), dtype=torch.int64, device=param.device)
        _C.kernels.param_checksum(param.view(-1), rows, out, streams.current(param.device))
        return out
    p = 2**31 - 1  # prime modulus
    x = param.view(torch.int16).reshape(-1).to(torch.int32).bitwise_and_(0xFFFF).add_(1)
    n, total = x.numel(), torch.zeros((), dtype=torch.int64, device=x.device)
    w = torch.arange(1, _CHECKSUM_ROW + 1, dtype=torch.int32, device=x.device)
    for start, rows in ((0, x[:n // _CHECKSUM_ROW * _CHECKSUM_ROW].view(-1, _CHECKSUM_ROW)),
                        (n // _CHECKSUM_ROW, x[n // _CHECKSUM_ROW * _CHECKSUM_ROW:].view(1, -1))):
        # x * (column + 1) < 2**29; a row sums to < 2**41; then each row gets its own
        # pseudo-random weight in [1, p), so equal changes in two rows do not cancel.
        sums = (rows * w[:rows.shape[1]]).sum(dim=1, dtype=torch.int64) % p
        rw = torch.arange(start, start + len(rows), device=x.device) * 0x9E3779B1 % (p - 1) + 1
        total += (sums * rw % p).sum()
    return total % p


def residual_rebuild(param: torch.Tensor, residual: torch.Tensor,
                     exceptions: tuple[torch.Tensor, torch.Tensor],
                     main_out: torch.Tensor) -> torch.Tensor:
    """residual_decode without its checks and without a device sync: rebuilds the master
    into `main_out` and returns a 0-dim device bool, True when some element outside the
    exceptions is inconsistent with `param` (see _inconsistent): the param changed."""
    return ResidualMasters([main_out], [param], [residual]).rebuild([exceptions], [None])


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device` (a checkpoint's exceptions load on the CPU); as it is when there."""
    return t if t.device == device else t.to(device)


def _rebuild_reference(param, residual, exceptions, main_out) -> torch.Tensor:
    idx, exc_bits = exceptions
    out = main_out.view(torch.int32).view(-1)
    torch.add(_bf16_bits_hi(param), residual.view(-1), out=out)
    bad = _inconsistent(main_out.view(-1), param.view(-1), residual.view(-1))
    out[idx] = exc_bits.to(device=out.device)
    bad[idx] = False
    return bad.any()


def _inconsistent(main: torch.Tensor, param: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Per element of a rebuilt master: True where it does not round to its param (bits,
    not values: NaN != NaN, -0.0 != +0.0), or is NaN with a nonzero residual (a master
    stored by residual is finite; the bf16 cast of a NaN is device-dependent, so NaNs are
    judged by the residual instead: a NaN exception's residual is 0)."""
    differs = main.to(torch.bfloat16).view(torch.int16) != param.view(torch.int16)
    return torch.where(main.isnan(), residual != 0, differs)


def residual_decode(param: torch.Tensor, residual: torch.Tensor,
                    exceptions: tuple[torch.Tensor, torch.Tensor], main_out: torch.Tensor,
                    *, checksum: torch.Tensor | None = None) -> None:
    """Rebuild the exact fp32 master into `main_out` from param, residual and exceptions.

    Raises ValueError if the param changed since residual_encode, instead of returning
    a wrong master. Pass checksum=param_checksum(param) taken at encode time: without
    it only the RNE check runs (RNE(rebuilt) == param outside the exceptions), which
    catches a param turned NaN (and some turned inf) but misses finite changes -- a changed
    param with the old residual decodes to a master that rounds to the changed param.
    """
    n_bad = 0
    if bool(residual_rebuild(param, residual, exceptions, main_out)):
        bad = _inconsistent(main_out.view(-1), param.view(-1), residual.view(-1))
        bad[exceptions[0].to(bad.device)] = False
        n_bad = int(bad.sum())
    if n_bad:
        what = f"{n_bad} of {param.numel()} elements differ from bf16(master)"
    elif checksum is not None and int(param_checksum(param)) != int(checksum):
        what = f"the checksum of its {param.numel()} elements differs from encode time"
    else:
        return
    raise ValueError(f"residual_decode: model parameter no longer matches its master weights "
                     f"(changed outside the optimizer?): {what}; the master cannot be rebuilt")


# ----------------------------------------------------------------------------- q8 format

def q8_num_blocks(numel: int, block: int = Q8_BLOCK) -> int:
    """How many fp32 scales q8_encode writes for `numel` elements."""
    return -(-numel // block)


def _blocks(t: torch.Tensor, block: int) -> list[torch.Tensor]:
    """Flat `t` as 2-D views: the full blocks, then the partial last block (if any)."""
    flat, full = t.view(-1), t.numel() // block * block
    views = [flat[:full].view(-1, block)] if full else []
    return views + ([flat[full:].view(1, -1)] if full < t.numel() else [])


def _scheme(kind: str, scheme: str | None) -> str:
    scheme = scheme or {"signed": Q8_SIGNED_SCHEME, "nonneg": Q8_NONNEG_SCHEME}.get(kind)
    if kind not in Q8_SCHEMES or scheme not in Q8_SCHEMES[kind]:
        raise ValueError(f"unknown q8 kind/scheme {kind!r}/{scheme!r}; known: {Q8_SCHEMES}")
    return scheme


def _q8_layout(x, codes, scales, kind: str, block: int, scheme: str | None):
    """Checks the tensors of q8_encode/q8_decode; returns the scheme and the codes' dtype."""
    scheme = _scheme(kind, scheme)
    assert x.dtype == torch.float32 and scales.dtype == torch.float32
    assert codes.dtype in (torch.int8, torch.uint8) and codes.numel() == x.numel()
    assert scales.numel() == q8_num_blocks(x.numel(), block)
    assert x.is_contiguous() and codes.is_contiguous() and scales.is_contiguous()
    return scheme, torch.int8 if scheme == "linear" and kind == "signed" else torch.uint8


def q8_encode(x: torch.Tensor, codes_out: torch.Tensor, scales_out: torch.Tensor,
              kind: str = "signed", *, block: int = Q8_BLOCK, scheme: str | None = None) -> None:
    """Quantize fp32 `x` to one byte per element plus one fp32 scale per block.

    kind="signed" (exp_avg, any sign) or "nonneg" (exp_avg_sq, x >= 0). The scale is the
    block's absmax s, and u = x/s in [-1, 1] is coded as
      linear:    round(u * 127) as int8 (signed) / round(u * 255) as uint8 (nonneg)
      sqrt:      round(sqrt(u) * 255) as uint8: relative precision where v is small
      e4m3:      float8_e4m3fn(u * 448), bits kept as a byte
      e4m3_sqrt: float8_e4m3fn(sqrt(u) * 448)
    scheme=None uses the module default for the kind. codes_out is int8 or uint8 with
    x.numel() elements; scales_out is fp32 with q8_num_blocks(x.numel(), block) elements.
    For "nonneg" a positive value never gets code 0 (it gets the smallest positive code:
    overestimating a tiny v shrinks its update; 0 would blow it up). Zeros stay exact: a
    zero block gets scale 0 and decodes to exact zeros; finite input never produces
    NaN/inf. Non-finite input makes its block decode non-finite: its scale is NaN (always
    0x7fc00000) or inf. Codes are defined for all input (linear, sqrt): 0 throughout a
    block whose scale is not finite and for a negative "nonneg" value under sqrt (then
    the "nonneg" rule above: 1 for a positive value).
    """
    scheme, codes_dtype = _q8_layout(x, codes_out, scales_out, kind, block, scheme)
    if kernels_used(x) and _kernel_q8(kind, block, scheme):
        _C.kernels.q8_encode(x.view(-1), codes_out.view(torch.uint8).view(-1), scales_out.view(-1),
                             kind == "nonneg", streams.current(x.device))
        return
    scales, row = scales_out.view(-1), 0
    for xb, cb in zip(_blocks(x, block), _blocks(codes_out.view(codes_dtype), block)):
        s = xb.abs().amax(dim=1, keepdim=True)
        s = torch.where(s.isnan(), _NAN, s)  # one NaN whatever the input's
        scales[row:row + len(s)] = s.view(-1)
        row += len(s)
        # Divide by s rather than multiply by 1/s: 1/s overflows for subnormal s.
        u = xb / torch.where(s > 0, s, 1.0)
        if scheme in ("sqrt", "e4m3_sqrt"):
            u.sqrt_()
        if scheme.startswith("e4m3"):
            cb.copy_(u.mul_(_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8))
        else:
            u.mul_(127.0 if kind == "signed" else 255.0)
            # Out-of-range float -> integer casts differ between devices: defined codes.
            cb.copy_(u.masked_fill_(u.isnan() | ~torch.isfinite(s), 0.0).round_())
        if kind == "nonneg":
            # Never decode a positive v as 0: with m != 0 the update would be m/eps.
            cb.masked_fill_((cb == 0) & (xb > 0), 1)


def q8_decode(codes: torch.Tensor, scales: torch.Tensor, x_out: torch.Tensor,
              kind: str = "signed", *, block: int = Q8_BLOCK, scheme: str | None = None) -> None:
    """Inverse of q8_encode (same kind, block and scheme) into fp32 `x_out`."""
    scheme, codes_dtype = _q8_layout(x_out, codes, scales, kind, block, scheme)
    if kernels_used(x_out) and _kernel_q8(kind, block, scheme):
        _C.kernels.q8_decode(codes.view(torch.uint8).view(-1), scales.view(-1), x_out.view(-1),
                             kind == "nonneg", streams.current(x_out.device))
        return
    scales, row = scales.view(-1), 0
    for xb, cb in zip(_blocks(x_out, block), _blocks(codes.view(codes_dtype), block)):
        s = scales[row:row + len(xb)].view(-1, 1)
        row += len(xb)
        # Divide by a tensor: CUDA divides by a Python number as a multiplication by its
        # reciprocal, which is not the same bits as CPU's division.
        if scheme.startswith("e4m3"):
            u = cb.view(torch.float8_e4m3fn).to(torch.float32).div_(_constant(_E4M3_MAX, xb))
        else:
            u = cb.to(torch.float32).div_(_constant(127.0 if kind == "signed" else 255.0, xb))
        if scheme in ("sqrt", "e4m3_sqrt"):
            u.square_()
        # |u| <= 1, so u * s never exceeds the block's absmax: no overflow.
        torch.mul(u, s, out=xb)


def _kernel_q8(kind: str, block: int, scheme: str) -> bool:
    """True when the kernels implement this q8 variant (the default schemes, Q8_BLOCK)."""
    return block == Q8_BLOCK and scheme == _scheme(kind, None)


def _constant(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((), value, dtype=torch.float32, device=like.device)


# --------------------------------------------------------------------------------- sizes

def encoded_bytes(numel: int, fmt: str, *, block: int = Q8_BLOCK, n_exceptions: int = 0) -> int:
    """On-disk bytes for `numel` elements in `fmt`: "fp32", "bf16", "q8" (codes plus fp32
    block scales) or "residual" (int16 residuals plus n_exceptions * (int64 index + int32
    bits); the exception count is data-dependent and usually 0 or tiny)."""
    if fmt == "fp32":
        return 4 * numel
    if fmt == "bf16":
        return 2 * numel
    if fmt == "q8":
        return numel + 4 * q8_num_blocks(numel, block)
    if fmt == "residual":
        return 2 * numel + 12 * n_exceptions
    raise ValueError(f"unknown format {fmt!r}; known: fp32, bf16, q8, residual")

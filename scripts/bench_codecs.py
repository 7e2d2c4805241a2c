"""Codec kernels against the memory-speed floor, on one CUDA device.

For each stored format's decode and encode (statepager.formats.codecs on CUDA tensors), prints
the time per GB of stored state, the bytes it reads and writes, and the time a plain
device-to-device copy of the same bytes takes in the same run (the floor: a codec that
reads and writes each byte once cannot beat it), then the same with the kernels off
(the torch reference), the store checksums' kernel, and the codec time of one whole step
of a model of --params parameters in each format (decode before the optimizer's step,
encode after it).

    python3 scripts/bench_codecs.py [--elements 268435456] [--params 1.34e9]
"""
import argparse
import statistics

import torch

import statepager
from statepager.formats import codecs as C


def timed(fn, reps: int) -> float:
    """Median seconds of fn() on the current stream (CUDA events), after a warm-up."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_seconds(nbytes: int, reps: int) -> float:
    """A device-to-device copy that reads nbytes/2 and writes nbytes/2."""
    half = max(nbytes // 2, 1)
    src = torch.empty(half, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), reps)


def operations(n: int):
    """(format, operation, fn, bytes read, bytes written, stored bytes) on n elements."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, device="cuda", generator=g)
    v = x.square()
    out = torch.empty_like(x)
    codes = torch.empty(n, dtype=torch.uint8, device="cuda")
    scales = torch.empty(C.q8_num_blocks(n), device="cuda")
    bf16 = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    param = x.to(torch.bfloat16)
    residual = torch.empty(n, dtype=torch.int16, device="cuda")
    q8 = n + 4 * C.q8_num_blocks(n)
    exceptions = C.residual_encode(x, param, residual)
    return [
        ("q8 m", "encode", lambda: C.q8_encode(x, codes, scales, "signed"), 4 * n, q8, q8),
        ("q8 m", "decode", lambda: C.q8_decode(codes, scales, out, "signed"), q8, 4 * n, q8),
        ("q8 v", "encode", lambda: C.q8_encode(v, codes, scales, "nonneg"), 4 * n, q8, q8),
        ("q8 v", "decode", lambda: C.q8_decode(codes, scales, out, "nonneg"), q8, 4 * n, q8),
        ("bf16", "encode", lambda: bf16.copy_(x), 4 * n, 2 * n, 2 * n),
        ("bf16", "decode", lambda: out.copy_(bf16), 2 * n, 4 * n, 2 * n),
        ("residual", "encode", lambda: C.residual_encode(x, param, residual), 6 * n, 2 * n, 2 * n),
        ("residual", "decode", lambda: C.residual_rebuild(param, residual, exceptions, out),
         4 * n, 4 * n, 2 * n),
        ("residual", "checksum", lambda: C.param_checksum(param), 2 * n, 0, 2 * n),
    ]


def adamw_operations(n: int):
    """(format, fused fn, unfused fn, bytes the fused step reads, writes) on n elements:
    the unfused step decodes the moments to fp32, runs torch's foreach AdamW ops, encodes."""
    g = torch.Generator(device="cuda").manual_seed(1)
    p, grad = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    m, v = torch.randn(n, device="cuda", generator=g), torch.rand(n, device="cuda", generator=g)
    mw, vw = torch.empty_like(m), torch.empty_like(v)
    stream = torch.cuda.current_stream().cuda_stream
    out = []
    for fmt, per in (("fp32", 4), ("bf16", 2), ("q8", 1 + 4 / C.Q8_BLOCK)):
        if fmt == "fp32":
            mt, vt = [m], [v]
            decode = encode = lambda: None
            mw_, vw_ = m, v
        elif fmt == "bf16":
            mt, vt = [m.bfloat16()], [v.bfloat16()]
            decode = lambda mt=mt, vt=vt: (mw.copy_(mt[0]), vw.copy_(vt[0]))
            encode = lambda mt=mt, vt=vt: (mt[0].copy_(mw), vt[0].copy_(vw))
            mw_, vw_ = mw, vw
        else:
            mt = [torch.empty(n, dtype=torch.uint8, device="cuda"),
                  torch.empty(C.q8_num_blocks(n), device="cuda")]
            vt = [torch.empty_like(mt[0]), torch.empty_like(mt[1])]
            C.q8_encode(m, *mt, "signed")
            C.q8_encode(v, *vt, "nonneg")
            decode = lambda mt=mt, vt=vt: (C.q8_decode(*mt, mw, "signed"),
                                           C.q8_decode(*vt, vw, "nonneg"))
            encode = lambda mt=mt, vt=vt: (C.q8_encode(mw, *mt, "signed"),
                                           C.q8_encode(vw, *vt, "nonneg"))
            mw_, vw_ = mw, vw

        def fused(mt=mt, vt=vt, fmt=fmt):
            statepager._C.kernels.adamw_step_many([p], [grad], [mt], [vt], [fmt],
                                                  [[1e-3, 0.9, 0.999, 1e-8, 0.01]], [2.0], stream)

        def unfused(decode=decode, encode=encode, mw_=mw_, vw_=vw_):
            decode()
            torch._foreach_mul_([p], 1 - 1e-5)
            torch._foreach_lerp_([mw_], [grad], 0.1)
            torch._foreach_mul_([vw_], 0.999)
            torch._foreach_addcmul_([vw_], [grad], [grad], 1e-3)
            d = torch._foreach_sqrt([vw_])
            torch._foreach_div_(d, [0.5])
            torch._foreach_add_(d, 1e-8)
            torch._foreach_addcdiv_([p], [mw_], d, [-1e-3])
            encode()

        out.append((fmt, fused, unfused, int((8 + 2 * per) * n), int((4 + 2 * per) * n)))
    return out


def crc_line(n: int, reps: int) -> None:
    """The store checksums' kernel (kernels/store_crc.cu) on 4 n bytes in ranges of 1 MiB,
    a mapped RAM store's requests, against a copy that moves as many bytes."""
    nbytes = 4 * n
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    ranges = [(o, min(1 << 20, nbytes - o)) for o in range(0, nbytes, 1 << 20)]
    stream = torch.cuda.current_stream().cuda_stream
    t = timed(lambda: statepager._C.kernels.crc32c(x, ranges, stream), reps)
    floor = copy_seconds(nbytes, reps)
    print(f"\nstore checksums (crc32c) of {nbytes / 1e9:.3f} GB in {len(ranges)} ranges: "
          f"{t * 1e3:.3f} ms, {nbytes / t / 1e9:.1f} GB/s; a copy moving as many bytes "
          f"{floor * 1e3:.3f} ms ({t / floor:.2f} x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 28)
    ap.add_argument("--params", type=float, default=1.34e9)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    n = a.elements
    print(f"device: {torch.cuda.get_device_name()}; {n} elements per tensor; kernels built: "
          f"{statepager._C.KERNELS_BUILT}")
    per_element = {}
    for kernels in (True, False):
        C.use_kernels(kernels)
        label = "kernels" if kernels else "torch reference"
        print(f"\n{label}:")
        print(f"{'format':10} {'op':9} {'read GB':>8} {'write GB':>8} {'ms':>8} {'ms/GB state':>11} "
              f"{'copy ms':>8} {'x copy':>7}")
        for fmt, op, fn, rd, wr, stored in operations(n):
            t = timed(fn, a.reps)
            floor = copy_seconds(rd + wr, a.reps)
            per_element[(kernels, fmt, op)] = t / n
            print(f"{fmt:10} {op:9} {rd / 1e9:8.3f} {wr / 1e9:8.3f} {t * 1e3:8.3f} "
                  f"{t * 1e3 / (stored / 1e9):11.3f} {floor * 1e3:8.3f} {t / floor:7.2f}")
        torch.cuda.empty_cache()
    C.use_kernels(True)
    crc_line(n, a.reps)
    print(f"\nAdamW step of {n} elements (param fp32 in place, fp32 grad, moments as stored):")
    print(f"{'moments':8} {'read GB':>8} {'write GB':>8} {'fused ms':>9} {'copy ms':>8} {'x copy':>7} "
          f"{'unfused ms':>10}  (step of {a.params:.3g} params: fused / unfused ms)")
    for fmt, fused, unfused, rd, wr in adamw_operations(n):
        t, t_unfused = timed(fused, a.reps), timed(unfused, a.reps)
        floor = copy_seconds(rd + wr, a.reps)
        print(f"{fmt:8} {rd / 1e9:8.3f} {wr / 1e9:8.3f} {t * 1e3:9.3f} {floor * 1e3:8.3f} "
              f"{t / floor:7.2f} {t_unfused * 1e3:10.3f}  ({t / n * a.params * 1e3:.1f} / "
              f"{t_unfused / n * a.params * 1e3:.1f})")
        torch.cuda.empty_cache()
    # One step: every moment decoded and encoded once (unless the step is fused: then the
    # moments' codec work is inside the AdamW kernel, timed above); a residual master
    # rebuilt, encoded and checksummed twice (changed-param check on decode, fingerprint
    # on encode).
    print(f"\ncodec time of one step of {a.params:.3g} parameters (AdamW: m, v, master), ms:")
    print(f"  {'moments':8} {'mains':9} {'kernels':>8} {'reference':>10} {'kernels, fused step':>20}")
    t = per_element
    for moments in ("fp32", "bf16", "q8"):
        for mains in ("fp32", "residual"):
            total = {}
            for kernels in (True, False):
                main = 0.0
                if mains == "residual":
                    main = (t[(kernels, "residual", "encode")] + t[(kernels, "residual", "decode")]
                            + 2 * t[(kernels, "residual", "checksum")])
                mom = 0.0
                for kind in ("m", "v"):
                    fmt = {"q8": f"q8 {kind}", "bf16": "bf16"}.get(moments)
                    if fmt:
                        mom += t[(kernels, fmt, "encode")] + t[(kernels, fmt, "decode")]
                total[kernels] = (main + mom, main)
            print(f"  {moments:8} {mains:9} {total[True][0] * a.params * 1e3:8.1f} "
                  f"{total[False][0] * a.params * 1e3:10.1f} {total[True][1] * a.params * 1e3:20.1f}")

if __name__ == "__main__":
    main()

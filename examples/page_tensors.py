"""Page tensors through a statepager store and print what happened.

Runs on the GPU when one is present (CUDA virtual memory), else on the host backend.
    python examples/page_tensors.py --dir /tmp/statepager-main [--size 1G]
"""
import argparse
import time

import torch

import statepager
from statepager.tools import cli_args


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, type=cli_args.directory)
    parser.add_argument("--size", type=cli_args.size, default=cli_args.size("1G"),
                        help="bytes of tensors to page")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    size = args.size

    with statepager.Pager(args.dir, device=args.device) as pager:
        # Eight buckets of three tensors each, like the fp32 main and two Adam moments.
        n = size // (8 * 3 * 4)
        buckets = [[pager.empty(n + b, dtype=torch.float32) for _ in range(3)] for b in range(8)]
        print(f"device {pager.device}; {sum(len(b) for b in buckets)} deferred tensors of "
              f"{n * 4 / 2**20:.1f} MiB; mapped {pager.stats()['mapped_bytes']} bytes")
        for i, bucket in enumerate(buckets):
            pager.page_in(bucket)  # zero extents: mapped and zero-filled, nothing read
            for j, t in enumerate(bucket):
                t.copy_(torch.arange(t.numel(), dtype=torch.float32, device=t.device) * (i + j))
        print(f"filled: mapped {pager.stats()['mapped_bytes'] / 2**20:.0f} MiB, "
              f"read {pager.stats()['bytes_read']} bytes")
        ptrs = [t.data_ptr() for b in buckets for t in b]

        t0 = time.perf_counter()
        for h in [pager.page_out_async(b) for b in buckets]:
            h.wait()
        out_s = time.perf_counter() - t0
        print(f"paged out {size / 2**30:.2f} GiB in {out_s:.2f} s ({size / out_s / 1e9:.2f} GB/s); "
              f"mapped now {pager.stats()['mapped_bytes']} bytes")

        t0 = time.perf_counter()
        for h in [pager.page_in_async(b) for b in buckets]:
            h.wait()
        in_s = time.perf_counter() - t0
        print(f"paged in  {size / 2**30:.2f} GiB in {in_s:.2f} s ({size / in_s / 1e9:.2f} GB/s)")

        same = ptrs == [t.data_ptr() for b in buckets for t in b]
        exact = all(
            torch.equal(t, torch.arange(t.numel(), dtype=torch.float32, device=t.device) * (i + j))
            for i, b in enumerate(buckets) for j, t in enumerate(b))
        print(f"addresses unchanged: {same}; bytes exact: {exact}")
        print("stats:", pager.stats())
        if not (same and exact):
            raise SystemExit(1)


if __name__ == "__main__":
    main()

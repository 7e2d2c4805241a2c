"""Whether a Python thread of its own would take a step's bucket loop off the training
thread: two Python threads, each launching 20000 small CUDA ops (an in-place multiply of
4096 floats, a little Python between two, as a model's forward and the bucket loop do)
on streams of their own; their host times alone, then together. Where the GIL serializes
them, together they take about as long as one after the other.

    python3 scripts/thread_overlap.py [N]    # N Python additions between the loop's ops (8)

What it decided, and its figures: Note [Steps under the forward] in docs/design.md,
docs/benchmarks.md.
"""
import sys
import threading
import time

import torch

OPS = 20000  # per thread


def launch(t: torch.Tensor, n: int, python: int = 8) -> None:
    """n small kernels, `python` Python additions between two."""
    s = 0
    for _ in range(n):
        t.mul_(1.0000001)
        for j in range(python):
            s += j


def measure(python: int) -> None:
    """The forward (main thread, 8 additions between ops) and the loop (a thread, `python`
    additions), alone and together, three times."""
    x = torch.randn(1 << 12, device="cuda")
    y = torch.randn(1 << 12, device="cuda")
    side = torch.cuda.Stream()

    def loop(out: list) -> None:
        with torch.cuda.stream(side):
            t0 = time.perf_counter()
            launch(y, OPS, python)
            out.append(time.perf_counter() - t0)

    def forward() -> float:
        t0 = time.perf_counter()
        launch(x, OPS)
        return time.perf_counter() - t0

    for _ in range(3):
        torch.cuda.synchronize()
        alone = forward()
        torch.cuda.synchronize()
        out = []
        worker = threading.Thread(target=loop, args=(out,))
        worker.start()
        worker.join()
        torch.cuda.synchronize()
        loop_alone, out = out[0], []
        worker = threading.Thread(target=loop, args=(out,))
        worker.start()
        t0 = time.perf_counter()
        together = forward()
        worker.join()
        both = time.perf_counter() - t0
        torch.cuda.synchronize()
        print(f"Python between the loop's ops {python:2}: alone forward {alone * 1e3:6.1f} ms, "
              f"loop {loop_alone * 1e3:6.1f} ms (sum {(alone + loop_alone) * 1e3:6.1f}); "
              f"together forward {together * 1e3:6.1f} ms, loop {out[0] * 1e3:6.1f} ms, both "
              f"done in {both * 1e3:6.1f} ms ({both / (alone + loop_alone):.2f} x the sum)",
              flush=True)


if __name__ == "__main__":
    measure(int(sys.argv[1]) if len(sys.argv) > 1 else 8)

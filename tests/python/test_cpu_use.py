"""statepager.tools.bench.cpu_use: the CPU time of this process's threads over a span, in cores
busy, by kind; the pager's I/O thread is told by its name."""
import os
import threading
import time

import pytest

from statepager import Pager
from statepager.tools.bench import cpu_use

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def test_threads_are_told_by_their_names():
    assert cpu_use._kind("iou-wrk-4242") == "io_uring workers"
    assert cpu_use._kind("statepager-io") == "pager I/O thread"
    assert cpu_use._kind("python3") == "other threads"


def test_the_pagers_io_thread_carries_its_name(tmp_path):
    with Pager(str(tmp_path / "store"), device="cpu"):
        kinds = [kind for kind, _ in cpu_use._cpu_seconds().values()]
    assert kinds.count("pager I/O thread") == 1


def test_a_thread_busy_over_the_span_is_counted():
    """A spinning thread, alive over the whole span, is counted among the other threads
    with the CPU time it reports itself (to a few clock ticks), whatever else runs."""
    stop, seen = threading.Event(), [0.0]

    def spin():
        while not stop.is_set():
            seen[0] = time.thread_time()

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.05)
        with cpu_use.CpuUse() as use:
            start = seen[0]
            time.sleep(0.5)  # the spinning thread runs; this one waits
            spun = seen[0] - start
    finally:
        stop.set()
        t.join()
    cores = use.cores()
    assert set(cores) == set(cpu_use.KINDS) and spun > 0.05
    assert cores["other threads"] * use.seconds >= spun - 0.03
    assert sum(cores.values()) <= os.cpu_count()
    assert cores["io_uring workers"] == 0 and cores["pager I/O thread"] == 0

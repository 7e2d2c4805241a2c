"""statepager.bench.cpu_use: the CPU time of this process's threads over a span, in cores
busy, by kind; the pager's I/O thread is told by its name."""
import os
import resource
import threading
import time

import pytest

from statepager import Pager
from statepager.bench import cpu_use

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def test_threads_are_told_by_their_names():
    assert cpu_use._kind("iou-wrk-4242") == "io_uring workers"
    assert cpu_use._kind("statepager-io") == "pager I/O thread"
    assert cpu_use._kind("python3") == "other threads"


def test_the_pagers_io_thread_carries_its_name(tmp_path):
    with Pager(str(tmp_path / "store"), device="cpu"):
        kinds = [kind for kind, _ in cpu_use._cpu_seconds().values()]
    assert kinds.count("pager I/O thread") == 1


def test_the_kinds_add_up_to_the_process_cpu_time():
    """A spinning thread, alive over the whole span, is counted: the kinds' cores times the
    span are the process's CPU time over it (to a few clock ticks), whatever the load."""
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        before = resource.getrusage(resource.RUSAGE_SELF)
        with cpu_use.CpuUse() as use:
            time.sleep(0.5)  # the spinning thread runs; this one waits
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        stop.set()
        t.join()
    process = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    cores = use.cores()
    assert set(cores) == set(cpu_use.KINDS) and process > 0.05
    assert sum(cores.values()) * use.seconds == pytest.approx(process, abs=0.05)
    assert cores["io_uring workers"] == 0 and cores["pager I/O thread"] == 0

"""CPU time this process's threads spend over a span of wall time, in cores busy, by
kind: io_uring's workers (iou-wrk-*: the kernel's copies of buffered store I/O, which on
a RAM filesystem bound the store's speed), the pager's I/O thread (statepager-io), and
the rest. Read from /proc/self/task (Linux); elsewhere nothing is counted."""
from __future__ import annotations

import os
import time

KINDS = ("io_uring workers", "pager I/O thread", "other threads")


def _kind(name: str) -> str:
    if name.startswith("iou-wrk"):
        return KINDS[0]
    return KINDS[1] if name == "statepager-io" else KINDS[2]


def _cpu_seconds() -> dict:
    """Per thread id: (kind, user + system CPU seconds so far)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (_kind(name), (int(fields[11]) + int(fields[12])) / tick)
    return out


class CpuUse:
    """with CpuUse() as use: ... ; use.cores() -> {kind: CPU seconds / wall seconds}.
    Threads that ended within the span are not counted (their time is gone with them)."""

    def __enter__(self) -> "CpuUse":
        self._before, self._t0 = _cpu_seconds(), time.perf_counter()
        self._wall, self._after = None, None
        return self

    def __exit__(self, *exc) -> None:
        self._after, self._wall = _cpu_seconds(), time.perf_counter() - self._t0

    @property
    def seconds(self) -> float:
        """The span's wall time."""
        return self._wall

    def cores(self) -> dict:
        busy = dict.fromkeys(KINDS, 0.0)
        for tid, (kind, seconds) in self._after.items():
            busy[kind] += seconds - self._before.get(tid, (kind, 0.0))[1]
        return {k: v / self._wall for k, v in busy.items()} if self._wall else busy

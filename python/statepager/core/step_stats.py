"""StepStats: what one streamed step did (StreamedOptimizer.last), with the times its
page-ins and page-outs moved bytes."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    """What one step did. Times are host wall-clock seconds."""

    step: int = 0
    buckets: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0            # from its first page-in to the loop's end; when begun,
                                    # from begin_step(), so with what ran until step()
    # The host's time in the step's parts (a Megatron step's opt.step holds these and
    # Megatron's own work: grad copies, norm, clip, the params' sync). setup + loop is
    # not `seconds`: it leaves out the gap between begin_step() and step(), and holds
    # the snapshot of a step not begun, taken before its first page-in.
    setup_seconds: float = 0.0      # before the bucket loop: the epoch opened, the first
                                    # page-ins issued (at begin_step(), when begun), the
                                    # snapshot taken
    loop_seconds: float = 0.0       # the bucket loop, its last page-outs waited for
    commit_seconds: float = 0.0     # the epoch's commit (atomic steps)
    wait_in_seconds: float = 0.0    # stalled waiting for a bucket's page-in
    wait_device_seconds: float = 0.0  # stalled reading the residual exception counts of
                                      # the bucket stepped LAG before (late_reads): the
                                      # device's work on it
    compute_seconds: float = 0.0    # the optimizer's own step on the buckets, queued
    wait_out_seconds: float = 0.0   # stalled waiting for page-outs (window or final flush)
    # A step under the forward on a thread of its own (statepager.core.step_thread): how
    # long after the step was deferred (step() returned) the thread started, and its own
    # CPU time (time.thread_time()) over its run. Zero without the thread.
    thread_start_seconds: float = 0.0
    thread_cpu_seconds: float = 0.0
    read_busy_seconds: float = 0.0  # some page-in was moving bytes
    write_busy_seconds: float = 0.0 # some page-out was moving bytes
    both_busy_seconds: float = 0.0  # reads and writes were moving at the same time
    peak_mapped_bytes: int = 0
    # Per bucket, in order: (bytes, read, step, write), each a (start, end) pair in
    # time.monotonic() seconds: its page-in's I/O, the optimizer's step on it (host time;
    # the device may still run it after), its page-out's I/O; (0, 0) when nothing moved.
    # statepager.tools.trace draws it.
    timeline: list = field(default_factory=list)

    @property
    def overlap(self) -> float:
        """Share of the shorter I/O direction that ran under the other one."""
        shorter = min(self.read_busy_seconds, self.write_busy_seconds)
        return self.both_busy_seconds / shorter if shorter > 0 else 0.0

    @property
    def gbps(self) -> float:
        return (self.bytes_read + self.bytes_written) / self.seconds / 1e9 if self.seconds else 0.0

    def set_io_times(self, reads: list, writes: list) -> None:
        """The busy and overlap times from the page-ins' and page-outs' (start, end)
        intervals ((0, 0): nothing moved)."""
        reads, writes = interval_union(reads), interval_union(writes)
        self.read_busy_seconds = sum(e - s for s, e in reads)
        self.write_busy_seconds = sum(e - s for s, e in writes)
        self.both_busy_seconds = interval_overlap(reads, writes)

    def summary(self) -> str:
        """One line for the log (Pager.attach(log_steps=True))."""
        return (f"step {self.step}: {self.buckets} buckets, read {self.bytes_read / 1e6:.1f} "
                f"MB, wrote {self.bytes_written / 1e6:.1f} MB in {self.seconds:.3f} s "
                f"({self.gbps:.2f} GB/s; reads busy {self.read_busy_seconds:.3f} s, writes busy "
                f"{self.write_busy_seconds:.3f} s, both {self.both_busy_seconds:.3f} s = "
                f"{100 * self.overlap:.0f}% overlap; stalled on reads "
                f"{self.wait_in_seconds:.3f} s, writes {self.wait_out_seconds:.3f} s, the device "
                f"{self.wait_device_seconds:.3f} s; compute "
                f"{self.compute_seconds:.3f} s; set-up {self.setup_seconds:.3f} s, loop "
                f"{self.loop_seconds:.3f} s, commit {self.commit_seconds:.3f} s; peak mapped "
                f"{self.peak_mapped_bytes / (1 << 20):.1f} MiB"
                + (f"; its thread started {self.thread_start_seconds:.3f} s after step(), "
                   f"CPU {self.thread_cpu_seconds:.3f} s" if self.thread_cpu_seconds else "")
                + ")")


def interval_union(intervals) -> list:
    """Disjoint, sorted union of (start, end) intervals; empty ones (0, 0) dropped."""
    out = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def interval_overlap(a: list, b: list) -> float:
    """Total length covered by both disjoint sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total

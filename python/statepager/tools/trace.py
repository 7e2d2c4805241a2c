"""Timelines of a streamed step, from StepStats.timeline (binding.last after a step):
each bucket's page-in, the optimizer's step on it and its page-out.

chrome_trace() / write_chrome_trace(): the Chrome trace-event JSON that chrome://tracing
and Perfetto (ui.perfetto.dev) open: one process, three threads (page-in, step, page-out),
one complete ("X") event per bucket and lane, times in microseconds from the step's first
event. plot_timeline(): the same as a PNG, drawn with matplotlib (an optional dependency:
pip install 'statepager[plot]'). `statepager bench step --trace F --plot F` writes both;
`python -m statepager.tools.trace TRACE.json OUT.png` draws a trace written elsewhere (e.g. on
a machine without matplotlib). The pager also marks each bucket's I/O and step for
NVIDIA's profilers (NVTX, allocator/trace_range.h: Nsight Systems shows them under the
"statepager" domain).

Step times are host times: on a GPU the kernels a bucket's step queued may run after it.
"""
from __future__ import annotations

import json
import sys

from statepager import _C

# (lane, label, colour, colour of every other bucket): the NVTX colours of TraceKind.
LANES = (("read", "page-in", "#2E86DE", "#85B9EE"),
         ("step", "step", "#27AE60", "#7DCEA0"),
         ("write", "page-out", "#E67E22", "#F0B27A"))


def _events(timeline: list) -> tuple[float, list]:
    """(origin, [(lane index, bucket, bytes, start, end)]) of the intervals that moved."""
    out = [(lane, k, nbytes, start, end) for k, (nbytes, *spans) in enumerate(timeline)
           for lane, (start, end) in enumerate(spans) if end > start]
    if not out:
        raise _C.UsageError("no streamed step to trace: pass the StepStats of a step that "
                            "ran (binding.last after optimizer.step())")
    return min(e[3] for e in out), out


def chrome_trace(stats, name: str = "statepager step") -> dict:
    """The Chrome trace-event JSON (a dict) of one step's buckets (stats: StepStats)."""
    origin, events = _events(stats.timeline)
    trace = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": name}}]
    for lane, (_, label, _, _) in enumerate(LANES):
        trace += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": lane + 1,
                   "args": {"name": label}},
                  {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": lane + 1,
                   "args": {"sort_index": lane}}]
    for lane, k, nbytes, start, end in events:
        trace.append({"name": f"{LANES[lane][1]} bucket {k}", "cat": LANES[lane][0],
                      "ph": "X", "pid": 1, "tid": lane + 1, "ts": (start - origin) * 1e6,
                      "dur": (end - start) * 1e6, "args": {"bucket": k, "bytes": nbytes}})
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"title": name, "step": stats.step, "buckets": len(stats.timeline),
                          "seconds": stats.seconds}}


def write_chrome_trace(path: str, stats, name: str = "statepager step") -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(stats, name), f)


def timeline_of(trace: dict) -> list:
    """StepStats.timeline back from a chrome_trace() (times in seconds from its start)."""
    lanes = [lane for lane, *_ in LANES]
    buckets = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in lanes:
            k = e["args"]["bucket"]
            row = buckets.setdefault(k, [e["args"]["bytes"], (0, 0), (0, 0), (0, 0)])
            row[1 + lanes.index(e["cat"])] = (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
    return [tuple(buckets[k]) for k in sorted(buckets)]


def plot_timeline(path: str, timeline: list, title: str) -> None:
    """A PNG (or any format matplotlib writes, by `path`'s suffix) of a step's lanes."""
    origin, events = _events(timeline)
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise _C.UsageError("plotting needs matplotlib: pip install 'statepager[plot]' "
                            "(or pip install matplotlib)") from e
    fig = Figure(figsize=(12, 3.4), layout="constrained")
    ax = fig.subplots()
    span = max(e[4] for e in events) - origin
    for lane, k, _, start, end in events:
        ax.broken_barh([(start - origin, end - start)], (lane - 0.4, 0.8),
                       facecolors=LANES[lane][2 + k % 2], edgecolors="white", linewidth=0.5)
        if end - start > span / 60:  # room for the bucket's number
            ax.text((start + end) / 2 - origin, lane, str(k), ha="center", va="center",
                    fontsize=7)
    ax.set_yticks(range(len(LANES)), [label for _, label, _, _ in LANES])
    ax.set_ylim(len(LANES) - 0.5, -0.5)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("seconds from the step's first event")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title)
    fig.savefig(path, dpi=150)


def write_outputs(stats, trace_path: str | None, plot_path: str | None, title: str) -> list:
    """The Chrome trace and the plot of a step, where a path is given; returns the paths."""
    if trace_path:
        write_chrome_trace(trace_path, stats, title)
    if plot_path:
        plot_timeline(plot_path, stats.timeline, f"{title}: {stats.seconds:.3f} s")
    return [p for p in (trace_path, plot_path) if p]


def main(argv: list) -> int:
    """python -m statepager.tools.trace TRACE.json OUT.png: the plot of a written trace."""
    if len(argv) != 2:
        print("usage: python -m statepager.tools.trace TRACE.json OUT.png", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        trace = json.load(f)
    info = trace.get("otherData", {})
    plot_timeline(argv[1], timeline_of(trace),
                  f"{info.get('title', argv[0])}: {info.get('seconds', 0):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

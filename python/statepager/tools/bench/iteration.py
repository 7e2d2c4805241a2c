"""One whole training iteration as torch.profiler sees it (CUPTI): where the host spends
it (forward, backward, optimizer.step: record_function ranges the training step marks)
and what the device does meanwhile (the model's kernels, statepager's, the copies each
way), as lanes of intervals. `bench megatron --iteration-trace F.json --iteration-plot
F.png` runs one more iteration under it after the timed ones (a profiled iteration is
slower on the host: it is not timed) and writes the lanes and their picture; the summary
says how much of the copies ran under the model's kernels: what steps under the forward
(Note [Steps under the forward] in docs/design.md) are for.

`python -m statepager.tools.bench.iteration LANES.json OUT.png` draws lanes written
elsewhere (e.g. on a machine without matplotlib).
"""
from __future__ import annotations

import json
import sys
from typing import Callable

from statepager import _C
from statepager.core.step_stats import interval_overlap, interval_union
from statepager.tools.bench.device_time import kernel_name, trace_events

# The training step's record_function ranges (examples/megatron_gpt.py train_step).
PHASES = ("forward", "backward", "optimizer.step")
# Copies shorter than this (ms) are not the state's (summary): its pages are 2 MiB or more,
# 0.04 ms at 50 GB/s.
SMALL_COPY_MS = 0.02
# (key, label, colour): the host's phases, then the device's lanes.
LANES = (("forward", "host: forward", "#5D6D7E"),
         ("backward", "host: backward", "#85929E"),
         ("optimizer.step", "host: optimizer.step", "#AEB6BF"),
         ("compute", "model kernels", "#8E44AD"),
         ("statepager", "statepager kernels", "#27AE60"),
         ("h2d", "copies host to device", "#2E86DE"),
         ("d2h", "copies device to host", "#E67E22"))


def profile(step: Callable[[], object]) -> dict:
    """Runs step() under torch.profiler and returns lanes_of() its events."""
    return lanes_of(trace_events(step))


def _lane(e: dict) -> str | None:
    """The lane of one Chrome trace event, or None."""
    cat = e.get("cat")
    if cat == "user_annotation" and e["name"] in PHASES:
        return e["name"]
    if cat == "kernel":
        return "statepager" if kernel_name(e["name"]) else "compute"
    if cat == "gpu_memcpy":
        for way, lane in (("HtoD", "h2d"), ("DtoH", "d2h")):
            if way in e["name"]:
                return lane
    return None


def lanes_of(events: list) -> dict:
    """{"lanes": {key: [[start, end], ...]}, "span_ms": ...}: each lane's events merged,
    in milliseconds from the first one (host phases and device work alike: the profiler
    puts both on one clock)."""
    spans = {key: [] for key, _, _ in LANES}
    for e in events:
        lane = _lane(e) if e.get("ph") == "X" else None
        if lane is not None:
            spans[lane].append((e["ts"], e["ts"] + e["dur"]))
    starts = [s for lane in spans.values() for s, _ in lane]
    if not starts:
        raise _C.UsageError("the profiler saw none of the iteration's phases: mark them with "
                            f"torch.profiler.record_function({', '.join(PHASES)})")
    origin = min(starts)
    lanes = {key: [[(s - origin) / 1e3, (e - origin) / 1e3] for s, e in interval_union(v)]
             for key, v in spans.items()}
    return {"lanes": lanes, "span_ms": max(e for v in lanes.values() for _, e in v)}


def summary(timeline: dict) -> dict:
    """Milliseconds: each lane busy, the copies (either way) busy, how much of that ran
    while the model's kernels ran, each way's copies while the host ran each phase
    (steps under the forward: how far page-outs lag into the backward), and the
    forward's longest stretch with no copy of the state either way, from when (what a
    step under it left the links idle for: buckets that step without a copy, a window
    full). A copy of the state is one of SMALL_COPY_MS or more: the residual exception
    counts' few bytes, copied every bucket, are not."""
    lanes = {k: [tuple(i) for i in v] for k, v in timeline["lanes"].items()}
    busy = {k: sum(e - s for s, e in v) for k, v in lanes.items()}
    copies = interval_union(lanes["h2d"] + lanes["d2h"])
    state = [(s, e) for s, e in copies if e - s >= SMALL_COPY_MS]
    idle = max(_uncovered(lanes["forward"], state), key=lambda i: i[1] - i[0],
               default=(0.0, 0.0))
    return {"span_ms": timeline["span_ms"], "busy_ms": busy,
            "copies_ms": sum(e - s for s, e in copies),
            "copies_under_compute_ms": interval_overlap(copies, lanes["compute"]),
            "copies_in_phase_ms": {phase: {way: interval_overlap(lanes[way], lanes[phase])
                                           for way in ("h2d", "d2h")} for phase in PHASES},
            "forward_without_copies_ms": [idle[0], idle[1] - idle[0]]}


def _uncovered(spans: list, covered: list) -> list:
    """The parts of disjoint sorted `spans` that disjoint sorted `covered` leaves out."""
    out = []
    for s, e in spans:
        at = s
        for cs, ce in covered:
            if ce <= at or cs >= e:
                continue
            if cs > at:
                out.append((at, cs))
            at = max(at, ce)
        if at < e:
            out.append((at, e))
    return out


def write(path: str, timeline: dict, title: str) -> None:
    with open(path, "w") as f:
        json.dump(dict(timeline, title=title), f)


def plot(path: str, timeline: dict, title: str) -> None:
    """A PNG (or any format matplotlib writes, by `path`'s suffix) of the lanes."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise _C.UsageError("plotting needs matplotlib: pip install 'statepager[plot]' "
                            "(or pip install matplotlib), or draw the lanes elsewhere: "
                            "python -m statepager.tools.bench.iteration LANES.json OUT.png") \
            from e
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    ax = fig.subplots()
    for row, (key, _, colour) in enumerate(LANES):
        ax.broken_barh([(s, e - s) for s, e in timeline["lanes"][key]], (row - 0.4, 0.8),
                       facecolors=colour)
    ax.set_yticks(range(len(LANES)), [label for _, label, _ in LANES])
    ax.set_ylim(len(LANES) - 0.5, -0.5)
    ax.set_xlim(0, timeline["span_ms"] * 1.01)
    ax.set_xlabel("milliseconds from the iteration's first event")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title)
    fig.savefig(path, dpi=150)


def write_outputs(timeline: dict, json_path: str | None, plot_path: str | None,
                  title: str) -> list:
    """The lanes (JSON) and their plot, where a path is given; returns the paths."""
    if json_path:
        write(json_path, timeline, title)
    if plot_path:
        plot(plot_path, timeline, f"{title}: {timeline['span_ms']:.1f} ms")
    return [p for p in (json_path, plot_path) if p]


def main(argv: list) -> int:
    """python -m statepager.tools.bench.iteration LANES.json OUT.png"""
    if len(argv) != 2:
        print("usage: python -m statepager.tools.bench.iteration LANES.json OUT.png",
              file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        timeline = json.load(f)
    plot(argv[1], timeline, f"{timeline.get('title', argv[0])}: {timeline['span_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

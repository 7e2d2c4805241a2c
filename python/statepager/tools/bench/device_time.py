"""The device's time in one step, as torch.profiler sees it (CUPTI): statepager's kernels
(kernels/: the codecs and the fused AdamW step) by name, all kernels, and how long the
copy engines were busy each way and both at once. `bench megatron --device-time` runs
one more step under it, after the timed ones: a profiled step is slower on the host, and
the steps after it in the same process looked slower too (q8 on the H200: 0.262 s with a
warm-up step profiled, 0.215-0.235 s in runs without, on other machines), so none of
them is timed. What the profiler adds is host work; the device's durations are its own."""
from __future__ import annotations

import collections
import json
import os
import tempfile
from typing import Callable

import torch

from statepager.core.step_stats import interval_overlap, interval_union

_OURS = "statepager::kernels::"


def profile(step: Callable[[], object]) -> dict:
    """Runs step() under torch.profiler and summarizes the device's side of it
    (summarize())."""
    return summarize(trace_events(step))


def trace_events(step: Callable[[], object]) -> list:
    """Runs step() under torch.profiler (CPU activity, and CUDA's where there is a
    device, waited for) and returns the Chrome trace's events."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = torch.cuda.is_available()
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def summarize(events: list) -> dict:
    """From a Chrome trace's events (torch.profiler's export), in seconds: statepager's
    kernels, in all and by kernel (largest first); all kernels (summed: kernels on
    several streams may overlap); the copies' busy time host to device, device to host,
    and both at once; and how many kernels ran, statepager's and all (each a launch the
    host paid for)."""
    ours, kernels, launches = collections.Counter(), 0.0, collections.Counter()
    for e in events:
        if e.get("cat") == "kernel":
            kernels += e["dur"]
            name = kernel_name(e["name"])
            launches["statepager" if name else "all"] += 1
            if name:
                ours[name] += e["dur"]
    h2d, d2h = (interval_union((e["ts"], e["ts"] + e["dur"]) for e in events
                               if e.get("cat") == "gpu_memcpy" and way in e["name"])
                for way in ("HtoD", "DtoH"))
    return {"statepager_kernels_s": sum(ours.values()) / 1e6, "kernels_s": kernels / 1e6,
            "by_kernel": {k: v / 1e6 for k, v in ours.most_common()},
            "statepager_launches": launches["statepager"],
            "launches": launches["statepager"] + launches["all"],
            "h2d_busy_s": sum(e - s for s, e in h2d) / 1e6,
            "d2h_busy_s": sum(e - s for s, e in d2h) / 1e6,
            "both_busy_s": interval_overlap(h2d, d2h) / 1e6}


def kernel_name(name: str) -> str | None:
    """A statepager kernel's own name from its demangled signature ('void statepager::
    kernels::(anonymous namespace)::adamw_kernel<(...)2, true>(float*, ...)' ->
    'adamw_kernel'); None for other kernels."""
    if _OURS not in name:
        return None
    name = name.split(_OURS, 1)[1].replace("(anonymous namespace)::", "")
    for stop in "<(":
        name = name.split(stop, 1)[0]
    return name.rsplit("::", 1)[-1]


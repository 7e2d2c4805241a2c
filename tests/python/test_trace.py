"""Step timelines (statepager.tools.trace): the Chrome trace of a step holds one page-in, one
step and one page-out per bucket, in the order the pipeline runs them; the plot is drawn;
bench step writes both."""
import json
import os

import pytest
import torch

import statepager
from statepager import Pager
from statepager.tools import cli, trace

KiB = 1 << 10


def stepped(store_dir, steps=2):
    """binding.last of a torch AdamW over 6 params in buckets of ~1 param, after `steps`."""
    torch.manual_seed(0)
    pager = Pager(store_dir, device="cpu", page_size=64 * KiB)
    params = [torch.nn.Parameter(torch.randn(20000)) for _ in range(6)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    binding = pager.attach(opt, bucket_size=200 * KiB, depth=3)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return pager, binding


def test_chrome_trace_has_one_read_step_write_per_bucket_in_pipeline_order(tmp_path):
    pager, binding = stepped(str(tmp_path / "store"))
    try:
        stats = binding.last
        n = len(binding.buckets)
        assert n >= 3 and len(stats.timeline) == n
        path = str(tmp_path / "step.json")
        trace.write_chrome_trace(path, stats)
        with open(path) as f:
            doc = json.load(f)
    finally:
        pager.close()
    assert doc["displayTimeUnit"] == "ms" and doc["otherData"]["buckets"] == n
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert names == {1: "page-in", 2: "step", 3: "page-out"}
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for e in events:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert isinstance(e["ts"], float) and e["ts"] >= 0 and e["dur"] > 0
    by = {(e["cat"], e["args"]["bucket"]): e for e in events}
    assert len(by) == len(events) == 3 * n  # the second step reads and writes every bucket
    assert min(e["ts"] for e in events) == 0
    for k in range(n):
        read, step, write = by["read", k], by["step", k], by["write", k]
        assert read["name"] == f"page-in bucket {k}" and read["tid"] == 1
        assert read["args"]["bytes"] == binding.buckets[k].nbytes
        # A bucket steps once its page-in is complete; its page-out starts after its step.
        assert read["ts"] + read["dur"] <= step["ts"]
        assert step["ts"] + step["dur"] <= write["ts"]
        if k:
            assert by["step", k - 1]["ts"] + by["step", k - 1]["dur"] <= step["ts"]


def test_no_step_no_trace(tmp_path):
    with Pager(str(tmp_path / "store"), device="cpu") as pager:
        binding = pager.attach(torch.optim.AdamW([torch.nn.Parameter(torch.ones(8))]))
        with pytest.raises(statepager.UsageError, match="no streamed step to trace"):
            trace.chrome_trace(binding.last)
        with pytest.raises(statepager.UsageError, match="no streamed step to trace"):
            trace.plot_timeline("x.png", binding.last.timeline, "none")


def test_plot_is_drawn(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (statepager[plot])")
    pager, binding = stepped(str(tmp_path / "store"))
    try:
        path = str(tmp_path / "step.png")
        trace.plot_timeline(path, binding.last.timeline, "a step")
        trace.write_chrome_trace(str(tmp_path / "step.json"), binding.last)
        timeline = binding.last.timeline
    finally:
        pager.close()
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10000
    # A trace written elsewhere is drawn from its JSON: the same intervals, shifted.
    with open(tmp_path / "step.json") as f:
        back = trace.timeline_of(json.load(f))
    origin = min(s for _, *spans in timeline for s, _ in spans)
    assert [b[0] for b in back] == [t[0] for t in timeline]
    for b, t in zip(back, timeline):
        for (s1, e1), (s0, e0) in zip(b[1:], t[1:]):
            assert s1 == pytest.approx(s0 - origin, abs=1e-6)
            assert e1 == pytest.approx(e0 - origin, abs=1e-6)
    assert trace.main([str(tmp_path / "step.json"), str(tmp_path / "again.png")]) == 0
    assert os.path.getsize(tmp_path / "again.png") > 10000


def test_trace_ranges_take_names_and_kinds():
    r = statepager._C.TraceRange()
    r.start("step bucket 0", "step")
    r.start("step bucket 1", "step")  # ends the open one first
    r.end()
    r.end()
    with pytest.raises(statepager.UsageError, match="kind must be"):
        r.start("x", "compute")
    assert isinstance(statepager._C.NVTX, bool)


def test_bench_step_writes_trace_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (statepager[plot])")
    out_json, out_png = str(tmp_path / "t.json"), str(tmp_path / "t.png")
    assert cli.main(["bench", "step", "--dir", str(tmp_path / "work"), "--device", "cpu",
                     "--params", "1e7", "--bucket-size", "4M", "--page-size", "1M", "--steps", "2",
                     "--no-baseline", "--no-in-place", "--trace", out_json,
                     "--plot", out_png]) == 0
    assert "timeline: " + out_json in capsys.readouterr().out
    with open(out_json) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    buckets = {e["args"]["bucket"] for e in events}
    assert len(buckets) >= 2 and len(events) == 3 * len(buckets)
    with open(out_png, "rb") as f:
        assert f.read(4) == b"\x89PNG"


def test_bench_step_refuses_an_unwritable_trace_path(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "step", "--trace", "/nonexistent-dir/t.json"])
    assert e.value.code == 2
    assert "is not a directory this user can write" in capsys.readouterr().err

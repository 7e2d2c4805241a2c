"""One training iteration's lanes (statepager.tools.bench.iteration): the host's phases
and the device's kernels and copies, read from torch.profiler's Chrome trace, and how much
of the copies ran under the model's kernels."""
import json

import pytest
import torch

from statepager import _C
from statepager.tools.bench import iteration

OURS = "void statepager::kernels::(anonymous namespace)::adamw_kernel<2, true>(float*)"


def event(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


# As torch.profiler writes them (the H200's trace of bench megatron's GPT), in microseconds.
EVENTS = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
    event("user_annotation", "forward", 1000, 50_000),
    event("user_annotation", "backward", 51_000, 70_000),
    event("user_annotation", "optimizer.step", 121_000, 40_000),
    event("cpu_op", "aten::mm", 1_200, 30),
    event("kernel", "sm90_xmma_gemm_bf16bf16", 2_000, 10_000, stream=7),
    event("kernel", "sm90_xmma_gemm_bf16bf16", 11_000, 4_000, stream=7),  # overlaps the first
    event("kernel", OURS, 20_000, 1_000, stream=24),
    event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 5_000, 10_000, stream=14, bytes=1),
    event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 14_000, 6_000, stream=13, bytes=1),
    event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 30_000, 500, stream=7, bytes=1),
]


def test_lanes_are_merged_per_kind_from_the_first_event():
    t = iteration.lanes_of(EVENTS)
    lanes = t["lanes"]
    assert lanes["forward"] == [[0.0, 50.0]]
    assert lanes["optimizer.step"] == [[120.0, 160.0]]
    assert lanes["compute"] == [[1.0, 14.0]]  # the two gemms, one interval
    assert lanes["statepager"] == [[19.0, 20.0]]
    assert lanes["h2d"] == [[4.0, 14.0]] and lanes["d2h"] == [[13.0, 19.0]]
    assert t["span_ms"] == 160.0
    s = iteration.summary(t)
    assert s["copies_ms"] == 15.0  # 4..19
    assert s["copies_under_compute_ms"] == 10.0  # 4..14
    assert s["busy_ms"]["backward"] == 70.0
    assert s["copies_in_phase_ms"] == {"forward": {"h2d": 10.0, "d2h": 6.0},
                                       "backward": {"h2d": 0.0, "d2h": 0.0},
                                       "optimizer.step": {"h2d": 0.0, "d2h": 0.0}}
    # The forward (0..50) has copies 4..19 alone: its longest stretch without one is 19..50.
    assert s["forward_without_copies_ms"] == [19.0, 31.0]
    late = iteration.lanes_of(EVENTS + [  # a page-out after the forward's end
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 50_000, 5_000, bytes=1)])
    assert iteration.summary(late)["copies_in_phase_ms"]["backward"]["d2h"] == 4.0


def test_the_forward_without_copies_is_its_longest_uncovered_stretch():
    """Copies that start before the forward, touch each other or end after it: what is
    left of the forward, and its longest piece (none: a forward copies cover whole)."""
    spans = [(0.0, 50.0)]
    assert iteration._uncovered(spans, [(-5.0, 3.0), (10.0, 12.0), (12.0, 20.0),
                                         (45.0, 60.0)]) == [(3.0, 10.0), (20.0, 45.0)]
    assert iteration._uncovered(spans, [(-1.0, 51.0)]) == []
    assert iteration._uncovered([(0.0, 5.0), (8.0, 9.0)], []) == [(0.0, 5.0), (8.0, 9.0)]
    counts = iteration.lanes_of(EVENTS + [  # an exception count's few bytes at 30 ms
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 31_000, 5, bytes=16)])
    assert iteration.summary(counts)["forward_without_copies_ms"] == [19.0, 31.0]
    covered = {"lanes": {k: [] for k, _, _ in iteration.LANES}, "span_ms": 50.0}
    covered["lanes"].update(forward=[[0.0, 50.0]], h2d=[[0.0, 50.0]])
    assert iteration.summary(covered)["forward_without_copies_ms"] == [0.0, 0.0]


def test_an_iteration_without_its_phases_is_refused_by_name():
    with pytest.raises(_C.UsageError, match=r"record_function\(forward, backward, "
                                            r"optimizer.step\)"):
        iteration.lanes_of([e for e in EVENTS if e.get("cat") == "cpu_op"])


def test_a_profiled_step_on_the_cpu_has_the_host_phases(tmp_path):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        with torch.profiler.record_function("forward"):
            loss = model(torch.randn(8, 64)).square().mean()
        with torch.profiler.record_function("backward"):
            loss.backward()
        with torch.profiler.record_function("optimizer.step"):
            opt.step()
    t = iteration.profile(step)
    assert all(t["lanes"][phase] for phase in iteration.PHASES)
    forward, backward = t["lanes"]["forward"][0], t["lanes"]["backward"][0]
    assert forward[0] == 0.0 and forward[1] <= backward[0]
    path = str(tmp_path / "lanes.json")
    assert iteration.write_outputs(t, path, None, "cpu step") == [path]
    with open(path) as f:
        written = json.load(f)
    assert written["title"] == "cpu step" and written["lanes"]["forward"] == t["lanes"]["forward"]


def test_the_lanes_are_drawn_from_their_file(tmp_path):
    path, png = str(tmp_path / "lanes.json"), str(tmp_path / "lanes.png")
    iteration.write(path, iteration.lanes_of(EVENTS), "canned")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(_C.UsageError, match="python -m statepager.tools.bench.iteration"):
            iteration.main([path, png])
        return
    assert iteration.main([path, png]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

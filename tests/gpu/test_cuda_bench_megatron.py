"""`statepager bench megatron` on the GPU, at a tiny size, for four configurations
(unpaged, Megatron's own optimizer_cpu_offload, statepager fp32 on the store, and q8
moments + residual mains in the host tier), each in its own process: all train the same
GPT to the same first loss, Megatron's offload runs as users configure it, the paged
ones move their stored state once per step each way (through the files, or the host
tier alone), each has its floor measured in the same run, the first paged one's step is
written as a Chrome trace, the driver's peak covers torch's peak allocation, and
Megatron's own checkpoint of each saves and loads back, a paged one through one window.
Skips without megatron-core."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from statepager.tools.bench import megatron as bench_megatron
from statepager.tools.bench.floor import find_fio

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.alone,  # the driver's memory, and timings side by side
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="megatron-core is not installed (the GPU suite carries it)"),
]
TINY = ["--layers", "2", "--hidden", "256", "--heads", "4", "--vocab", "1024", "--seq", "64",
        "--micro-batch", "2", "--warmup", "2", "--steps", "3", "--bucket-size", "1M",
        "--fio-jobs", "2"]
CONFIGS = ["unpaged", "offload", "fp32", "host-q8"]


def test_bench_megatron_runs_four_configurations_side_by_side(tmp_path, capsys):
    trace = tmp_path / "fp32.json"
    out = subprocess.run([sys.executable, "-m", "statepager", "bench", "megatron", "--dir",
                          str(tmp_path / "work"), "--configs", ",".join(CONFIGS), *TINY,
                          "--trace", str(trace), "--device-time", "--checkpoint", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["failed"] == [] and [c["config"] for c in r["configs"]] == CONFIGS
    unpaged, offload, fp32, host = r["configs"]
    for c in r["configs"]:
        assert c["step_s"]["n"] == c["opt_step_s"]["n"] == 3
        assert 0 < c["opt_step_s"]["median"] < c["step_s"]["median"]
        d, t = c["driver"], c["torch"]
        assert d["samples"] > 0 and d["peak"] >= d["with_context"]
        assert d["warmup_peak"] >= d["built"] >= d["with_context"]
        assert d["peak"] - (d["baseline"] or 0) > t["max_allocated"] > 0
        assert len(c["losses"]) == 5
        assert c["losses"][0] == unpaged["losses"][0]  # the same GPT, the same batch
    assert unpaged["pager"] is offload["pager"] is None
    assert unpaged["floor"] is offload["floor"] is None
    # Megatron's offload holds no state in device memory: less allocated than unpaged.
    assert offload["torch"]["max_allocated"] < unpaged["torch"]["max_allocated"]

    p = fp32["pager"]
    assert p["stored_bytes"] > 0 and p["buckets"] > 1 and p["undo_bytes"] == 0
    assert p["bytes_read"] == p["bytes_written"] == [p["stored_bytes"]] * 3  # one pass
    assert p["bytes_from_host"] == p["bytes_to_host"] == [0] * 3 and p["host_budget"] == 0
    assert p["held"] >= p["peak_mapped"] > 0 and p["window"] >= p["largest_bucket"]
    assert p["mapped_before_first_step"] > 0  # scope() built the mains resident
    parts = {k: v["median"] for k, v in p["parts_s"].items()}  # opt.step's host time
    assert parts["setup"] > 0 and parts["loop"] > 0
    assert p["atomic"] == "bucket" and parts["commit"] == 0  # resumable: nothing to commit
    assert parts["rest"] > 0  # Megatron's own: grad copies, norm, clip
    assert fp32["torch"]["max_allocated"] < unpaged["torch"]["max_allocated"]
    f = fp32["floor"]
    assert (f["read_bytes"], f["write_bytes"]) == (p["stored_bytes"], p["stored_bytes"])
    assert f["pcie"]["seconds"]["median"] > 0 and f["seconds"] > 0
    assert (f["fio"] is not None) == (find_fio()[0] is not None), f["fio_note"]

    # q8 moments + residual mains, all in the host tier: the files see nothing; the
    # step writes its stored state (a resumable step's undo copies of the mains' bf16
    # params stay on the device).
    q = host["pager"]
    assert q["host_budget"] > 0 and q["undo_bytes"] == 0 and q["spilled_bytes"] == [0] * 3
    assert q["bytes_read"] == q["bytes_written"] == [0] * 3
    assert q["bytes_from_host"] == [q["stored_bytes"]] * 3
    assert q["bytes_to_host"] == [q["stored_bytes"]] * 3
    assert q["stored_bytes"] < p["stored_bytes"] / 2  # 4 bytes and the scales vs 12
    f = host["floor"]
    assert (f["read_bytes"], f["write_bytes"]) == (0, 0) and f["fio"] is None
    assert (f["host_in"], f["host_out"]) == (q["stored_bytes"], q["stored_bytes"])
    assert f["bound_by"] == "pcie" and f["seconds"] > 0

    # The first paged configuration's last timed step, as a Chrome trace.
    assert fp32["timeline_files"] == [str(trace)] and host["timeline_files"] == []
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in events} == {"read", "step", "write"}
    assert len({e["args"]["bucket"] for e in events}) == p["buckets"]

    # --device-time: one more step's optimizer.step() under torch.profiler.
    for c in (fp32, host):
        t = c["device_time"]
        assert "adamw_kernel" in t["by_kernel"]  # the fused step, its kernels by name
        assert 0 < t["statepager_kernels_s"] <= t["kernels_s"]
        assert t["h2d_busy_s"] > 0 and t["d2h_busy_s"] > 0
    assert unpaged["device_time"]["statepager_kernels_s"] == 0

    # --checkpoint: Megatron's own format saved and loaded back (the steps of
    # --device-time ran after it); a paged optimizer's through one window of the pool.
    for c in (unpaged, fp32, host):
        k = c["checkpoint"]
        assert "error" not in k, k
        assert k["format"] == "dp_reshardable" and k["files_bytes"] > 0
        for part in (k["save"], k["load"]):
            assert part["seconds"] > 0 and part["driver"] >= 0 and part["host"] >= 0
            if c["pager"] is not None:
                assert 0 < part["pool"] <= c["pager"]["window"]
    assert unpaged["checkpoint"]["save"]["pool"] is None and "statepager" not in \
        unpaged["checkpoint"]
    for c in (fp32, host):  # statepager.checkpoint's: files and host memory copied
        own = c["checkpoint"]["statepager"]
        assert own["files_bytes"] >= c["pager"]["stored_bytes"]
        assert own["save"]["pool"] == 0, (c["config"], own["save"], "never through the device")
        # Residual mains' exception lists, where their chunks' lists are joined on the
        # device (then copied and sorted on the host for the manifest): a few blocks of
        # the caching allocator, none of the state's bytes.
        assert own["save"]["torch"] <= (1 << 20 if c is host else 0), (c["config"], own["save"])
        assert own["load"]["pool"] <= c["pager"]["window"] and own["load"]["seconds"] > 0
    assert "checkpoint" in offload  # its figures, or the error Megatron's offload gave

    bench_megatron.print_megatron(r)
    text = capsys.readouterr().out
    assert "per step read = stored: True, written = stored: True" in text
    assert "undo copies: " not in text and "x the floor" in text
    assert re.search(r"Megatron's checkpoint \(dp_reshardable, [0-9.]+ GiB in its files of "
                     r"[0-9.]+ GiB stored\): save [0-9.]+ s, peaks above before: device "
                     r"[0-9.]+ GiB \(torch [0-9.]+, pool [0-9.]+\); host [0-9.]+ GiB; load "
                     r"[0-9.]+ s", text), text
    # Megatron's load of each: unpaged, fp32 and host-q8 (residual mains too).
    assert len(re.findall(r"Megatron's checkpoint \([^)]*\): save [^;]*; host [0-9.]+ GiB; "
                          r"load [0-9.]+ s, peaks above before", text)) == 3, text
    assert re.search(r"; statepager's \([0-9.]+ GiB\): save [0-9.]+ s, peaks above before: "
                     r"device [0-9.]+ GiB \(torch 0.00, pool 0.00\)", text), text
    # The summary: each against the offload, each paged one against its floor (or why
    # not), the kernels' device time; q8 and host-fp32 did not run, so no q8 / fp32.
    summary = text[text.index("summary (medians of the timed steps):"):]
    assert "step against Megatron's offload (" in summary
    for name in ("unpaged", "fp32", "host-q8"):
        assert re.search(rf"^    {name} +[0-9.]+ s: .*; opt\.step [0-9.]+ s: .*; driver peak "
                         r"[0-9.]+ GiB = [0-9.]+ x the offload's$", summary, re.M), summary
    for name in ("fp32", "host-q8"):
        assert re.search(rf"^    {name} +(step [0-9.]+ x its floor, opt\.step [0-9.]+ x its "
                         r"floor, the pager's pipeline [0-9.]+ x its floor|not shown: the "
                         r"pager's pipeline .* beat its floor)", summary, re.M), summary
    assert re.search(r"statepager's kernels on the device in one more optimizer\.step\(\) "
                     r"\(--device-time\): fp32 [0-9.]+ ms = [0-9.]+ x its opt\.step, host-q8 "
                     r"[0-9.]+ ms = [0-9.]+ x its opt\.step$", summary, re.M), summary
    assert " / fp32:" not in summary and "failed:" not in summary


MEGATRON_LM = os.path.join(os.path.dirname(__file__), "..", "..", ".deps", "megatron-lm")


@pytest.mark.skipif(not os.path.isfile(os.path.join(MEGATRON_LM, "pretrain_gpt.py")),
                    reason="Megatron-LM's pretrain_gpt.py is not in .deps/megatron-lm "
                           "(NVIDIA/Megatron-LM core_r0.19.0, git-ignored)")
def test_bench_megatron_lm_times_pretrain_gpt_side_by_side(tmp_path):
    """`bench megatron-lm`: Megatron-LM's own iterations, unpaged and paged (host tier,
    under the forward), each with a median of its logged times and a driver peak, and with
    an async save every 3 iterations the iterations under a save timed apart."""
    out = subprocess.run([sys.executable, "-m", "statepager", "bench", "megatron-lm",
                          "--megatron-lm", MEGATRON_LM, "--dir", str(tmp_path / "work"),
                          "--configs", "unpaged,host-fp32-overlap", "--layers", "2",
                          "--hidden", "256", "--heads", "4", "--vocab", "1024", "--seq",
                          "128", "--micro-batch", "2", "--iters", "8", "--bucket-size", "4M",
                          "--page-size", "2M", "--save-interval", "3", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["failed"] == []
    for c in r["configs"]:
        assert sorted(map(int, c["iterations"])) == list(range(1, 9))
        assert c["n"] == 5 and c["min_ms"] <= c["median_ms"] <= c["max_ms"]
        assert c["driver_peak"] > 0
        assert c["saving_wall_n"] >= 1 and c["quiet_wall_n"] >= 1  # saves at 3 and 6

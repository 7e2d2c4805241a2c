"""`statepager bench megatron` on the GPU, at a tiny size, for two configurations (unpaged
and statepager fp32), each in its own process: both train the same GPT to the same first
loss, the paged one reads and writes its stored state once per step, and the driver's
peak covers torch's peak allocation. Skips without megatron-core."""
import importlib.util
import json
import subprocess
import sys

import pytest

from statepager.bench import megatron as bench_megatron

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="megatron-core is not installed (the GPU suite carries it)"),
]
TINY = ["--layers", "2", "--hidden", "256", "--heads", "4", "--vocab", "1024", "--seq", "64",
        "--micro-batch", "2", "--warmup", "2", "--steps", "3", "--bucket", "1M"]


def test_bench_megatron_runs_two_configurations_side_by_side(tmp_path, capsys):
    out = subprocess.run([sys.executable, "-m", "statepager", "bench", "megatron", "--dir",
                          str(tmp_path), "--configs", "unpaged,fp32", *TINY, "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["failed"] == [] and [c["config"] for c in r["configs"]] == ["unpaged", "fp32"]
    unpaged, fp32 = r["configs"]
    for c in (unpaged, fp32):
        assert c["step_s"]["n"] == c["opt_step_s"]["n"] == 3
        assert 0 < c["opt_step_s"]["median"] < c["step_s"]["median"]
        d, t = c["driver"], c["torch"]
        assert d["samples"] > 0 and d["peak"] >= d["with_context"]
        assert d["warmup_peak"] >= d["built"] >= d["with_context"]
        assert d["peak"] - (d["baseline"] or 0) > t["max_allocated"] > 0
        assert len(c["losses"]) == 5
    assert unpaged["pager"] is None
    assert fp32["losses"][0] == unpaged["losses"][0]  # the same GPT, the same batch
    p = fp32["pager"]
    assert p["stored_bytes"] > 0 and p["buckets"] > 1
    assert p["bytes_read"] == [p["stored_bytes"]] * 3  # one pass per step
    assert p["bytes_written"] == [p["stored_bytes"]] * 3
    assert p["held"] >= p["peak_mapped"] > 0 and p["window"] >= p["largest_bucket"]
    assert p["mapped_before_first_step"] > 0  # scope() built the mains resident
    # Mains and moments are out of device memory: less is allocated than unpaged.
    assert fp32["torch"]["max_allocated"] < unpaged["torch"]["max_allocated"]
    bench_megatron.print_megatron(r)
    text = capsys.readouterr().out
    assert "read per step = stored: True" in text and "driver peak - torch max allocated" in text

"""`bench megatron` without megatron-core (CPU): its options, the error naming the extra
to install, a failed configuration reported with its log, the peak sampler, and the
side-by-side report from canned results. tests/gpu/test_cuda_bench_megatron.py runs it."""
import json
import sys

import pytest

from statepager import cli
from statepager.bench import megatron as bench_megatron

GiB = 1 << 30


def parse(tmp_path, *argv):
    return cli.parser("statepager").parse_args(["bench", "megatron", "--dir", str(tmp_path),
                                                *argv])


def test_the_defaults_are_the_1_34_b_gpt_with_every_configuration(tmp_path):
    a = parse(tmp_path)
    assert (a.layers, a.hidden, a.heads, a.vocab, a.seq, a.micro_batch) == \
        (24, 2048, 16, 32000, 512, 4)
    assert not a.bf16_grads and (a.warmup, a.steps) == (3, 5)
    assert a.configs == ["unpaged", "offload", "fp32", "bf16", "q8"]
    a = parse(tmp_path, "--configs", "q8, unpaged", "--steps", "2", "--layers", "2",
              "--bucket", "64M", "--hbm-budget", "4G", "--json")
    assert a.configs == ["q8", "unpaged"] and a.steps == 2 and a.layers == 2
    assert a.bucket == 64 << 20 and a.hbm_budget == 4 * GiB and a.json


@pytest.mark.parametrize("argv, message", [
    (["--configs", "fp16"], "configurations are unpaged, offload, fp32, bf16, q8"),
    (["--configs", "fp32,fp32"], "names a configuration twice"),
    (["--configs", ","], "configurations are"),
    (["--warmup", "0"], "creates the moments, so it is not timed (at least 1)"),
    (["--steps", "0"], "timed steps (at least 1)"),
    (["--micro-batch", "x"], "'x' is not a whole number"),
])
def test_bad_options_are_refused_with_a_message(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as e:
        parse(tmp_path, *argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err


def test_without_megatron_core_it_names_the_extra_to_install(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)  # import megatron fails
    assert cli.main(["bench", "megatron", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "UsageError: bench megatron needs megatron-core" in err, err
    assert "pip install 'statepager[megatron]'" in err and "Traceback" not in err


def test_a_failed_configuration_is_reported_with_its_log(tmp_path):
    spec = {"config": "fp32", "example": str(tmp_path / "no-such-example.py")}
    r = bench_megatron.run_worker(spec, str(tmp_path), timeout=300)
    assert r["config"] == "fp32" and r["error"] == "exit status 1"
    assert any("no-such-example.py" in line for line in r["log_tail"]), r["log_tail"]


def test_the_sampler_keeps_the_largest_value_seen():
    values = iter(range(1, 10**9))
    with bench_megatron.PeakSampler(lambda: next(values), interval=1e-4) as s:
        while s.samples < 20:
            pass
    assert s.peak >= 21 and s.samples >= 20


def canned(config, *, peak, pager=None, error=None):
    if error:
        return {"config": config, "error": error, "log_tail": ["Traceback", "OutOfMemory"]}
    return {
        "config": config, "what": config, "params": 1_340_000_000, "losses": [10.5, 9.25],
        "step_s": {"n": 5, "median": 0.5, "min": 0.4, "max": 0.7},
        "opt_step_s": {"n": 5, "median": 0.2, "min": 0.1, "max": 0.3},
        "driver": {"source": "NVML (device-wide used)", "baseline": 1 * GiB,
                   "with_context": int(1.5 * GiB), "built": 4 * GiB, "warmup_peak": 15 * GiB,
                   "peak": peak, "samples": 900},
        "torch": {"max_allocated": 5 * GiB, "max_reserved": 6 * GiB, "reserved": 6 * GiB,
                  "scope_pool": GiB // 4},
        "pager": pager,
    }


def test_the_report_puts_the_configurations_side_by_side(capsys):
    pager = {"bytes_read": [16 * 10**9] * 5, "bytes_written": [16 * 10**9] * 5,
             "stored_bytes": 16 * 10**9, "compute_s": {"n": 5, "median": 0.02, "min": 0.01,
                                                       "max": 0.03},
             "peak_mapped": int(1.5 * GiB), "held": int(2.25 * GiB), "buckets": 70,
             "largest_bucket": 750 << 20, "window": int(2.5 * GiB),
             "mapped_before_first_step": 5 * GiB}
    r = {"model": {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 32000, "seq": 512,
                   "micro_batch": 4, "warmup": 3, "steps": 5, "bucket": 256 << 20,
                   "hbm_budget": None, "grads": "fp32"},
         "dir": "/dev/shm/sp", "failed": ["offload"],
         "configs": [canned("unpaged", peak=20 * GiB), canned("offload", peak=0, error="exit "
                                                                "status 1"),
                     canned("fp32", peak=10 * GiB, pager=pager)]}
    json.dumps(r)  # what --json prints
    b = bench_megatron.breakdown(r["configs"][2])
    # 10 - 1 (baseline) - 5 (torch max allocated) = 4 GiB above torch's peak: context 0.5,
    # torch cache 6 - 5 = 1, pool 2.25 held - 0.25 counted by torch too = 2, other 0.5.
    assert b == {"above_torch_peak": 4 * GiB, "context": GiB // 2, "torch_cache": GiB,
                 "pool": 2 * GiB, "other": GiB // 2}
    bench_megatron.print_megatron(r)
    out = capsys.readouterr().out
    assert out.startswith("megatron bench: GPT 1.34 B params, 24 layers, hidden 2048")
    lines = out.splitlines()
    fp32 = next(line for line in lines if line.strip().startswith("fp32 "))
    assert fp32.split()[1:] == ["0.500", "(0.400-0.700,", "n=5)", "0.200", "(0.100-0.300,",
                                "n=5)", "16.00", "16.00", "9.00", "5.00", "6.00", "2.25"]
    unpaged = next(line for line in lines if line.strip().startswith("unpaged "))
    assert unpaged.split()[7:] == ["-", "-", "19.00", "5.00", "6.00", "-"]
    assert "offload  failed (exit status 1):" in out and "OutOfMemory" in out
    assert ("read per step = stored: True; 70 buckets, largest 750 MiB; pool peak mapped 1.50 "
            "GiB of a window of 2.50 GiB") in out
    assert ("warm-up steps: driver peak 14.00 GiB; pool mapped before the first step 5.00 "
            "GiB; loss 10.5000 -> 9.2500") in out
    assert ("driver peak - torch max allocated = 4.00 GiB: CUDA context 0.50 + torch cache "
            "1.00 + page pool 2.00 + other 0.50") in out

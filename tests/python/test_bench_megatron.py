"""`bench megatron` without megatron-core (CPU): its options, the error naming the extra
to install, a failed configuration reported with its log, the peak sampler, the host
tier's size, each configuration printed as it ends, and the side-by-side report, floors
and ratios from canned results; the example GPT refusing Megatron's offload with its
native fp32 parameter. tests/gpu/test_cuda_bench_megatron.py runs it."""
import importlib.util
import json
import os
import sys
import time

import pytest

import torch

from statepager import _C
from statepager.tools import cli
from statepager.tools.bench import driver_memory, iteration
from statepager.tools.bench import megatron as bench_megatron
from statepager.tools.bench import megatron_configs, megatron_report, megatron_worker

import test_bench_iteration

GiB = 1 << 30


def parse(tmp_path, *argv):
    return cli.parser("statepager").parse_args(["bench", "megatron", "--dir", str(tmp_path),
                                                *argv])


def test_the_defaults_are_the_1_34_b_gpt_in_six_configurations(tmp_path):
    a = parse(tmp_path)
    assert (a.layers, a.hidden, a.heads, a.vocab, a.seq, a.micro_batch) == \
        (24, 2048, 16, 32000, 512, 4)
    assert not a.bf16_grads and not a.no_overlap_grad_reduce and (a.warmup, a.steps) == (3, 5)
    assert a.configs == ["unpaged", "offload", "fp32", "q8", "host-fp32", "host-q8"]
    assert a.host_budget is None and a.fio_jobs == (4, 8, 16)
    assert a.timeline is a.trace is a.plot is None and not a.device_time
    a = parse(tmp_path, "--configs", "q8, unpaged,bf16", "--steps", "2", "--layers", "2",
              "--bucket-size", "64M", "--hbm-budget", "4G", "--host-budget", "40G", "--fio-jobs",
              "8,2", "--timeline", "host-q8", "--trace", str(tmp_path / "t.json"), "--json",
              "--device-time", "--no-overlap-grad-reduce")
    assert a.configs == ["q8", "unpaged", "bf16"] and a.steps == 2 and a.layers == 2
    assert a.no_overlap_grad_reduce
    assert a.bucket_size == 64 << 20 and a.hbm_budget == 4 * GiB and a.json
    assert a.host_budget == 40 * GiB and a.fio_jobs == (8, 2)
    assert a.timeline == "host-q8" and a.trace == str(tmp_path / "t.json") and a.device_time


def test_pages_are_as_large_as_a_bucket_unless_given(tmp_path):
    """A page mapped while a page-out copies costs the step about 1 ms (see Note [Mapping
    costs per call, not per byte] in docs/design.md): the bench streams with bucket-sized
    pages, in whole 2 MiB, up to 256 MiB at depth 4; with q8 moments up to 128 MiB at
    depth 6 (Note [Pages for compact formats]); what is given wins."""
    a = parse(tmp_path)
    assert a.page_size is None and a.depth is None
    assert parse(tmp_path, "--page-size", "32M").page_size == 32 << 20
    streaming = megatron_configs.streaming
    assert streaming("fp32", 256 << 20, None, None) == (256 << 20, 4)
    assert streaming("fp32", (100 << 20) + 1, None, None) == (102 << 20, 4)
    assert streaming("fp32", 512 << 20, None, None) == (256 << 20, 4)
    assert streaming(None, 512 << 20, None, None) == (256 << 20, 4)
    assert streaming("q8", 512 << 20, None, None) == (128 << 20, 6)
    assert streaming("q8", 64 << 20, None, None) == (64 << 20, 6)
    assert streaming("q8", 512 << 20, 32 << 20, 3) == (32 << 20, 3)


@pytest.mark.parametrize("argv, message", [
    (["--configs", "fp16"], "configurations are unpaged, offload, fp32, bf16, q8, host-fp32, "
                            "host-q8"),
    (["--configs", "fp32,fp32"], "names a configuration twice"),
    (["--configs", ","], "configurations are"),
    (["--warmup", "0"], "creates the moments, so it is not timed (at least 1)"),
    (["--steps", "0"], "timed steps (at least 1)"),
    (["--micro-batch", "x"], "'x' is not a whole number"),
    (["--timeline", "offload"], "the timeline is a paged configuration's: one of fp32, bf16, "
                                "q8, host-fp32, host-q8"),
    (["--fio-jobs", "4,0"], "'4,0': '0' is not a job count"),
    (["--host-budget", "0"], "the size must be more than 0"),
])
def test_bad_options_are_refused_with_a_message(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as e:
        parse(tmp_path, *argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err


def test_the_timeline_is_the_first_paged_configuration_unless_chosen(tmp_path):
    trace = str(tmp_path / "t.json")
    assert megatron_configs.timeline_config(parse(tmp_path)) is None  # no --trace, no --plot
    assert megatron_configs.timeline_config(parse(tmp_path, "--trace", trace)) == "fp32"
    assert megatron_configs.timeline_config(parse(
        tmp_path, "--trace", trace, "--configs", "offload,host-q8,q8")) == "host-q8"
    assert megatron_configs.timeline_config(parse(
        tmp_path, "--trace", trace, "--timeline", "q8")) == "q8"
    assert megatron_configs.timeline_config(parse(  # the iteration's lanes alone
        tmp_path, "--iteration-trace", trace, "--configs", "unpaged,host-q8")) == "host-q8"
    with pytest.raises(_C.UsageError, match="--timeline 'bf16' is not in --configs unpaged,"
                                            "offload,fp32,q8,host-fp32,host-q8: add it"):
        megatron_configs.timeline_config(parse(tmp_path, "--trace", trace, "--timeline", "bf16"))
    with pytest.raises(_C.UsageError, match="--configs unpaged,offload has none: add one"):
        megatron_configs.timeline_config(parse(tmp_path, "--trace", trace, "--configs",
                                             "unpaged,offload"))


def test_the_host_tier_holds_the_state_twice():
    params = [torch.nn.Parameter(torch.zeros(1000, 300)), torch.nn.Parameter(torch.zeros(77)),
              torch.nn.Parameter(torch.zeros(5), requires_grad=False)]  # not trained
    n, slack = 300_077, 256 << 20
    fp32 = megatron_worker.host_budget_for(params, "fp32", "fp32")
    assert fp32 == int(2 * 12 * n * 1.03) + slack
    # q8: a code byte per element and an fp32 scale per block of each moment; residual
    # mains 2 bytes (the undo copies of their bf16 params are not in the tier).
    from statepager.formats import codecs
    blocks = codecs.q8_num_blocks(300_000) + codecs.q8_num_blocks(77)
    q8 = megatron_worker.host_budget_for(params, "q8", "residual")
    assert q8 == int(2 * (2 * n + 2 * (n + 4 * blocks)) * 1.03) + slack


def test_without_megatron_core_it_names_the_extra_to_install(capsys, tmp_path, monkeypatch):
    for name in ["megatron"] + [m for m in sys.modules if m.startswith("megatron.")]:
        monkeypatch.setitem(sys.modules, name, None)  # import megatron(.core) fails
    assert cli.main(["bench", "megatron", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "UsageError: bench megatron needs megatron-core" in err, err
    assert "pip install 'statepager[megatron]'" in err and "Traceback" not in err


def test_a_failed_configuration_is_reported_with_its_error(tmp_path, monkeypatch):
    # The worker's interpreter teardown aborts (as torch's does on a broken CUDA context):
    # the report still names the error the configuration stopped at.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import atexit, os\natexit.register(os.abort)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    spec = {"config": "fp32", "example": str(tmp_path / "no-such-example.py")}
    r = bench_megatron.run_worker(spec, str(tmp_path), timeout=300)
    assert r["config"] == "fp32" and r["error"].startswith("FileNotFoundError: "), r["error"]
    assert any("no-such-example.py" in line for line in r["log_tail"]), r["log_tail"]
    assert "fp32      failed (FileNotFoundError: " in megatron_report.config_lines(r)[0]


def test_a_worker_that_dies_is_reported_with_its_log_tail(tmp_path, monkeypatch):
    # It dies at exit after writing a result: the result is not taken as its figures.
    (tmp_path / "q8.json").write_text(json.dumps({"config": "q8", "step_s": [1.0]}))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nprint('dying')\nos.abort()\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    r = bench_megatron.run_worker({"config": "q8"}, str(tmp_path), timeout=300)
    assert r["config"] == "q8" and r["error"] == "exit status -6", r
    assert "dying" in r["log_tail"], r["log_tail"]


def test_the_sampler_keeps_the_largest_value_seen():
    values = iter(range(1, 10**9))
    with driver_memory.PeakSampler(lambda: next(values), interval=1e-4) as s:
        while s.samples < 20:
            pass
    assert s.peak >= 21 and s.samples >= 20


def test_a_child_sampler_without_nvml_says_so():
    """The child process runs alone (this file as a script, the standard library only)
    and tells when it cannot sample; DriverMemory then never hands one out."""
    if driver_memory.DriverMemory().without_context:
        pytest.skip("NVML is here: the child samples (the GPU test below)")
    with pytest.raises(RuntimeError, match=r"did not start: it said \['no', 'NVML'\]"):
        with driver_memory.ChildPeakSampler(lambda: 0):
            pass
    assert isinstance(driver_memory.DriverMemory().sampler(), driver_memory.PeakSampler)


@pytest.mark.gpu
@pytest.mark.alone  # the driver's used memory counts every process on the device
def test_the_child_sampler_sees_what_this_process_allocates():
    """With NVML, a child process samples: it sees memory this process's CUDA context
    takes and gives back within the block, the peak above what was in use before."""
    driver = driver_memory.DriverMemory()
    if not driver.without_context:
        pytest.skip("no NVML (libnvidia-ml): the driver memory is sampled by a thread")
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what earlier tests left cached would hold the 2 GiB below
    before = driver.used()
    with driver.sampler() as s:
        assert isinstance(s, driver_memory.ChildPeakSampler)
        x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        time.sleep(0.05)
        del x
        torch.cuda.empty_cache()
        time.sleep(0.02)
    assert s.peak >= before + (2 << 30) and s.samples >= 20


def canned(config, *, peak, step=0.5, pager=None, floor=None, error=None, cpu=None):
    if error:
        return {"config": config, "error": error, "log_tail": ["Traceback", "OutOfMemory"],
                "seconds": 12.0}
    return {
        "config": config, "what": config, "params": 1_340_000_000, "losses": [10.5, 9.25],
        "step_s": {"n": 5, "median": step, "min": step - 0.1, "max": step + 0.2},
        "opt_step_s": {"n": 5, "median": 0.7 * step, "min": 0.6 * step, "max": 0.8 * step},
        "driver": {"source": "NVML (device-wide used)", "baseline": 1 * GiB,
                   "with_context": int(1.5 * GiB), "built": 4 * GiB, "warmup_peak": 15 * GiB,
                   "peak": peak, "samples": 900},
        "torch": {"max_allocated": 5 * GiB, "max_reserved": 6 * GiB, "reserved": 6 * GiB,
                  "scope_pool": GiB // 4},
        "pager": pager, "floor": floor, "timeline_files": [], "seconds": 31.0,
        "cpu_cores": cpu, "cpus": 16,
    }


def paged(stored, *, undo=0, host=False):
    """A pager result whose steps read and write the stored state, through the files or
    (host) the host tier; `undo` bytes of undo copies in host memory."""
    files, tier = ([0] * 5, [stored] * 5) if host else ([stored] * 5, [0] * 5)
    return {"bytes_read": files, "bytes_written": files, "bytes_from_host": tier,
            "bytes_to_host": tier, "spilled_bytes": [0] * 5, "stored_bytes": stored,
            "undo_bytes": undo, "host_budget": 40 * 10**9 if host else 0,
            "host_used": 2 * stored if host else 0, "direct_io": True, "io_depth": 32,
            "io_block": 1 << 20,
            "loop_host_s": {k: {"n": 5, "median": m, "min": m, "max": m} for k, m in
                            (("stepping", 0.02), ("page_ins", 0.004), ("device", 0.003),
                             ("page_outs", 0.006))},
            "pipeline_s": {"n": 5, "median": 0.55, "min": 0.54, "max": 0.57},
            "peak_mapped": int(1.5 * GiB), "held": int(2.25 * GiB), "buckets": 70,
            "largest_bucket": 750 << 20, "window": int(2.5 * GiB),
            "mapped_before_first_step": 5 * GiB, "mapped_read_bytes": [0] * 5,
            "mapped_written_bytes": [0] * 5,
            "parts_s": megatron_worker.opt_step_parts([0.30, 0.28, 0.32, 0.29, 0.31],
                                                     [[0.010, 0.25, 0.002]] * 5)}


def floor(read, written, *, host_in=0, host_out=0, pcie_s, fio_s=None):
    pcie = {"seconds": {"n": 3, "median": pcie_s, "min": pcie_s, "max": pcie_s + 0.01},
            "chunk": 256 << 20, "h2d_gbps": 50.0, "d2h_gbps": 45.0}
    way = {"gbps": 20.0, "seconds": fio_s, "bytes": read}
    fio = fio_s and {"version": "fio-3.33", "jobs": 4, "iodepth": 8, "block": 1 << 20,
                     "direct": True, "read": way, "write": way,
                     "both": {"read": way, "write": way, "seconds": fio_s}, "seconds": fio_s}
    return {"read_bytes": read, "write_bytes": written, "host_in": host_in,
            "host_out": host_out, "pcie": pcie, "fio": fio, "pcie_note": "",
            "fio_note": "" if fio else "no fio floor: nothing went through the store's files",
            "seconds": max(pcie_s, fio_s or 0), "bound_by": "fio" if fio_s else "pcie"}


MODEL = {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 32000, "seq": 512,
         "micro_batch": 4, "warmup": 3, "steps": 5, "bucket": 256 << 20, "depth": 3,
         "page_size": 32 << 20, "hbm_budget": None, "host_budget": None, "fio_jobs": (4, 8, 16),
         "grads": "fp32", "overlap_grad_reduce": True}


def canned_run():
    configs = [
        canned("unpaged", peak=33 * GiB, step=0.12),
        canned("offload", peak=22 * GiB, step=0.42),
        canned("fp32", peak=10 * GiB, step=1.0, pager=paged(16 * 10**9),
               floor=floor(16 * 10**9, 16 * 10**9, pcie_s=0.32, fio_s=0.5),
               cpu={"io_uring workers": 11.94, "pager I/O thread": 0.41,
                    "other threads": 1.23}),
        canned("q8", peak=10 * GiB, step=0.7,
               pager=dict(paged(5 * 10**9, undo=2 * 10**9), mapped_read_bytes=[5 * 10**9] * 5,
                          mapped_written_bytes=[4 * 10**9] * 5),
               floor=floor(5 * 10**9, 7 * 10**9, pcie_s=0.12, fio_s=0.2)),
        canned("host-fp32", peak=11 * GiB, step=0.35, pager=paged(16 * 10**9, host=True),
               floor=floor(0, 0, host_in=16 * 10**9, host_out=16 * 10**9, pcie_s=0.32)),
        canned("host-q8", peak=0, error="timed out after 240 s"),
    ]
    return {"model": MODEL, "dir": "/dev/shm/sp", "configs": configs, "failed": ["host-q8"]}


DEVICE_TIME = {"statepager_kernels_s": 0.0247, "kernels_s": 0.034,
               "by_kernel": {"adamw_kernel": 0.0133, "checksum_rows_kernel": 0.0039,
                             "residual_encode_kernel": 0.0031,
                             "residual_rebuild_kernel": 0.0028,
                             "checksum_total_kernel": 0.0014},
               "h2d_busy_s": 0.1117, "d2h_busy_s": 0.1049, "both_busy_s": 0.0495,
               "statepager_launches": 2655, "launches": 3689}


def summary(r):
    return "\n".join(megatron_report.summary_lines(r))


def test_the_summary_compares_with_the_offload_only_when_it_ran():
    r = canned_run()
    assert "step against Megatron's offload (0.420 s; opt.step 0.294 s; driver peak 21.00 " \
        "GiB):" in summary(r)
    r["configs"] = [c for c in r["configs"] if c["config"] != "offload"]
    text = summary(r)
    assert "Megatron's offload: not measured (not in --configs, or failed)" in text
    assert "against Megatron's offload" not in text and "the offload's" not in text
    assert "q8 / fp32: step 0.70, opt.step 0.70" in text  # the rest is still compared


def test_the_summary_gives_each_iteration_against_unpaged():
    text = summary(canned_run())
    assert "  the whole iteration against unpaged's (0.120 s):" in text
    assert ("    fp32      1.000 s = 8.33 x, paging exposed 0.880 s; 2.00 x the larger of "
            "unpaged's and its floor (0.500 s)") in text
    assert "    host-fp32 0.350 s = 2.92 x" in text and "    offload " not in text
    r = canned_run()
    r["configs"] = r["configs"][1:]
    assert "against unpaged's" not in summary(r)


def test_steps_under_the_forward_say_what_held_their_page_ins_back(capsys):
    """Under the forward: how many steps began in the backward, and why the grad-sync
    starts that began none did not (the step in flight still paging, or no room)."""
    r = canned_run()
    r["configs"][4]["pager"].update(under_forward=True, begun_in_backward=3,
                                    held_back={"the step in flight": 40, "room": 2})
    bench_megatron.print_megatron(r)
    assert ("steps whose first page-ins began in the backward before them: 3 (warm-up and "
            "timed); grad-sync starts that began none: 40 with the step in flight still "
            "paging, 2 without room for its page-ins") in capsys.readouterr().out


def test_the_step_thread_says_when_it_started_and_its_cpu_time(capsys):
    """On a thread: how long after step() the thread started, and its own CPU time;
    nothing of it without the thread."""
    r = canned_run()
    pager = r["configs"][4]["pager"]
    pager.update(under_forward=True, in_hooks_s={"n": 5, "median": 0.009, "min": 0.009,
                                                 "max": 0.01})
    pager["loop_host_s"].update(
        thread_start={"n": 5, "median": 0.0042, "min": 0.004, "max": 0.005},
        thread_cpu={"n": 5, "median": 0.061, "min": 0.06, "max": 0.07})
    bench_megatron.print_megatron(r)
    assert "the step's thread" not in capsys.readouterr().out
    pager["step_thread"] = True
    bench_megatron.print_megatron(r)
    assert ("the step's thread (medians): started 4.2 ms after step() left the buckets to "
            "the forward, its own CPU time 61.0 ms") in capsys.readouterr().out


def test_the_kernels_device_time_is_shown_when_the_profiler_saw_them():
    r = canned_run()
    assert "statepager's kernels on the device" not in summary(r)  # no --device-time
    r["configs"][3]["device_time"] = DEVICE_TIME  # q8's, with --device-time
    r["configs"][0]["device_time"] = dict(DEVICE_TIME, statepager_kernels_s=0.0)  # unpaged's
    assert ("statepager's kernels on the device in one more optimizer.step() (--device-time): "
            "q8 24.7 ms = 0.05 x its opt.step\n") in summary(r) + "\n"
    # A profile that saw no kernel, or failed, measured nothing.
    for seen in (dict(DEVICE_TIME, kernels_s=0.0, statepager_kernels_s=0.0, by_kernel={}),
                 {"error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}):
        r["configs"][3]["device_time"] = seen
        assert "statepager's kernels on the device" not in summary(r)
        text = "\n".join(megatron_report.config_lines(r["configs"][3]))
        assert ("the profiler saw no kernel" in text) if "kernels_s" in seen else \
            "under torch.profiler failed: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED" in text


def test_a_floor_the_pipeline_beat_is_not_shown():
    """A floor measured slower than the pager's own copies is no floor: the summary shows
    no multiple of it, and says why."""
    r = canned_run()
    fp32 = r["configs"][2]
    fp32["floor"] = floor(16 * 10**9, 16 * 10**9, pcie_s=0.437)
    fp32["step_s"] = {"n": 5, "median": 0.35, "min": 0.34, "max": 0.36}
    fp32["opt_step_s"] = {"n": 5, "median": 0.366, "min": 0.36, "max": 0.37}
    fp32["pager"] = dict(fp32["pager"], pipeline_s={"n": 5, "median": 0.359, "min": 0.35,
                                                  "max": 0.37})
    text = summary(r)
    assert ("fp32      not shown: the pager's pipeline (0.359 s) beat its floor (0.437 s, set "
            "by pcie), so that floor was none") in text
    assert "fp32      step" not in text
    assert "q8        step 3.50 x its floor" in text  # the others' floors stand
    text = "\n".join(megatron_report.config_lines(fp32))
    assert ("the pager's pipeline 0.359 s = 0.82 x the floor (below the floor: that floor was "
            "none") in text


def test_the_report_puts_the_configurations_side_by_side(capsys):
    r = canned_run()
    r["configs"][3]["device_time"] = DEVICE_TIME  # q8 ran with --device-time
    r["configs"][3]["pager"]["skipped_steps"] = 1  # Megatron skipped one of q8's steps
    r["configs"][4]["iteration"] = iteration.summary(  # host-fp32 ran with --iteration-trace
        iteration.lanes_of(test_bench_iteration.EVENTS))
    json.dumps(r)  # what --json prints
    b = megatron_report.breakdown(r["configs"][2])
    # 10 - 1 (baseline) - 5 (torch max allocated) = 4 GiB above torch's peak: context 0.5,
    # torch cache 6 - 5 = 1, pool 2.25 held - 0.25 counted by torch too = 2, other 0.5.
    assert b == {"above_torch_peak": 4 * GiB, "context": GiB // 2, "torch_cache": GiB,
                 "pool": 2 * GiB, "other": GiB // 2}
    bench_megatron.print_megatron(r)
    out = capsys.readouterr().out
    assert out.startswith("megatron bench: GPT, 24 layers, hidden 2048")
    assert "micro-batch 4, fp32 grads, overlap_grad_reduce; 3 warm-up" in out.splitlines()[0]
    assert ("one more iteration under torch.profiler: 160.0 ms; on the host forward 50.0, "
            "backward 70.0, optimizer.step 40.0 ms; on the device the model's kernels 13.0 "
            "ms, statepager's 1.0 ms, copies 15.0 ms (host to device 10.0, device to host "
            "6.0), 10.0 ms of them under the model's kernels; while the host ran forward "
            "h2d 10.0, d2h 6.0; while the host ran backward h2d 0.0, d2h 0.0; while the host "
            "ran optimizer.step h2d 0.0, d2h 0.0; the forward's longest stretch without a "
            "copy of the state 31.0 ms, from 19.0 ms") in out
    lines = out.splitlines()

    def row(name):
        return next(line for line in lines if line.strip().startswith(name + " ")).split()

    assert row("fp32")[1:] == ["1.000", "(0.900-1.200,", "n=5)", "0.700", "(0.600-0.800,",
                               "n=5)", "16.00", "16.00", "0.00", "0.00", "9.00", "5.00",
                               "6.00", "2.25"]
    assert row("host-fp32")[7:11] == ["0.00", "0.00", "16.00", "16.00"]
    assert row("unpaged")[7:] == ["-", "-", "-", "-", "32.00", "5.00", "6.00", "-"]
    assert "host-q8   failed (timed out after 240 s):" in out and "OutOfMemory" in out
    assert "1.340 B params; 31 s in all (build, steps, floor)" in out
    assert "stored state 16.00 GB; per step read = stored: True, written = stored: True\n" in out
    assert out.count("timed steps skipped by Megatron") == 1
    assert ("1 timed steps skipped by Megatron (inf or nan in the grads): left out, the "
            "figures are of the others") in out
    # q8 (all or nothing) keeps the undo copies of its residual mains' bf16 params in host
    # memory.
    assert ("stored state 5.00 GB; per step read = stored: True, written = stored: True\n"
            in out)
    assert "undo copies: 2.00 GB of pinned host memory" in out
    assert ("through the mapped store files (map_ram): 5.00 GB of the read and 4.00 GB of the "
            "written per step") in out
    assert out.count("mapped store files") == 1  # the others moved none that way
    assert ("host tier 40.00 GB pinned, 32.00 GB in use after the steps; spilled to the store "
            "over the timed steps: 0.00 GB") in out
    assert ("70 buckets, largest 750 MiB; pool peak mapped 1.50 GiB of a window of 2.50 "
            "GiB") in out
    # opt.step less the pager's set-up, loop and commit: the rest is mostly Megatron's own.
    assert ("opt.step's host time (medians): the pager's set-up 10.0 ms (the epoch, the "
            "first page-ins, the snapshot), its bucket loop 250.0 ms, commit 2.0 ms; the rest, "
            "Megatron's own (grad copies, norm, clip, the params' sync) and the pager's "
            "bookkeeping after the loop, 38.0 ms") in out
    assert ("in the bucket loop, the host's time (medians): stepping 20.0 ms (each bucket's "
            "kernels queued, its hooks), waiting for page-ins 4.0 ms, for the device 3.0 ms "
            "(the residual exception counts of the bucket stepped two before), for page-outs "
            "to land 6.0 ms (room in the window, the last ones)") in out
    # Steps under the forward: the loop runs in the next forward's hooks, not in opt.step.
    under = megatron_worker.opt_step_parts([0.05] * 5, [[0.010, 0.25, 0.0]] * 5, True)
    assert abs(under["rest"]["median"] - 0.04) < 1e-9
    assert ("warm-up steps: driver peak 14.00 GiB; pool mapped before the first step 5.00 "
            "GiB; loss 10.5000 -> 9.2500") in out
    assert ("driver peak - torch max allocated = 4.00 GiB: CUDA context 0.50 + torch cache "
            "1.00 + page pool 2.00 + other 0.50") in out
    assert ("CPU over the timed steps, in cores busy: io_uring workers 11.9, pager I/O thread "
            "0.4, other threads 1.2 (of 16)") in out
    # Each paged configuration against the floor of its own bytes, with the floor's parts.
    # opt.step = the pager's pipeline (the floor's bytes) + the optimizer's work around it.
    assert ("step 2.00 x the floor, opt.step 1.40 x the floor, of which the pager's pipeline "
            "0.550 s = 1.10 x the floor; the floor of its") in out
    assert "floor: 16.00 GB read and 16.00 GB written, measured in this run" in out
    assert ("floor: 0.00 GB read and 0.00 GB written through the files and 16.00 GB from and "
            "16.00 GB to the host tier (PCIe only)") in out
    assert "fio: no fio floor: nothing went through the store's files" in out
    assert "floor = the larger: 0.320 s, set by pcie (no file bytes: PCIe alone)" in out
    assert "floor = the larger: 0.500 s, set by fio" in out
    # The summary: against offload, against the floors, q8 / fp32, the kernels.
    summary = out[out.index("summary (medians of the timed steps):"):]
    assert ("step against Megatron's offload (0.420 s; opt.step 0.294 s; driver peak 21.00 "
            "GiB):") in summary
    assert ("unpaged   0.120 s: 3.50 x faster; opt.step 0.084 s: 3.50 x faster; driver peak "
            "32.00 GiB = 1.52 x the offload's") in summary
    assert ("fp32      1.000 s: 2.38 x slower; opt.step 0.700 s: 2.38 x slower; driver peak "
            "9.00 GiB = 0.43 x the offload's") in summary
    assert ("host-fp32 0.350 s: 1.20 x faster; opt.step 0.245 s: 1.20 x faster; driver peak "
            "10.00 GiB = 0.48 x the offload's") in summary
    assert "host-q8   0" not in summary  # it failed
    assert ("fp32      step 2.00 x its floor, opt.step 1.40 x its floor, the pager's pipeline "
            "1.10 x its floor (0.500 s, set by fio)" in summary)
    assert ("host-fp32 step 1.09 x its floor, opt.step 0.77 x its floor, the pager's pipeline "
            "1.72 x its floor (0.320 s, set by pcie)" in summary)
    assert "q8 / fp32: step 0.70, opt.step 0.70 (q8's step is 1.43 x faster)" in summary
    assert "host-q8 / host-fp32" not in summary
    assert ("statepager's kernels on the device in one more optimizer.step() (--device-time): "
            "q8 24.7 ms = 0.05 x its opt.step") in summary
    assert "failed: host-q8 (their logs above)" in summary
    assert ("one more step's optimizer.step() under torch.profiler, on the device: "
            "statepager's kernels 24.7 ms (adamw_kernel 13.3 ms, checksum_rows_kernel 3.9 ms, "
            "residual_encode_kernel 3.1 ms, residual_rebuild_kernel 2.8 ms) of all kernels' "
            "34.0 ms, 2655 of 3689 launches; copies busy host to device 111.7 ms, device to "
            "host 104.9 ms, both at once 49.5 ms") in out
    # Only q8 ran with --device-time.
    assert out.count("step's optimizer.step() under torch.profiler") == 1


def test_each_configuration_is_printed_as_soon_as_it_ends(tmp_path, capsys, monkeypatch):
    """A run cut short (the whole command's time limit) keeps what finished: each
    configuration's lines are on stdout before the next one starts."""
    monkeypatch.setattr(bench_megatron, "require_megatron", lambda: None)
    results = {c["config"]: c for c in canned_run()["configs"]}
    seen = []

    def worker(spec, work, timeout):
        seen.append(capsys.readouterr().out)  # printed before this configuration starts
        assert timeout == 99 and spec["store"] == os.path.join(work, spec["config"])
        assert spec["fio_jobs"] == (4, 8, 16) and spec["host_budget"] is None
        assert ("trace" in spec) == (spec["config"] == "q8")
        return results[spec["config"]]

    monkeypatch.setattr(bench_megatron, "run_worker", worker)
    trace = str(tmp_path / "t.json")
    assert cli.main(["bench", "megatron", "--dir", str(tmp_path), "--timeout", "99",
                     "--configs", "unpaged,q8,host-q8", "--timeline", "q8", "--trace",
                     trace]) == 1  # host-q8 failed
    last = capsys.readouterr().out
    assert seen[0].startswith("megatron bench: GPT, 24 layers") and "unpaged " not in seen[0]
    assert "  unpaged " in seen[1] and "  q8 " not in seen[1]
    assert "  q8 " in seen[2] and "host-q8" not in seen[2]
    assert last.index("host-q8   failed") < last.index("summary (medians")
    assert "Megatron's offload: not measured" in last and "q8 / fp32" not in last
    assert os.listdir(tmp_path) == []  # its work directory is gone


def test_the_example_gpt_says_why_megatrons_offload_cannot_step_its_fp32_parameter():
    """megatron-core 0.19.2's DistributedOptimizer gives HybridDeviceOptimizer a native fp32
    parameter's shard as a view of it (a non-leaf tensor), which torch refuses: the
    example refuses the combination first, with the way out; bench megatron builds its GPT
    without that parameter (tests/gpu/test_cuda_bench_megatron.py runs offload)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "megatron_gpt.py")
    spec = importlib.util.spec_from_file_location("megatron_gpt_cpu_test", path)
    gpt = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpt  # its dataclass needs it
    try:
        spec.loader.exec_module(gpt)
        assert gpt.Setup().fp32_param  # the tests' GPT keeps it
        with pytest.raises(ValueError, match=r"cannot step a native fp32 parameter: its shard "
                                             r"is a non-leaf view .* Setup\(fp32_param=False\)"):
            gpt.build(gpt.Setup(), optimizer_options=megatron_configs.OFFLOAD)
    finally:
        del sys.modules[spec.name]


def test_the_header_says_when_map_ram_is_off():
    plain = megatron_report.header_lines({"model": MODEL, "dir": "/dev/shm/sp"})[0]
    off = megatron_report.header_lines({"model": dict(MODEL, no_map_ram=True),
                                       "dir": "/dev/shm/sp"})[0]
    assert "map_ram" not in plain
    assert "; map_ram off (a store in RAM goes through io_uring);" in off


def test_megatron_s_checkpoint_is_reported_against_the_state(tmp_path):
    """--checkpoint: the save's and the load's seconds and peaks above what was in use,
    beside the paged state's size; a failure names the error and the figures stand."""
    assert parse(tmp_path, "--checkpoint").checkpoint and not parse(tmp_path).checkpoint
    r = canned_run()
    part = {"seconds": 2.5, "driver": GiB // 2, "torch": GiB // 4, "pool": GiB // 8,
            "host": 3 * GiB}
    r["configs"][2]["checkpoint"] = {"format": "dp_reshardable", "files_bytes": 18 * GiB,
                                     "save": part, "load": dict(part, seconds=4.0),
                                     "statepager": {"files_bytes": 15 * GiB,
                                                    "save": dict(part, pool=0, torch=0),
                                                    "load": dict(part, seconds=1.5)}}
    r["configs"][0]["checkpoint"] = {"format": "dp_reshardable", "files_bytes": 18 * GiB,
                                     "save": dict(part, pool=None), "load": dict(part, pool=None)}
    r["configs"][3]["checkpoint"] = {"error": "CheckpointingException: no room"}
    text = "\n".join(megatron_report.config_lines(r["configs"][2]))
    assert ("Megatron's checkpoint (dp_reshardable, 18.00 GiB in its files of 14.90 GiB "
            "stored): save 2.50 s, peaks above before: device 0.50 GiB (torch 0.25, pool "
            "0.12); host 3.00 GiB; load 4.00 s, peaks above before: device 0.50 GiB (torch "
            "0.25, pool 0.12); host 3.00 GiB; statepager's (15.00 GiB): save 2.50 s, peaks "
            "above before: device 0.50 GiB (torch 0.00, pool 0.00); host 3.00 GiB; load 1.50 "
            "s,") in text
    text = "\n".join(megatron_report.config_lines(r["configs"][0]))
    assert ("Megatron's checkpoint (dp_reshardable, 18.00 GiB in its files): save 2.50 s, "
            "peaks above before: device 0.50 GiB (torch 0.25); host 3.00 GiB;") in text
    text = "\n".join(megatron_report.config_lines(r["configs"][3]))
    assert ("Megatron's checkpoint (--checkpoint) failed: CheckpointingException: no room"
            in text)
    assert "stored state 5.00 GB" in text  # the step's figures stand


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_the_host_peak_is_reset_to_what_is_in_use():
    from statepager.tools.bench import megatron_checkpoint

    before = megatron_checkpoint._reset_host_peak()
    block = bytearray(256 << 20)  # touched: resident
    block[::4096] = b"x" * len(block[::4096])
    assert megatron_checkpoint._host_peak() - before >= 200 << 20
    del block
    assert megatron_checkpoint._reset_host_peak() - before < 100 << 20

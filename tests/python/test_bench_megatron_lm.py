"""`bench megatron-lm` on the CPU: the commands it runs (the GPT's flags, Megatron's
offload flags, statepager's flags per configuration), and a whole run against a stand-in
pretrain_gpt.py that logs Megatron-LM's iteration lines: the medians, the comparison, a
failed configuration with its log's last lines, and a missing checkout named.
tests/gpu/test_cuda_bench_megatron.py runs it on Megatron-LM itself."""
import json
import os
import textwrap

import pytest

from statepager.tools import cli
from statepager.tools.bench import megatron_lm

# Logs Megatron-LM's iteration lines on a clock of its own: iteration i takes 100 + i ms,
# 200 + i ms under Megatron's offload flags. With --save-interval N: after each N-th
# iteration a save's call blocks 50 ms, and the next iteration, under the save, 30 ms more.
PRETRAIN_GPT = textwrap.dedent('''
    import datetime, sys
    argv = sys.argv[1:]
    iters = int(argv[argv.index("--train-iters") + 1])
    every = int(argv[argv.index("--save-interval") + 1]) if "--save-interval" in argv else 0
    base = 200 if "--optimizer-cpu-offload" in argv else 100
    clock = datetime.datetime(2026, 12, 3, 10)
    def at(ms):
        global clock
        clock += datetime.timedelta(milliseconds=ms)
        return clock.isoformat(" ")
    saving = False
    for i in range(1, iters + 1):
        ms = base + i + (30 if saving else 0)
        print(f" [{at(ms)}] iteration {i:8d}/{iters:8d} | consumed samples: {4 * i} | "
              f"elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.0E-04 | "
              "lm loss: 6.9E+00 | grad norm: 1.000 |")
        if saving:
            print(f"  [{at(0)}] successfully saved checkpoint from iteration {i - 1:7d}")
            saving = False
        if every and i % every == 0 and i < iters:
            print(f"  [{at(50)}] scheduled an async checkpoint save at iteration {i:7d}")
            saving = True
''')


def parse(tmp_path, *argv):
    return cli.parser("statepager").parse_args(
        ["bench", "megatron-lm", "--dir", str(tmp_path / "work"), "--megatron-lm",
         str(tmp_path / "mlm"), *argv])


def test_megatron_args_come_last_in_every_configuration(tmp_path):
    args = parse(tmp_path, "--configs", "unpaged,host-q8-overlap",
                 "--megatron-args", "--no-check-for-nan-in-loss-and-grad --seed 7")
    for name in args.configs:
        cmd = megatron_lm.command(name, args, "/w")
        assert cmd[-3:] == ["--no-check-for-nan-in-loss-and-grad", "--seed", "7"]
    plain = megatron_lm.command("unpaged", parse(tmp_path), "/w")
    assert "--no-check-for-nan-in-loss-and-grad" not in plain


def test_each_configuration_runs_pretrain_gpt_with_its_flags(tmp_path):
    args = parse(tmp_path, "--configs", "unpaged,offload,host-q8-overlap,fp32")
    assert args.configs == ["unpaged", "offload", "host-q8-overlap", "fp32"]
    unpaged = megatron_lm.command("unpaged", args, "/w")
    assert unpaged[:6] == [unpaged[0], "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "1"]
    assert unpaged[6] == os.path.join(str(tmp_path / "mlm"), "pretrain_gpt.py")
    flags = unpaged[7:]
    for pair in (("--num-layers", "24"), ("--hidden-size", "2048"), ("--vocab-size", "32000"),
                 ("--micro-batch-size", "4"), ("--global-batch-size", "4"),
                 ("--train-iters", "14")):
        i = flags.index(pair[0])
        assert flags[i + 1] == pair[1]
    assert "--accumulate-allreduce-grads-in-fp32" in flags and "--overlap-grad-reduce" in flags
    plain = megatron_lm.command("unpaged", parse(tmp_path, "--no-overlap-grad-reduce"), "/w")
    assert "--overlap-grad-reduce" not in plain and len(plain) == len(unpaged) - 1
    assert not any(f.startswith("--statepager") for f in flags)
    offload = megatron_lm.command("offload", args, "/w")
    assert offload[7:] == flags + ["--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                                   "--optimizer-offload-fraction", "1.0",
                                   "--overlap-cpu-optimizer-d2h-h2d"]
    q8 = megatron_lm.command("host-q8-overlap", args, "/w")
    assert q8[6:8] == ["-m", "statepager.megatron_lm"]
    extra = q8[9 + len(flags):]
    budget = megatron_lm.host_budget(args, "q8", "residual")
    assert extra == ["--statepager-dir", "/w/host-q8-overlap-{rank}",
                     "--statepager-bucket-size", str(512 << 20),
                     "--statepager-page-size", str(128 << 20), "--statepager-depth", "6",
                     "--statepager-moments", "q8", "--statepager-mains", "residual",
                     "--statepager-host-budget", str(budget),
                     "--statepager-overlap-forward", "on"]
    threaded = megatron_lm.command("host-q8-overlap-thread", args, "/w")
    assert threaded[9 + len(flags):] == [
        "/w/host-q8-overlap-thread-{rank}" if f == "/w/host-q8-overlap-{rank}" else f
        for f in extra] + ["--statepager-step-thread", "on"]
    muon = megatron_lm.command("muon-host-fp32", args, "/w")
    assert muon[9:9 + len(flags) + 2] == flags + ["--optimizer", "muon"]
    assert "--statepager-host-budget" in muon
    fp32 = megatron_lm.command("fp32", args, "/w")
    assert "--statepager-host-budget" not in fp32 and "--statepager-overlap-forward" not in fp32
    i = fp32.index("--statepager-page-size")
    assert fp32[i:i + 4] == ["--statepager-page-size", str(256 << 20), "--statepager-depth", "4"]
    assert megatron_lm.command("unpaged", parse(tmp_path, "--bf16-grads"), "/w").count(
        "--accumulate-allreduce-grads-in-fp32") == 0


def test_the_parameter_count_is_the_1_34_b_gpt_of_bench_megatron():
    assert megatron_lm.gpt_params(24, 2048, 32000, 512) == 1_340_723_200
    # Two copies of 12 bytes per parameter (fp32 mains and moments), 3 % and 256 MiB more.
    args = parse_defaults()
    assert megatron_lm.host_budget(args, "fp32", "fp32") == \
        int(2 * 1_340_723_200 * 12 * 1.03) + (256 << 20)


def test_the_header_says_when_grad_syncs_wait_for_the_backward():
    m = dict(params=1.341e9, layers=24, hidden=2048, heads=16, vocab=32000, seq=512,
             micro_batch=4, iters=14, skip=3, overlap_grad_reduce=False)
    assert "micro-batch 4, without --overlap-grad-reduce); elapsed" in megatron_lm.header(m)
    assert "without" not in megatron_lm.header(dict(m, overlap_grad_reduce=True))


def test_the_header_says_how_many_hardware_queues_the_runs_had():
    """CUDA_DEVICE_MAX_CONNECTIONS as the caller set it (1 puts every stream in one
    queue: the pager's copies behind the model's kernels)."""
    m = dict(params=1.34e9, layers=24, hidden=2048, heads=16, vocab=32000, seq=512,
             micro_batch=4, iters=14, skip=3, overlap_grad_reduce=True)
    assert megatron_lm.header(m).endswith("; CUDA_DEVICE_MAX_CONNECTIONS unset")
    assert megatron_lm.header(dict(m, max_connections="1")).endswith(
        "; CUDA_DEVICE_MAX_CONNECTIONS 1")


def parse_defaults():
    return cli.parser("statepager").parse_args(["bench", "megatron-lm", "--dir", "/tmp"])


@pytest.mark.parametrize("argv, message", [
    (["--configs", "fp32,nope"], "configurations are unpaged, offload"),
    (["--configs", "fp32,fp32"], "names a configuration twice"),
    (["--skip", "0"], "the first iteration builds the moments"),
])
def test_bad_options_are_refused_with_a_message(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit):
        parse(tmp_path, *argv)
    assert message in capsys.readouterr().err


def run_bench(tmp_path, capsys, *argv) -> tuple[int, str]:
    """bench megatron-lm against the stand-in pretrain_gpt.py: (exit status, stdout)."""
    (tmp_path / "mlm").mkdir()
    (tmp_path / "mlm" / "pretrain_gpt.py").write_text(PRETRAIN_GPT)
    code = cli.main(["bench", "megatron-lm", "--dir", str(tmp_path / "work"), "--megatron-lm",
                     str(tmp_path / "mlm"), "--timeout", "120", *argv])
    return code, capsys.readouterr().out


def test_a_run_prints_medians_side_by_side(tmp_path, capsys):
    code, out = run_bench(tmp_path, capsys, "--configs", "unpaged,offload", "--iters", "8")
    assert code == 0, out
    # Iterations 4-8: 104-108 ms unpaged, 204-208 ms under the offload's flags.
    for shown in ("unpaged              106.0 ms per iteration (104.0-108.0, n=5)",
                  "offload              206.0 ms per iteration (204.0-208.0, n=5)",
                  "median of iterations 4-8", "against unpaged's (106.0 ms): offload 1.94 x"):
        assert shown in out, out
    assert not os.listdir(tmp_path / "work")  # the bench's own directory is gone


def test_a_failed_configuration_keeps_its_log_tail_and_the_others_run(tmp_path, capsys):
    """statepager's flags need Megatron-LM's training code, which the stand-in lacks: the
    paged run fails naming it, the unpaged one after it still runs."""
    code, out = run_bench(tmp_path, capsys, "--configs", "fp32,unpaged", "--iters", "5")
    assert code == 1, out
    assert "fp32               failed: exit status 1" in out, out
    assert "not importable" in out, out
    assert "unpaged              104.5 ms per iteration (104.0-105.0, n=2)" in out
    assert "fp32 failed" in out


def test_json_results_hold_every_iteration(tmp_path, capsys):
    code, out = run_bench(tmp_path, capsys, "--configs", "unpaged", "--iters", "5", "--skip",
                          "1", "--json")
    assert code == 0
    r = json.loads(out)
    (c,) = r["configs"]
    assert {int(i): it["ms"] for i, it in c["iterations"].items()} == \
        {i: 100.0 + i for i in range(1, 6)}
    assert [c["iterations"][str(i)]["wall_ms"] for i in range(1, 6)] == \
        [None, 102.0, 103.0, 104.0, 105.0]
    assert (c["median_ms"], c["n"]) == (103.5, 4)
    assert r["failed"] == []


def test_iterations_under_an_async_save_are_timed_apart_by_the_wall_clock(tmp_path, capsys):
    """--save-interval 3: iterations 4 and 7 run under a save, their wall time 50 ms (the
    save's call) + 30 ms more than their neighbours'; Megatron's own time misses the 50."""
    code, out = run_bench(tmp_path, capsys, "--configs", "unpaged", "--iters", "9",
                          "--save-interval", "3", "--json")
    assert code == 0, out
    (c,) = json.loads(out)["configs"]
    saving = sorted(int(i) for i, it in c["iterations"].items() if it["saving"])
    assert saving == [4, 7]
    assert c["iterations"]["4"]["ms"] == 134.0 and c["iterations"]["4"]["wall_ms"] == 184.0
    assert (c["saving_wall_median_ms"], c["saving_wall_n"]) == (185.5, 2)
    assert (c["quiet_wall_median_ms"], c["quiet_wall_n"]) == (107.0, 4)  # 5, 6, 8, 9
    line = megatron_lm.config_line(c)
    assert "185.5 ms with a save in flight (n=2), 107.0 ms without (n=4): 1.73 x" in line
    flags = megatron_lm.command("unpaged", parse(tmp_path, "--save-interval", "3"), "/w")
    assert flags[-2:] == ["--save", "/w/ckpt-unpaged"]
    for flag in ("--async-save", "--use-persistent-ckpt-worker"):
        assert flag in flags


def test_a_missing_checkout_is_named(tmp_path, capsys):
    code = cli.main(["bench", "megatron-lm", "--dir", str(tmp_path / "work"), "--megatron-lm",
                     str(tmp_path / "nowhere")])
    assert code == 1
    err = capsys.readouterr().err
    assert "pretrain_gpt.py" in err and "--megatron-lm" in err


def test_each_configuration_is_compared_with_its_own_optimizers(capsys):
    """Adam's paged runs against unpaged and Megatron's offload; Muon's against Muon's
    unpaged run, never against Adam's."""
    def ran(name, ms):
        return {"config": name, "median_ms": ms}
    megatron_lm.print_megatron_lm({"configs": [
        ran("unpaged", 100.0), ran("offload", 200.0), ran("host-q8", 120.0),
        ran("muon-unpaged", 150.0), ran("muon-host-fp32", 180.0)], "failed": []})
    assert capsys.readouterr().out.splitlines() == [
        "  against unpaged's (100.0 ms): offload 2.00 x (+100.0 ms); host-q8 1.20 x (+20.0 ms)",
        "  against offload's (200.0 ms): host-q8 0.60 x",
        "  against muon-unpaged's (150.0 ms): muon-host-fp32 1.20 x (+30.0 ms)"]


def test_paged_runs_report_statepager_s_fields_of_megatron_s_line():
    """statepager's fields of each counted iteration's line (IntervalStats.log_text), their
    medians beside the iteration's."""
    def line(i, ms, step, waits):
        return (f" [2026-12-06 05:40:0{i}.5] iteration {i:8d}/       5 | consumed samples: 4 | "
                f"elapsed time per iteration (ms): {ms} | lm loss: 9.3E+00 | grad norm: 0.899 | "
                f"statepager read/written per iter (GB): 0.000/0.000 | statepager step (ms): "
                f"{step} | statepager page-in/out wait (ms): {waits} | statepager io overlap: "
                "35% | statepager peak mapped (MiB): 4864 |")
    log = "\n".join([line(1, 900.0, 800.0, "5.0/9.0"), line(2, 300.0, 250.0, "0.5/10.0"),
                     line(3, 310.0, 270.0, "0.3/14.0"), line(4, 320.0, 260.0, "0.4/12.0")])
    its = megatron_lm.iterations(log)
    assert its[3] == {"ms": 310.0, "wall_ms": 1000.0, "saving": False, "step_ms": 270.0,
                      "page_in_wait_ms": 0.3, "page_out_wait_ms": 14.0}
    counted = [its[i] for i in (2, 3, 4)]
    c = {"config": "host-q8-overlap", "what": "w", "driver_peak": None, "median_ms": 310.0,
         "min_ms": 300.0, "max_ms": 320.0, "n": 3,
         "statepager_ms": {k: sorted(it[k] for it in counted)[1]
                           for k in ("step_ms", "page_in_wait_ms", "page_out_wait_ms")}}
    assert ("statepager's step 260.0 ms, waiting for page-ins 0.4 ms and page-outs 12.0 ms"
            in megatron_lm.config_line(c))

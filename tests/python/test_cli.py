"""The command line: bad values are refused with a message, benches state spreads and
unambiguous comparisons, progress shows only on a terminal of rank 0."""
import json
import os
import pty
import subprocess
import sys
import textwrap

import pytest
import torch

from statepager.tools import cli
from statepager.tools.bench import common
from statepager.tools.bench.floor import Fio, find_fio
from statepager.tools.bench.report import faster, show, spread


def refused(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, message", [
    (["bench", "store", "--size", "512X"], "'512X' is not a size"),
    (["bench", "store", "--size", "0"], "the size must be more than 0"),
    (["bench", "store", "--size=-1G"], "the size must be more than 0"),
    (["bench", "store", "--size", "-5G"], "argument --size: '-5G' is -5368709120 bytes: the "
                                          "size must be more than 0"),
    (["bench", "step", "--bucket-size", "-1.5M"], "argument --bucket-size: '-1.5M' is"),
    (["bench", "store", "--repeat", "-2"], "argument --repeat: -2 is too small"),
    (["bench", "store", "--size", "inf"], "'inf' is not a size"),
    (["bench", "store", "--repeat", "0"], "rounds (at least 1)"),
    (["bench", "store", "--io-block", "1000"], "not a multiple of 4 KiB"),
    (["bench", "store", "--io-depth", "0"], "requests in flight (at least 1)"),
    (["bench", "step", "--params", "0"], "the count must be at least 1"),
    (["bench", "step", "--params", "lots"], "'lots' is not a number"),
    (["bench", "step", "--depth", "1"], "one stepping, one moving (at least 2)"),
    (["bench", "step", "--warmup", "0"], "so it is not timed (at least 1)"),
    (["bench", "step", "--steps", "0"], "a step must be timed (at least 1)"),
    (["bench", "step", "--device", "tpu"], "not a device statepager runs on"),
])
def test_bad_bench_values_are_refused_with_a_message(capsys, tmp_path, argv, message):
    refused(capsys, argv + ["--dir", str(tmp_path)], message)


def test_a_dir_that_is_a_file_is_refused(capsys):
    refused(capsys, ["bench", "store", "--dir", "/etc/passwd"], "is a file, not a directory")
    refused(capsys, ["bench", "ckpt", "--dir", "/etc/passwd/x"], "lies under '/etc/passwd'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_device_is_refused(capsys, tmp_path):
    refused(capsys, ["bench", "step", "--dir", str(tmp_path), "--device", "cuda"],
            "no CUDA device is visible here")


def test_comparisons_never_call_a_ratio_below_one_faster():
    assert faster(2.0, 1.0, higher_is_better=True) == "2.00 x faster"
    assert faster(1.0, 1.96, higher_is_better=True) == "1.96 x slower"
    assert faster(1.0, 2.0, higher_is_better=False) == "2.00 x faster"  # seconds
    assert faster(0.51, 1.0, higher_is_better=True) == "1.96 x slower"
    assert faster(1.0, 1.001, higher_is_better=True) == "as fast"
    g = torch.Generator().manual_seed(0)
    for a, b in (torch.rand(200, 2, generator=g) * 10 + 0.01).tolist():
        for better in (True, False):
            words = faster(a, b, higher_is_better=better).split()
            assert words == ["as", "fast"] or float(words[0]) >= 1.0


def test_spread_and_its_wording():
    s = spread([3.0, 1.0, 2.0, 10.0])
    assert s == {"n": 4, "median": 2.5, "min": 1.0, "max": 10.0}
    assert show(s, "GB/s") == "2.50 GB/s (median of 4, 1.00-10.00)"
    assert show(spread([1.5]), "s", 3) == "1.500 s (1 run)"


def test_bench_store_reports_spreads_over_its_rounds(capsys, tmp_path):
    assert cli.main(["bench", "store", "--dir", str(tmp_path), "--size", "16M",
                     "--bucket-size", "4M", "--repeat", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("write_gbps", "read_gbps"):
        assert r[key]["n"] == 2 and r[key]["min"] <= r[key]["median"] <= r[key]["max"]
    assert r["data_intact"]
    assert cli.main(["bench", "store", "--dir", str(tmp_path), "--size", "16M",
                     "--bucket-size", "4M", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "(median of 2, " in out
    for line in out.splitlines():
        if " x " in line:
            assert " x faster" in line or " x slower" in line, line


def test_bench_store_of_less_than_one_io_block(capsys, tmp_path):
    if find_fio()[0] is None:
        pytest.skip("no fio here: the store bench's fio floor is what a small size broke")
    assert cli.main(["bench", "store", "--dir", str(tmp_path), "--size", "1M", "--repeat",
                     "1", "--io-block", "4M", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["data_intact"] and r["fio_write_gbps"]["n"] == 1


def test_a_failing_fio_is_an_error_message_not_a_traceback(capsys, tmp_path, monkeypatch):
    false = Fio("/bin/false", dict(os.environ), "fio-that-fails")
    monkeypatch.setattr(common, "find_fio", lambda: (false, ""))
    assert cli.main(["bench", "store", "--dir", str(tmp_path), "--size", "1M",
                     "--repeat", "1"]) == 1
    err = capsys.readouterr().err
    assert "ChildProcessError: fio write of 1048576 bytes failed (exit status 1)" in err
    assert "Traceback" not in err


def test_inspect_of_a_missing_path_says_it_does_not_exist(capsys, tmp_path):
    missing = tmp_path / "nothing-here"
    assert cli.main(["inspect", str(missing)]) == 1
    assert capsys.readouterr().out == f"{missing} does not exist\n"


def test_bench_map_reports_a_spread(capsys):
    assert cli.main(["bench", "map", "--device", "cpu", "--page-size", "64K", "--size", "8M",
                     "--repeat", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["map_s_per_gib"]["n"] == 3 and r["unmap_s_per_gib"]["n"] == 3


# -- progress ------------------------------------------------------------------------

PROGRESS = textwrap.dedent("""
    from statepager.tools.progress import Progress
    with Progress("work", phases=2) as bar:
        bar.phase("first part")
        bar.phase("second part")
    print("done")
""")


def run_on_terminal(code: str, env: dict) -> tuple[str, str]:
    """Runs `code` with stderr on a pseudo-terminal; returns (stdout, what the terminal got)."""
    leader, follower = pty.openpty()
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=follower, env={**os.environ, **env}, text=True)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        seen += chunk
    out = p.communicate()[0]
    os.close(leader)
    assert p.returncode == 0, seen
    return out, seen.decode(errors="replace")


def test_progress_shows_on_a_terminal_of_rank_0_only():
    out, terminal = run_on_terminal(PROGRESS, {"RANK": "0"})
    assert out == "done\n" and "second part" in terminal
    out, terminal = run_on_terminal(PROGRESS, {"RANK": "1"})
    assert out == "done\n" and terminal == ""


def test_progress_is_silent_when_stderr_is_not_a_terminal():
    r = subprocess.run([sys.executable, "-c", PROGRESS], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "done\n" and r.stderr == ""

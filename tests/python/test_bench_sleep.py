"""`bench sleep`'s report from canned results: pause and resume against the raw io_uring
loop, and with --compare-tms torch-memory-saver's figures and statepager's steady
pause and resume as multiples of its own."""
import os

from statepager.tools.bench import pager as bench_pager
from statepager.tools.bench.report import spread

GiB = 1 << 30


def canned_sleep(**tms):
    r = {"device": "cuda:0", "dir": "/dev/shm", "bytes": 8 * GiB, "tensors": 40,
         "direct_io": False, "io_depth": 64, "io_block": 4 << 20, "host_budget": 8400 << 20,
         "file_bytes_written": 0, "file_bytes_read": 0, "raw_write_gbps": 20.0,
         "raw_read_gbps": 25.0, "freed_bytes": 8 * GiB, "data_intact": True,
         "first": {"pause_gbps": 54.0, "resume_gbps": 50.0},
         "again": {"pause_gbps": spread([55.0, 54.0, 56.0]),
                   "resume_gbps": spread([53.0, 52.0, 54.0])}}
    if tms:
        r["tms"] = tms
    return r


def test_the_sleep_report_gives_statepager_against_torch_memory_saver(capsys):
    tms = {"pause_s": [4.0, 3.9, 4.0, 4.1], "resume_s": [1.0, 1.2, 1.25, 1.3],
           "bytes": 8 * GiB, "data_intact": True, "version": "0.0.10"}
    bench_pager.print_sleep(canned_sleep(**tms))
    out = capsys.readouterr().out
    assert "pause  again 55.00 GB/s (median of 3, 54.00-56.00): 2.75 x faster than the raw " \
        "write" in out
    assert "device memory freed while paused: 8.00 GiB" in out and "data intact: True" in out
    # Steady: 8 GiB / 4.0 s = 2.15 GB/s paused and 8 GiB / 1.25 s = 6.87 GB/s resumed.
    assert "torch-memory-saver 0.0.10 (hook_mode torch, CPU backup pinned" in out
    assert ("statepager vs torch-memory-saver (steady medians): pause 25.6 x, resume 7.7 x\n"
            in out)
    assert out.splitlines()[-1].startswith("  statepager vs torch-memory-saver")


def test_the_sleep_report_says_why_torch_memory_saver_did_not_run(capsys):
    bench_pager.print_sleep(canned_sleep(skipped="torch-memory-saver needs a CUDA device"))
    out = capsys.readouterr().out
    assert "torch-memory-saver: skipped: torch-memory-saver needs a CUDA device" in out
    assert "statepager vs torch-memory-saver" not in out


def test_bench_sleep_saver_runs_each_backup_on_the_host_backend(tmp_path, capsys):
    from statepager.tools import cli
    rc = cli.main(["bench", "sleep", "--saver", "--compare-tms", "--size", "4M", "--repeat",
                   "2", "--dir", str(tmp_path), "--device", "cpu", "--fio-jobs", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "allocated inside region('bench')" in out
    rows = {line.split("  ")[1].strip(): line for line in out.splitlines()
            if line.startswith("  statepager")}
    assert len(rows) == 3, out
    for backup in ("cpu backup", "disk backup"):
        row = next(line for name, line in rows.items() if backup in name)
        assert "pause first" in row and "GB/s, again" in row and "(median of 2" in row
        assert "data intact: True" in row
    discard = next(line for name, line in rows.items() if "no backup" in name)
    assert "pause first" in discard and " ms, again" in discard and "resume first" in discard
    assert "zeros after resume: True" in discard
    assert out.count("torch-memory-saver") == 3 and "needs a CUDA device" in out
    floor = next(line for line in out.splitlines() if line.startswith("  disk floor"))
    assert ("(2 jobs)" in floor and "x the write" in floor) or "fio not found" in floor, floor
    assert os.listdir(tmp_path) == []  # the bench's directory is gone, stores with it


def test_the_saver_report_gives_torch_memory_saver_per_backup(capsys):
    def rounds(intact, **more):
        return {"bytes": 8 * GiB, "tensors": 40, "pause_s": [2.0, 1.0, 1.0],
                "resume_s": [4.0, 2.0, 2.0], "data_intact": intact, **more}
    r = {"saver": True, "device": "cuda:0", "dir": "/d", "repeat": 2, "data_intact": True,
         "cpu": rounds(True, freed_bytes=8 * GiB, zeros_after_resume=None),
         "disk": rounds(True, freed_bytes=8 * GiB, zeros_after_resume=None),
         "none": rounds(None, freed_bytes=8 * GiB, zeros_after_resume=True),
         "tms": {"cpu": rounds(True, version="0.0.10"), "disk": {"failed": "no room"},
                 "none": rounds(None, version="0.0.10")},
         "disk_floor": {"version": "fio-3.33", "jobs": 8, "iodepth": 8, "block": 4 << 20,
                        "direct": True, "write": {"gbps": 17.18}, "read": {"gbps": 8.59},
                        "tried": [(4, 2.0), (8, 1.5)],
                        "fastest": {"write": {"gbps": 17.18, "jobs": 8},
                                    "read": {"gbps": 8.59, "jobs": 4}}}}
    bench_pager.print_sleep(r)
    out = capsys.readouterr().out
    assert "8.00 GiB in 40 tensors allocated inside region('bench')" in out
    # 8 GiB in 2 s first, 1 s after: 4.29 and 8.59 GB/s; no backup: 2000 ms, 1000 ms.
    assert "pause first 4.29 GB/s, again 8.59 GB/s (median of 2, 8.59-8.59)" in out
    assert "no backup (discard)           pause first 2000.0 ms, again 1000.0 ms" in out
    assert "torch-memory-saver disk backup (store in --dir) FAILED: no room" in out
    assert out.count("(0.0.10, hook_mode torch)") == 2
    # The rounds after the first: 8 GiB paused in 1 s (8.59 GB/s), resumed in 2 s.
    assert ("disk floor (fio fio-3.33, 4 MiB requests, O_DIRECT, the fastest of 4, 8 jobs "
            "each way): write 17.18 GB/s (8 jobs), read 8.59 GB/s (4 jobs); pause again 0.50 x "
            "the write, resume 0.50 x the read") in out

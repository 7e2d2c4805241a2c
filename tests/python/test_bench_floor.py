"""The floor of `bench step` (statepager.tools.bench.floor): fio found on the PATH or unpacked
with its own libraries, fio's read/write/both figures on a real directory, the floor as
the larger of PCIe and fio (PCIe skipped on the CPU, with a note), and `bench step`
printing the step as a multiple of it."""
import argparse
import json
import os
import re
import stat

import pytest
import torch

from statepager.tools import cli
from statepager.tools.bench import floor as bench_floor

FIO, WHY_NOT = bench_floor.find_fio()
needs_fio = pytest.mark.skipif(FIO is None, reason=f"no fio here ({WHY_NOT})")


def executable(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return str(path)


def test_an_unpacked_fio_runs_with_its_own_library_folders(tmp_path, monkeypatch):
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    root = tmp_path / "deps" / "fio"
    fio = executable(root / "usr" / "bin" / "fio",
                     "#!/bin/sh\necho \"fio-9.9 $LD_LIBRARY_PATH\"\n")
    libs = root / "usr" / "lib" / "x86_64-linux-gnu"
    os.makedirs(libs / "ceph")
    (libs / "libaio.so.1").write_bytes(b"")
    (libs / "ceph" / "libceph-common.so.2").write_bytes(b"")
    os.makedirs(root / "usr" / "share" / "doc")
    found, why = bench_floor.find_fio([str(tmp_path / "missing"), fio])
    assert why == "" and found.path == fio
    dirs = found.env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert dirs == [str(libs), str(libs / "ceph")]  # no empty entry (the working directory)
    assert found.version.startswith(f"fio-9.9 {libs}{os.pathsep}{libs / 'ceph'}")


def test_no_fio_or_a_broken_one_says_why_and_how_to_get_one(tmp_path):
    found, why = bench_floor.find_fio([str(tmp_path / "nowhere" / "fio")])
    assert found is None
    assert why.startswith("fio not found") and "scripts/fetch_fio.sh" in why
    broken = executable(tmp_path / "fio",
                        "#!/bin/sh\necho 'libaio.so.1: cannot open' >&2\nexit 127\n")
    found, why = bench_floor.find_fio([broken])
    assert found is None and "fio does not run" in why and "libaio.so.1: cannot open" in why


def test_fio_on_its_own_path_variable_comes_first(tmp_path, monkeypatch):
    mine = executable(tmp_path / "myfio", "#!/bin/sh\necho fio-mine\n")
    monkeypatch.setenv(bench_floor.FIO_VARIABLE, mine)
    assert bench_floor.fio_candidates()[0] == mine
    assert bench_floor.find_fio()[0].version == "fio-mine"
    monkeypatch.setenv(bench_floor.FIO_VARIABLE, str(tmp_path / "gone"))
    assert bench_floor.find_fio([str(tmp_path / "gone")]) == (
        None, f"fio does not run (${bench_floor.FIO_VARIABLE}={tmp_path / 'gone'} is not a "
              "file): install fio (apt-get install fio), set $STATEPAGER_FIO to a fio binary, "
              "or unpack one with scripts/fetch_fio.sh into .deps/fio")


@needs_fio
def test_fio_floor_reads_writes_and_does_both_at_once(tmp_path):
    mib = 1 << 20
    r = bench_floor.fio_floor(FIO, str(tmp_path), 24 * mib, 16 * mib, block=mib, depth=8,
                              jobs=2, direct=False)
    assert r["jobs"] == 2 and r["iodepth"] == 4 and r["block"] == mib
    assert r["read"]["bytes"] == 24 * mib and r["write"]["bytes"] == 16 * mib
    both = r["both"]
    assert both["read"]["bytes"] == 24 * mib and both["write"]["bytes"] == 16 * mib
    for way in (r["read"], r["write"], both["read"], both["write"]):
        assert way["gbps"] > 0 and way["seconds"] > 0
    assert r["seconds"] == min(both["seconds"], r["read"]["seconds"] + r["write"]["seconds"])
    assert os.listdir(tmp_path) == []  # its files are gone


@needs_fio
def test_the_fio_floor_is_the_fastest_of_the_job_counts_tried(tmp_path, monkeypatch):
    """A floor measured with too few jobs is one the pager beats: each count runs, the
    fastest sets the floor, and the report names them all."""
    mib = 1 << 20
    real, calls = bench_floor.fio_floor, []

    def timed(*a, jobs, **k):
        calls.append(jobs)
        r = real(*a, jobs=jobs, **k)
        return dict(r, seconds={1: 3.0, 2: 1.0, 4: 2.0}[jobs],
                    read=dict(r["read"], gbps={1: 5.0, 2: 1.0, 4: 2.0}[jobs]),
                    write=dict(r["write"], gbps={1: 1.0, 2: 2.0, 4: 6.0}[jobs]))
    monkeypatch.setattr(bench_floor, "fio_floor", timed)
    r = bench_floor.measure(str(tmp_path), torch.device("cpu"), 4 * mib, 4 * mib,
                            block=mib, depth=4, direct=False, jobs=(1, 2, 4))
    assert calls == [1, 2, 4]
    assert r["fio"]["jobs"] == 2 and r["seconds"] == 1.0
    assert r["fio"]["tried"] == [(1, 3.0), (2, 1.0), (4, 2.0)]
    # Each way's fastest, of any count (what a transfer one way is held to).
    fastest = r["fio"]["fastest"]
    assert (fastest["read"]["jobs"], fastest["read"]["gbps"]) == (1, 5.0)
    assert (fastest["write"]["jobs"], fastest["write"]["gbps"]) == (4, 6.0)
    text = "\n".join(bench_floor.describe(r))
    assert "fio, the fastest of 1 jobs 3.000 s, 2 jobs 1.000 s, 4 jobs 2.000 s:" in text
    assert "fio (fio" in text and "2 jobs each way x 2 x 1024 KiB" in text
    # No more jobs than the pager's requests in flight; a count fio fails at is left out.
    calls.clear()
    r = bench_floor.measure(str(tmp_path), torch.device("cpu"), 4 * mib, 4 * mib,
                            block=mib, depth=2, direct=False, jobs=(1, 2, 4))
    assert calls == [1, 2] and r["fio"]["jobs"] == 2
    real_timed = bench_floor.fio_floor

    def failing(*a, jobs, **k):
        if jobs == 2:
            raise OSError("fio failed (injected)")
        return real_timed(*a, jobs=jobs, **k)
    monkeypatch.setattr(bench_floor, "fio_floor", failing)
    calls.clear()
    r = bench_floor.measure(str(tmp_path), torch.device("cpu"), 4 * mib, 4 * mib,
                            block=mib, depth=4, direct=False, jobs=(1, 2, 4))
    assert calls == [1, 4] and r["fio"]["tried"] == [(1, 3.0), (4, 2.0)]


def test_job_counts_are_comma_separated_whole_numbers():
    from statepager.tools.cli_args import job_counts
    assert job_counts("4, 8,16") == (4, 8, 16) and job_counts("2") == (2,)
    for bad in ("0", "4,x", "", "4,,8", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a job count"):
            job_counts(bad)


@needs_fio
def test_on_the_cpu_the_floor_is_fio_alone_with_a_note(tmp_path):
    r = bench_floor.measure(str(tmp_path), torch.device("cpu"), 8 << 20, 8 << 20,
                            block=1 << 20, depth=4, direct=False, jobs=(2,))
    assert r["pcie"] is None and "the device is the CPU" in r["pcie_note"]
    assert r["bound_by"] == "fio" and r["seconds"] == r["fio"]["seconds"]
    text = "\n".join(bench_floor.describe(r))
    assert "PCIe: no PCIe floor" in text
    assert "set by fio (no PCIe on this device: fio alone)" in text


def test_without_fio_the_pcie_floor_stands_alone_and_says_so():
    pcie = {"seconds": {"n": 3, "median": 0.5, "min": 0.4, "max": 0.6}, "chunk": 1,
            "h2d_gbps": 50.0, "d2h_gbps": 40.0}
    r = {"read_bytes": 10**9, "write_bytes": 10**9, "pcie": pcie, "fio": None,
         "pcie_note": "", "fio_note": "fio not found: install fio", "seconds": 0.5,
         "bound_by": "pcie"}
    text = "\n".join(bench_floor.describe(r))
    assert "fio: fio not found: install fio" in text
    assert "0.500 s, set by pcie (fio missing: PCIe alone)" in text
    none = dict(r, pcie=None, pcie_note="no PCIe floor: the device is the CPU", seconds=None,
                bound_by=None)
    assert "no floor: neither could be measured here" in "\n".join(bench_floor.describe(none))


@needs_fio
def test_mapped_store_bytes_take_pcie_alone_and_fio_only_the_rest(tmp_path):
    """Store bytes the device copied through mapped files (map_ram) crossed no file system:
    fio's floor (a kernel copy) is measured on the other bytes only, and with none left
    there is no fio floor."""
    mib = 1 << 20
    kw = dict(block=mib, depth=4, direct=False, jobs=(1,))
    part = bench_floor.measure(str(tmp_path), torch.device("cpu"), 8 * mib, 8 * mib,
                               mapped_in=6 * mib, mapped_out=4 * mib, **kw)
    assert part["fio"]["read"]["bytes"] == 2 * mib
    assert part["fio"]["write"]["bytes"] == 4 * mib
    every = bench_floor.measure(str(tmp_path), torch.device("cpu"), 8 * mib, 8 * mib,
                                mapped_in=8 * mib, mapped_out=8 * mib, **kw)
    assert every["fio"] is None and every["seconds"] is None
    assert every["fio_note"] == ("no fio floor: no byte went through the file system (the "
                                 "store files were mapped)")
    pcie = {"seconds": {"n": 3, "median": 0.5, "min": 0.4, "max": 0.6}, "chunk": 1,
            "h2d_gbps": 50.0, "d2h_gbps": 40.0}
    text = "\n".join(bench_floor.describe(dict(every, pcie=pcie, seconds=0.5,
                                                bound_by="pcie")))
    assert text.startswith("floor: 0.01 GB read and 0.01 GB written through the files (0.01 "
                           "and 0.01 GB of them mapped: PCIe only), measured"), text
    assert "0.500 s, set by pcie (every file byte mapped: PCIe alone)" in text


@needs_fio
def test_with_no_file_bytes_there_is_no_fio_floor_and_the_host_tier_bytes_are_named(tmp_path):
    r = bench_floor.measure(str(tmp_path), torch.device("cpu"), 0, 0, block=1 << 20, depth=4,
                            direct=False, host_in=3 * 10**9, host_out=2 * 10**9)
    assert r["fio"] is None and r["fio_note"] == ("no fio floor: nothing went through the "
                                                  "store's files")
    assert (r["host_in"], r["host_out"]) == (3 * 10**9, 2 * 10**9) and r["seconds"] is None
    pcie = {"seconds": {"n": 3, "median": 0.5, "min": 0.4, "max": 0.6}, "chunk": 1,
            "h2d_gbps": 50.0, "d2h_gbps": 40.0}
    text = "\n".join(bench_floor.describe(dict(r, pcie=pcie, seconds=0.5, bound_by="pcie")))
    assert text.startswith("floor: 0.00 GB read and 0.00 GB written through the files and "
                           "3.00 GB from and 2.00 GB to the host tier (PCIe only), measured")
    assert "fio: no fio floor: nothing went through the store's files" in text
    assert "0.500 s, set by pcie (no file bytes: PCIe alone)" in text


@needs_fio
def test_bench_step_prints_the_step_as_a_multiple_of_the_floor(capsys, tmp_path):
    assert cli.main(["bench", "step", "--device", "cpu", "--dir", str(tmp_path),
                     "--params", "3e6", "--warmup", "1", "--steps", "1", "--bucket-size", "8M",
                     "--no-baseline", "--no-in-place", "--fio-jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "x the floor" in out and "fio (" in out and "no PCIe floor" in out, out
    assert "raw io_uring" not in out


@needs_fio
def test_bench_step_with_part_of_the_state_in_the_host_tier_prints_its_mean_step(capsys,
                                                                                  tmp_path):
    """Atomic steps alternate which part the host tier keeps: the mean step against the
    floor of the mean step's bytes."""
    with pytest.warns(UserWarning, match="spill to the store at every step"):
        assert cli.main(["bench", "step", "--device", "cpu", "--dir", str(tmp_path),
                         "--params", "3e6", "--warmup", "1", "--steps", "2", "--bucket-size", "8M",
                         "--host-budget", "20M", "--no-baseline", "--no-in-place",
                         "--fio-jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  host tier holding part of the state: mean step [0-9.]+ x the floor "
                     r"of the mean step's bytes \(set by fio\)$", out, re.M), out


def test_bench_step_times_only_the_steps_after_the_warmup(capsys, tmp_path):
    assert cli.main(["bench", "step", "--device", "cpu", "--dir", str(tmp_path), "--json",
                     "--params", "1e6", "--warmup", "3", "--steps", "2", "--bucket-size", "2M",
                     "--no-baseline", "--no-in-place", "--fio-jobs", "1"]) == 0
    paged = json.loads(capsys.readouterr().out)["paged"]
    assert paged["step_s"]["n"] == 2 and len(paged["warmup_s"]) == 2
    # Per timed step: a whole step's bytes, the mains and both moments each way.
    assert paged["bytes_read"] == paged["bytes_written"] == 12 * 10**6


@needs_fio
def test_bench_step_on_a_mapped_ram_store_says_what_went_through_the_mapping(capsys,
                                                                             shm_dir):
    os.makedirs(shm_dir)
    assert cli.main(["bench", "step", "--device", "cpu", "--dir", shm_dir, "--params", "3e6",
                     "--warmup", "1", "--steps", "1", "--bucket-size", "8M", "--no-baseline",
                     "--no-in-place", "--fio-jobs", "2"]) == 0
    out = capsys.readouterr().out
    # Every store byte went through the mapping: no fio floor, and a CPU has no PCIe one.
    assert "through the mapped store files (map_ram): 0.04 GB of the read and " in out, out
    assert "no fio floor: no byte went through the file system" in out, out

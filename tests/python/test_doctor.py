"""statepager doctor on a good directory, on tmpfs, on a read-only mount, with io_uring
blocked by a seccomp filter (as in a container), and the pager's own error there."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = [sys.executable, os.path.join(HERE, "seccomp_block.py")]
DOCTOR = [sys.executable, "-m", "statepager", "doctor", "--probe-size", "16M"]


def doctor(*args, wrap=(), as_json=True):
    """(exit status, {check name: check} or the printed text)."""
    r = subprocess.run([*wrap, *DOCTOR, *map(str, args), *(["--json"] if as_json else [])],
                       capture_output=True, text=True)
    if r.returncode == 77:
        pytest.skip("seccomp filters cannot be installed here (prctl refused)")
    assert "Traceback" not in r.stderr, r.stderr
    if not as_json:
        return r.returncode, r.stdout
    report = json.loads(r.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["blockers"] == [n for n, c in checks.items() if c["status"] == "FAIL"]
    return r.returncode, checks


def test_good_directory(tmp_path):
    code, c = doctor("--dir", tmp_path, "--device", "cpu")
    assert code == 0, c
    assert c["io_uring"]["status"] == "ok"
    assert c["directory"]["status"] == "ok" and "writable" in c["directory"]["detail"]
    assert c["direct I/O"]["status"] in ("ok", "warn")
    assert c["free space"]["figures"]["free_bytes"] > 0
    assert c["bandwidth"]["figures"]["read_gbps"] > 0 < c["bandwidth"]["figures"]["write_gbps"]
    assert c["checkpoints"]["figures"]["copy_method"] in ("reflink", "copy_file_range",
                                                         "read_write")
    assert c["memlock"]["status"] in ("ok", "warn") and c["cuda"]["status"] == "skip"
    assert os.listdir(tmp_path) == []  # the directory is left as found
    code, text = doctor("--dir", tmp_path, "--device", "cpu", as_json=False)
    assert code == 0 and "no blockers" in text and "bandwidth" in text


def test_state_larger_than_the_free_space_is_a_blocker(tmp_path):
    code, c = doctor("--dir", tmp_path, "--device", "cpu", "--size", "1000T")
    assert code == 1 and c["free space"]["status"] == "FAIL"
    assert "free space" in c["free space"]["fix"]
    # ... and than the host memory: a host tier holding it is a warning, with the sizes.
    h = c["host memory"]
    assert h["status"] == "warn" and "spills the rest to the store" in h["fix"]
    assert "host_budget 1024000.0 GiB (atomic='bucket', the default), 2048000.0 GiB with " \
        "atomic='step'" in h["detail"]


def test_host_memory_holds_a_small_state(tmp_path):
    code, c = doctor("--dir", tmp_path, "--device", "cpu", "--size", "1M")
    h = c["host memory"]
    assert code == 0 and h["status"] == "ok" and h["figures"]["available_bytes"] > 1 << 20


def test_tmpfs(shm_dir):
    code, c = doctor("--dir", shm_dir, "--device", "cpu")
    assert code == 0, c
    assert c["directory"]["figures"]["fstype"] == "tmpfs"
    assert "the Pager creates it" in c["directory"]["detail"]  # shm_dir does not exist yet
    assert c["direct I/O"]["status"] == "ok" and "is RAM" in c["direct I/O"]["detail"]
    assert "map_ram, the default" in c["direct I/O"]["detail"]  # how it moves, and the other way
    assert "map_ram=False" in c["direct I/O"]["detail"]
    assert not os.path.exists(shm_dir)


def test_a_file_is_not_a_directory():
    code, c = doctor("--dir", "/etc/passwd", "--device", "cpu")
    assert code == 1 and c["directory"]["status"] == "FAIL"
    assert "not a directory" in c["directory"]["detail"]


def test_read_only_mount(tmp_path):
    """A tmpfs mounted read-only, in a private mount namespace (needs CAP_SYS_ADMIN)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here to make a private mount namespace")
    mount = tmp_path / "ro"
    mount.mkdir()
    script = ('mount -t tmpfs -o ro tmpfs "$1" || exit 77; shift; exec "$@"')
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                        "sh", str(mount), *DOCTOR, "--dir", str(mount / "store"), "--device",
                        "cpu", "--json"], capture_output=True, text=True)
    if r.returncode == 77 or "unshare failed" in r.stderr:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs CAP_SYS_ADMIN): {r.stderr}")
    assert r.returncode == 1, r.stdout + r.stderr
    c = {x["name"]: x for x in json.loads(r.stdout)["checks"]}
    assert c["directory"]["status"] == "FAIL"
    assert "read-only filesystem" in c["directory"]["detail"]
    assert "writable filesystem" in c["directory"]["fix"]


def test_io_uring_blocked_by_seccomp(tmp_path):
    code, c = doctor("--dir", tmp_path, "--device", "cpu", wrap=[*BLOCK, "--"])
    assert code == 1
    assert c["io_uring"]["status"] == "FAIL" and "blocked" in c["io_uring"]["detail"]
    assert "seccomp" in c["io_uring"]["fix"]
    assert c["directory"]["status"] == "ok"  # the directory is not blamed
    assert c["direct I/O"]["status"] == "skip"
    code, text = doctor("--dir", tmp_path, "--device", "cpu", wrap=[*BLOCK, "--"],
                        as_json=False)
    assert code == 1 and "FAIL  io_uring" in text and "fix: allow io_uring_setup" in text


@pytest.mark.parametrize("err, words", [("EPERM", "io_uring is blocked"),
                                        ("ENOSYS", "io_uring is not available")])
def test_the_pagers_own_error_names_io_uring_not_permissions(tmp_path, err, words):
    r = subprocess.run([*BLOCK, "--errno", err, "--", sys.executable, "-c",
                        f"import statepager; statepager.Pager({str(tmp_path / 's')!r})"],
                       capture_output=True, text=True)
    if r.returncode == 77:
        pytest.skip("seccomp filters cannot be installed here (prctl refused)")
    assert r.returncode == 1
    assert "IoUringUnavailableError: " + words in r.stderr, r.stderr
    assert "seccomp" in r.stderr and "writable" not in r.stderr


def test_low_memlock_limit_is_a_warning_and_the_pager_still_runs(tmp_path):
    """Without CAP_IPC_LOCK and with 1 MiB of RLIMIT_MEMLOCK the staging buffers cannot be
    registered: a warning naming the fix; the pager (the bandwidth check) still runs."""
    if shutil.which("setpriv") is None or shutil.which("prlimit") is None:
        pytest.skip("no setpriv/prlimit (util-linux) here to drop CAP_IPC_LOCK")
    code, c = doctor("--dir", tmp_path, "--device", "cpu", wrap=[
        "setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock",
        "prlimit", "--memlock=1048576"])
    assert code == 0, c
    assert c["memlock"]["status"] == "warn" and "ulimit -l" in c["memlock"]["fix"]
    assert c["memlock"]["figures"]["rlimit_memlock"] == 1 << 20
    assert c["bandwidth"]["figures"]["write_gbps"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_asked_for_without_one_is_a_blocker(tmp_path):
    code, c = doctor("--device", "cuda")
    assert code == 1 and c["cuda driver"]["status"] == "FAIL" and c["cuda driver"]["fix"]


@pytest.mark.gpu
def test_cuda_device_checks(tmp_path):
    code, c = doctor("--dir", tmp_path, "--device", "cuda")
    assert code == 0, c
    assert c["cuda vmm"]["status"] == "ok"
    assert c["pcie"]["figures"]["h2d_gbps"]["median"] > 1
    assert c["pcie"]["figures"]["d2h_gbps"]["median"] > 1

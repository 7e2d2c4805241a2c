"""Shared pytest fixtures, and the markers: `gpu` tests skip (with the reason) on
machines without a CUDA device, and `pytest -m gpu tests` runs just the GPU suite;
`alone` tests need the device to themselves (they read the driver's free memory, or
start processes of their own by the handful), so scripts/gpu.sh runs them one at a time
after the others, which it runs side by side under pytest-xdist. `megatron` tests need
megatron-core (Python >= 3.12 wheels, which the GPU machine's suite carries) but no GPU:
the GPU suite runs them with its shared part."""
import os
import subprocess
import uuid

import pytest
import torch

import statepager

HAVE_GPU = torch.cuda.is_available() and statepager.cuda_available()

# Under pytest-xdist (`-n N`), each worker's single-rank Megatron jobs (its own and its
# subprocesses') rendezvous on a port of its own: they would otherwise share
# examples/megatron_gpt.py's default.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("MASTER_PORT",
                          str(29600 + int(os.environ["PYTEST_XDIST_WORKER"].lstrip("gw"))))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "alone: needs the device to itself (see the module doc)")
    config.addinivalue_line("markers", "megatron: needs megatron-core, not a GPU (skipped "
                                       "without it); the GPU suite, which carries it, runs it")


def pytest_terminal_summary(terminalreporter, config):
    """Lines a test module left in config.summary_lines (e.g. test_optim_db's counts)."""
    for line in getattr(config, "summary_lines", []):
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "cuda_free" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.alone)
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device here: the GPU suite runs on the GPU machine "
                                   "(scripts/gpu.sh test)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def store_dir(tmp_path):
    """A fresh store directory on the same filesystem as the test's temp dir."""
    return str(tmp_path / f"store-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def shm_dir():
    """A store directory on tmpfs."""
    d = f"/dev/shm/statepager-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield d
    os.system(f"rm -rf {d}")


@pytest.fixture
def sized_tmpfs(tmp_path):
    """mount(mib, why) -> the path of a fresh tmpfs of `mib` MiB, to fill up (ENOSPC); the
    test is skipped, saying `why` needs it, where mounting is not permitted (needs root,
    as on CI). Unmounted after the test."""
    mounted = []

    def mount(mib: int, why: str) -> str:
        mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "statepager-test",
                            str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            cause = r.stderr.strip() or "mount failed"
            pytest.skip(f"cannot mount a size-limited tmpfs here ({cause}): {why} needs root")
        mounted.append(str(mnt))
        return str(mnt)

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", mnt], check=False)


@pytest.fixture
def cuda_free():
    """Bytes the CUDA driver reports free, after the device's queued work is done."""
    def read() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]
    return read

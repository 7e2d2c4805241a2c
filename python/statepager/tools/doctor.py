"""statepager doctor: checks what the pager needs on this machine, and names each fix.

    statepager doctor [--dir D] [--device cuda] [--size 64G] [--probe-size 256M] [--json]

Checks, each ok, warn (works, slower or with a caveat), FAIL (a blocker) or skip:
  torch        the torch imported is the one the extension was built against
  io_uring     io_uring_setup works (a container's seccomp profile or sysctl
               kernel.io_uring_disabled blocks it)
  directory    D (or its nearest existing ancestor) is a directory this process can
               write, on a filesystem that is not read-only; its filesystem type
  direct I/O   a Pager on D: O_DIRECT past the page cache, or buffered (RAM filesystems
               by design; other filesystems that refuse O_DIRECT: slower)
  free space   free bytes on D's filesystem, against --size when given
  checkpoints  how a checkpoint on D's filesystem copies (reflink or copy_file_range)
  bandwidth    D's sequential read and write through the pager's raw io_uring loop
  memlock      RLIMIT_MEMLOCK against the pager's registered staging buffers
  host memory  the memory available, against a host tier holding --size (host_budget)
  cuda         (--device cuda) the CUDA driver, the device's virtual memory management
               support (the pool needs it), and host<->device copy bandwidth (PCIe)
The exit status is 1 when a check failed, else 0. D is left as found: the checks work
in a temporary directory inside it (or its nearest existing ancestor), removed after.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from statepager import _C
from statepager.tools.bench.report import spread
from statepager.tools.progress import Progress
from statepager.util.units import GiB, MiB

NR_IO_URING_SETUP = 425  # the same number on every Linux architecture (since 5.1)
CAP_IPC_LOCK = 14
VMM_ATTRIBUTE = 102      # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED


@dataclass
class Check:
    name: str
    status: str           # "ok", "warn", "FAIL" or "skip"
    detail: str
    fix: str = ""
    figures: dict = field(default_factory=dict)


def run(directory: str | None, device: str, size: int | None, probe_bytes: int) -> list:
    """Every check, in order."""
    with Progress("statepager doctor", phases=4) as bar:
        bar.phase("torch, io_uring")
        checks = [check_torch(), check_io_uring()]
        bar.phase("directory")
        io_ok = checks[-1].status != "FAIL"
        staging = None
        if directory is None:
            checks.append(Check("directory", "skip", "no --dir given: pass --dir D to check the "
                                "directory the Pager will store to"))
        else:
            found, staging = check_directory(directory, size, probe_bytes, io_ok, bar)
            checks += found
        checks.append(check_memlock(staging))
        checks.append(check_host_memory(size))
        bar.phase("cuda")
        checks += check_cuda(device, probe_bytes)
    return checks


def check_host_memory(size: int | None) -> Check:
    """What a host tier holding the whole state (host_budget) needs: the state's size with
    the default resumable steps, twice that with all-or-nothing ones (Note [Atomic steps
    need twice the state in the host tier])."""
    available = _mem_available()
    figures = {"available_bytes": available, "needed_bytes": size}
    if size is None or available is None:
        return Check("host memory", "ok", "pass --size to check a host tier holding the state "
                     "(host_budget) against the memory available", figures=figures)
    text = (f"{available / GiB:.1f} GiB available; a host tier holding the state needs "
            f"host_budget {size / GiB:.1f} GiB (atomic='bucket', the default), "
            f"{2 * size / GiB:.1f} GiB with atomic='step'")
    if available < size:
        return Check("host memory", "warn", text, "a smaller host_budget spills the rest to "
                     "the store at every step: keep the store on local NVMe", figures)
    return Check("host memory", "ok", text, figures=figures)


def _mem_available() -> int | None:
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


# -- torch and io_uring --------------------------------------------------------------

def check_torch() -> Check:
    # Importing statepager refuses a torch of another minor release; report both anyway.
    return Check("torch", "ok", f"torch {torch.__version__} (CUDA {torch.version.cuda}); the "
                 f"extension was built against torch {_C.TORCH_VERSION}")


def check_io_uring() -> Check:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    fd = libc.syscall(ctypes.c_long(NR_IO_URING_SETUP), ctypes.c_uint(1), params)
    kernel = platform.release()
    if fd >= 0:
        os.close(fd)
        return Check("io_uring", "ok", f"io_uring_setup works (Linux {kernel})")
    err = ctypes.get_errno()
    sysctl = _read("/proc/sys/kernel/io_uring_disabled")
    if err in (errno.EPERM, errno.EACCES, errno.ENOSYS):
        cause = ("blocked for this process" if err != errno.ENOSYS else "not available")
        fix = ("allow io_uring_setup, io_uring_enter and io_uring_register in the container's "
               "seccomp profile (Docker 25+ blocks them by default: docker run --security-opt "
               "seccomp=<profile that allows them>)")
        if sysctl not in (None, "0"):
            fix = (f"sysctl kernel.io_uring_disabled is {sysctl}: set it to 0 (or 1 with this "
                   f"user in kernel.io_uring_group); or {fix}")
        if err == errno.ENOSYS:
            fix += "; or use a kernel with io_uring (Linux 5.10+)"
        return Check("io_uring", "FAIL", f"io_uring is {cause} (io_uring_setup: "
                     f"{os.strerror(err)}; Linux {kernel}): the pager cannot run", fix)
    fix = ("raise the locked-memory limit (ulimit -l; docker run --ulimit memlock=-1)"
           if err == errno.ENOMEM else "")
    return Check("io_uring", "FAIL", f"io_uring_setup failed: {os.strerror(err)} "
                 f"(Linux {kernel})", fix)


# -- the directory ---------------------------------------------------------------------

def check_directory(directory: str, size: int | None, probe_bytes: int, io_ok: bool,
                    bar) -> tuple[list, int | None]:
    """The directory's checks, and the staging bytes a Pager there registers (None when
    no Pager could be opened)."""
    path = os.path.abspath(directory)
    base = path
    while not os.path.lexists(base):
        base = os.path.dirname(base)
    mount = _mount_of(base)
    where = f"{mount['fstype']} at {mount['point']}" if mount else "filesystem unknown"
    if not os.path.isdir(base):
        what = "is not a directory" if base == path else f"lies under {base}, not a directory"
        return [Check("directory", "FAIL", f"{path} {what}",
                      "give the Pager a directory (it is created when missing)")], None
    try:
        work = tempfile.mkdtemp(prefix=".statepager-doctor-", dir=base)
    except OSError as e:
        return [_unwritable(path, base, mount, e)], None
    try:
        missing = "" if base == path else f" (missing: the Pager creates it under {base})"
        checks = [Check("directory", "ok", f"{path}{missing}: {where}, writable",
                        figures={"fstype": mount["fstype"] if mount else None})]
        checks.append(_free_space(base, size))
        if not io_ok:
            checks.append(Check("direct I/O", "skip", "io_uring is not available"))
            return checks, None
        bar.phase("bandwidth")
        pager_checks, staging = _pager_checks(work, mount, probe_bytes)
        return checks + pager_checks, staging
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _unwritable(path: str, base: str, mount: dict | None, e: OSError) -> Check:
    if e.errno == errno.EROFS or (mount and mount["read_only"]):
        return Check("directory", "FAIL", f"{path}: {base} is on a read-only filesystem "
                     f"({mount['fstype'] if mount else '?'} mounted read-only at "
                     f"{mount['point'] if mount else '?'})",
                     "give the Pager a directory on a writable filesystem (local NVMe), or "
                     "remount this one read-write")
    if e.errno in (errno.EACCES, errno.EPERM):
        return Check("directory", "FAIL", f"{path}: {base} is not writable by this process "
                     f"(uid {os.getuid()}): {e.strerror}",
                     "give the Pager a directory this user can write (chown/chmod it), or "
                     "run as its owner")
    return Check("directory", "FAIL", f"{path}: cannot create a file in {base}: {e}")


def _free_space(base: str, size: int | None) -> Check:
    st = os.statvfs(base)
    free = st.f_bavail * st.f_frsize
    figures = {"free_bytes": free, "needed_bytes": size}
    if size is None:
        return Check("free space", "ok", f"{free / GiB:.1f} GiB free (pass --size to check "
                     "against the state's size)", figures=figures)
    if free < size:
        return Check("free space", "FAIL", f"{free / GiB:.1f} GiB free, the state needs "
                     f"{size / GiB:.1f} GiB", "free space on this filesystem or give the Pager "
                     "a larger one", figures)
    return Check("free space", "ok", f"{free / GiB:.1f} GiB free, the state needs "
                 f"{size / GiB:.1f} GiB", figures=figures)


def _pager_checks(work: str, mount: dict | None, probe_bytes: int) -> tuple[list, int | None]:
    """A host Pager in `work` (what the pager itself chooses there), checkpoint copies and
    the raw io_uring bandwidth with the pager's I/O shape."""
    from statepager.core.pager import Pager

    checks = []
    try:
        with Pager(os.path.join(work, "store"), device="cpu") as pager:
            stats = pager.stats()
    except _C.Error as e:
        return [Check("direct I/O", "FAIL", f"a Pager cannot open a store here: {e}")], None
    depth, block, direct = stats["io_depth"], stats["io_block"], stats["direct_io"]
    shape = f"{depth} x {block // MiB} MiB requests in flight"
    ram = mount is not None and mount["fstype"] in ("tmpfs", "ramfs")
    if direct:
        checks.append(Check("direct I/O", "ok", f"O_DIRECT: the pager moves state past the "
                            f"page cache, {shape}"))
    elif ram:
        checks.append(Check("direct I/O", "ok", f"{mount['fstype']} is RAM: the state takes "
                            "host memory, not disk, and is lost at reboot. A GPU's copy "
                            "engines move it straight to and from the store files' pages "
                            "(map_ram, the default; they stay pinned and keep their "
                            "high-water mark), as fast as a host tier (host_budget); with "
                            f"map_ram=False, buffered I/O striped over 8 files, {shape}, "
                            "copied by the kernel on the CPU (on the H200 machine 12 of 16 "
                            "cores for 15 GB/s each way, half the copy engines' speed)"))
    else:
        checks.append(Check("direct I/O", "warn", "the filesystem refuses O_DIRECT: the pager "
                            "falls back to buffered I/O through the page cache (slower, and "
                            "it takes host memory)", "use a local ext4 or XFS directory on "
                            "NVMe for the store"))
    src, dst = os.path.join(work, "copy-src"), os.path.join(work, "copy-dst")
    with open(src, "wb") as f:
        f.write(os.urandom(MiB))
    method = _C.copy_file(src, dst)
    saves = ("shares the store's blocks (reflink: no bytes moved; its crc32c checksums read "
             "them once)" if method == "reflink" else
             "copies the store through memory, crc32c-checksummed in the same pass (no "
             f"reflink here; a plain file copy goes by {method})")
    checks.append(Check("checkpoints", "ok", f"a checkpoint here {saves}",
                        figures={"copy_method": method}))
    read = _C.measure_raw_io(work, probe_bytes, block, depth, True, False)
    write = _C.measure_raw_io(work, probe_bytes, block, depth, False, True)
    checks.append(Check("bandwidth", "ok", f"read {read['read_gbps']:.2f} GB/s, write "
                        f"{write['write_gbps']:.2f} GB/s ({probe_bytes // MiB} MiB each, "
                        f"{shape}, the pager's raw io_uring loop)",
                        figures={"read_gbps": read["read_gbps"],
                                 "write_gbps": write["write_gbps"]}))
    return checks, depth * block


# -- memlock and CUDA ------------------------------------------------------------------

def check_memlock(staging: int | None) -> Check:
    """The pager registers its staging buffers with io_uring (faster I/O); the kernel
    counts them against RLIMIT_MEMLOCK unless the process has CAP_IPC_LOCK."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need = staging if staging is not None else 64 * 4 * MiB  # the disk default, 64 x 4 MiB
    figures = {"rlimit_memlock": None if soft == resource.RLIM_INFINITY else soft,
               "registered_bytes": need}
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / MiB:.0f} MiB"
    if _has_capability(CAP_IPC_LOCK):
        return Check("memlock", "ok", f"CAP_IPC_LOCK: registered buffers are not limited "
                     f"(RLIMIT_MEMLOCK {limit})", figures=figures)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return Check("memlock", "ok", f"RLIMIT_MEMLOCK {limit} holds the {need // MiB} MiB of "
                     "registered staging buffers", figures=figures)
    return Check("memlock", "warn", f"RLIMIT_MEMLOCK {limit} is below the {need // MiB} MiB "
                 "of staging buffers the pager registers with io_uring: it falls back to "
                 "unregistered I/O (correct, a little slower)",
                 "raise the limit: ulimit -l unlimited (docker run --ulimit memlock=-1, "
                 "or LimitMEMLOCK=infinity in a systemd unit)", figures)


def check_cuda(device: str, probe_bytes: int) -> list:
    dev = torch.device(device)
    if dev.type != "cuda":
        return [Check("cuda", "skip", f"--device {device}: pass --device cuda to check the GPU")]
    index = dev.index or 0
    driver = _cuda_driver(index)
    if isinstance(driver, Check):
        return [driver]
    checks = [Check("cuda driver", "ok", f"driver {driver['driver']} (CUDA "
                    f"{driver['driver_cuda']}), device {index}: {driver['name']}; torch built "
                    f"for CUDA {torch.version.cuda}", figures=driver)]
    if torch.version.cuda is None:
        checks.append(Check("cuda torch", "FAIL", f"torch {torch.__version__} is a CPU build",
                            "install a CUDA build of torch (pip install torch "
                            "--index-url https://download.pytorch.org/whl/cu130)"))
    elif _version(torch.version.cuda) > _version(driver["driver_cuda"]):
        checks.append(Check("cuda torch", "FAIL", f"torch needs CUDA {torch.version.cuda}, the "
                            f"driver supports up to {driver['driver_cuda']}",
                            "update the NVIDIA driver, or install a torch built for an "
                            "older CUDA"))
    if not driver["vmm"]:
        checks.append(Check("cuda vmm", "FAIL", f"{driver['name']} does not support CUDA "
                            "virtual memory management (cuMemCreate/cuMemMap), which the pool "
                            "is built on", "use a GPU and driver with VMM support (Pascal "
                            "or newer, not under vGPU profiles that disable it)"))
    else:
        checks.append(Check("cuda vmm", "ok", "virtual memory management supported"))
    if not _C.cuda_available():
        checks.append(Check("cuda pager", "FAIL", "statepager's extension sees no CUDA "
                            "device: it was built without the CUDA headers",
                            "rebuild where the CUDA toolkit headers are installed "
                            "(find_package(CUDAToolkit))"))
        return checks
    if torch.cuda.is_available():
        checks.append(_pcie(index, probe_bytes))
    return checks


def _cuda_driver(index: int):
    """Driver facts from libcuda (the pool uses the driver API), or a failed Check."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return Check("cuda driver", "FAIL", "no CUDA driver: libcuda.so.1 is not found",
                     "install the NVIDIA driver (in a container: run it with the NVIDIA "
                     "container toolkit, --gpus all)")
    value = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(value), index) != 0:
        return Check("cuda driver", "FAIL", f"the CUDA driver finds no device {index} "
                     "(cuInit/cuDeviceGet failed)", "check nvidia-smi and CUDA_VISIBLE_DEVICES")
    handle = value.value
    name = ctypes.create_string_buffer(256)
    cuda.cuDeviceGetName(name, 256, handle)
    vmm = ctypes.c_int()
    cuda.cuDeviceGetAttribute(ctypes.byref(vmm), VMM_ATTRIBUTE, handle)
    version = ctypes.c_int()
    cuda.cuDriverGetVersion(ctypes.byref(version))
    v = version.value
    return {"name": name.value.decode(errors="replace"), "vmm": bool(vmm.value),
            "driver_cuda": f"{v // 1000}.{v % 1000 // 10}",
            "driver": _read("/sys/module/nvidia/version") or "?"}


def _pcie(index: int, probe_bytes: int) -> Check:
    """Host (pinned) -> device and back, three rounds each."""
    n = min(probe_bytes, 1 * GiB)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=f"cuda:{index}")
    rates = {"h2d": [], "d2h": []}
    for _ in range(4):
        for way, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
            torch.cuda.synchronize(index)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(index)
            rates[way].append(n / (time.perf_counter() - t0) / 1e9)
    h2d, d2h = spread(rates["h2d"][1:]), spread(rates["d2h"][1:])  # round 1 warms up
    return Check("pcie", "ok", f"host->device {h2d['median']:.1f} GB/s, device->host "
                 f"{d2h['median']:.1f} GB/s (pinned, {n // MiB} MiB, median of 3)",
                 figures={"h2d_gbps": h2d, "d2h_gbps": d2h})


# -- helpers ---------------------------------------------------------------------------

def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _has_capability(bit: int) -> bool:
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def _mount_of(path: str) -> dict | None:
    """The mount holding `path` (the longest mount point above it): its point,
    filesystem type and whether it is read-only."""
    real, best = os.path.realpath(path), None
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        sep = fields.index("-")
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best["point"])):
            options = fields[5].split(",") + fields[sep + 3].split(",")
            best = {"point": point, "fstype": fields[sep + 1], "read_only": "ro" in options}
    return best


def _version(text: str) -> tuple:
    return tuple(int(x) for x in text.split(".")[:2])


# -- output ----------------------------------------------------------------------------

def report(checks: list, as_json: bool) -> int:
    """Prints the checks; the exit status: 1 when one failed."""
    failed = [c.name for c in checks if c.status == "FAIL"]
    if as_json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "blockers": failed}))
        return 1 if failed else 0
    print(f"statepager doctor (Python {platform.python_version()} at {sys.executable})")
    for c in checks:
        print(f"  {c.status:5s} {c.name:12s} {c.detail}")
        if c.fix:
            print(f"  {'':5s} {'':12s} fix: {c.fix}")
    warned = sum(c.status == "warn" for c in checks)
    if failed:
        print(f"{len(failed)} blocker(s): {', '.join(failed)}; the pager cannot run here until "
              "they are fixed")
    else:
        print(f"no blockers ({warned} warning(s))")
    return 1 if failed else 0

"""Device memory in use as the driver reports it, and its peak over a span, sampled.

DriverMemory reads NVML (libnvidia-ml: no CUDA context needed, so the baseline before a
process's context is known), else cudaMemGetInfo (total - free; needs the context).

DriverMemory.sampler() samples every millisecond while its `with` block runs. With NVML
a child process samples (this file, run as a script: it imports nothing but the standard
library): NVML's figure is device-wide, so the sampling need share nothing with the step
it measures, whose host side is Python (a thread would take the GIL from it two thousand
times a second; an A/B on the H200 showed no difference beyond the runs' spread, and the
child makes that certain). Without NVML a thread samples (PeakSampler): cudaMemGetInfo
needs this process's CUDA context.
"""
from __future__ import annotations

import ctypes
import os
import select
import subprocess
import sys
import threading

INTERVAL = 1e-3  # seconds between samples


class _Info(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class _Nvml:
    """Device-wide used memory of CUDA device 0 (the first of CUDA_VISIBLE_DEVICES, an
    index or a UUID, else NVML's device 0) through libnvidia-ml; None where it is not."""

    @classmethod
    def open(cls) -> "_Nvml | None":
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return None
        handle = ctypes.c_void_p()
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        if nvml.nvmlInit_v2() != 0:
            return None
        found = (nvml.nvmlDeviceGetHandleByIndex_v2(int(first), ctypes.byref(handle))
                 if first.isdigit() else
                 nvml.nvmlDeviceGetHandleByUUID(first.encode(), ctypes.byref(handle)))
        return cls(nvml, handle) if found == 0 else None

    def __init__(self, nvml, handle):
        self._nvml, self._handle = nvml, handle

    def used(self) -> int | None:
        info = _Info()
        if self._nvml.nvmlDeviceGetMemoryInfo(self._handle, ctypes.byref(info)) == 0:
            return int(info.used)
        return None


class DriverMemory:
    """used(): device memory in use, as the driver reports it (see the module doc)."""

    def __init__(self):
        self._nvml = _Nvml.open()
        self.source = ("NVML (device-wide used)" if self._nvml is not None
                       else "cudaMemGetInfo (total - free)")

    @property
    def without_context(self) -> bool:
        return self._nvml is not None

    def used(self) -> int:
        used = self._nvml.used() if self._nvml is not None else None
        if used is not None:
            return used
        import torch  # only here: the sampling child imports nothing heavy
        free, total = torch.cuda.mem_get_info(0)
        return int(total - free)

    def sampler(self, interval: float = INTERVAL):
        """A `with` block's peak of used(), sampled every `interval` seconds: by a child
        process with NVML, else by a thread (see the module doc)."""
        if self._nvml is not None:
            return ChildPeakSampler(self.used, interval)
        return PeakSampler(self.used, interval)


class PeakSampler:
    """The largest of `read()` seen by a thread sampling every `interval` seconds while
    the `with` block runs."""

    def __init__(self, read, interval: float = INTERVAL):
        self._read, self._interval = read, interval
        self._stop = threading.Event()
        self.peak, self.samples = 0, 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._read())
            self.samples += 1
            self._stop.wait(self._interval)

    def __enter__(self):
        self.peak = self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())


class ChildPeakSampler:
    """PeakSampler's figures, NVML sampled by a child process: it starts sampling before
    the block and reports when its stdin closes. `read` (this process's NVML reader)
    takes the figures at the block's edges."""

    def __init__(self, read, interval: float = INTERVAL):
        self._read, self._interval = read, interval
        self.peak, self.samples = 0, 0
        self._child = None

    def __enter__(self):
        self._child = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                        str(self._interval)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        ready = self._child.stdout.readline().split()  # "sampling": it sampled once
        if ready != ["sampling"]:
            self._child.kill()
            self._child.wait()
            raise RuntimeError("the driver memory sampler (NVML, a child process) did not "
                               f"start: it said {ready!r}")
        self.peak = self._read()
        return self

    def __exit__(self, exc_type, *_):
        child, self._child = self._child, None
        child.stdin.close()
        said = child.stdout.readline().split()
        child.wait()
        if len(said) != 2 or not all(x.isdigit() for x in said):
            if exc_type is None:  # else the block's own error is the one to see
                raise RuntimeError("the driver memory sampler (NVML, a child process) "
                                   f"ended without its figures (exit status "
                                   f"{child.returncode}, said {said!r})")
            return
        peak, self.samples = int(said[0]), int(said[1])
        self.peak = max(self.peak, peak, self._read())


def _sample(interval: float) -> None:
    """The child's side: samples NVML every `interval` seconds until stdin closes, then
    prints its peak and how many samples it took."""
    nvml = _Nvml.open()
    used = nvml.used() if nvml is not None else None
    if used is None:
        print("no NVML", flush=True)
        return
    peak, samples = used, 1
    print("sampling", flush=True)
    while not select.select([sys.stdin], [], [], interval)[0]:
        used = nvml.used()
        if used is not None:
            peak, samples = max(peak, used), samples + 1
    print(peak, samples, flush=True)


if __name__ == "__main__":
    _sample(float(sys.argv[1]))

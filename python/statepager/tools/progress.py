"""Progress of long work (the benchmarks, doctor): a bar on stderr when stderr is a
terminal and this process is rank 0, nothing otherwise (logs, pipes, other ranks).

    with Progress("bench store", phases=7) as bar:
        bar.phase("fio write")      # what runs now; the previous phase is done
        ...

tqdm draws the bar when it is installed; otherwise one line, rewritten in place.
Thread-safety: one thread per Progress.
"""
from __future__ import annotations

import os
import sys
import time

import torch


def enabled() -> bool:
    """Whether progress is shown: stderr is a terminal and this is rank 0."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0"))  # set by torchrun before init
    return rank == 0 and sys.stderr.isatty()


class Progress:
    def __init__(self, title: str, phases: int):
        self._title, self._total = title, phases
        self._done, self._label = -1, ""
        self._start = time.monotonic()
        self._bar = None
        self._on = enabled()
        if self._on:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=phases, desc=title, file=sys.stderr, leave=False)

    def phase(self, label: str) -> None:
        """Marks the previous phase done and shows `label` as running."""
        self._done += 1
        self._label = label
        if not self._on:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(label)
            if self._done:
                self._bar.update(1)
        else:
            self._draw()

    def close(self) -> None:
        """Removes the bar (the results follow on stdout)."""
        if not self._on:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        self._on = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _draw(self) -> None:
        elapsed = time.monotonic() - self._start
        sys.stderr.write(f"\r\033[K{self._title}: [{self._done}/{self._total}] {self._label} "
                         f"({elapsed:.0f} s)")
        sys.stderr.flush()

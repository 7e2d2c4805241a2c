"""Argument types of the command line: each turns a value into what the commands use
or refuses it with a message naming the value and what is allowed (argparse prints
"argument --size: ..." and exits with status 2)."""
from __future__ import annotations

import argparse
import math
import os
import re

import torch

from statepager.core.args import parse_size

# A value starting with '-' and a digit that argparse would take for an option: only
# plain negative numbers ("-5", "-1.5") are values to it.
_DASH_VALUE = re.compile(r"-\d")
_PLAIN_NEGATIVE = re.compile(r"-\d+|-\d*\.\d+")


def dash_values_joined(argv: list[str]) -> list[str]:
    """argv with each value like "-5G" joined to the option before it ("--size=-5G"), so
    that the option's type refuses it by name, not argparse as a missing value (no option
    of this command line starts with a digit)."""
    out = []
    for arg in argv:
        if (out and out[-1].startswith("--") and "=" not in out[-1]
                and _DASH_VALUE.match(arg) and not _PLAIN_NEGATIVE.fullmatch(arg)):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out

def size(text: str) -> int:
    """A byte count above 0, with an optional unit."""
    try:
        n = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give a number with an optional unit K, M, G or T "
            "(binary: 1K = 1024 bytes), e.g. 512M or 8G") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is {n} bytes: the size must be more than 0")
    return n


def io_block(text: str) -> int:
    """Bytes per I/O request: a size that is a multiple of 4 KiB."""
    n = size(text)
    if n % 4096:
        raise argparse.ArgumentTypeError(f"{text!r} ({n} bytes) is not a multiple of 4 KiB, "
                                         "as O_DIRECT requests must be: e.g. 1M or 4M")
    return n


# fio job counts each way the floors try by default (statepager.tools.bench.floor says why).
FIO_JOBS = (4, 8, 16)


def job_counts(text: str) -> tuple[int, ...]:
    """Comma-separated fio job counts, each at least 1: e.g. 4,8,16."""
    counts = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {part!r} is not a job count: give whole numbers of at least 1, "
                "comma-separated, e.g. 4,8,16")
        counts.append(int(part))
    return tuple(counts)


def at_least(minimum: int, what: str):
    """An integer type of at least `minimum`; `what` says why, in the message."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{n} is too small: {what} (at least {minimum})")
        return n
    return parse


def count(text: str) -> int:
    """A count like a parameter count, written 5e8 or 500000000, at least 1."""
    try:
        n = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number: e.g. 5e8") from None
    if not math.isfinite(n) or n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the count must be at least 1")
    return int(n)


def directory(text: str) -> str:
    """A directory to work in: an existing one, or a path whose nearest existing ancestor
    is a directory this process may write (it is created)."""
    path = os.path.abspath(text)
    base = path
    while not os.path.lexists(base):
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        where = "is" if base == path else f"lies under {base!r}, which is"
        raise argparse.ArgumentTypeError(f"{text!r} {where} a file, not a directory: give a "
                                         "directory (it is created when missing)")
    if not os.access(base, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: {base!r} is not writable by this user: "
                                         "give a directory on local storage you can write")
    return text


def device_name(text: str) -> str:
    """'cpu', 'cuda' or 'cuda:N' (whether the device exists is not checked)."""
    try:
        d = torch.device(text)
    except RuntimeError:
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device statepager runs on: use "
                                         "cpu, cuda or cuda:N")
    return text


def device(text: str) -> str:
    """'cpu', or 'cuda' / 'cuda:N' where that device exists."""
    d = torch.device(device_name(text))
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is visible here "
                                             "(torch.cuda.is_available() is False): use cpu")
        if (d.index or 0) >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: there are {torch.cuda.device_count()} "
                                             "CUDA devices (cuda:0 ...)")
    return text


def output_file(text: str) -> str:
    """A file to write: not a directory, in an existing directory this process may write."""
    path = os.path.abspath(text)
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory: give a file name in it")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: {parent!r} is not a directory this user "
                                         "can write: create it first, or give another path")
    return text


def plot_file(text: str) -> str:
    """output_file(), when matplotlib can be imported (checked before a long bench runs)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError("plotting needs matplotlib: pip install "
                                         "'statepager[plot]' (or pip install matplotlib)") from None
    return output_file(text)

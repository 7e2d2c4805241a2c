"""Checks of public arguments on the Python side: a UsageError that names the argument,
its value and what is allowed, instead of pybind's signature dump. Only what Python
must know before calling the core: the type, and a lower bound. Ranges that depend on
the device or on the core's limits (page granularity, maxima) are checked in C++, so C++
users get the same errors."""
from __future__ import annotations

import math
import operator

import torch

from statepager import _C

_LIMIT = 1 << 64  # what a size_t of the core holds
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def integer(name: str, value, *, minimum: int = 0) -> int:
    """`value` as an int of at least `minimum` that the core can take (below 2^64);
    bools and floats are refused (32e6 is not a byte count)."""
    number = _as_int(value)
    if number is None:
        raise _C.UsageError(f"{name} must be an integer, not {type(value).__name__} {value!r}")
    if not minimum <= number < _LIMIT:
        raise _C.UsageError(f"{name} = {number} is out of range: it must be at least "
                            f"{minimum} and below 2^64")
    return number


def optional_integer(name: str, value, *, minimum: int = 0) -> int | None:
    return None if value is None else integer(name, value, minimum=minimum)


def shape(dims) -> list[int]:
    """Pager.empty's shape as ints (negative sizes and overflow are refused by the core)."""
    out = [_as_int(d) for d in dims]
    if None in out:
        raise _C.UsageError(f"Pager.empty: the shape must be integers, not {tuple(dims)!r}")
    return out


def integers(name: str, values) -> list[int]:
    """A sequence of integer() values (byte counts: Pager.empty's pieces)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise _C.UsageError(f"{name} must be a sequence of integers, not "
                            f"{type(values).__name__} {values!r}")
    return [integer(f"{name}[{i}]", v) for i, v in enumerate(values)]


def _as_int(value) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def dtype(value) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise _C.UsageError(f"dtype must be a torch.dtype (e.g. torch.float32), not "
                            f"{type(value).__name__} {value!r}")
    return value


def text(name: str, value) -> str:
    if not isinstance(value, str):
        raise _C.UsageError(f"{name} must be a str, not {type(value).__name__} {value!r}")
    return value


def bucketing(bucket_size, depth) -> tuple[int, int]:
    """attach()'s bucket_size (bytes, at least 1) and depth (buckets resident or in
    flight, at least 2: one stepping, one in flight)."""
    return integer("bucket_size", bucket_size, minimum=1), integer("depth", depth, minimum=2)


def parse_size(text: str) -> int:
    """'4G', '512M', '1.5GiB', '1048576' -> bytes (binary units: K = 1024); ValueError for
    anything else."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    number = float(t[: len(t) - len(unit)])  # ValueError for "", "512X", "G"
    if not math.isfinite(number):
        raise ValueError(text)
    return int(number * _UNITS[unit])

"""Checks of public arguments on the Python side: a UsageError that names the argument,
its value and what is allowed, instead of pybind's signature dump, a TypeError, or a
value taken for its truthiness or its str(). Only what Python must know before calling
the core: the type, and a lower bound. Ranges that depend on the device or on the core's
limits (page granularity, maxima) are checked in C++, so C++ users get the same errors.

What is taken: integers are ints and what has __index__ (numpy and 0-d torch integers),
never bools or floats; booleans are bool and numpy.bool_ only (a 0-d tensor or 0/1 is
refused: "false" and "no" are truthy); paths are str, bytes (os.fsdecode) or
os.PathLike, never None or a number (str() would name a directory "None")."""
from __future__ import annotations

import math
import operator
import os
import sys
from typing import Callable

import torch

from statepager import _C
from statepager.util import names
from statepager.formats.stored import MAIN_FORMATS, MOMENT_FORMATS

_LIMIT = 1 << 64  # what a size_t of the core holds
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def integer(name: str, value, *, minimum: int = 0) -> int:
    """`value` as an int of at least `minimum` that the core can take (below 2^64);
    bools and floats are refused (32e6 is not a byte count)."""
    number = _as_int(value)
    if number is None:
        raise _C.UsageError(f"{name} must be an integer, not {_shown(value)}")
    if not minimum <= number < _LIMIT:
        raise _C.UsageError(f"{name} = {number} is out of range: it must be at least "
                            f"{minimum} and below 2^64")
    return number


def optional_integer(name: str, value, *, minimum: int = 0) -> int | None:
    return None if value is None else integer(name, value, minimum=minimum)


def shape(dims, name: str = "shape") -> list[int]:
    """Pager.empty's shape (or strides) as ints (negative sizes and overflow are refused by
    the core)."""
    out = None if isinstance(dims, (str, bytes)) or not hasattr(dims, "__iter__") \
        else [_as_int(d) for d in dims]
    if out is None or None in out:
        raise _C.UsageError(f"Pager.empty: the {name} must be integers, not {_shown(dims)}")
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
        raise _C.UsageError(f"{name} must be a str, not {_shown(value)}")
    return value


def flag(name: str, value) -> bool:
    """`value` as a bool: a bool or a numpy.bool_ (anything else is refused, not read for
    its truthiness)."""
    numpy = sys.modules.get("numpy")  # a numpy.bool_ can only come from an imported numpy
    if isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_)):
        return bool(value)
    raise _C.UsageError(f"{name} must be a bool (True or False), not {_shown(value)}")


ATOMICITY = (True, "step", "bucket", False)


def atomicity(value) -> str | bool:
    """attach()'s atomic: True or "step" (all or nothing) as "step", "bucket"
    (resumable, atomic per bucket) or False (in place); bools as flag() takes them."""
    numpy = sys.modules.get("numpy")
    if isinstance(value, bool) or (numpy is not None and isinstance(value, numpy.bool_)):
        return "step" if value else False
    if isinstance(value, str) and value in ("step", "bucket"):
        return value
    raise _C.UsageError(f"atomic must be one of {ATOMICITY}: True or 'step' (all or "
                        "nothing), 'bucket' (resumable, the default) or False (in place), "
                        f"not {_shown(value)}")


def optional_flag(name: str, value) -> bool | None:
    return None if value is None else flag(name, value)


def path(name: str, value) -> str:
    """`value` as a str path: a str, bytes (decoded as the file system does) or
    os.PathLike of either; not empty, no NUL (the C library would cut the path there)."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise _C.UsageError(f"{name} must be a str or os.PathLike path, not {_shown(value)}")
    decoded = os.fsdecode(value)
    if not decoded:
        raise _C.UsageError(f"{name} must not be empty: give a path ('.' for the working "
                            "directory)")
    if "\0" in decoded:
        raise _C.UsageError(f"{name} {decoded!r} holds a NUL character, which no path can")
    return decoded


def device(value) -> torch.device:
    """A torch.device or its name (a bare index would be taken for a CUDA device)."""
    try:
        if isinstance(value, (str, torch.device)):
            return torch.device(value)
    except RuntimeError:
        pass
    raise _C.UsageError(f"device must be a torch.device or its name ('cpu', 'cuda', "
                        f"'cuda:N'), not {_shown(value)}")


def choice(name: str, value, allowed: tuple) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise _C.UsageError(f"{name} must be one of {allowed}, not {value!r}")
    return value


def formats(moments, mains) -> tuple[str, str]:
    """attach()'s on-disk formats (statepager.formats)."""
    return choice("moments", moments, MOMENT_FORMATS), choice("mains", mains, MAIN_FORMATS)


def hook(name: str, value) -> Callable | None:
    """A callable the pager calls later (a hook, a predicate), or None; checked now, not
    when a step first calls it."""
    if value is not None and not callable(value):
        raise _C.UsageError(f"{name} must be callable or None, not {_shown(value)}")
    return value


def optimizer(value) -> torch.optim.Optimizer:
    if isinstance(value, torch.optim.Optimizer):
        return value
    hint = (": attach the optimizer of its parameters, e.g. "
            "torch.optim.AdamW(model.parameters())" if isinstance(value, torch.nn.Module)
            else "")
    raise _C.UsageError(f"optimizer must be a torch.optim.Optimizer, not {_shown(value)}{hint}")


def optimizer_name(value) -> str | None:
    """attach()'s name: None, or one that names its store and checkpoint directories
    (names.check_name, the rule save applies)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _C.UsageError(f"name must be a str or None, not {_shown(value)}")
    names.check_name(value)
    return value


def tensors(what: str, value) -> list:
    """A tensor or a sequence of tensors, as a list of dense tensors (`what`: the call, for
    the message). Whether this pager made them the core checks, naming the one it did not."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise _C.UsageError(f"{what}: tensors must be a tensor or a sequence of tensors, not "
                            f"{_shown(value)}")
    out = list(value)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise _C.UsageError(f"{what}: tensors[{i}] must be a dense torch.Tensor of this "
                                f"Pager, not {_shown(t)}")
    return out


def _shown(value) -> str:
    """A value for a message: its type and a repr cut short (a tensor's may be long)."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def bucketing(bucket_size, depth) -> tuple[int | None, int | None]:
    """attach()'s bucket_size (bytes, at least 1) and depth (the window's consecutive
    buckets, at least 2: one stepping, one in flight); None: chosen (core.defaults)."""
    return (optional_integer("bucket_size", bucket_size, minimum=1),
            optional_integer("depth", depth, minimum=2))


def stationary(stationary_bytes, atomic) -> int:
    """attach()'s stationary_bytes (bytes, at least 0) with its atomic (atomicity()):
    an all-or-nothing step writes every bucket before it commits."""
    nbytes = integer("stationary_bytes", stationary_bytes)
    if nbytes and atomic == "step":
        raise _C.UsageError(
            f"stationary_bytes = {nbytes} keeps buckets mapped between steps, which "
            "all-or-nothing steps (atomic='step') cannot: their commit needs every bucket "
            "written. Use atomic='bucket' (resumable, the default) or stationary_bytes=0")
    return nbytes


def parse_size(text: str) -> int:
    """'4G', '512M', '1.5GiB', '1048576' -> bytes (binary units: K = 1024); ValueError for
    anything else."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    number = float(t[: len(t) - len(unit)])  # ValueError for "", "512X", "G"
    if not math.isfinite(number):
        raise ValueError(text)
    return int(number * _UNITS[unit])

"""The megatron-core releases statepager supports, and the one check of them, for both
of its Megatron integrations: the DistributedOptimizer adapter (megatron_internals, at
attach) and the Megatron-LM launcher (megatron_lm_hooks, which also needs Megatron-LM's
training code of the same release)."""
from __future__ import annotations

import importlib
import importlib.metadata

from statepager._C import UsageError

# megatron-core releases statepager is written and tested against: [low, high).
SUPPORTED = ((0, 19), (0, 20))


def supported_range() -> str:
    (a, b), (c, d) = SUPPORTED
    return f"{a}.{b}.x (>= {a}.{b}, < {c}.{d})"


def installed() -> str | None:
    """The installed megatron-core's version text, None when there is none."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path
        try:
            return importlib.import_module("megatron.core.package_info").__version__
        except (ImportError, AttributeError):
            return None


def check_version(text: str | None = None) -> None:
    """UsageError unless megatron-core `text` (its __version__; None: the one installed)
    is in SUPPORTED, saying which is and what to install."""
    text = installed() if text is None else text
    (a, b), _ = SUPPORTED
    fix = (f"install megatron-core=={a}.{b}.* (statepager[megatron]; with Megatron-LM, its "
           f"training code of the same release, core_r{a}.{b}.0), or update statepager")
    if text is None:
        raise UsageError(f"statepager supports megatron-core {supported_range()}, not an "
                         f"unknown version: {fix}")
    try:
        found = tuple(int(x) for x in text.split(".")[:2])
    except ValueError:
        raise UsageError(f"megatron-core reports the version {text!r}, which statepager "
                         f"cannot read; it supports megatron-core {supported_range()}: "
                         f"{fix}") from None
    if not SUPPORTED[0] <= found < SUPPORTED[1]:
        raise UsageError(f"megatron-core {text} is installed; statepager supports "
                         f"megatron-core {supported_range()}: {fix}")

"""The extension statepager._C and the torch it was compiled against.

The extension is C++ compiled against one torch release, whose C++ ABI changes between
minor releases: under another torch it fails to load (an "undefined symbol"), or loads
and misbehaves. load_extension() refuses both with an ImportError that names the torch
it was built against, the torch imported and the fix. Patch releases of the same minor
release are accepted (torch keeps its ABI within them).
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys

import torch

# The marker module.cc compiles into the binary, read when the extension cannot load.
_MARKER = re.compile(rb"statepager-built-against-torch=([0-9A-Za-z.+_-]+)\0")


def load_extension():
    """statepager._C, once it loaded and was built against this torch's minor release."""
    try:
        ext = importlib.import_module("statepager._C")
    except ModuleNotFoundError as e:
        if e.name != "statepager._C":
            raise
        raise ImportError("statepager's C++ extension (statepager._C) is not built: "
                          f"{_fix()}") from e
    except ImportError as e:
        built = built_against(importlib.util.find_spec("statepager._C").origin)
        raise ImportError(f"statepager's C++ extension does not load under torch "
                          f"{torch.__version__} ({e}). It was built against torch "
                          f"{built or 'of another release'}: {_fix(built)}") from e
    check_versions(ext.TORCH_VERSION, torch.__version__)
    return ext


def check_versions(built: str, running: str) -> None:
    """ImportError unless `running` (torch.__version__) is of the minor release `built`
    (the torch the extension was compiled against) is of."""
    if _minor(built) != _minor(running):
        raise ImportError(f"statepager was built against torch {built}, but torch {running} "
                          f"is imported: {_fix(built)}")


def built_against(extension_path: str | None) -> str | None:
    """The torch version compiled into the extension file, or None when it is not there."""
    if extension_path is None:
        return None
    try:
        with open(extension_path, "rb") as f:
            found = _MARKER.search(f.read())
    except OSError:
        return None
    return found.group(1).decode() if found else None


def _minor(version: str) -> tuple:
    return tuple(version.split("+")[0].split(".")[:2])


def _fix(built: str | None = None) -> str:
    """How to get an extension that matches the torch of this interpreter."""
    fix = (f"rebuild it for this interpreter and its torch, from the statepager source "
           f"directory: `PYTHON={sys.executable} bash scripts/setup.sh`, or `{sys.executable} "
           f"-m pip install --no-build-isolation --force-reinstall --no-deps .`")
    if built is not None:
        major, minor = _minor(built)
        fix += f"; or install the torch it was built for: pip install 'torch=={major}.{minor}.*'"
    return fix

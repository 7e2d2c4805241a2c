"""Optimizer names: each names a binding's store directory (directory/<name>/) and its
checkpoint directory, so one rule serves attach() and save()."""
import re

from statepager import _C

MANIFEST = "manifest.json"  # a checkpoint's manifest file: no optimizer may take its name


def valid_name(name: str) -> bool:
    """An optimizer name that can name its checkpoint directory and its store directory
    (backing/store_dir.cc takes up to 128 of these characters, not starting with '.')."""
    return (re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", name) is not None
            and name != MANIFEST)


def check_name(name: str) -> None:
    """UsageError for an optimizer name that is not valid_name() (attach and save)."""
    if not valid_name(name):
        raise _C.UsageError(f"optimizer name {name!r} names its checkpoint and store "
                            "directories: use 1 to 128 letters, digits and _ . -, starting "
                            f"with a letter, digit or _, other than {MANIFEST} "
                            "(attach(..., name=...))")

"""Warnings that point at the user's line: the first frame outside the statepager
package, however deep inside it the warning is raised (attach through an adapter, a
wrapper, a binding's constructor)."""
from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_user(message: str, category: type = UserWarning) -> None:
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level + 1)

"""statepager autoload on | off | status: the opt-in start-up hook for launchers that
build Megatron-LM's command line themselves (NeMo, verl, miles) and can only set
environment variables.

`on` writes statepager-autoload.pth into the site-packages directory that holds the
hook module (_statepager_autoload, installed with statepager); Python then runs its one
line, `import _statepager_autoload`, at every start of that environment, and the hook
pages Megatron-LM's optimizer wherever STATEPAGER_DIR is set. Nothing runs at start-up
until `on`; `python -m statepager.megatron_lm` needs no hook at all. `off` removes the
file, and only a file that `on` wrote: a .pth of that name with other content is left
alone and reported.
"""
from __future__ import annotations

import importlib.util
import os

from statepager import _C

PTH = "statepager-autoload.pth"
LINE = "import _statepager_autoload\n"


def site_dir() -> str:
    """The directory holding the hook module, where Python reads .pth files."""
    spec = importlib.util.find_spec("_statepager_autoload")
    if spec is None or spec.origin is None:
        raise _C.UsageError("the start-up hook _statepager_autoload is not installed: "
                            "install statepager (pip install .) or pass --site-dir")
    return os.path.dirname(spec.origin)


def _ours(path: str) -> bool:
    with open(path) as f:
        return f.read() == LINE


def main(action: str, directory: str | None) -> int:
    directory = directory or site_dir()
    path = os.path.join(directory, PTH)
    present = os.path.lexists(path)
    if present and (not os.path.isfile(path) or os.path.islink(path) or not _ours(path)):
        raise _C.UsageError(f"{path} exists and was not written by `statepager autoload on`: "
                            "statepager leaves it as it is (remove it yourself if it is "
                            "a stale copy)")
    if action == "on" and not present:
        with open(path, "x") as f:
            f.write(LINE)
    elif action == "off" and present:
        os.remove(path)
    on = os.path.exists(path)
    print(f"statepager autoload: {'on' if on else 'off'} ({path})")
    return 0

"""statepager's start-up hook: statepager on for Megatron-LM training scripts run
unchanged (`torchrun pretrain_gpt.py ...`), for launchers that build the command line
themselves (NeMo, verl, miles) and can only set environment variables.

Opt-in: `statepager autoload on` writes statepager-autoload.pth beside this module in
site-packages (`off` removes it), and Python then runs its one line (`import
_statepager_autoload`) at every start. That costs one environment lookup: unless
STATEPAGER_DIR is set (and STATEPAGER_AUTOLOAD is not 0), nothing else happens. When it is, a finder on sys.meta_path waits for megatron.training.training to
be imported and, once that module has run, installs statepager.megatron_lm's hooks, as
`python -m statepager.megatron_lm` does before it runs the script; the options come from
the STATEPAGER_* variables (statepager.megatron_lm_config).

Only the standard library is imported here: statepager and torch load when Megatron-LM's
training code does, so processes that never import it pay nothing. A failure to install
the hooks (an unsupported Megatron-LM, say) fails that import with statepager's message:
a run that asked for statepager never goes on without it.
"""
import importlib.util
import os
import sys

_TRIGGER = "megatron.training.training"


class _Loader:
    """The trigger module's own loader, which then installs the hooks."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        from statepager.integrations import megatron_lm

        megatron_lm.install_once()

    def __getattr__(self, name):  # get_source, get_filename, ... as the loader's own
        return getattr(self._loader, name)


class _Finder:
    """On sys.meta_path until the trigger module is imported; finds nothing itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TRIGGER:
            return None
        disarm()  # once; and the search below finds the real module
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def armed() -> bool:
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def arm() -> None:
    if not armed():
        sys.meta_path.insert(0, _Finder())


def disarm() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


if os.environ.get("STATEPAGER_DIR") and os.environ.get("STATEPAGER_AUTOLOAD", "1") != "0":
    arm()

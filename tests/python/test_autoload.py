"""The start-up hook (python/_statepager_autoload.py, run by the statepager-autoload.pth
that `statepager autoload on` writes into site-packages): with STATEPAGER_DIR set, importing Megatron-LM's training code installs
statepager.megatron_lm's hooks; without it, nothing of statepager loads.

Megatron-LM is played by a package of the same module names in tmp_path (megatron-core's
version module and megatron.training's four modules with the functions the hooks wrap),
so this runs on CPU machines without megatron-core; tests/gpu/test_megatron_lm.py runs
the real pretrain_gpt.py this way."""
import os
import shutil
import subprocess
import sys

import pytest

import statepager
from statepager.integrations.megatron_lm_hooks import _NAMES
from statepager.tools import autoload_cmd

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SOURCE = os.path.join(ROOT, "python")

CHECK = """
import sys
import megatron.training.training as t
wrapped = t.get_megatron_optimizer is not t.ORIGINAL
print("wrapped" if wrapped else "unwrapped", "statepager" in sys.modules)
"""


@pytest.fixture
def hook_dir(tmp_path):
    """A folder holding the source's copy of the hook module alone (statepager itself is
    imported from wherever this test imported it: installed, or the source tree)."""
    folder = tmp_path / "hook"
    folder.mkdir()
    shutil.copy(os.path.join(SOURCE, "_statepager_autoload.py"), folder)
    return str(folder)


@pytest.fixture
def fake_megatron(tmp_path, hook_dir):
    """The hook's folder and one holding a package `megatron` with the names
    statepager.megatron_lm reads, as a search path."""
    root = tmp_path / "fake"
    core, training = root / "megatron" / "core", root / "megatron" / "training"
    core.mkdir(parents=True)
    training.mkdir()
    for d in (root / "megatron", core, training):
        (d / "__init__.py").write_text("")
    (core / "package_info.py").write_text("__version__ = '0.19.2'\n")
    for module, names in _NAMES.items():
        body = "".join(f"def {n}(*a, **kw):\n    return None\n" for n in names)
        if module == "training":  # the trigger imports the others first, as Megatron's does
            body = ("from megatron.training import arguments, checkpointing, global_vars\n"
                    + body + "ORIGINAL = get_megatron_optimizer\n")
        (training / f"{module}.py").write_text(body)
    return os.pathsep.join([hook_dir, str(root)])


def hooked(env_changes, fake):
    """Runs CHECK with the hook armed by `import _statepager_autoload` (what the .pth
    line does); `fake`: the path to the hook module and the fake Megatron."""
    code = "import _statepager_autoload\n" + CHECK
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATEPAGER_")}
    env.update(env_changes, PYTHONPATH=os.pathsep.join([fake] + sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    return out.returncode, out.stdout


def test_statepager_dir_installs_the_hooks_when_megatron_training_loads(fake_megatron, tmp_path):
    code, out = hooked({"STATEPAGER_DIR": str(tmp_path / "sp-{rank}")}, fake_megatron)
    assert code == 0, out
    assert out.split()[-2:] == ["wrapped", "True"]


def test_without_statepager_dir_nothing_loads(fake_megatron):
    code, out = hooked({}, fake_megatron)
    assert code == 0, out
    assert out.split()[-2:] == ["unwrapped", "False"]


def test_autoload_0_opts_out(fake_megatron, tmp_path):
    code, out = hooked({"STATEPAGER_DIR": str(tmp_path), "STATEPAGER_AUTOLOAD": "0"},
                       fake_megatron)
    assert code == 0, out
    assert out.split()[-2:] == ["unwrapped", "False"]


def test_an_unsupported_megatron_fails_the_import_with_the_reason(fake_megatron, tmp_path):
    fake = fake_megatron.split(os.pathsep)[-1]
    with open(os.path.join(fake, "megatron", "core", "package_info.py"), "w") as f:
        f.write("__version__ = '0.12.0'\n")
    code, out = hooked({"STATEPAGER_DIR": str(tmp_path)}, fake_megatron)
    assert code != 0
    assert "megatron-core 0.12.0 is installed; statepager supports megatron-core 0.19.x" in out


def test_entry_point_and_hook_install_once(fake_megatron, tmp_path):
    """python -m statepager.megatron_lm with STATEPAGER_DIR also set: one set of hooks."""
    script = tmp_path / "train.py"
    script.write_text("import megatron.training.training as t\n"
                      "from statepager.integrations import megatron_lm\n"
                      "replaced = [(id(m), n) for m, n, _ in megatron_lm._installed.megatron._replaced]\n"
                      "print('replaced', len(replaced), 'twice', len(replaced) - len(set(replaced)))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATEPAGER_")}
    env.update(STATEPAGER_DIR=str(tmp_path / "sp"),
               PYTHONPATH=os.pathsep.join([fake_megatron] + sys.path))
    code = "import _statepager_autoload, sys, runpy; sys.argv[1:] = [%r]; " \
           "runpy.run_module('statepager.megatron_lm', run_name='__main__')" % str(script)
    out = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert out.returncode == 0, out.stdout
    assert "replaced" in out.stdout and out.stdout.split()[-1] == "0", out.stdout


def test_the_installed_package_carries_the_hook_but_runs_nothing_at_start():
    """pip puts the hook module beside the package, and no .pth: nothing of statepager
    runs at an interpreter's start until `statepager autoload on`."""
    site_dir = os.path.dirname(os.path.dirname(os.path.abspath(statepager.__file__)))
    if site_dir == SOURCE:
        pytest.skip("statepager is imported from the source tree (PYTHONPATH), not installed")
    assert os.path.isfile(os.path.join(site_dir, "_statepager_autoload.py"))
    assert not os.path.exists(os.path.join(site_dir, autoload_cmd.PTH))


def autoload(*args):
    out = subprocess.run([sys.executable, "-m", "statepager", "autoload", *args],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    return out.returncode, out.stdout + out.stderr


def test_autoload_on_and_off_write_and_remove_only_their_own_file(tmp_path):
    site = str(tmp_path)
    pth = tmp_path / autoload_cmd.PTH
    assert autoload("status", "--site-dir", site)[1].startswith("statepager autoload: off")
    code, out = autoload("on", "--site-dir", site)
    assert code == 0 and "autoload: on" in out
    assert pth.read_text() == "import _statepager_autoload\n"
    assert autoload("on", "--site-dir", site)[0] == 0  # already on: unchanged
    code, out = autoload("off", "--site-dir", site)
    assert code == 0 and "autoload: off" in out and not pth.exists()
    assert autoload("off", "--site-dir", site)[0] == 0  # already off
    pth.write_text("import something_else\n")  # a file of that name it did not write
    for action in ("on", "off"):
        code, out = autoload(action, "--site-dir", site)
        assert code == 1 and "was not written by `statepager autoload on`" in out
        assert pth.read_text() == "import something_else\n"


def test_the_pth_line_arms_the_hook(fake_megatron, tmp_path):
    """The line `autoload on` writes is the one the hook tests run (`hooked`)."""
    assert autoload_cmd.LINE == "import _statepager_autoload\n"
    code, out = hooked({"STATEPAGER_DIR": str(tmp_path / "sp")}, fake_megatron)
    assert code == 0 and out.split()[-2:] == ["wrapped", "True"], out

"""The package as its users meet it: errors that fit torch's, stats that say what they
mean, the console script, an extension that refuses a torch it was not built for, and
profiling scripts that still find what they time."""
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import statepager
from statepager import _build

KiB, MiB = 1 << 10, 1 << 20


def test_pool_out_of_memory_is_a_torch_out_of_memory(store_dir):
    assert issubclass(statepager.OutOfMemoryError, torch.cuda.OutOfMemoryError)
    assert issubclass(statepager.OutOfMemoryError, statepager.Error)
    with statepager.Pager(store_dir, page_size=64 * KiB, hbm_budget=2 * 64 * KiB) as p:
        ts = [p.empty(40_000) for _ in range(4)]
        with pytest.raises(torch.cuda.OutOfMemoryError, match="budget") as e:
            p.page_in(ts)
        assert isinstance(e.value, statepager.OutOfMemoryError)


def test_stats_say_none_for_no_budget(store_dir, tmp_path):
    with statepager.Pager(store_dir) as p:
        assert p.stats()["hbm_budget"] is None
    with statepager.Pager(str(tmp_path / "b"), page_size=64 * KiB, hbm_budget=MiB) as p:
        assert p.stats()["hbm_budget"] == MiB


# -- the torch the extension was built against -----------------------------------------

def test_the_extension_records_the_torch_it_was_built_against():
    assert statepager._C.TORCH_VERSION == torch.__version__
    assert _build.built_against(statepager._C.__file__) == torch.__version__


def test_another_torch_release_is_refused_with_the_fix():
    _build.check_versions("2.11.0+cu130", "2.11.1")  # a patch release keeps the ABI
    with pytest.raises(ImportError) as e:
        _build.check_versions("2.11.0+cu130", "2.12.0")
    message = str(e.value)
    assert "built against torch 2.11.0+cu130" in message and "torch 2.12.0" in message
    assert "scripts/setup.sh" in message and "pip install 'torch==2.11.*'" in message


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_an_extension_that_does_not_load_names_its_torch(tmp_path):
    """An extension built against another torch fails to load with an undefined symbol;
    the ImportError names the torch it was built against and the fix."""
    package = tmp_path / "statepager"
    shutil.copytree(os.path.dirname(statepager.__file__), package,
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    source = tmp_path / "fake.c"
    source.write_text(
        'const char marker[] = "statepager-built-against-torch=2.9.1+cu128";\n'
        "extern void _ZN3c1020symbol_of_torch_2_9Ev(void);\n"
        "void *PyInit__C(void) { _ZN3c1020symbol_of_torch_2_9Ev(); return 0; }\n")
    suffix = next(n for n in os.listdir(os.path.dirname(statepager._C.__file__))
                  if n.startswith("_C") and n.endswith(".so"))
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(package / suffix), str(source)],
                   check=True)
    r = subprocess.run([sys.executable, "-c", "import statepager"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode != 0
    assert "does not load under torch" in r.stderr and "undefined symbol" in r.stderr
    assert "built against torch 2.9.1+cu128" in r.stderr
    assert "pip install 'torch==2.9.*'" in r.stderr


def test_console_script_runs_the_same_commands():
    script = os.path.join(os.path.dirname(sys.executable), "statepager")
    if not os.path.exists(script):
        pytest.skip("statepager is not pip-installed in this interpreter's environment")
    r = subprocess.run([script, "bench", "store", "--size", "0", "--dir", "/tmp"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "the size must be more than 0" in r.stderr
    r = subprocess.run([script, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and all(c in r.stdout for c in ("doctor", "inspect", "bench"))


@pytest.mark.parametrize("script", ["loop_host_time.py", "profile_step.py"])
def test_the_profiling_scripts_time_phases_that_exist(script):
    """scripts/loop_host_time.py and scripts/profile_step.py wrap the bucket loop's
    methods by name: each must still be there."""
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / script
    spec = importlib.util.spec_from_file_location(script[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in module.PHASES
               if not hasattr(owner, name)]
    assert module.PHASES and missing == []

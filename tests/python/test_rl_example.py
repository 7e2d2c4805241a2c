"""examples/rl_colocate.py on the host backend, small: a trainer paused for an inference
phase and resumed gives the losses, parameters and optimizer state of the same run
without the pause, bit for bit."""
import os
import pathlib
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "rl_colocate.py"


def run_example(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, str(EXAMPLE), *flags], capture_output=True,
                          text=True, timeout=300, env=env)


def test_rl_colocation_example_is_bit_exact_on_the_host_backend():
    out = run_example("--device", "cpu", "--hidden", "64", "--steps", "2", "--kv-mib", "16")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "bit-exact: True" in out.stdout
    assert "pause: " in out.stdout and "GB/s" in out.stdout and "resume: " in out.stdout

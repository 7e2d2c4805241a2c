"""examples/rl_colocate.py on CUDA: the inference buffer takes more than the memory free
before the pause (the trainer's GiBs given back), and the run after resume is bit-exact
with the one that never paused."""
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "rl_colocate.py"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rl_colocation_example_needs_the_pause_and_is_bit_exact():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # 4 blocks of width 2048: about 2 GiB of parameters, gradients and AdamW state.
    out = subprocess.run([sys.executable, str(EXAMPLE), "--device", "cuda", "--hidden", "2048",
                          "--layers", "4", "--steps", "2"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "would not fit without the pause: True" in out.stdout, out.stdout
    assert "bit-exact: True" in out.stdout, out.stdout
    state = float(re.search(r"state in the region: ([0-9.]+) MiB", out.stdout).group(1))
    assert state > 512, out.stdout

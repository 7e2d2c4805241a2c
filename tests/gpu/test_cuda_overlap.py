"""Steps under the forward on CUDA (tests/python/test_overlap.py on the host backend):
the buckets step on the binding's own stream, the forward's stream waits for each on the
device, and training is bit-identical to training without it."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from test_overlap import WIDTH, model_and_opt, run, same, train  # noqa: E402

from statepager import Pager  # noqa: E402

pytestmark = pytest.mark.gpu
MiB = 1 << 20


@pytest.mark.parametrize("overlap", [True, "thread"])
@pytest.mark.parametrize("atomic", ["bucket", False])
def test_steps_under_the_forward_are_bit_identical_on_cuda(tmp_path, atomic, overlap):
    base = run(tmp_path, "base", False, device="cuda", atomic=atomic)
    paged = run(tmp_path, "under", overlap, device="cuda", atomic=atomic)
    assert paged[2].last.buckets > 2
    assert base[0] == paged[0]
    assert same(base[1], paged[1])


@pytest.mark.parametrize("overlap", [True, "thread"])
def test_the_forward_waits_on_the_device_not_the_host(tmp_path, overlap):
    """The pre-hooks (or the step's thread) queue the buckets' steps on the binding's
    stream and an event wait on the forward's: after the forward is launched, the host
    has not waited for the last bucket's step kernels (they may still run), yet the loss
    is the one of the stepped params."""
    with Pager(str(tmp_path / "s"), "cuda", page_size=2 * MiB) as pager:
        model, opt, binding, _ = model_and_opt(pager, overlap)
        train(model, opt, 2)
        run_ = binding.step_in_flight
        assert run_ is not None and run_.stepped == 0
        x = torch.ones(8, WIDTH, device="cuda")
        loss = model(x).square().mean()
        assert run_.stepped == len(run_.buckets)
        expected = model(x).square().mean()  # every bucket stepped and waited for
        assert torch.equal(loss, expected)

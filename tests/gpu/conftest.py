"""GPU suite: runs on a machine with a CUDA device, skips (with the reason) elsewhere."""
import pytest
import torch

import statepager


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and statepager.cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: GPU tests run on the GPU machine "
                                   "(scripts/gpu_suite.sh)")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)

"""tests/python/test_tight_budget.py on CUDA: under an hbm_budget smaller than one
parameter's state, steps, state_dict(), load_state_dict(), save through the store and the
device, load and pause run within it, bit-exact with torch's unpaged AdamW on the GPU; and
PagedAdamW's narrow formats read and loaded back in pieces change nothing."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from test_tight_budget import (test_load_state_dict_within_the_budget,  # noqa: E402,F401
                               test_narrow_formats_read_and_load_in_pieces,
                               test_save_load_and_pause_within_the_budget,
                               test_steps_and_state_dict_within_the_budget)

pytestmark = pytest.mark.gpu


@pytest.fixture
def device():
    return "cuda"

"""On CUDA: a script that fails while a Pager is live exits with its traceback and exit
status, never 'terminate called without an active exception' (SIGABRT, status 134), and
its stores are closed at exit. The same cases as tests/python/test_exit.py, plus Megatron
GPT runs (examples/megatron_gpt.py) refused at attach or failing after a step; the
unpaged Megatron case is the control: if it aborts too, the abort is not statepager's."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from test_exit import CASES, check_exit, run_case  # noqa: E402

pytestmark = pytest.mark.gpu

MEGATRON_CASES = {
    "megatron-attach-usage-error": (1, "UsageError: hbm_budget"),
    "megatron-assert": (1, "AssertionError: user code failed after a Megatron step"),
    "megatron-assert-unpaged": (1, "AssertionError: user code failed after a Megatron step"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_failing_cuda_script_exits_with_its_traceback_and_status(case, tmp_path):
    status, last_line = CASES[case]
    store = str(tmp_path / "store")
    check_exit(run_case(case, store, "cuda"), status, last_line, store)


@pytest.mark.parametrize("case", list(MEGATRON_CASES))
def test_failing_megatron_script_exits_with_its_traceback_and_status(case, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    status, last_line = MEGATRON_CASES[case]
    store = str(tmp_path / "store")
    check_exit(run_case(case, store, "cuda", timeout=500), status, last_line, store)

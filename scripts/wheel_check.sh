#!/usr/bin/env bash
# Proof that statepager installs from its wheel alone: builds the wheel here, installs it
# into a FRESH virtual environment (no system site-packages, no source tree on the path)
# with torch 2.11 and the [test,plot] extras, then runs the Python test suite against
# that install.
#
#   BUILD_PYTHON  the interpreter that builds the wheel: it must have torch 2.11, pybind11
#                 and scikit-build-core (the wheel is compiled against its torch; any
#                 2.11 build of torch, CUDA or CPU, has the same C++ ABI). Default python3.
#   WORK          where the wheel and the venv go (default: a new /tmp/statepager-wheel.*)
#   TESTS         pytest targets, relative to the repository (default: tests/python)
#   TORCH_INDEX   where torch 2.11 comes from: PyTorch's CPU index by default (190 MB);
#                 where that cannot be reached, PyPI's torch 2.11.0 (the CUDA 13 build,
#                 with its nvidia-* packages, about 3 GB; it runs on CPU too).
# The wheel is built with --no-build-isolation: an isolated build would compile against
# a torch downloaded for the build, not the one the wheel will run with.
# Prints "wheel check: OK" (and pytest's summary) when every test passed or skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD_PYTHON=${BUILD_PYTHON:-python3}
WORK=${WORK:-$(mktemp -d /tmp/statepager-wheel.XXXXXX)}
TESTS=${TESTS:-tests/python}
mkdir -p "$WORK"
echo "wheel check in $WORK"

"$BUILD_PYTHON" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/dist" .
WHEEL=$(ls "$WORK"/dist/statepager-*.whl)
echo "built $(basename "$WHEEL")"

python_bin=$("$BUILD_PYTHON" -c 'import sys; print(sys.executable)')
"$python_bin" -m venv "$WORK/venv"  # fresh: without --system-site-packages
VPY=$WORK/venv/bin/python
if ! "$VPY" -m pip install -q --retries 1 --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
    "torch==2.11.0" 2>"$WORK/torch-index.log"; then
  echo "torch's index is not reachable from here (see $WORK/torch-index.log): torch 2.11.0 from PyPI"
  "$VPY" -m pip install -q "torch==2.11.0"
fi
"$VPY" -m pip install -q "$WHEEL[test,plot]"
"$VPY" -m pip check

# From outside the checkout, so only the installed wheel can be imported.
cd "$WORK"
"$VPY" - <<'PY'
import statepager, torch
print(f"installed: statepager from {statepager.__file__}, torch {torch.__version__}, "
      f"built against {statepager._C.TORCH_VERSION}, crc32c by {statepager._C.CRC32C_ENGINE}")
assert "/venv/" in statepager.__file__, statepager.__file__
PY
"$WORK/venv/bin/statepager" --help >/dev/null
TARGETS=$(for t in $TESTS; do echo "$ROOT/$t"; done)
"$VPY" -m pytest -q -rs -p no:cacheprovider $TARGETS
echo "wheel check: OK"

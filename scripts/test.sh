#!/usr/bin/env bash
# Every test: set up, then the GoogleTest suite (ctest, then again under ThreadSanitizer)
# and the pytest suites.
# GPU tests skip with a reason on machines without a GPU. A suite that runs no test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=${PYTHON:-python3}
ctest --test-dir build/cpp --output-on-failure --no-tests=error
bash scripts/ctest_skips.sh build/cpp  # ctest does not say why a test was skipped
# The C++ tests again under ThreadSanitizer (build/tsan): a data race fails its test.
cmake -S . -B build/tsan -G Ninja -DSTATEPAGER_BUILD_PYTHON=OFF -DSTATEPAGER_SANITIZE=thread \
  >/dev/null
cmake --build build/tsan
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  ctest --test-dir build/tsan --output-on-failure --no-tests=error
# Run from outside the checkout so the installed package (with its extension) is tested.
ROOT=$PWD
cd /tmp
$PYTHON -m pytest -q -rs -p no:cacheprovider "$ROOT/tests/python" "$ROOT/tests/gpu"

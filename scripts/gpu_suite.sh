#!/usr/bin/env bash
# The GPU suite, on the GPU machine: build against the machine's own torch, run every
# C++ and Python test (GPU tests included), then the benchmarks. Logs go to $OUT.
# Expects liburing and GoogleTest in .deps/ and megatron-core in .whl/ (see README,
# "GPU machine").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/statepager-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cmake -S . -B build/gpu -G Ninja -DLIBURING_ROOT="$PWD/.deps/liburing" \
  -DSTATEPAGER_GTEST_SOURCE="$PWD/.deps/googletest" >"$OUT/cmake.log" 2>&1
cmake --build build/gpu -j "$(nproc)" >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
cp build/gpu/python/_C*.so python/statepager/
export PYTHONPATH=$PWD/python
# Python packages the machine lacks (megatron-core) travel as wheels in .whl/.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
{ ctest --test-dir build/gpu --output-on-failure --no-tests=error --timeout 120 2>&1 | tail -5
  bash scripts/ctest_skips.sh build/gpu; } | tee "$OUT/ctest.log"
ROOT=$PWD
# PYTEST_TARGETS: test files or folders (relative to the repo) to run instead of tests/.
TARGETS=$(for t in ${PYTEST_TARGETS:-tests}; do echo "$ROOT/$t"; done)
(cd /tmp && python3 -m pytest -q -rs -p no:cacheprovider $TARGETS) 2>&1 | tee "$OUT/pytest.log" | tail -25

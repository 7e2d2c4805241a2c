#!/usr/bin/env bash
# Installs what statepager needs on a fresh Debian/Ubuntu machine and builds it:
# system packages (compiler, CMake, liburing, GoogleTest, fio), the pinned Python
# packages, then the C++ tests (build/cpp) and the Python package (pip install .).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need_apt=0
for pkg in g++ cmake ninja-build liburing-dev libgtest-dev fio; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt=1
done
if [ "$need_apt" -eq 1 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    g++ cmake ninja-build liburing-dev libgtest-dev googletest fio >/dev/null
fi

PYTHON=${PYTHON:-python3}
# torch is pinned to the version on the GPU machine. expecttest and hypothesis: torch's
# own optimizer test inputs (tests/python/test_optim_db.py) import them.
$PYTHON -m pip install -q "torch==2.11.0" pybind11 pytest "scikit-build-core>=0.10" numpy \
  expecttest hypothesis

cmake -S . -B build/cpp -G Ninja -DSTATEPAGER_BUILD_PYTHON=OFF >/dev/null
cmake --build build/cpp
$PYTHON -m pip install -q --no-build-isolation .

#!/usr/bin/env bash
# The host tier on the GPU machine, in under 5 minutes, after scripts/setup.sh (or
# scripts/gpu_suite.sh's build in build/gpu). Logs go to $OUT.
#  1. the host tier's GPU tests and its CPU tests (pinned memory, streams, bit-exact steps,
#     spill order, read-ahead, load filling the tier);
#  2. bench step on CUDA, 3 GB of state each way, host tier holding all of it (atomic
#     steps: twice the state): state moved over PCIe next to concurrent PCIe measured in
#     the same run, at 256 MiB x depth 3 and at 128 MiB x depth 4;
#  3. the same with the host tier at half the state (128 MiB x depth 6): the rest goes
#     to the store each step; the step against its floor (fio of the store's bytes or
#     PCIe of all, the larger) and atomic vs in-place steps bit-exact;
#  4. bench sleep: pause/resume of 8 GiB through the host tier, then torch-memory-saver
#     0.0.10 on the same tensors in its own process (installed from .whl/ when present).
# Success: pytest "passed" with no failures; step 2 prints "state moved over PCIe N GB/s
# vs concurrent PCIe M GB/s (the floor's copies): P%"; step 3 "host tier holding part of
# the state: mean step K x the floor of the mean step's bytes" and "atomic and in-place
# steps bit-exact: True"; step 4 "data intact: True" (statepager and torch-memory-saver)
# and "statepager vs torch-memory-saver (steady medians): pause X x, resume Y x". Every
# bench exits non-zero on bytes not intact. Figures measured so far: docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/statepager-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G "build/gpu/python/_C*.so" >/dev/null; then
  cp build/gpu/python/_C*.so python/statepager/
fi
source scripts/gpu_env.sh  # fio for the half-budget floor
if ! python3 -c "import torch_memory_saver" 2>/dev/null && compgen -G ".whl/torch_memory_saver-0.0.10*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps .whl/torch_memory_saver-0.0.10*.whl 2>&1 | tail -2 || true
fi
ROOT=$PWD
# Each part runs even when one before it failed; the script's status says whether any did.
status=0
run() {  # run LOG COMMAND...: the command's output to $OUT/LOG and here
  local log=$1
  shift
  "$@" 2>&1 | tee "$OUT/$log" || { echo "FAILED: $*"; status=1; }
}
cd_tmp_pytest() { (cd /tmp && python3 -m pytest -q -rs -p no:cacheprovider "$@"); }
run tier_pytest.log cd_tmp_pytest "$ROOT/tests/gpu/test_cuda_host_tier.py" \
  "$ROOT/tests/python/test_host_tier.py"

# 2.5e8 params: 3 GB of state each way; the step's fresh copies need as much again. Pages
# as large as the buckets: a page mapped while a page-out copies costs the step about 1 ms
# (see Note [Mapping costs per call, not per byte] in docs/design.md; figures in
# docs/benchmarks.md). Then a deeper pipeline with smaller buckets (one more page-in queued
# on the copy engine while a page-out waits; a shorter first page-in and last page-out, the
# only copies not overlapped).
run tier_bench_step.log python3 -m statepager bench step --device cuda --dir /dev/shm \
  --params 2.5e8 --bucket 256M --page-size 256M --host-budget 7G --steps 8 --no-baseline \
  --no-in-place
run tier_bench_step_d4.log python3 -m statepager bench step --device cuda --dir /dev/shm \
  --params 2.5e8 --bucket 128M --page-size 128M --depth 4 --host-budget 7G --steps 8 \
  --no-baseline --no-in-place

# Half the state: 1.5 GB of host tier for 3 GB (with the in-place run: bit-exact check),
# in 128 MiB buckets x 6 (other shapes measured beside it: docs/benchmarks.md).
run tier_bench_step_half.log python3 -m statepager bench step --device cuda --dir /dev/shm \
  --params 2.5e8 --bucket 128M --page-size 128M --depth 6 --host-budget 1500M --steps 10 \
  --no-baseline

# 8 GiB of mixed tensors; the host tier holds them with their 4 KiB rounding.
run tier_sleep.log python3 -m statepager bench sleep --device cuda --dir /dev/shm --size 8G \
  --host-budget 8400M --repeat 3 --compare-tms
exit $status

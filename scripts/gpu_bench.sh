#!/usr/bin/env bash
# The benchmarks on the GPU machine (after scripts/gpu_suite.sh has built the module).
# DISK: a directory on the local disk; /dev/shm is RAM. Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/statepager-gpu-out}
DISK=${DISK:-/tmp/statepager-bench}
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
run() { echo "\$ python -m statepager $*"; timeout 300 python3 -m statepager "$@" 2>&1 | grep -v "^W1"; }
{
  if [ -z "${QUICK:-}" ]; then
    for page in 2M 32M 64M; do run bench map --device cuda --page-size $page --size 8G; done
  fi
  run bench store --device cuda --dir "$DISK" --size ${STORE_SIZE:-8G} --repeat 2
  run bench sleep --device cuda --dir "$DISK" --size ${SLEEP_SIZE:-8G}
  run bench sleep --device cuda --dir /dev/shm/statepager-bench --size ${SLEEP_SIZE:-8G}
  run bench step --device cuda --dir "$DISK" --params ${DISK_PARAMS:-5e8} --steps 4
  run bench step --device cuda --dir /dev/shm/statepager-bench --params ${SHM_PARAMS:-1e9} --steps 4
} 2>&1 | tee "$OUT/bench.log"

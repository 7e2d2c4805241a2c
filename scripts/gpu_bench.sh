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
  run bench sleep --device cuda --dir /dev/shm/statepager-bench --size ${SLEEP_SIZE:-8G} \
    --io-block 4M --io-depth 64
  run bench formats --device cuda --dir "$DISK" --params ${FORMAT_PARAMS:-2e8}
  run bench ckpt --device cuda --dir "$DISK" --size ${CKPT_SIZE:-4G} --repeat 2
  run bench step --device cuda --dir "$DISK" --params ${DISK_PARAMS:-5e8} --steps 3
  run bench step --device cuda --dir /dev/shm/statepager-bench --params ${SHM_PARAMS:-1e9} --steps 3
  if [ -d /tmp/site/megatron ]; then  # installed by gpu_suite.sh from .whl/
    echo "\$ python examples/megatron_gpt.py --steps 12"
    PYTHONPATH=$PYTHONPATH:/tmp/site timeout 300 python3 examples/megatron_gpt.py --steps 12 \
      --budget-mib 1024 --bucket-mib 64 2>&1 | grep -v -i warn
  fi
} 2>&1 | tee "$OUT/bench.log"

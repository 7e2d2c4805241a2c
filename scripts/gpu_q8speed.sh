#!/usr/bin/env bash
# The q8 format's speed (the streamed step's codec time against its memory traffic), on the
# GPU machine after the module is built (scripts/setup.sh, or gpu_suite.sh's build, which
# copies _C into python/). Logs go to $OUT. At most 3 min 50 s (BUDGET_S 230); three parts,
# each under its own time limit:
#   a. bits: tests/gpu/test_codec_kernels.py (kernels vs the CPU reference, the streamed
#      step with kernels on = off, the residual exceptions' overflow fallback) and
#      tests/gpu/test_cuda_optim.py
#   b. scripts/profile_step.py: the 1.34 B GPT's shapes (PROFILE_ARGS, e.g. "--layers 8"
#      to make it smaller) under torch AdamW attached as Megatron's inner optimizer, store
#      in /dev/shm, fp32 and q8+residual: step time, the pager's compute, host time per
#      phase, syncs per step, top CPU/CUDA ops, codec compute per step
#   c. bench megatron, the 1.34 B GPT, fp32 and q8 (MEGATRON_CONFIGS), 2 warm-up + 3 timed
#      steps: the real step, "pager compute" per configuration
# PARTS picks parts (default "a b c"). megatron-core: /tmp/site, installed from .whl/ when
# missing (as gpu_suite.sh does); without it part c says so.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/statepager-q8speed-out}
SHM=${SHM:-/dev/shm/statepager-q8speed}
mkdir -p "$OUT" "$SHM"
source scripts/gpu_env.sh

part() {  # part NAME LIMIT_S LOG COMMAND...: runs it under a time limit into $OUT/LOG
  local name=$1 limit=$2 log=$OUT/$3 start=$SECONDS
  shift 3
  echo "=== part $name (limit ${limit} s): $*"
  case " ${PARTS:-a b c} " in
    *" $name "*) ;;
    *) echo "=== part $name: skipped (PARTS)"; return ;;
  esac
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  grep -v -e "Warning: " -e "warnings.warn(" -e "^W1" "$log" | tail -n "${TAIL:-200}"
  echo "=== part $name: exit $rc after $((SECONDS - start)) s (log: $log)"
}
ROOT=$PWD
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  part a 80 pytest.log bash -c "cd /tmp && python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
    $ROOT/tests/gpu/test_codec_kernels.py $ROOT/tests/gpu/test_cuda_optim.py"
  part b 100 profile.log python3 scripts/profile_step.py --dir "$SHM" ${PROFILE_ARGS:-}
  left=$(( ${BUDGET_S:-230} - SECONDS ))
  [ "$left" -gt 30 ] || left=30
  # shellcheck disable=SC2086
  part c "$left" benchmeg.log python3 -m statepager bench megatron --dir "$SHM" \
    --configs "${MEGATRON_CONFIGS:-fp32,q8}" --warmup 2 --steps 3 --timeout 120 \
    ${MEGATRON_ARGS:-}
  rmdir "$SHM" 2>/dev/null  # the stores in it delete themselves
  echo "=== total ${SECONDS} s"
} 2>&1 | tee "$OUT/q8speed.log"

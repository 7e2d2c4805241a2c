#!/usr/bin/env bash
# The benchmarks' GPU batch (floors, the host tier, the step timeline, bench megatron), on
# the GPU machine after the module is built (scripts/gpu_suite.sh's build, which copies _C
# into python/, or scripts/setup.sh). Logs go to $OUT. Three parts, each with its own time
# limit:
#   a. tests/gpu/test_cuda_bench_megatron.py: bench megatron at a tiny size, four
#      configurations (unpaged, offload, fp32, host-q8), floors and a trace
#   b. bench step on CUDA, STEP_PARAMS (3.6e8: 4.3 GB of state each way) on /dev/shm,
#      the floor from PCIe and fio
#   c. bench megatron, the 1.34 B GPT, MEGATRON_CONFIGS (default unpaged, offload, fp32,
#      q8, host-fp32, host-q8: about 20-40 s each, floors included), 3 warm-up + 5 timed
#      steps, at most 200 s per configuration, and one more profiled step (--device-time:
#      the codecs' device time); each configuration's lines are printed as it ends, then
#      the summary. MEGATRON_ARGS adds options (e.g.
#      "--layers 12" to make it smaller). PLOT=path.png: the step timeline of TIMELINE
#      (default fp32) as a Chrome trace (path.json) and, where matplotlib is importable, the
#      PNG (else draw it anywhere: python -m statepager.trace path.json path.png).
#      Its limit is what is left of BUDGET_S (470 s) after a and b.
# PARTS picks parts (default "a b c"; e.g. PARTS=c for the GPT alone, in its own batch).
# Success: part a "1 passed"; part c a row per configuration, no "failed (", and a
# "summary": each configuration's step, opt.step and driver peak against Megatron's
# offload, each paged one's step, opt.step and stream as multiples of its floor, q8 / fp32
# and host-q8 / host-fp32, and the kernels' device time per paged configuration.
# fio: on the PATH, or .deps/fio (scripts/fetch_fio.sh), unpacked here from
# .deps/fio.tar.xz when only that was carried. megatron-core: /tmp/site, installed from
# .whl/ when missing (as gpu_suite.sh does).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/statepager-gpu-out}
SHM=${SHM:-/dev/shm/statepager-benchmeg}
mkdir -p "$OUT"
source scripts/gpu_env.sh

part() {  # part NAME LIMIT_S COMMAND...: runs it under a time limit, says how long it took
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "=== part $name (limit ${limit} s): $*"
  case " ${PARTS:-a b c} " in
    *" $name "*) ;;
    *) echo "=== part $name: skipped (PARTS)"; return ;;
  esac
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v -e "Warning: " -e "warnings.warn(" -e "^W1"
  local rc=${PIPESTATUS[0]}
  echo "=== part $name: exit $rc after $((SECONDS - start)) s"
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  python3 -c "from statepager.bench import floor as f; fio, why = f.find_fio()
print('fio:', f'{fio.path} ({fio.version})' if fio else why)"
  part a 200 bash -c "cd /tmp && python3 -m pytest -q -rs -p no:cacheprovider \
    $PWD/tests/gpu/test_cuda_bench_megatron.py"
  part b 120 python3 -m statepager bench step --device cuda --dir "$SHM" \
    --params "${STEP_PARAMS:-3.6e8}" --steps 2 --no-baseline --no-in-place
  timeline=()
  if [ -n "${PLOT:-}" ]; then
    timeline=(--timeline "${TIMELINE:-fp32}" --trace "${PLOT%.*}.json")
    if python3 -c "import matplotlib" 2>/dev/null; then
      timeline+=(--plot "$PLOT")
    else
      echo "matplotlib is not importable here: the trace ${PLOT%.*}.json only (draw it with" \
        "python -m statepager.trace ${PLOT%.*}.json $PLOT)"
    fi
  fi
  left=$(( ${BUDGET_S:-470} - SECONDS ))
  [ "$left" -gt 30 ] || left=30
  # shellcheck disable=SC2086
  part c "$left" python3 -m statepager bench megatron --dir "$SHM" \
    --configs "${MEGATRON_CONFIGS:-unpaged,offload,fp32,q8,host-fp32,host-q8}" --warmup 3 \
    --steps 5 --timeout 200 --device-time "${timeline[@]}" ${MEGATRON_ARGS:-}
  echo "=== total ${SECONDS} s"
} 2>&1 | tee "$OUT/benchmeg.log"

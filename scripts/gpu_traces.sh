#!/usr/bin/env bash
# Step timelines on the GPU machine (after scripts/setup.sh or scripts/gpu_suite.sh has
# built the extension), for docs/: `bench step` on CUDA with --trace and --plot
#   1. on the disk (DISK) at the 1.34 B GPT's size (PARAMS, default 1.34e9 fp32 params:
#      16 GB of AdamW state each way); with PARAMS=5e8, docs/step_timeline_5e8_disk.png;
#   2. on /dev/shm (RAM) at SHM_PARAMS (default 5e8) (the GPT's own step in RAM,
#      docs/step_timeline_1.34b_gpt_fp32_shm.png, is drawn by `bench megatron --plot`:
#      scripts/gpu_benchmeg.sh's PLOT);
#   3. if nsys is installed, an Nsight Systems capture of a small bench step (1e8) with
#      its NVTX summary: the statepager domain's page-in / step / page-out ranges.
# Writes to $OUT: step_{disk,shm}.json (Chrome traces: chrome://tracing, ui.perfetto.dev),
# step_{disk,shm}.png (when matplotlib is importable here; else draw them anywhere with
# `python -m statepager.trace $OUT/step_disk.json step_disk.png`), traces.log, and
# step.nsys-rep / nvtx.txt. At most 4.8 minutes (timeouts 180 + 50 + 60 s).
# Success: traces.log ends with "gpu traces: OK", after a "last paged step's timeline:"
# line per bench and, with nsys, NVTX ranges named "page-in ...", "step bucket ..." and
# "page-out ..." in nvtx.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/statepager-gpu-out}
DISK=${DISK:-/tmp/statepager-bench}
mkdir -p "$OUT" "$DISK"
export PYTHONUNBUFFERED=1
# The extension built in place by gpu_suite.sh, else the installed package (setup.sh).
if compgen -G "python/statepager/_C*.so" >/dev/null; then export PYTHONPATH=$PWD/python; fi
if python3 -c "import matplotlib" 2>/dev/null; then PLOT=1; else PLOT=""; fi
status=0
bench() {  # NAME DIR PARAMS LIMIT_S
  local plot=()
  [ -n "$PLOT" ] && plot=(--plot "$OUT/step_$1.png")
  echo "\$ python -m statepager bench step --device cuda --dir $2 --params $3 ..."
  timeout "$4" python3 -m statepager bench step --device cuda --dir "$2" --params "$3" \
    --warmup 1 --steps 1 --no-baseline --no-in-place --trace "$OUT/step_$1.json" "${plot[@]}" \
    || { echo "bench step on $1 FAILED"; status=1; }
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import statepager; print('statepager', statepager.__file__, 'NVTX compiled in:', statepager._C.NVTX)"
  [ -n "$PLOT" ] || echo "matplotlib is not importable here: traces only, no PNG"
  bench disk "$DISK" "${PARAMS:-1.34e9}" 180
  bench shm /dev/shm/statepager-bench "${SHM_PARAMS:-5e8}" 50
  if command -v nsys >/dev/null; then
    timeout 60 nsys profile -q -o "$OUT/step" --force-overwrite true --trace cuda,nvtx \
      python3 -m statepager bench step --device cuda --dir "$DISK" --params 1e8 --warmup 1 --steps 1 \
      --no-baseline --no-in-place >/dev/null || { echo "nsys capture FAILED"; status=1; }
    nsys stats -q --report nvtx_sum --format csv "$OUT/step.nsys-rep" > "$OUT/nvtx.txt" 2>&1
    echo "NVTX ranges in the capture (nvtx.txt):"
    grep -o -E '(page-in|page-out|step bucket)[^,"]*' "$OUT/nvtx.txt" | sed -E 's/[0-9.]+ MiB//; s/bucket [0-9]+/bucket/' | sort | uniq -c
  else
    echo "nsys not installed: no Nsight Systems capture"
  fi
  rm -rf /dev/shm/statepager-bench
  [ "$status" -eq 0 ] && echo "gpu traces: OK" || echo "gpu traces: FAILED"
} 2>&1 | grep -v "^W1" | tee "$OUT/traces.log"

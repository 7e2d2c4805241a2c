#!/usr/bin/env bash
# Parameters split into chunks (no bucket above bucket_size) on the GPU
# machine, after `bash scripts/setup.sh` (or with PYTHONPATH=python and the module
# built): torch's Adam variants on slices of a CUDA parameter (fused, capturable), and a
# 0.116 B GPT (4 layers, hidden 1024, 16 heads, vocab 32000) under hbm_budget 256 MiB
# with 16 MiB buckets, bit for bit Megatron without the pager over 20 steps (bf16 and
# fp32 grads). Logs go to $OUT. About 2 minutes on an H200.
# Success: pytest's last line "8 passed", and per GPT case a line
#   split GPT (bf16 grads): ..., N chunks, largest bucket <= 16 MiB, ..., peak mapped P MiB of 256
# with N > 0 and P <= 256; exit status 0.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/statepager-split-out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ROOT=$PWD
status=0
(cd /tmp && timeout 230 $PYTHON -m pytest -q -rs -s -p no:cacheprovider -m gpu \
  "$ROOT/tests/gpu/test_split_gpt.py") >"$OUT/pytest.log" 2>&1 || status=$?
grep "split GPT" "$OUT/pytest.log" || true
tail -15 "$OUT/pytest.log"
exit $status

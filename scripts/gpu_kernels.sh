#!/usr/bin/env bash
# The codec and fused-AdamW kernels on the GPU machine, after `bash scripts/setup.sh` (or
# gpu_suite.sh's build, with PYTHONPATH=python): their bit-exactness tests (kernels vs
# the CPU reference, fused AdamW vs torch's foreach AdamW, streamed steps with the kernels
# on and off) and a micro-benchmark of each format's codec time per GB of state next to
# a device copy of the same bytes. Logs go to $OUT. About 2 minutes on an H200.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/statepager-kernels-out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
$PYTHON - <<'PY' 2>&1 | tee "$OUT/built.txt"
import statepager, torch
assert torch.cuda.is_available(), "no CUDA device"
assert statepager._C.KERNELS_BUILT, ("statepager was built without the kernels (no nvcc when "
                                     "it was built): rebuild where nvcc is on PATH")
print("kernels built:", statepager._C.__file__, torch.cuda.get_device_name())
PY
ROOT=$PWD
status=0
(cd /tmp && $PYTHON -m pytest -q -rs -p no:cacheprovider -m gpu \
  "$ROOT/tests/gpu/test_codec_kernels.py" "$ROOT/tests/python/test_codecs.py" \
  "$ROOT/tests/gpu/test_cuda_optim.py") >"$OUT/pytest.log" 2>&1 || status=$?
tail -15 "$OUT/pytest.log"
$PYTHON scripts/bench_codecs.py 2>&1 | tee "$OUT/bench_codecs.txt"
exit $status

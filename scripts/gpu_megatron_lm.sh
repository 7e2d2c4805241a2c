#!/usr/bin/env bash
# Megatron-LM through `python -m statepager.megatron_lm` on the GPU machine:
# tests/gpu/test_megatron_lm.py (pretrain_gpt.py, tiny GPT, 20 iterations, 1 GPU and
# DP = 2 where two are visible; paged vs unpaged, SIGKILL at 15 and restart, Megatron's own
# resume as control, --no-load-optim, a missing rank state, a refused flag, --async-save,
# a crash between the saves, STATEPAGER_* alone through the start-up hook). Its Megatron
# runs go in two waves of concurrent processes: about 3 minutes on an H200.
# Expects `bash scripts/setup.sh` (or gpu_suite.sh) to have built the extension into
# python/statepager/, megatron-core in .whl/ (README, "The GPU machine") and Megatron-LM's
# core_r0.19.0 training scripts in .deps/megatron-lm (carried, git-ignored).
# Logs: $OUT/pytest.log and one log per Megatron run in $OUT/megatron-lm/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/statepager-gpu-out}
mkdir -p "$OUT/megatron-lm"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/megatron_core-*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/megatron_core-*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# The wheel ships the dataset helpers built, yet pretrain_gpt.py runs `make` in their
# folder (megatron/training/initialize.py): give it Megatron-LM's Makefile (carried in
# .deps/megatron-lm), with the built library newer than its source so nothing is rebuilt.
helpers=/tmp/site/megatron/core/datasets
if [ -d "$helpers" ] && [ ! -f "$helpers/Makefile" ]; then
  cp .deps/megatron-lm/megatron/core/datasets/Makefile "$helpers/"
  touch "$helpers"/helpers_cpp*.so
fi
export STATEPAGER_TEST_LOGS=$OUT/megatron-lm
ROOT=$PWD
(cd /tmp && timeout 560 python3 -m pytest -q -rs -p no:cacheprovider \
  "$ROOT/tests/gpu/test_megatron_lm.py") 2>&1 | tee "$OUT/pytest.log" | tail -25

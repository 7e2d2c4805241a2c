#!/usr/bin/env bash
# The Megatron adapter's seams on the GPU machine, after `bash scripts/setup.sh`: the
# adapter's parity tests (tests/gpu/test_megatron.py), its contract with the installed
# megatron-core (tests/gpu/test_megatron_contract.py), the attach refusals, and the GIL
# tests. Logs go to $OUT. Success: pytest.log ends with "N passed" and no "failed"; the
# one skip expected is test_attach_without_a_supported_megatron_core_is_refused
# (megatron-core is installed there).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/statepager-seams-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# megatron-core travels as a wheel in .whl/ when the machine lacks it (see gpu_suite.sh).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
fi
python3 -c "import statepager, megatron.core; print(statepager.__file__)" | tee "$OUT/env.txt"
(cd /tmp && timeout 280 python3 -m pytest -q -rs -p no:cacheprovider \
  "$ROOT/tests/gpu/test_megatron_contract.py" "$ROOT/tests/python/test_adapters.py" \
  "$ROOT/tests/python/test_gil.py" "$ROOT/tests/gpu/test_megatron.py") 2>&1 \
  | tee "$OUT/pytest.log" | tail -25

#!/usr/bin/env bash
# The host tier (#14) on the GPU machine, in under 5 minutes, after scripts/setup.sh (or
# scripts/gpu_suite.sh's build in build/gpu). Logs go to $OUT.
#  1. the host tier's GPU tests and its CPU tests (pinned memory, streams, bit-exact steps);
#  2. bench step on CUDA with the host tier holding the state (atomic steps: twice the
#     state), state moved per second next to concurrent PCIe measured in the same run;
#  3. pause/resume of 8 GiB through the host tier: GB/s each way, first pause and steady.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/statepager-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G "build/gpu/python/_C*.so" >/dev/null; then
  cp build/gpu/python/_C*.so python/statepager/
  export PYTHONPATH=$PWD/python
fi
ROOT=$PWD
(cd /tmp && python3 -m pytest -q -rs -p no:cacheprovider \
  "$ROOT/tests/gpu/test_cuda_host_tier.py" "$ROOT/tests/python/test_host_tier.py") 2>&1 |
  tee "$OUT/tier_pytest.log" | tail -5

# 2.5e8 params: 3 GB of state each way; the step's fresh copies need as much again.
python3 -m statepager bench step --device cuda --dir /dev/shm --params 2.5e8 --bucket 256M \
  --host-budget 7G --steps 5 --no-baseline --no-in-place 2>&1 | tee "$OUT/tier_bench_step.log"

python3 - <<'PY' 2>&1 | tee "$OUT/tier_sleep.log"
import statistics, tempfile, time
import torch
import statepager

GiB, MiB = 1 << 30, 1 << 20
size = 8 * GiB
with tempfile.TemporaryDirectory(dir="/dev/shm") as d, \
        statepager.Pager(d + "/store", device="cuda", page_size=64 * MiB,
                         host_budget=size + 256 * MiB) as p:
    ts = [p.empty(256 * MiB // 4) for _ in range(size // (256 * MiB))]
    p.page_in(ts)
    for i, t in enumerate(ts):
        t.fill_(float(i))
    rounds = []
    for r in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        p.pause()
        pause_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        p.resume()
        torch.cuda.synchronize()
        rounds.append((size / pause_s / 1e9, size / (time.perf_counter() - t0) / 1e9))
    ok = all(bool((t == float(i)).all()) for i, t in enumerate(ts))
    s = p.stats()
    print(f"host tier sleep: {size / GiB:.0f} GiB in {len(ts)} tensors, bytes exact: {ok}, "
          f"file bytes written {s['bytes_written']}, read {s['bytes_read']}")
    print(f"  first pause {rounds[0][0]:.1f} GB/s, first resume {rounds[0][1]:.1f} GB/s")
    print(f"  steady pause {statistics.median(r[0] for r in rounds[1:]):.1f} GB/s, "
          f"steady resume {statistics.median(r[1] for r in rounds[1:]):.1f} GB/s")
PY

#!/usr/bin/env bash
# statepager on a GPU machine: build it against the machine's torch, run its tests,
# benchmarks, kernels' checks, step timelines and profiles.
#
#   scripts/gpu.sh build            build/gpu with CMake and Ninja; the extension is copied
#                                   into python/statepager/, which every command then runs
#                                   (without a build: the installed package, scripts/setup.sh)
#   scripts/gpu.sh test [PART|PATH...]
#                                   the GPU suite: ctest (build/gpu), then pytest -m gpu of
#                                   tests/ (and -m megatron: tests/conftest.py) in two
#                                   parts: `shared`, the tests that may share
#                                   the device, side by side (pytest-xdist, WORKERS at once,
#                                   default 6, where it imports), and `alone`, those marked
#                                   alone (tests/conftest.py), one at a time; a PART runs
#                                   that part alone (no ctest); with PATHs (relative to the
#                                   repository, e.g. tests/gpu/test_split_gpt.py), pytest
#                                   of those, CPU tests included
#   scripts/gpu.sh suite            build, then test
#   scripts/gpu.sh bench [NAME...]  the benchmarks, default all of: map store sleep formats
#                                   ckpt step tier megatron megatron-lm (tier: the host
#                                   tier; megatron: `bench megatron`'s 1.34 B GPT, needs
#                                   megatron-core; megatron-lm: the same GPT in Megatron-LM's
#                                   pretrain_gpt.py, needs its scripts in .deps/megatron-lm)
#   scripts/gpu.sh megatron-lm      Megatron-LM's pretrain_gpt.py through
#                                   `python -m statepager.megatron_lm`
#                                   (tests/gpu/test_megatron_lm.py; a log per run)
#   scripts/gpu.sh kernels          the CUDA codec and fused-AdamW kernels: bit-exact
#                                   against the CPU reference and torch's AdamW, then their
#                                   time against a device copy (scripts/bench_codecs.py)
#   scripts/gpu.sh profile [ARG...] where the streamed step's time goes, per format
#                                   (scripts/profile_step.py --dir $SHM ARG...)
#   scripts/gpu.sh traces           bench step's timeline (Chrome trace, and PNG where
#                                   matplotlib imports) on DISK and on SHM; with nsys, an
#                                   Nsight Systems capture and its NVTX ranges
#   scripts/gpu.sh deps             on a Debian machine with internet (not the GPU machine):
#                                   fills the git-ignored folders below for a GPU machine
#                                   without it (MEGATRON_LM_SRC, TMS_SRC: git clones of
#                                   Megatron-LM and torch_memory_saver to take the sources
#                                   from, else they are cloned from GitHub)
#
# Environment: OUT, where the logs go (default /tmp/statepager-gpu-out: a log per command,
# $OUT/COMMAND.log); DISK, a directory on the local disk (default /tmp/statepager-bench);
# SHM, one in RAM (default /dev/shm/statepager-bench). bench megatron: MEGATRON_CONFIGS
# (its --configs), MEGATRON_ARGS (more options, e.g. "--layers 12"), PLOT=path.png (the
# step timeline of TIMELINE, default fp32, as path.json and, where matplotlib imports, the
# PNG). bench megatron-lm: MEGATRON_LM_CONFIGS (its --configs). traces: PARAMS (default
# 1.34e9, on DISK), SHM_PARAMS (default 5e8).
# Offline, from git-ignored folders: liburing (.deps/liburing) and GoogleTest
# (.deps/googletest) for build; wheels in .whl/ (megatron-core, expecttest), installed into
# /tmp/site; fio (.deps/fio, or .deps/fio.tar.xz unpacked: scripts/fetch_fio.sh);
# Megatron-LM's core_r0.19.0 scripts (.deps/megatron-lm) for megatron-lm.
# Each part of a command runs even when one before it failed; the exit status is 1 when
# any failed.
# shellcheck disable=SC2317  # the commands and benches are called by name: "cmd_$command"
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-/tmp/statepager-gpu-out}
DISK=${DISK:-/tmp/statepager-bench}
SHM=${SHM:-/dev/shm/statepager-bench}
SITE=/tmp/site
BENCHES="map store sleep formats ckpt step tier megatron megatron-lm"
status=0

usage() {  # the header above
  awk 'NR == 1 || /^# shellcheck/ {next} /^#/ {sub(/^# ?/, ""); print; next} {exit}' "$0"
}

# -- the environment ----------------------------------------------------------------------

use_checkout_module() {  # the extension `build` copied into python/statepager/, if any
  compgen -G "python/statepager/_C*.so" >/dev/null || return 0
  [[ ":${PYTHONPATH:-}:" == *":$ROOT/python:"* ]] && return 0
  export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
}

install_wheels() {  # .whl/ into $SITE, again when the set of wheels changes
  local wheels=() w
  for w in .whl/*.whl; do
    # torch-memory-saver installs into the environment (bench tier), as its wheel expects.
    [ -e "$w" ] && [[ $(basename "$w") != torch_memory_saver-* ]] && wheels+=("$w")
  done
  if [ ${#wheels[@]} -gt 0 ] && [ "$(cat "$SITE/.wheels" 2>/dev/null)" != "${wheels[*]}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${wheels[@]}" && echo "${wheels[*]}" >"$SITE/.wheels"
  fi
  [ -d "$SITE" ] || return 0
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE
  # The wheel ships Megatron's dataset helpers built, yet pretrain_gpt.py runs `make` in
  # their folder (megatron/training/initialize.py): Megatron-LM's Makefile, with the built
  # library newer than its source so that nothing is rebuilt.
  local helpers=$SITE/megatron/core/datasets make=.deps/megatron-lm/megatron/core/datasets/Makefile
  if [ -d "$helpers" ] && [ ! -f "$helpers/Makefile" ] && [ -f "$make" ]; then
    cp "$make" "$helpers/"
    touch "$helpers"/helpers_cpp*.so
  fi
}

setup_env() {
  export PYTHONUNBUFFERED=1
  use_checkout_module
  install_wheels
  if [ ! -x .deps/fio/usr/bin/fio ] && [ -f .deps/fio.tar.xz ]; then
    tar -C .deps -xJf .deps/fio.tar.xz
  fi
}

show_env() {  # the device, the statepager it runs, fio and megatron-core
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
  python3 - <<'PY'
import importlib.util
import statepager
from statepager.tools.bench.floor import find_fio
fio, why = find_fio()
try:
    megatron = importlib.util.find_spec("megatron.core") is not None
except ModuleNotFoundError:
    megatron = False
print(f"statepager {statepager.__file__}: kernels built {statepager._C.KERNELS_BUILT}, NVTX "
      f"{statepager._C.NVTX}; fio {f'{fio.path} ({fio.version})' if fio else why}; "
      f"megatron-core {'installed' if megatron else 'not installed'}")
PY
}

make_dirs() {  # DISK, and SHM: removed at the end when made here (each bench deletes what
  # it writes in it)
  mkdir -p "$DISK"
  if [ ! -d "$SHM" ]; then
    mkdir -p "$SHM" && trap 'rmdir "$SHM" 2>/dev/null' EXIT
  fi
}

# -- running parts --------------------------------------------------------------------------

part() {  # part LIMIT_S COMMAND...: under a time limit (0: none), without torch's log noise
  local limit=$1 start=$SECONDS rc
  shift
  echo "\$ $*"
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v -e "^W1" -e "Warning: " -e "warnings.warn("
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "FAILED (exit $rc after $((SECONDS - start)) s): $*"
    status=1
  fi
}

tests() {  # tests LIMIT_S PYTEST_ARG...: pytest from /tmp (the package it imports is the
  # one on PYTHONPATH or installed, not the checkout's python/ without its extension); a
  # path is relative to the repository
  local limit=$1 args=() a
  shift
  for a in "$@"; do
    [ -e "$ROOT/${a%%::*}" ] && a=$ROOT/$a
    args+=("$a")
  done
  part "$limit" env -C /tmp python3 -m pytest -q -rs -p no:cacheprovider "${args[@]}"
}

sp() {  # sp LIMIT_S ARG...: python -m statepager ARG...
  local limit=$1
  shift
  part "$limit" python3 -m statepager "$@"
}

# -- the commands ---------------------------------------------------------------------------

cmd_build() {
  local gtest=()
  [ -d .deps/googletest ] && gtest=(-DSTATEPAGER_GTEST_SOURCE="$ROOT/.deps/googletest")
  echo "building build/gpu (logs: $OUT/cmake.log, $OUT/build.log)"
  if ! cmake -S . -B build/gpu -G Ninja -DLIBURING_ROOT="$ROOT/.deps/liburing" "${gtest[@]}" \
      >"$OUT/cmake.log" 2>&1; then
    tail -50 "$OUT/cmake.log"
    return 1
  fi
  if ! cmake --build build/gpu -j "$(nproc)" >"$OUT/build.log" 2>&1; then
    tail -50 "$OUT/build.log"
    return 1
  fi
  cp build/gpu/python/_C*.so python/statepager/
  use_checkout_module
  echo "built; the extension is in python/statepager/"
}

cmd_test() {
  show_env
  case "${1:-}" in
    "") run_ctest; test_part shared; test_part alone ;;
    shared|alone) test_part "$1" ;;
    *) tests 0 "$@" ;;
  esac
  return "$status"
}

run_ctest() {
  [ -d build/gpu ] || return 0
  echo "\$ ctest --test-dir build/gpu (log: $OUT/ctest.log)"
  ctest --test-dir build/gpu --output-on-failure --no-tests=error --timeout 120 \
    >"$OUT/ctest.log" 2>&1 || status=1
  tail -5 "$OUT/ctest.log"
  bash scripts/ctest_skips.sh build/gpu
}

test_part() {  # shared: side by side where pytest-xdist imports; alone: one at a time
  if [ "$1" = alone ]; then
    tests 0 -m "gpu and alone" tests
  elif python3 -c "import xdist" 2>/dev/null; then
    tests 0 -m "(gpu or megatron) and not alone" -n "${WORKERS:-6}" tests
  else
    tests 0 -m "(gpu or megatron) and not alone" tests
  fi
}

cmd_suite() {
  cmd_build || return 1
  cmd_test
}

bench_map() {
  local page
  for page in 2M 32M 64M; do sp 300 bench map --device cuda --page-size "$page" --size 8G; done
}

bench_store() {
  sp 300 bench store --device cuda --dir "$DISK" --size 8G --repeat 2
}

bench_sleep() {
  sp 300 bench sleep --device cuda --dir "$DISK" --size 8G
  sp 300 bench sleep --device cuda --dir "$SHM" --size 8G
  sp 300 bench sleep --device cuda --dir "$SHM" --size 8G --io-block 4M --io-depth 64
}

bench_formats() {
  sp 300 bench formats --device cuda --dir "$DISK" --params 2e8
}

bench_ckpt() {
  sp 300 bench ckpt --device cuda --dir "$DISK" --size 4G --repeat 2
}

bench_step() {
  sp 300 bench step --device cuda --dir "$DISK" --params 5e8 --steps 3
  sp 300 bench step --device cuda --dir "$SHM" --params 1e9 --steps 3
}

bench_tier() {
  # 3 GB of state each way (2.5e8 params), the host tier holding all of it through atomic
  # steps (twice the state), pages as large as the buckets (see Note [Mapping costs per
  # call, not per byte] in docs/design.md): its state moved over PCIe against concurrent
  # PCIe, at 256 MiB x depth 3, then deeper with smaller buckets.
  local step=(bench step --device cuda --dir "$SHM" --params 2.5e8 --no-baseline)
  sp 300 "${step[@]}" --bucket-size 256M --page-size 256M --host-budget 7G --steps 8 --no-in-place
  sp 300 "${step[@]}" --bucket-size 128M --page-size 128M --depth 4 --host-budget 7G --steps 8 \
    --no-in-place
  # Half the state in the tier, the rest to the store each step: the step against its
  # floor, and atomic steps bit-exact with in-place ones.
  sp 300 "${step[@]}" --bucket-size 128M --page-size 128M --depth 6 --host-budget 1500M --steps 10
  # Pause and resume of 8 GiB through the tier (4 KiB rounding included), beside
  # torch-memory-saver 0.0.10 (from .whl/ when it is not installed).
  if ! python3 -c "import torch_memory_saver" 2>/dev/null \
      && compgen -G ".whl/torch_memory_saver-0.0.10*.whl" >/dev/null; then
    python3 -m pip install -q --no-deps .whl/torch_memory_saver-0.0.10*.whl 2>&1 | tail -2
  fi
  sp 300 bench sleep --device cuda --dir "$SHM" --size 8G --host-budget 8400M --repeat 3 \
    --compare-tms
}

bench_megatron() {
  if ! python3 -c "import megatron.core" 2>/dev/null; then
    echo "skipped: megatron-core is not installed (pip install 'statepager[megatron]'," \
      "or its wheel in .whl/)"
    return
  fi
  local extra=()
  [ -n "${MEGATRON_CONFIGS:-}" ] && extra+=(--configs "$MEGATRON_CONFIGS")
  if [ -n "${PLOT:-}" ]; then
    extra+=(--timeline "${TIMELINE:-fp32}" --trace "${PLOT%.*}.json")
    if python3 -c "import matplotlib" 2>/dev/null; then
      extra+=(--plot "$PLOT")
    else
      echo "matplotlib does not import here: the trace ${PLOT%.*}.json alone (draw it" \
        "anywhere with python -m statepager.tools.trace ${PLOT%.*}.json $PLOT)"
    fi
  fi
  # Each configuration has its own --timeout; the run as a whole no limit of its own.
  # shellcheck disable=SC2086
  sp 0 bench megatron --dir "$SHM" --warmup 3 --steps 5 --timeout 200 --device-time \
    "${extra[@]}" ${MEGATRON_ARGS:-}
}

bench_megatron-lm() {
  if [ ! -f .deps/megatron-lm/pretrain_gpt.py ]; then
    echo "skipped: Megatron-LM's scripts are not in .deps/megatron-lm (core_r0.19.0)"
    return
  fi
  # shellcheck disable=SC2086
  sp 0 bench megatron-lm --megatron-lm .deps/megatron-lm --dir "$SHM" --timeout 300 \
    ${MEGATRON_LM_CONFIGS:+--configs "$MEGATRON_LM_CONFIGS"}
}

cmd_bench() {
  local names=("$@") name
  [ $# -gt 0 ] || read -r -a names <<<"$BENCHES"
  for name in "${names[@]}"; do
    [[ " $BENCHES " == *" $name "* ]] || { echo "no bench $name: one of $BENCHES"; return 2; }
  done
  show_env
  make_dirs
  for name in "${names[@]}"; do
    echo "=== bench $name"
    "bench_$name"
  done
  return "$status"
}

cmd_megatron_lm() {
  export STATEPAGER_TEST_LOGS=$OUT/megatron-lm
  mkdir -p "$STATEPAGER_TEST_LOGS"
  show_env
  echo "a log per Megatron run in $STATEPAGER_TEST_LOGS"
  tests 560 tests/gpu/test_megatron_lm.py
  return "$status"
}

cmd_kernels() {
  show_env
  python3 -c "import statepager, torch
assert torch.cuda.is_available(), 'no CUDA device'
assert statepager._C.KERNELS_BUILT, ('statepager was built without the kernels (no nvcc when '
                                     'it was built): rebuild where nvcc is on PATH')" || return 1
  tests 0 -m gpu tests/gpu/test_codec_kernels.py tests/python/test_codecs.py \
    tests/gpu/test_cuda_optim.py
  part 0 python3 scripts/bench_codecs.py
  return "$status"
}

cmd_profile() {
  show_env
  make_dirs
  part 0 python3 scripts/profile_step.py --dir "$SHM" "$@"
  return "$status"
}

traced_step() {  # traced_step NAME DIR PARAMS LIMIT_S: one bench step, drawn to $OUT/step_NAME.*
  local plot=()
  python3 -c "import matplotlib" 2>/dev/null && plot=(--plot "$OUT/step_$1.png")
  sp "$4" bench step --device cuda --dir "$2" --params "$3" --warmup 1 --steps 1 \
    --no-baseline --no-in-place --trace "$OUT/step_$1.json" "${plot[@]}"
}

cmd_traces() {
  show_env
  python3 -c "import matplotlib" 2>/dev/null \
    || echo "matplotlib does not import here: traces alone (draw one anywhere with" \
      "python -m statepager.tools.trace $OUT/step_disk.json step_disk.png)"
  make_dirs
  # The 1.34 B GPT's size (16 GB of AdamW state each way) on the disk; less in RAM.
  traced_step disk "$DISK" "${PARAMS:-1.34e9}" 180
  traced_step shm "$SHM" "${SHM_PARAMS:-5e8}" 50
  if ! command -v nsys >/dev/null; then
    echo "nsys is not installed: no Nsight Systems capture"
    return "$status"
  fi
  part 60 nsys profile -q -o "$OUT/step" --force-overwrite true --trace cuda,nvtx \
    python3 -m statepager bench step --device cuda --dir "$DISK" --params 1e8 --warmup 1 \
    --steps 1 --no-baseline --no-in-place
  nsys stats -q --report nvtx_sum --format csv "$OUT/step.nsys-rep" >"$OUT/nvtx.txt" 2>&1
  echo "NVTX ranges in the capture ($OUT/nvtx.txt):"
  grep -o -E '(page-in|page-out|step bucket)[^,"]*' "$OUT/nvtx.txt" \
    | sed -E 's/[0-9.]+ MiB//; s/bucket [0-9]+/bucket/' | sort | uniq -c
  return "$status"
}

# -- the offline dependencies ------------------------------------------------------------

MEGATRON_LM_REF=core_r0.19.0
# Megatron-LM's training scripts that pretrain_gpt.py imports; megatron/core comes from the
# megatron-core wheel, but for the Makefile that Megatron-LM runs in its datasets folder.
MEGATRON_LM_PATHS="pretrain_gpt.py gpt_builders.py model_provider.py hybrid_builders.py
mamba_builders.py megatron/training megatron/post_training megatron/rl megatron/inference
megatron/elastification megatron/core/datasets/Makefile LICENSE"
WHEELS="megatron-core==0.19.2 emerging-optimizers==0.3.0 expecttest pytest-xdist execnet
torch_memory_saver==0.0.10"

cmd_deps() {
  local work
  work=$(mktemp -d) || return 1
  # shellcheck disable=SC2064  # the folder made now; the script exits after this command
  trap "rm -rf '$work'" EXIT
  mkdir -p .deps .whl
  (cd "$work" && apt-get download liburing2 liburing-dev googletest >/dev/null) || return 1
  rm -rf .deps/liburing .deps/googletest
  dpkg -x "$work"/liburing2_*.deb .deps/liburing
  dpkg -x "$work"/liburing-dev_*.deb .deps/liburing
  dpkg -x "$work"/googletest_*.deb "$work/gtest"
  cp -r "$work/gtest/usr/src/googletest" .deps/googletest
  # fio as an archive alone: unpacked it would take most of what a copy to the GPU machine
  # may carry; setup_env unpacks it there.
  PACK=1 bash scripts/fetch_fio.sh | tail -1 && rm -rf .deps/fio || return 1
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: -d .whl \
    $WHEELS || return 1
  deps_source .deps/megatron-lm "${MEGATRON_LM_SRC:-$work/megatron-lm}" \
    https://github.com/NVIDIA/Megatron-LM "$MEGATRON_LM_REF" "$MEGATRON_LM_PATHS" || return 1
  deps_source .deps/torch_memory_saver "${TMS_SRC:-$work/tms}" \
    https://github.com/fzyzcjy/torch_memory_saver HEAD "" || return 1
  du -sh .deps .whl
}

deps_source() {  # deps_source DEST CLONE URL REF PATHS: PATHS (all when empty) of REF in
  # the git clone CLONE, cloned from URL where it does not exist
  local dest=$1 clone=$2 url=$3 ref=$4 paths=$5
  if [ ! -e "$clone" ]; then
    git clone -q --filter=blob:none "$url" "$clone" || return 1
  fi
  git -C "$clone" rev-parse -q --verify "$ref^{commit}" >/dev/null \
    || ref=origin/$ref  # a branch of the clone's remote
  rm -rf "$dest" && mkdir -p "$dest"
  # shellcheck disable=SC2086
  git -C "$clone" archive "$ref" $paths | tar -x -C "$dest"
  echo "$dest: $url at $(git -C "$clone" rev-parse --short "$ref")"
}

command=${1:-help}
shift
case $command in
  build | test | suite | bench | megatron-lm | kernels | profile | traces) ;;
  deps) cmd_deps; exit ;;
  help | -h | --help) usage; exit 0 ;;
  *) usage >&2; exit 2 ;;
esac
mkdir -p "$OUT"
setup_env
"cmd_${command//-/_}" "$@" 2>&1 | tee "$OUT/$command.log"
exit "${PIPESTATUS[0]}"

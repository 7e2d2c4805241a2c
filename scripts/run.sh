#!/usr/bin/env bash
# The main job: set up, then page tensors through a store and print what happened.
# Runs on the GPU when one is present, else on the host backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=${PYTHON:-python3}
DIR=${STATEPAGER_DIR:-/tmp/statepager-main}
ROOT=$PWD
cd /tmp
$PYTHON "$ROOT/examples/page_tensors.py" --dir "$DIR" --size 512M
$PYTHON "$ROOT/examples/train_paged_adamw.py" --dir "$DIR" --steps 20

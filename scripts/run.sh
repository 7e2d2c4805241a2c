#!/usr/bin/env bash
# The main job: set up, then page tensors through a store and print what happened.
# Runs on the GPU when one is present, else on the host backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=${PYTHON:-python3}
DIR=${STATEPAGER_DIR:-/tmp/statepager-main}
cd /tmp && $PYTHON "$OLDPWD/examples/page_tensors.py" --dir "$DIR"

#!/usr/bin/env bash
# Prints the reason of each GoogleTest test the last ctest run in build dir $1 skipped
# (GTEST_SKIP() << "reason"): ctest lists skipped tests, not why.
set -euo pipefail
log="$1/Testing/Temporary/LastTest.log"
[ -f "$log" ] || exit 0
awk '
  /^\[ RUN      \] / { name = $4 }
  /: Skipped$/       { reason = ""; collecting = 1; next }
  /^\[  SKIPPED \] / { if (collecting) printf "  skipped %s: %s\n", name, reason; collecting = 0; next }
  collecting && NF   { reason = reason (reason == "" ? "" : " ") $0 }
' "$log"

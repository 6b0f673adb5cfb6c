#!/usr/bin/env bash
# Set up, then run the test suite.
#   bash scripts/test.sh            everything, the real-model tests included (CI runs this)
#   bash scripts/test.sh --quick    the quick tier: tiny models, every module, no real-model tests
# Further arguments go to pytest. Both tiers run on all cores (pytest-xdist; LOOKAHEAD_TEST_WORKERS
# overrides the count) and print the slowest tests. docs/testing.md says what each tier covers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
tier=full
if [ "${1:-}" = "--quick" ]; then
  tier=quick
  shift
fi
args=(--hypothesis-profile="$tier" --durations=15 -n "${LOOKAHEAD_TEST_WORKERS:-auto}" --dist worksteal)
if [ "$tier" = quick ]; then
  args+=(-m "not slow")
fi
.venv/bin/python -m pytest "${args[@]}" "$@"

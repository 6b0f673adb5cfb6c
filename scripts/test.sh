#!/usr/bin/env bash
# Set up, then run the whole test suite (the slow real-model tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest "$@"

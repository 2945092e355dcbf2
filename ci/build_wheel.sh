#!/usr/bin/env bash
# Build the sglite wheel (abi3: loads on CPython 3.11 and 3.12) into dist/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh >/dev/null
rm -rf dist && .venv/bin/python -m pip wheel -q --no-deps -w dist .
ls dist

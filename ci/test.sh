#!/usr/bin/env bash
# The test command of the README: set up from a fresh clone, lint, test the Rust crate, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
PY=.venv/bin/python
echo "[test] lint"
"$PY" -m ruff check python tests benches kernels
"$PY" -m ruff format --check python tests benches kernels
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
echo "[test] cargo test"
cargo test -p sglite-tree-core -p sglite-cpu-attn -p sglite-quant
echo "[test] pytest"
SGL_TEST_REQUIRE_RUST=1 "$PY" -m pytest -q -p no:cacheprovider --timeout 900 --durations=25 tests "$@"

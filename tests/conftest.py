"""Shared pytest set-up: Triton runs through its interpreter unless a GPU run asks otherwise.

TRITON_INTERPRET must be set before any kernel module is imported, so it is set here, at
collection time. ci/gpu_check.sh sets SGL_TEST_GPU=1 to run the kernels compiled on CUDA.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if os.environ.get("SGL_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Run from a source checkout too (PYTHONPATH=python), without an installed wheel: the
# installed packages win, the source folders are only a fallback.
_ROOT = Path(__file__).resolve().parents[1]
for _src in (_ROOT / "python", _ROOT / "kernels"):
    if str(_src) not in sys.path:
        sys.path.append(str(_src))

pytest_plugins = ["fixtures.plugin"]

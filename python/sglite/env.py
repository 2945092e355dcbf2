"""The few SGL_* environment variables, typed and read in one place.

Nothing else in sglite reads os.environ. Each getter is called at start-up, never at import.

| variable        | meaning                                                        |
|-----------------|----------------------------------------------------------------|
| SGL_TREE_CORE   | tree-core backend: python (default), rust, auto               |
| SGL_CACHE_DIR   | where converted checkpoints (GGUF -> HF folder) are cached     |
| SGL_LOG_LEVEL   | default log level when no --log-level is given                 |
| SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR | HiCache file tier directory (SGLang's name) when no --hicache-storage-dir is given |
| SGL_CPU_ISA     | cap the CPU kernels' instructions: scalar, avx2, avx2vnni or avx512 (default: the best the CPU has), e.g. to run and measure the AVX2 paths on an AVX-512 machine |

It also holds the OpenMP settings the model's process starts with unless the user set them
(`apply_openmp_defaults`, called before the scheduler process is spawned):

| variable        | default | why                                                        |
|-----------------|---------|------------------------------------------------------------|
| GOMP_SPINCOUNT  | 20000   | torch's OpenMP workers otherwise spin ~0.3M iterations after each op, holding cores that other threads and the server's other processes need (decode step 124 -> 87 ms, bs 32, 256 tokens, 2 cores, when the native attention kernel still started threads of its own; it now runs on torch's team, where 20000 and 200000 measure the same) |
"""

from __future__ import annotations

import os
from pathlib import Path

TREE_CORE_CHOICES = ("python", "rust", "auto")
CPU_ISA_CHOICES = ("scalar", "avx2", "avx2vnni", "avx512")
OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "20000"}


def tree_core() -> str:
    """The requested tree core, lower-cased; validated by sglite.core, not here."""
    return os.environ.get("SGL_TREE_CORE", "python").strip().lower() or "python"


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sglite"
    return Path(os.environ.get("SGL_CACHE_DIR", default))


def cpu_isa() -> str | None:
    """The cap on the CPU kernels' instructions (None: none); a bad value is a ValueError."""
    value = os.environ.get("SGL_CPU_ISA", "").strip().lower()
    if not value:
        return None
    if value not in CPU_ISA_CHOICES:
        raise ValueError(f"SGL_CPU_ISA={value!r}: one of {', '.join(CPU_ISA_CHOICES)}")
    return value


def log_level() -> str:
    return os.environ.get("SGL_LOG_LEVEL", "info").strip().lower() or "info"


def hicache_storage_dir() -> Path:
    default = Path("/tmp") / "sglite-hicache"
    return Path(os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", default))


def apply_openmp_defaults() -> list[str]:
    """Set the OpenMP defaults the user has not set, for processes started from now on.

    OpenMP reads them when torch loads, so they reach child processes (and a re-executed
    process), not this one. Returns the names it set."""
    missing = [name for name in OPENMP_DEFAULTS if name not in os.environ]
    for name in missing:
        os.environ[name] = OPENMP_DEFAULTS[name]
    return missing

"""The few SGL_* environment variables, typed and read in one place.

Nothing else in sglite reads os.environ. Each getter is called at start-up, never at import.

| variable        | meaning                                                        |
|-----------------|----------------------------------------------------------------|
| SGL_TREE_CORE   | tree-core backend: python (default), rust, auto               |
| SGL_CACHE_DIR   | where converted checkpoints (GGUF -> HF folder) are cached     |
| SGL_LOG_LEVEL   | default log level when no --log-level is given                 |
"""

from __future__ import annotations

import os
from pathlib import Path

TREE_CORE_CHOICES = ("python", "rust", "auto")


def tree_core() -> str:
    """The requested tree core, lower-cased; validated by sglite.core, not here."""
    return os.environ.get("SGL_TREE_CORE", "python").strip().lower() or "python"


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sglite"
    return Path(os.environ.get("SGL_CACHE_DIR", default))


def log_level() -> str:
    return os.environ.get("SGL_LOG_LEVEL", "info").strip().lower() or "info"

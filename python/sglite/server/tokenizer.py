"""Loading the Hugging Face tokenizer shared by the TokenizerManager and the detokenizer, and
the `--chat-template` that may replace its chat template."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TEMPLATE_MARKERS = ("{{", "{%")


# Tokenizer classes that are plain `tokenizers` files (tokenizer.json) with no model-specific
# code: loaded through their own class, because `AutoTokenizer` imports transformers' model
# configuration code, which imports torch (~0.4 GB of RSS in the main process and again in
# the detokenizer, neither of which runs a model).
PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str, *, mode: str = "auto", trust_remote_code: bool = False) -> Any:
    """The HF tokenizer of a model folder (the fast one unless `mode` is "slow"); a clear
    error when there is none. A plain fast tokenizer loads without importing torch; any
    other goes through `AutoTokenizer` (which imports torch when it is installed)."""
    try:
        plain = _plain_tokenizer_class(path) if mode != "slow" else None
        if plain is not None:
            return plain.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            path, use_fast=mode != "slow", trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise RuntimeError(
            f"could not load a tokenizer from {path!r} ({e}); pass --tokenizer-path "
            "to a folder with tokenizer.json / tokenizer_config.json"
            + ("" if trust_remote_code else ", or --trust-remote-code if it ships its own code")
        ) from e


def _plain_tokenizer_class(path: str) -> Any:
    """The class of a local folder's tokenizer when it is one of PLAIN_TOKENIZER_CLASSES
    with a tokenizer.json and no remote code; None otherwise (AutoTokenizer decides)."""
    folder = Path(path)
    config_file = folder / "tokenizer_config.json"
    if not (config_file.is_file() and (folder / "tokenizer.json").is_file()):
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if name not in PLAIN_TOKENIZER_CLASSES or "auto_map" in config:
        return None
    import transformers

    return getattr(transformers, name, None)


def tokenizer_for(server_args: Any, path: str | None = None) -> Any:
    """The tokenizer `server_args` asks for (its path, mode, remote-code permission)."""
    return load_tokenizer(
        path or server_args.tokenizer_path or server_args.model_path,
        mode=server_args.tokenizer_mode,
        trust_remote_code=server_args.trust_remote_code,
    )


def load_chat_template(value: str) -> str:
    """The Jinja source `--chat-template value` names: a file's content, or the value
    itself when it is a template. Raises ValueError (naming the flag) otherwise, or when
    the template does not compile."""
    import jinja2

    path = Path(value).expanduser()
    if path.is_file():
        source = path.read_text(encoding="utf-8")
    elif any(marker in value for marker in TEMPLATE_MARKERS):
        source = value
    else:
        raise ValueError(
            f"--chat-template: {value!r} is neither a file nor a Jinja template "
            "(a template contains {{ ... }} or {% ... %})"
        )
    try:
        jinja2.Environment().parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template ({e})") from None
    return source


def apply_chat_template_override(tokenizer: Any, value: str | None) -> None:
    """Give `tokenizer` the `--chat-template` (nothing to do without one)."""
    if value:
        tokenizer.chat_template = load_chat_template(value)
        logger.info("chat template: from --chat-template")


def eos_token_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's own end-of-sequence id(s), for when the model config has none."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]

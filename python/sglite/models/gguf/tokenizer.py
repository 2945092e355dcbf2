"""The tokenizer files of a converted GGUF, built by transformers' GGUF tokenizer support.

transformers' `integrations.gguf` (`get_gguf_tokenizer`, `convert_gguf_tokenizer`: what
`AutoTokenizer.from_pretrained(folder, gguf_file=name)` calls, without also needing a
config for the architecture, which it lacks for some, e.g. gemma) rebuilds the tokenizer a
GGUF describes: `tokenizer.ggml.model` "gpt2" is byte-level BPE with the file's merges and
the split regex its `tokenizer.ggml.pre` names; "llama" is SentencePiece BPE with byte
fallback, merges recovered from the vocabulary, Gemma's and Phi-3's own normalization. The
tokens the file marks control become special tokens, user-defined ones added tokens. It is
saved as a plain `tokenizers` tokenizer (tokenizer_class TokenizersBackend), so what is
loaded later is exactly the tokenizer.json written here, with the file's BOS/EOS flags,
special tokens and chat template. Added here: the maximum length (the model's context) and
the digit split that llama.cpp's `smollm`, `starcoder` and `refact` pre-tokenizers do
before the GPT-2 regex (transformers does not know these names).
"""

from __future__ import annotations

from pathlib import Path

from sglite.models.gguf.reader import GGUFFile, UnsupportedGGUF

TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece BPE
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact")


def check_tokenizer(gguf: GGUFFile) -> None:
    model = gguf.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise UnsupportedGGUF(
            f"{gguf.path.name}: GGUF tokenizer {model!r} is not supported; supported: "
            f"{', '.join(TOKENIZER_MODELS)} (byte-level BPE, SentencePiece BPE)"
        )
    if not gguf.has("tokenizer.ggml.tokens"):
        raise UnsupportedGGUF(f"{gguf.path.name}: the file has no tokenizer.ggml.tokens")


def write_tokenizer(gguf: GGUFFile, out: Path, context_length: int) -> str | None:
    """Write the tokenizer files into `out`; returns the chat template (None without one)."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    check_tokenizer(gguf)
    try:
        arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(gguf.path))
        backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    except (ValueError, KeyError) as e:
        raise UnsupportedGGUF(
            f"{gguf.path.name}: transformers cannot build its tokenizer ({e})"
        ) from None
    if tokenizer_dict.get("pre_tokenizer_type") in _DIGIT_SPLIT_PRE:
        digits = pre_tokenizers.Digits(individual_digits=True)
        current = backend.pre_tokenizer
        backend.pre_tokenizer = (
            pre_tokenizers.Sequence([digits, current]) if current is not None else digits
        )
    settings = {k: v for k, v in {**tokenizer_config, **extra}.items() if v is not None}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, model_max_length=context_length, **settings
    )
    tok.save_pretrained(str(out))
    template = tok.chat_template
    return template if isinstance(template, str) else None

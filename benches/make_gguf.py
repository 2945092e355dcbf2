"""Write a GGUF with the shape of a served model and llama.cpp's type mix (random weights),
for serving benchmarks on a small machine (benches/quant_matrix.py, benches/single_user.py).

    python benches/make_gguf.py --out /tmp/llama2-7b.Q4_K_M.gguf
    python benches/make_gguf.py --shape qwen2.5-7b --type Q8_0 --out /tmp/q7.Q8_0.gguf
    python benches/make_gguf.py --shape gemma3-1b --layers 1 --out /tmp/tiny.gguf

Shapes (`--shape`, SHAPES below) take the real configs' dimensions: hidden size, layers,
heads and KV heads, head size, MLP width, vocabulary, tied or separate LM head, Q/K/V biases
(Qwen2.5), llama 3 RoPE scaling (Llama 3.2), Gemma 3's norms and sliding windows.

Types (`--type`) follow llama.cpp's quantizer as it states its rules: the file type's base
type for the 2-D tensors (the embedding too), Q6_K for the LM head (Q8_0 in a Q8_0 file; a
tied head makes the embedding the head), in Q4_K_M / Q5_K_M Q6_K for attn_v and ffn_down of
the layers that get more bits (the first and last eighth and every third in between); a
k-quant tensor whose rows are not a multiple of 256 falls back (Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0: Gemma 3 1B's hidden size of 1152); F32 norms and biases.

Tokenizer: the demo model's (SmolLM2's byte-level BPE, 49152 tokens), so that the file
carries a real tokenizer that sglite and llama-server both read. A larger vocabulary is
padded with unique dummy tokens (normal type, no merges: never produced by tokenizing text)
so the embedding and the LM head have the real shape.

Weights: a pool of blocks quantized from Gaussian values (std 0.02) per type, drawn at random
for every block of every tensor, so that no 7B floats are ever made or quantized (minutes,
not an hour; memory: one tensor). The values are random; the file is for speed and memory,
not for text.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fixtures.gguf_writer import GGUF_ARCH, write_gguf_from  # noqa: E402
from sglite.layers.quant_formats import QUANT_TYPES, quantize  # noqa: E402

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip
# name -> (transformers config class, its arguments); dimensions of the published configs
# (llama2-7b keeps the tokenizer's 49152 tokens: Llama 2's 32000 are fewer)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama2-7b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0)),
    "llama3-8b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)),
    "llama3.2-3b": ("LlamaConfig", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters=_LLAMA3_ROPE)),
    "llama3.2-1b": ("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters=_LLAMA3_ROPE)),
    "qwen2.5-7b": ("Qwen2Config", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False)),
    "qwen2.5-1.5b": ("Qwen2Config", dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True)),
    "gemma3-1b": ("Gemma3TextConfig", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=512, vocab_size=262144,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
}  # fmt: skip
# file type -> (base type, LM head type, attn_v / ffn_down type of the more-bits layers)
FILE_TYPES: dict[str, tuple[str, str, str | None]] = {
    "Q4_K_M": ("Q4_K", "Q6_K", "Q6_K"),
    "Q5_K_M": ("Q5_K", "Q6_K", "Q6_K"),
    "Q6_K": ("Q6_K", "Q6_K", None),
    "Q8_0": ("Q8_0", "Q8_0", None),
    "Q4_0": ("Q4_0", "Q6_K", None),
}
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # rows not a multiple of 256
POOL_BLOCKS = 1 << 15
SMOLLM2_BOS, SMOLLM2_EOS = 1, 2


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M / Q5_K_M rule for attn_v / ffn_down getting Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(gguf_name: str, cols: int, file_type: str, layers: int, tied: bool) -> str:
    """The type llama.cpp gives a 2-D tensor of `cols` columns in a `file_type` file."""
    base, head, more = FILE_TYPES[file_type]
    qtype = base
    if gguf_name == "output.weight" or (tied and gguf_name == "token_embd.weight"):
        qtype = head
    elif more and gguf_name.endswith(("attn_v.weight", "ffn_down.weight")):
        if more_bits(int(gguf_name.split(".")[1]), layers):
            qtype = more
    if cols % QUANT_TYPES[qtype][0]:
        qtype = K_FALLBACK[qtype]
    return qtype


def gguf_names(config: Any) -> Any:
    """gguf-py's HF -> GGUF tensor name map for `config`'s architecture (the writer's)."""
    import gguf

    arch = GGUF_ARCH[config.model_type]
    key = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return gguf.get_tensor_name_map(key, config.num_hidden_layers)


def random_blocks(
    config: Any, file_type: str, seed: int, types: dict[str, str]
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array): uint8 blocks of random pooled blocks for 2-D tensors, F32 norms and
    biases. Fills `types` (GGUF name -> type) as it goes; the writer reads it per tensor."""
    import torch
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(seed)
    pools: dict[str, np.ndarray] = {}
    tied = bool(config.tie_word_embeddings)
    # the writer adds 1 to Gemma's norms (llama.cpp stores 1 + w)
    norm = 0.0 if config.model_type.startswith("gemma") else 1.0
    names = gguf_names(config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    for name, p in skeleton.state_dict().items():
        if p.dim() == 1:
            yield name, np.full(p.shape, 0.0 if name.endswith(".bias") else norm, np.float32)
            continue
        if name == "lm_head.weight" and tied:
            continue
        rows, cols = p.shape
        gname = names.get_name(name.removesuffix(".weight")) + ".weight"
        qtype = types[gname] = tensor_type(gname, cols, file_type, config.num_hidden_layers, tied)
        block, size, _ = QUANT_TYPES[qtype]
        if qtype not in pools:
            w = (0.02 * rng.standard_normal((POOL_BLOCKS, block))).astype(np.float32)
            pools[qtype] = quantize(qtype, w).reshape(POOL_BLOCKS, size)
        index = rng.integers(0, POOL_BLOCKS, rows * (cols // block))
        yield name, pools[qtype][index].reshape(rows, cols // block * size)


def padded_tokenizer(src: Path, vocab_size: int, out: Path) -> Path:
    """A copy of the tokenizer folder `src` whose vocabulary is padded to `vocab_size` with
    unique dummy tokens (ids after the real ones; no merge makes them)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    data = json.loads((src / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    known = set(vocab) | {t["content"] for t in data.get("added_tokens", [])}
    size = len(known)
    if max(vocab.values()) != size - 1:
        raise SystemExit(f"{src}: token ids are not 0..{size - 1}; cannot pad")
    if vocab_size < size:
        raise SystemExit(f"vocab_size {vocab_size} is smaller than the tokenizer's {size}")
    for i in range(size, vocab_size):
        token = f"<dummy_{i}>"
        assert token not in known, token
        vocab[token] = i
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    return out


def tokenizer_size(tok_dir: Path) -> int:
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    return len(set(data["model"]["vocab"]) | {t["content"] for t in data.get("added_tokens", [])})


def make_config(shape: str, layers: int | None, vocab_size: int) -> Any:
    """The transformers config of `shape` (`vocab_size` where the shape names none)."""
    import transformers

    cls_name, kwargs = SHAPES[shape]
    cls = getattr(transformers, cls_name)
    kwargs = dict(kwargs, bos_token_id=SMOLLM2_BOS, eos_token_id=SMOLLM2_EOS)
    kwargs.setdefault("vocab_size", vocab_size)
    kwargs.setdefault("tie_word_embeddings", False)
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    config = cls(**kwargs)
    config.architectures = [cls_name.replace("Text", "").replace("Config", "ForCausalLM")]
    return config


def write(
    shape: str, file_type: str, out: Path, layers: int | None = None, seed: int = 0
) -> dict[str, str]:
    """Write the file (see the module docstring); returns its 2-D tensors' types by name."""
    from sglite.models import gguf

    tok_dir = gguf.convert_gguf_to_hf(gguf.smollm2_gguf_path())  # config + tokenizer.json
    config = make_config(shape, layers, tokenizer_size(tok_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    types: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = padded_tokenizer(tok_dir, config.vocab_size, Path(tmp))
        partial = out.with_name(out.name + ".partial")
        write_gguf_from(
            config, random_blocks(config, file_type, seed, types), tokenizer, partial,
            qtype=FILE_TYPES[file_type][0], types=types, tokenizer_pre="smollm",
        )  # fmt: skip
        partial.replace(out)  # a killed run leaves no file that looks complete
    return types


def cached(
    shape: str, file_type: str, folder: Path, layers: int | None = None
) -> tuple[Path, bool]:
    """`{shape}.{type}[.L{layers}].gguf` in `folder`, written first when it is missing;
    (path, whether this call wrote it)."""
    path = folder / f"{shape}.{file_type}{f'.L{layers}' if layers else ''}.gguf"
    made = not path.is_file()
    if made:
        start = time.perf_counter()
        write(shape, file_type, path, layers)
        print(f"made {path} ({path.stat().st_size / 2**30:.2f} GiB) in "
              f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    return path, made


def type_counts(types: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the .gguf to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    parser.add_argument("--type", choices=list(FILE_TYPES), default="Q4_K_M", dest="file_type")
    parser.add_argument("--layers", type=int, default=None, help="fewer for a quick file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")

    start = time.perf_counter()
    types = write(args.shape, args.file_type, args.out, args.layers, args.seed)
    size = args.out.stat().st_size
    print(f"wrote {args.out}: {args.shape} {args.file_type}, {size / 2**30:.2f} GiB "
          f"({type_counts(types)}), in {time.perf_counter() - start:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()

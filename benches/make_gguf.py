"""Write a GGUF with the shapes of a 7B Llama (random weights, llama.cpp's Q4_K_M type mix),
for serving benchmarks on a small machine (benches/bench_quant.py).

    .venv/bin/python benches/make_gguf.py --out /work/peer/models/llama-7b-shape.Q4_K_M.gguf

Shapes: Llama 2 7B (hidden 4096, 32 layers, 32 heads, MLP 11008), the vocabulary of the demo
model's tokenizer (SmolLM2's 49152 tokens, so that the file carries a real tokenizer that
sglite and llama-server both read): 6.9B weights. Types as llama.cpp's Q4_K_M: Q6_K for the
LM head and for attn_v and ffn_down of the layers llama.cpp gives more bits (the first and
last eighth of the layers and every third in between), Q4_K for every other 2-D tensor
(the embedding too), F32 norms. Weights: a pool of blocks quantized from Gaussian values
(std 0.02) per type, drawn at random for every block of every tensor, so that no 7B floats
are ever made or quantized (minutes, not an hour; memory: one tensor). The values are
random; the file is for speed and memory, not for text.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fixtures.gguf_writer import write_gguf_from  # noqa: E402
from sglite.layers.quant_formats import QUANT_TYPES, quantize  # noqa: E402

LLAMA_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
POOL_BLOCKS = 1 << 15


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for attn_v / ffn_down getting Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_types(layers: int) -> dict[str, str]:
    """GGUF tensor name -> type, for the tensors that are not Q4_K."""
    types = {"output.weight": "Q6_K"}
    for i in range(layers):
        if more_bits(i, layers):
            types[f"blk.{i}.attn_v.weight"] = types[f"blk.{i}.ffn_down.weight"] = "Q6_K"
    return types


def gguf_name(hf: str) -> str:
    parts = {"embed_tokens": "token_embd", "lm_head": "output", "v_proj": "attn_v",
             "down_proj": "ffn_down"}  # fmt: skip
    if hf.startswith("model.layers."):
        layer, module = hf.split(".")[2], hf.split(".")[-2]
        return f"blk.{layer}.{parts.get(module, module)}.weight"
    return parts.get(hf.split(".")[-2] if "." in hf else hf, hf) + ".weight"


def random_blocks(config, types: dict[str, str], seed: int):
    """(HF name, array): uint8 blocks of random pooled blocks for 2-D tensors, F32 norms."""
    import torch
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(seed)
    pools: dict[str, np.ndarray] = {}
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    for name, p in skeleton.state_dict().items():
        if p.dim() == 1:
            yield name, np.ones(p.shape, np.float32)
            continue
        qtype = types.get(gguf_name(name), "Q4_K")
        block, size, _ = QUANT_TYPES[qtype]
        if qtype not in pools:
            w = (0.02 * rng.standard_normal((POOL_BLOCKS, block))).astype(np.float32)
            pools[qtype] = quantize(qtype, w).reshape(POOL_BLOCKS, size)
        rows, cols = p.shape
        index = rng.integers(0, POOL_BLOCKS, rows * (cols // block))
        yield name, pools[qtype][index].reshape(rows, cols // block * size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the .gguf to write")
    parser.add_argument("--layers", type=int, default=32, help="fewer for a quick file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import LlamaConfig

    from sglite.models import gguf

    tok_dir = gguf.convert_gguf_to_hf(gguf.smollm2_gguf_path())  # config + tokenizer.json
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tok_dir)))
    config = LlamaConfig(
        **{**LLAMA_7B, "num_hidden_layers": args.layers}, vocab_size=vocab,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    types = q4_k_m_types(args.layers)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    write_gguf_from(
        config, random_blocks(config, types, args.seed), tok_dir, args.out, qtype="Q4_K",
        types=types,
    )  # fmt: skip
    size = args.out.stat().st_size
    print(f"wrote {args.out}: {size / 2**30:.2f} GiB, {args.layers} layers, vocab {vocab}, "
          f"{len(types) - 1} Q6_K layer tensors + Q6_K output, in "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()

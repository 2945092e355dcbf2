"""bf16 vs fp32 on the demo model: how far bf16 weights and activations move the logits.

    python benches/bf16_logits.py [--model-path P] [--tokens 512]

Teacher-forces one prompt of real text through the model in float32 and in bfloat16 (same
weights, CPU) and prints the largest and mean absolute difference of the log-probabilities,
and how often the top-1 token agrees (and how far its log-probability moves); writes bench_results/bf16_logits.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from sglite.model_executor.forward_batch import ForwardBatch
from sglite.model_executor.model_runner import ModelRunner

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how books were made, sold and read across Europe. "
) * 40


def all_logits(model_path: str | None, dtype: str, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(model_path, device="cpu", dtype=dtype, max_total_tokens=len(ids) + 64)
    (row,) = runner.req_to_token_pool.alloc(1)
    slots = runner.allocator.alloc_extend([0], [len(ids)], [-1])
    runner.req_to_token_pool.write(row, 0, slots)
    batch = ForwardBatch.extend(
        input_ids=[ids], prefix_lens=[0], req_pool_indices=[row], out_cache_loc=slots,
        req_to_token_pool=runner.req_to_token_pool, kv_pool=runner.kv_pool,
        return_all_logits=True,
    )  # fmt: skip
    return torch.log_softmax(runner.forward(batch).float(), dim=-1)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the demo model")
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    runner = ModelRunner(args.model_path, device="cpu", dtype="float32", max_total_tokens=64)
    ids = AutoTokenizer.from_pretrained(runner.tokenizer_path)(TEXT)["input_ids"][: args.tokens]
    ref = all_logits(args.model_path, "float32", ids)
    low = all_logits(args.model_path, "bfloat16", ids)
    diff = (ref - low).abs()
    result = {
        "tokens": len(ids),
        "max_abs_logprob_diff": diff.max().item(),
        "mean_abs_logprob_diff": diff.mean().item(),
        "top1_agreement": (ref.argmax(-1) == low.argmax(-1)).float().mean().item(),
        # the fp32 top-1 token's log-probability: what sampling and greedy decoding see
        "max_abs_top1_logprob_diff": diff.gather(-1, ref.argmax(-1, keepdim=True)).max().item(),
    }
    print(
        f"bf16 vs fp32 over {result['tokens']} teacher-forced tokens: log-prob difference max "
        f"{result['max_abs_logprob_diff']:.3f}, mean {result['mean_abs_logprob_diff']:.4f} "
        f"(the top-1 token's: max {result['max_abs_top1_logprob_diff']:.3f}); "
        f"top-1 token agrees at {result['top1_agreement'] * 100:.1f}% of positions"
    )
    out = Path("bench_results")
    out.mkdir(exist_ok=True)
    (out / "bf16_logits.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

"""Safetensors-quantized checkpoints on the CPU (w8a8_int8, awq, gptq, fp8) next to their
float32 twin: decode and prefill tok/s and the linear weights' bytes, same run, same shapes.

    .venv/bin/python benches/bench_quant_safetensors.py [--hidden 1024] [--layers 4]
        [--methods w8a8_int8,awq,gptq,fp8] [--threads 2] [--out bench_results/]

A random Llama (hidden H, intermediate 2.75 H, H/64 heads over 4 KV heads, vocab 8192) is
written as a float checkpoint, then quantized per method by the tests' writer
(tests/fixtures/quant_checkpoints.py; awq / gptq with group 128); each is loaded by ModelRunner
(float32 activations, `--quant-kernel exact` for the int4 ones) and timed with
`bench_one_batch.run_one_batch` at batch 1 (prompt 64, 32 tokens) and batch 8 (prompt 64, 16
tokens), best of 3; the float model is measured again last (a shared machine drifts). Prints
one line per method and a summary line; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fixtures.quant_checkpoints import write_quantized  # noqa: E402
from sglite.bench_one_batch import run_one_batch  # noqa: E402
from sglite.model_executor.model_runner import ModelRunner  # noqa: E402


def write_float_model(out: Path, hidden: int, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=4, head_dim=64, vocab_size=8192,
        max_position_embeddings=512, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out))
    return out


def linear_bytes(runner: ModelRunner) -> int:
    total = 0
    for m in runner.model.modules():
        if hasattr(m, "packed") and hasattr(m, "load_packed") and hasattr(m, "tp_size"):
            for _, seg in m.packed.segments:
                total += sum(
                    t.numel() * t.element_size()
                    for t in vars(seg).values()
                    if isinstance(t, torch.Tensor)
                )
        elif type(m).__name__.endswith(("ParallelLinear", "ReplicatedLinear")):
            w = m.weight if m.weight is not None else m._packed
            total += w.numel() * w.element_size()
    return total


def measure(path: Path, repeats: int) -> dict:
    runner = ModelRunner(str(path), device="cpu", dtype="float32", max_total_tokens=4096,
                         max_running_requests=8)  # fmt: skip
    row = {"linear_MiB": linear_bytes(runner) / 2**20}
    for bs, out_len in ((1, 32), (8, 16)):
        run_one_batch(runner, bs, 64, 4)  # warm-up
        runs = [run_one_batch(runner, bs, 64, out_len) for _ in range(repeats)]
        row[f"bs{bs}_decode_tok_s"] = max(r["decode_tokens_per_s"] for r in runs)
        row[f"bs{bs}_prefill_tok_s"] = max(bs * 64 / r["prefill_latency_s"] for r in runs)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--methods", default="w8a8_int8,awq,gptq,fp8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="bench_results/")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = write_float_model(root / "float", args.hidden, args.layers)
        rows["float32"] = measure(src, args.repeats)
        for method in args.methods.split(","):
            opts = {"group_size": 128} if method in ("awq", "gptq") else {}
            quant_dir, _ = write_quantized(src, root, method, **opts)
            rows[method] = measure(quant_dir, args.repeats)
        rows["float32 again"] = measure(src, args.repeats)  # how much the machine drifted
    base = rows["float32"]
    print(f"{'weights':>10} | {'linear MiB':>10} | {'bs1 decode':>10} | {'bs8 decode':>10} | "
          f"{'bs8 prefill':>11} tok/s")  # fmt: skip
    for name, r in rows.items():
        print(
            f"{name:>10} | {r['linear_MiB']:>10.1f} | {r['bs1_decode_tok_s']:>10.1f} | "
            f"{r['bs8_decode_tok_s']:>10.1f} | {r['bs8_prefill_tok_s']:>11.1f}"
        )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    summary = ", ".join(
        f"{n} {r['bs1_decode_tok_s'] / base['bs1_decode_tok_s']:.2f}x" for n, r in rows.items()
        if not n.startswith("float32")
    )  # fmt: skip
    print(f"bench_quant_safetensors: batch-1 decode vs float32 (hidden {args.hidden}): {summary}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_quant_safetensors.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

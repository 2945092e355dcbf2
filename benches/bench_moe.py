"""CPU MoE decode and prefill: the grouped expert path vs a per-expert loop vs a dense model.

    .venv/bin/python benches/bench_moe.py [--threads 1] [--repeats 3] [--layers 4]

A random Qwen3-MoE (hidden 1024, 4 layers, 16 heads over 4 KV heads, 32 experts of width
512, top-4; built once with transformers into --cache-dir) and the dense Qwen3 with the
same active parameters (MLP width 4 x 512 = 2048), float32, through ModelRunner. Variants:

- `fused`: sglite's path (tokens sorted by expert, one matmul pair per expert with tokens,
  the per-expert weights oneDNN-packed);
- `grouped_plain`: the same grouping over the plain stacked weights (what packing buys);
- `naive`: transformers' loop (every expert in turn finds its tokens with a mask) over the
  plain weights;
- `dense`: the dense model.

Per-token times: decode step / batch at batch 1 and 32 (median step, 32-token prompts),
and a 512-token prefill / 512. Best of --repeats after a warm-up. Then one layer at batch
1: the MoE block's forward against only the matmuls of its 4 chosen experts (what a native
kernel that skips the routing and grouping could at best reach) and the dense MLP.
Writes bench_results/bench_moe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from sglite.bench_one_batch import run_one_batch
from sglite.layers.moe import FusedExperts, SparseMoeBlock
from sglite.layers.moe.fused_cpu import naive_forward
from sglite.model_executor.model_runner import ModelRunner

SHAPE = dict(
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=1024,
    initializer_range=0.02,
)
NUM_EXPERTS, TOP_K, EXPERT_WIDTH = 32, 4, 512


def build_checkpoints(cache: Path, layers: int) -> dict[str, Path]:
    import transformers

    configs = {
        "moe": transformers.Qwen3MoeConfig(
            **SHAPE,
            num_hidden_layers=layers,
            intermediate_size=TOP_K * EXPERT_WIDTH,
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_WIDTH,
            norm_topk_prob=True,
            architectures=["Qwen3MoeForCausalLM"],
        ),
        "dense": transformers.Qwen3Config(
            **SHAPE,
            num_hidden_layers=layers,
            intermediate_size=TOP_K * EXPERT_WIDTH,
            architectures=["Qwen3ForCausalLM"],
        ),
    }
    paths = {}
    for name, cfg in configs.items():
        path = cache / f"{name}_l{layers}"
        if not (path / "config.json").is_file():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            model.save_pretrained(str(path))
            del model
        paths[name] = path
    return paths


def _naive(experts: FusedExperts):
    def forward(x, topk_ids, topk_weights):
        w13, w2 = experts.w13_weight, experts.w2_weight
        return naive_forward(x, topk_ids, topk_weights, w13, w2, experts.act_fn.fn)

    return forward


def make_runner(path: Path, variant: str) -> ModelRunner:
    """The runner of one variant (the expert modules patched for grouped_plain / naive)."""
    real_prepack = FusedExperts.prepack
    if variant in ("grouped_plain", "naive"):
        FusedExperts.prepack = lambda self: False
    try:
        runner = ModelRunner(
            path, device="cpu", dtype="float32", max_total_tokens=4096, max_running_requests=32
        )
    finally:
        FusedExperts.prepack = real_prepack
    if variant == "naive":
        for m in runner.model.modules():
            if isinstance(m, FusedExperts):
                m.forward = _naive(m)
    return runner


def per_token_ms(runner: ModelRunner, repeats: int) -> dict[str, float]:
    run_one_batch(runner, 1, 16, 3)  # warm-up
    out = {}
    for bs in (1, 32):
        steps = [run_one_batch(runner, bs, 32, 9)["decode_median_step_s"] for _ in range(repeats)]
        out[f"decode_bs{bs}_ms_per_token"] = min(steps) * 1e3 / bs
    prefill = [run_one_batch(runner, 1, 512, 1)["prefill_latency_s"] for _ in range(repeats)]
    out["prefill_512_ms_per_token"] = min(prefill) * 1e3 / 512
    return out


def _median_ms(fn, n: int = 20) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.no_grad()
def one_layer_bs1(moe: ModelRunner, dense: ModelRunner) -> dict[str, float]:
    block = next(m for m in moe.model.modules() if isinstance(m, SparseMoeBlock))
    mlp = dense.model.model.layers[0].mlp
    x = torch.randn(1, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(0))
    _, ids = block.gate(x)
    chosen = ids[0].tolist()

    def matmuls_only():
        for e in chosen:
            block.experts.run_expert(e, x)

    return {
        "moe_block_ms": _median_ms(lambda: block(x)),
        "chosen_experts_matmuls_ms": _median_ms(matmuls_only),
        "dense_mlp_ms": _median_ms(lambda: mlp(x)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cache-dir", default="bench_results/bench_moe_models")
    parser.add_argument("--out", default="bench_results/bench_moe.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    paths = build_checkpoints(Path(args.cache_dir), args.layers)
    rows, runners = {}, {}
    for variant in ("fused", "grouped_plain", "naive", "dense"):
        runner = make_runner(paths["dense" if variant == "dense" else "moe"], variant)
        rows[variant] = per_token_ms(runner, args.repeats)
        if variant in ("fused", "dense"):
            runners[variant] = runner
        print(variant, json.dumps({k: round(v, 3) for k, v in rows[variant].items()}), flush=True)
    layer = one_layer_bs1(runners["fused"], runners["dense"])
    keys = list(rows["fused"])
    print(f"{'ms / token':>14} | " + " | ".join(f"{k.split('_ms')[0]:>13}" for k in keys))
    for variant, row in rows.items():
        print(f"{variant:>14} | " + " | ".join(f"{row[k]:>13.3f}" for k in keys))
    print("one layer, batch 1 (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in layer.items()))
    load = os.getloadavg()[0]
    if load > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f}: other processes share the CPU")
    f, n, d = rows["fused"], rows["naive"], rows["dense"]
    print(
        "bench_moe: fused vs per-expert loop "
        + ", ".join(f"{k.split('_ms')[0]} {n[k] / f[k]:.2f}x" for k in keys)
        + "; fused / dense "
        + ", ".join(f"{k.split('_ms')[0]} {f[k] / d[k]:.2f}" for k in keys)
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        shape=SHAPE, layers=args.layers, experts=NUM_EXPERTS, top_k=TOP_K, width=EXPERT_WIDTH
    )
    out.write_text(
        json.dumps(
            {
                **meta,
                "dtype": "float32",
                "threads": args.threads,
                "load_average": load,
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "ms_per_token": rows,
                "one_layer_bs1_ms": layer,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

"""Routed-expert time on CUDA: the Triton fused-MoE kernels vs torch loops over the experts.

Workload (fixed, seeded): one MoE layer's routed experts at Qwen3-30B-A3B-like shapes by
default (64 experts, top-8, hidden 2048, expert intermediate 768, bf16), softmax routing
over random scores, batches of 1, 32, 256 and 2048 tokens. For each batch it prints the
mean time of one call of:
- `fused`: sglite_kernels' fused MoE (align, gate/up GEMM + activation, down GEMM, top-k
  sum), eager, and replayed from a CUDA graph (`fused_graph`, as serving decode runs it);
- `grouped`: fused_cpu's grouped path on the GPU (one sort, one cuBLAS matmul pair per
  expert that has tokens, a host sync for the counts);
- `loop`: transformers' per-expert loop (a mask per expert, every expert in turn).
Writes JSON to --out (a .json file, or a folder for bench_moe_triton.json; default $OUT,
else bench_results/). Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

if importlib.util.find_spec("sglite_kernels") is None:  # source checkout, not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from sglite.layers.moe.experts import ExpertsSpec, FusedExperts  # noqa: E402
from sglite.layers.moe.fused_cpu import group_by_expert, grouped_forward, naive_forward  # noqa: E402
from sglite.layers.moe.fused_triton import triton_forward  # noqa: E402


def _time_us(fn, iters: int, graph: bool = False) -> float:
    """Mean time of one call (CUDA events); `graph`: replayed from a captured CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up off the default stream, as capture wants
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _layer(args, dtype):
    gen = torch.Generator().manual_seed(0)
    spec = ExpertsSpec(args.experts, args.intermediate)
    experts = FusedExperts(spec, args.hidden, dtype=dtype)
    for p in (experts.w13_weight, experts.w2_weight):
        p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return experts.cuda()


def _routing(num_tokens, args, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, args.hidden, generator=gen).to(dtype).cuda()
    scores = torch.randn(num_tokens, args.experts, generator=gen).softmax(-1)
    weights, ids = scores.topk(args.top_k, dim=-1)
    return x, ids.cuda(), (weights / weights.sum(-1, keepdim=True)).cuda()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--batches", default="1,32,256,2048")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "bench_results",
        help="a .json file, or a folder for bench_moe_triton.json",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe_triton: needs a CUDA GPU (none found); nothing was measured")
        return

    dtype = torch.bfloat16
    experts = _layer(args, dtype)
    w13, w2, s = experts.w13_weight, experts.w2_weight, experts.shard
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        x, ids, weights = _routing(batch, args, dtype)

        def fused(x=x, ids=ids, weights=weights):
            return triton_forward(experts, x, ids, weights)

        def grouped(x=x, ids=ids, weights=weights):
            groups = group_by_expert(ids, weights, s.expert_start, s.num_local)
            return grouped_forward(x, groups, experts.run_expert)

        def loop(x=x, ids=ids, weights=weights):
            return naive_forward(x, ids, weights, w13, w2)

        ref = loop().float()
        err = (fused().float() - ref).abs().max().item()
        row = {
            "batch": batch,
            "fused_us": round(_time_us(fused, args.iters), 1),
            "fused_graph_us": round(_time_us(fused, args.iters, graph=True), 1),
            "grouped_us": round(_time_us(grouped, args.iters), 1),
            "loop_us": round(_time_us(loop, args.iters), 1),
            "max_abs_err_vs_loop": err,
        }
        row["speedup_vs_loop"] = round(row["loop_us"] / row["fused_graph_us"], 2)
        row["speedup_vs_grouped"] = round(row["grouped_us"] / row["fused_graph_us"], 2)
        rows.append(row)
        print(
            f"batch {batch:5d}: fused {row['fused_us']:9.1f} us (graph {row['fused_graph_us']:9.1f})"
            f"  grouped {row['grouped_us']:9.1f} us  loop {row['loop_us']:9.1f} us"
            f"  x{row['speedup_vs_loop']} vs loop  max|err| {err:.2e}",
            flush=True,
        )
    result = {
        "bench": "moe_triton",
        "device": torch.cuda.get_device_name(0),
        "experts": args.experts,
        "top_k": args.top_k,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "dtype": "bfloat16",
        "rows": rows,
    }
    out = Path(args.out)
    if out.suffix != ".json":
        out = out / "bench_moe_triton.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    summary = ", ".join(
        f"batch {r['batch']}: x{r['speedup_vs_loop']} vs loop, x{r['speedup_vs_grouped']} vs grouped"
        for r in rows
    )
    print(f"bench_moe_triton: fused (graph) {summary}; wrote {out}")


if __name__ == "__main__":
    main()

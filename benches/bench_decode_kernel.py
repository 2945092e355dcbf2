"""Decode-attention kernel bandwidth on CUDA: bytes of K/V read per second vs the HBM peak.

Workload (fixed, seeded): batch 64, context 4096, Qwen3-0.6B attention shapes (16 query heads,
8 KV heads, head_dim 128, bf16), slots allocated page-wise (page 16) from a shuffled page
list. Prints one summary line and writes JSON to --out: a .json file, or a folder to hold
bench_decode_kernel.json (default $OUT, else bench_results/).
``--sweep`` also times stage-1 launch configs and split counts and reports the best.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

if importlib.util.find_spec("sglite_kernels") is None:  # source checkout, not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from sglite_kernels import decode_attention, num_kv_splits  # noqa: E402

PEAK_TBS = 4.8  # H200 HBM3e, vendor datasheet


def _workload(batch, context, hq, hkv, head_dim, page_size, dtype):
    gen = torch.Generator().manual_seed(0)
    num_pages = batch * context // page_size
    pages = torch.randperm(num_pages, generator=gen) + 1  # page 0 is the padding page
    slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(batch, context)
    rows = (num_pages + 1) * page_size
    k_buffer = torch.randn(rows, hkv, head_dim, device="cuda", dtype=dtype)
    v_buffer = torch.randn(rows, hkv, head_dim, device="cuda", dtype=dtype)
    q = torch.randn(batch, hq, head_dim, device="cuda", dtype=dtype)
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * context
    kv_indices = slots.reshape(-1).to(torch.int32).cuda()
    return q, k_buffer, v_buffer, kv_indptr, kv_indices


def _time_us(fn, iters: int) -> float:
    """Mean time of one call, replayed back to back from a CUDA graph (as the serving decode
    runs), so that Python launch overhead is not counted; eager if capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up off the default stream, as capture wants
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except RuntimeError:
        run = fn
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--max-splits", type=int, default=16)
    parser.add_argument("--sweep", action="store_true", help="also time launch configs")
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "bench_results",
        help="a .json file, or a folder for bench_decode_kernel.json",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_kernel: needs a CUDA GPU (none found); nothing was measured")

    hq, hkv, head_dim, dtype = 16, 8, 128, torch.bfloat16
    q, kb, vb, kv_indptr, kv_indices = _workload(
        args.batch, args.context, hq, hkv, head_dim, 16, dtype
    )
    o = torch.empty_like(q)
    sm_scale = 1 / math.sqrt(head_dim)
    kv_bytes = 2 * args.batch * args.context * hkv * head_dim * kb.element_size()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    seq_lens = kv_indptr.diff()

    def run(max_splits, splits, **cfg):
        mid_o = torch.empty(args.batch, hq, max_splits, head_dim, device="cuda")
        mid_lse = torch.empty(args.batch, hq, max_splits, device="cuda")

        def step():
            decode_attention(
                q, kb, vb, o, kv_indptr, kv_indices, splits, max_splits, sm_scale,
                mid_o, mid_lse, **cfg,
            )  # fmt: skip

        us = _time_us(step, args.iters)
        return {
            "time_us": round(us, 2),
            "fraction_of_peak": kv_bytes / (us * 1e-6) / 1e12 / PEAK_TBS,
        }

    default_splits = num_kv_splits(seq_lens, hkv, num_sms, args.max_splits)
    default = run(args.max_splits, default_splits)
    default["splits"] = int(default_splits[0])
    sweep = []
    if args.sweep:
        for n, block_n, warps, stages in itertools.product(
            (1, 2, 4), (32, 64, 128), (4, 8), (2, 3, 4)
        ):
            splits = torch.full_like(default_splits, n)
            try:
                r = run(n, splits, block_n=block_n, num_warps=warps, num_stages=stages)
            except Exception as e:  # out of shared memory etc.: record and go on
                r = {"error": type(e).__name__}
            sweep.append({"splits": n, "block_n": block_n, "num_warps": warps,
                          "num_stages": stages, **r})  # fmt: skip
    best = max([default, *sweep], key=lambda r: r.get("fraction_of_peak", 0.0))
    result = {
        "bench": "decode_kernel",
        "device": torch.cuda.get_device_name(0),
        "batch": args.batch,
        "context": args.context,
        "q_heads": hq,
        "kv_heads": hkv,
        "head_dim": head_dim,
        "dtype": "bfloat16",
        "kv_bytes": kv_bytes,
        "peak_tbs": PEAK_TBS,
        "default": default,
        "best": best,
        "sweep": sweep,
        "unix_time": int(time.time()),
    }
    out = Path(args.out)
    if out.suffix != ".json":
        out = out / "bench_decode_kernel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        f"decode kernel B={args.batch} ctx={args.context}: {default['time_us']:.1f} us, "
        f"{default['fraction_of_peak'] * PEAK_TBS:.2f} TB/s = "
        f"{default['fraction_of_peak']:.1%} of {PEAK_TBS} TB/s (best in sweep "
        f"{best['fraction_of_peak']:.1%})"
    )


if __name__ == "__main__":
    main()

"""GGUF block-quantized matmul on the CPU (rust/quant): GEMV GB/s vs the machine's copy
bandwidth, GEMM GFLOP/s vs torch's fp32 matmul on the dequantized weight; the default panel
kernels (int16 activations, and int8) beside the exact ones on the file's blocks.

Workload (fixed, seeded): per block type, a 576x1536 weight (the demo model's MLP input) and a
4096x4096 one (a 7B's attention), random Gaussian rows quantized by `quant_formats.quantize`.
GEMV (decode, batch 1 and 8) cycles over copies of the weight adding up to >= 128 MiB, so
that it streams from DRAM as a model's layers do; it reports weight bytes read per second and
their share of the measured copy bandwidth (`torch.Tensor.copy_` of 256 MiB: bytes copied per
second) and read bandwidth (`torch.sum`). GEMM (batch 1, 16, 128, 512) reports GFLOP/s
(2 * n * rows * cols per call) of the panels (int16, int8), of each exact kernel and their
automatic choice, of torch fp32
(`F.linear` on the dequantized weight, and oneDNN's packed linear, which sglite's float
layers use), and of dequantizing the weight then `F.linear` (the "dequantized tiles + torch"
variant). Rounds interleave every variant; the best round counts. With one thread (the
default runs 1 and all threads) times are the thread's CPU time, which other processes on
the machine do not inflate; with more, wall time (compare ratios). Prints one summary line
per type and thread count and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from sglite.layers import quant_kernels
from sglite.layers.linear import can_prepack
from sglite.layers.quant_formats import QUANT_TYPES, quantize

SHAPES = ((576, 1536), (4096, 4096))
GEMV_BATCHES = (1, 8)
GEMM_BATCHES = (1, 16, 128, 512)
STREAM_BYTES = 128 << 20


def _clock() -> float:
    """This thread's CPU time with one thread (everything runs on it: immune to other
    processes taking the core away), else wall time."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def _best(fn, rounds: int) -> tuple[float, float]:
    """(best, median) seconds of `fn()` over `rounds` calls."""
    times = []
    for _ in range(rounds):
        start = _clock()
        fn()
        times.append(_clock() - start)
    return min(times), statistics.median(times)


def bandwidth(rounds: int) -> dict[str, float]:
    src = torch.ones(256 << 18)  # 256 MiB of float32
    dst = torch.empty_like(src)
    copy, _ = _best(lambda: dst.copy_(src), rounds)
    read, _ = _best(lambda: src.sum(), rounds)
    nbytes = src.numel() * 4
    return {"copy_gbs": nbytes / copy / 1e9, "read_gbs": nbytes / read / 1e9}


def make_weight(qtype: str, rows: int, cols: int) -> torch.Tensor:
    """Quantized Gaussian rows (512 distinct, repeated: quantizing 4096 k-quant rows in numpy
    would take longer than the benchmark)."""
    rng = np.random.default_rng(0)
    distinct = min(rows, 512)
    w = rng.standard_normal((distinct, cols)).astype(np.float32) * 0.02
    packed = torch.from_numpy(quantize(qtype, w))
    return packed.repeat((rows + distinct - 1) // distinct, 1)[:rows].contiguous()


def variants(qtype: str, weight: torch.Tensor, cols: int, n: int):
    """name -> a call computing `x W^T` for a `[n, cols]` x."""
    x = torch.randn(n, cols)
    out = torch.empty(n, weight.shape[0])
    dense = quant_kernels.dequantize(qtype, weight, cols)
    calls = {
        f"native_{k}": (lambda k=k: quant_kernels.matmul(x, qtype, weight, cols, out, kernel=k))
        for k in quant_kernels.KERNELS
    }
    calls["native_auto"] = lambda: quant_kernels.matmul(x, qtype, weight, cols, out)
    panels = quant_kernels.Panels(qtype, weight, cols)
    for precision in quant_kernels.PRECISIONS:
        calls[f"panels_{precision}"] = lambda p=precision: quant_kernels.panel_matmul(
            [panels.segment(0)], x, out, p, torch.get_num_threads()
        )
    calls["torch_fp32"] = lambda: F.linear(x, dense)
    if can_prepack(torch.float32):
        packed = torch.ops.mkldnn._reorder_linear_weight(dense)
        calls["torch_fp32_onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""
        )
    calls["dequantize_then_torch"] = lambda: F.linear(
        x, quant_kernels.dequantize(qtype, weight, cols)
    )
    return calls


def bench_gemv(qtype: str, weight: torch.Tensor, cols: int, rounds: int, bw: dict) -> list:
    copies = [weight.clone() for _ in range(max(1, STREAM_BYTES // weight.numel()))]
    panels = [quant_kernels.Panels(qtype, w, cols).segment(0) for w in copies]
    results = []
    for n in GEMV_BATCHES:
        x = torch.randn(n, cols)
        out = torch.empty(n, weight.shape[0])
        for kernel in ("gemv", "panels_int16", "panels_int8"):

            def sweep(kernel=kernel, x=x, out=out):
                threads = torch.get_num_threads()
                for w, p in zip(copies, panels):
                    if kernel == "gemv":
                        quant_kernels.matmul(x, qtype, w, cols, out, kernel=kernel)
                    else:
                        quant_kernels.panel_matmul([p], x, out, kernel[7:], threads)

            best, median = _best(sweep, rounds)
            gbs = weight.numel() * len(copies) / best / 1e9
            results.append(
                dict(kind="gemv", n=n, variant=kernel, best_ms=best / len(copies) * 1e3,
                     median_ms=median / len(copies) * 1e3, weight_gbs=gbs,
                     pct_of_copy=100 * gbs / bw["copy_gbs"], pct_of_read=100 * gbs / bw["read_gbs"])
            )  # fmt: skip
    return results


def bench_gemm(qtype: str, weight: torch.Tensor, cols: int, rounds: int) -> list:
    rows = weight.shape[0]
    results = []
    for n in GEMM_BATCHES:
        calls = variants(qtype, weight, cols, n)
        times = {name: [] for name in calls}
        for _ in range(rounds):  # interleaved: each round sees the same machine load
            for name, call in calls.items():
                start = _clock()
                call()
                times[name].append(_clock() - start)
        for name, ts in times.items():
            best = min(ts)
            results.append(
                dict(kind="gemm", n=n, variant=name, best_ms=best * 1e3,
                     median_ms=statistics.median(ts) * 1e3, gflops=2 * n * rows * cols / best / 1e9)
            )  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(QUANT_TYPES), help="comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--threads",
        default=f"1,{torch.get_num_threads()}",
        help="comma-separated thread counts (1: per-core numbers, immune to another process "
        "holding the second core)",
    )
    parser.add_argument("--shapes", default="576x1536,4096x4096", help="rowsxcols, comma-separated")
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT", "bench_results"),
        help="a .json file, or a folder for bench_quant_kernels.json",
    )
    args = parser.parse_args()
    if quant_kernels.unavailable_reason() is not None:
        raise SystemExit(quant_kernels.unavailable_reason())
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    report = dict(isas=quant_kernels.isas(), bandwidth={}, results=[])
    weights = {}
    for threads in sorted({int(t) for t in args.threads.split(",")}):
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        bw = bandwidth(args.rounds)
        report["bandwidth"][threads] = bw
        print(f"{threads} thread(s): copy {bw['copy_gbs']:.1f} GB/s, read {bw['read_gbs']:.1f} "
              f"GB/s, {report['isas'][0]}")  # fmt: skip
        for qtype in args.types.split(","):
            for rows, cols in shapes:
                key = (qtype, rows, cols)
                weight = weights.setdefault(key, make_weight(*key))
                found = bench_gemv(qtype, weight, cols, args.rounds, bw)
                found += bench_gemm(qtype, weight, cols, args.rounds)
                for r in found:
                    r.update(qtype=qtype, rows=rows, cols=cols, threads=threads)
                report["results"] += found
                print(summary(qtype, rows, cols, found))
    out = Path(args.out)
    if out.suffix != ".json":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "bench_quant_kernels.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


def summary(qtype: str, rows: int, cols: int, results: list) -> str:
    def pick(kind, n, variant, key):
        for r in results:
            if (r["kind"], r["n"], r["variant"]) == (kind, n, variant):
                return r[key]
        return float("nan")

    gemv = pick("gemv", 1, "panels_int16", "weight_gbs")
    pct = pick("gemv", 1, "panels_int16", "pct_of_copy")
    torch_best = "torch_fp32_onednn" if can_prepack(torch.float32) else "torch_fp32"
    gemm = " ".join(
        f"n={n} {pick('gemm', n, 'panels_int16', 'gflops'):.0f}"
        f"/{pick('gemm', n, torch_best, 'gflops'):.0f}"
        for n in GEMM_BATCHES
    )
    return (
        f"{qtype} {rows}x{cols} {results[0]['threads']}t: panels int16 GEMV {gemv:.1f} GB/s "
        f"({pct:.0f}% of copy); GFLOP/s panels int16/{torch_best} {gemm}"
    )


if __name__ == "__main__":
    main()

"""Quantized linears on CUDA: the Triton FP8 / AWQ / GPTQ GEMMs vs a bf16 matmul.

Workload (fixed, seeded, random weights): bf16 x [M, in] times one linear of in x out =
4096x4096 and 4096x14336 (a Llama-3-8B attention and gate/up projection), M in 1, 16, 256,
2048, for each weight format of sglite_kernels.quant_gemm: fp8 e4m3 per-channel (weight-only,
and w8a8: x quantized per token, fp8 x fp8 products), fp8 with 128x128 block scales, AWQ int4 g128, GPTQ int4 g128, GPTQ g128 with an act-order g_idx.
For each it prints the mean time of one call replayed from a CUDA graph (the kernel, not
Python's launch), its TFLOP/s (2*M*in*out / t) and GB/s (weight + scales + x + y bytes / t),
next to torch's bf16 matmul on the dequantized weight (cuBLAS), and the max error relative
to the fp32 product. Writes JSON to --out (a .json file, or a folder for
bench_quant_triton.json; default $OUT, else bench_results/). Without CUDA it says so and
exits 0.
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
from sglite_kernels.quant_gemm import (  # noqa: E402
    fp8_dequantize,
    fp8_linear,
    gemm_tiles,
    int4_dequantize,
    int4_linear,
)
from sglite_kernels.quant_ref import int4_pack  # noqa: E402

FORMATS = (
    "fp8_channel",
    "fp8_channel_w8a8",
    "fp8_block128",
    "awq_g128",
    "gptq_g128",
    "gptq_g128_act_order",
)


def _time_us(fn, iters: int) -> float:
    """Mean time of one call replayed from a captured CUDA graph (CUDA events)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up off the default stream, as capture wants
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _layer(fmt: str, k: int, n: int, gen: torch.Generator, dev: str = "cuda"):
    """(call(x), dequantized fp32 weight as x @ W wants it [k, n], weight bytes)."""
    if fmt.startswith("fp8"):
        weight = (torch.randn(n, k, generator=gen, device=dev) * 100).clamp(-448, 448)
        weight = weight.to(torch.float8_e4m3fn)
        if fmt.startswith("fp8_channel"):
            scale, block = torch.rand(n, generator=gen, device=dev) * 4e-3 + 1e-3, None
        else:
            shape = (-(-n // 128), -(-k // 128))
            scale, block = torch.rand(shape, generator=gen, device=dev) * 4e-3 + 1e-3, (128, 128)
        w = fp8_dequantize(weight, scale, block).T
        w8a8 = fmt.endswith("w8a8")
        call = lambda x: fp8_linear(x, weight, scale, block, w8a8=w8a8)  # noqa: E731
        return call, w, n * k + scale.numel() * 4
    layout = "awq" if fmt.startswith("awq") else "gptq"
    groups = k // 128
    q = torch.randint(0, 16, (k, n), generator=gen, device=dev)
    z = torch.randint(1, 16, (groups, n), generator=gen, device=dev)
    scales = (torch.rand(groups, n, generator=gen, device=dev) * 0.02 + 0.005).half()
    qweight, qzeros = int4_pack(q, z, layout)
    g_idx = None
    if fmt.endswith("act_order"):
        perm = torch.randperm(k, generator=gen, device=dev)
        g_idx = (torch.arange(k, device=dev) // 128)[perm].to(torch.int32)
    w = int4_dequantize(qweight, scales, qzeros, 128, layout, g_idx)

    def call(x):
        return int4_linear(x, qweight, scales, qzeros, 128, layout, g_idx)

    nbytes = k * n // 2 + scales.numel() * 2 + qzeros.numel() * 4
    return call, w, nbytes + (k * 4 if g_idx is not None else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x4096,4096x14336", help="in x out, comma list")
    parser.add_argument("--batches", default="1,16,256,2048")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "bench_results",
        help="a .json file, or a folder for bench_quant_triton.json",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_quant_triton: needs a CUDA GPU (none found); nothing was measured")
        return

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        k, n = (int(d) for d in shape.split("x"))
        for fmt in args.formats.split(","):
            call, w, w_bytes = _layer(fmt, k, n, gen)
            w_bf16 = w.to(torch.bfloat16)
            for m in (int(b) for b in args.batches.split(",")):
                x = (torch.randn(m, k, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
                ref = x.float() @ w
                err = ((call(x).float() - ref).abs().max() / ref.abs().max()).item()
                t = _time_us(lambda x=x, f=call: f(x), args.iters)
                t_bf16 = _time_us(lambda x=x, wb=w_bf16: x @ wb, args.iters)
                flop, io = 2 * m * k * n, 2 * m * (k + n)
                tiles = gemm_tiles(m, n, k, x.device)
                row = {
                    "format": fmt,
                    "in": k,
                    "out": n,
                    "m": m,
                    "us": round(t, 2),
                    "tflops": round(flop / t / 1e6, 2),
                    "gbps": round((w_bytes + io) / t / 1e3, 1),
                    "bf16_us": round(t_bf16, 2),
                    "bf16_tflops": round(flop / t_bf16 / 1e6, 2),
                    "bf16_gbps": round((2 * k * n + io) / t_bf16 / 1e3, 1),
                    "speedup_vs_bf16": round(t_bf16 / t, 2),
                    "max_rel_err": err,
                    "tiles": list(tiles),
                }
                rows.append(row)
                print(
                    f"{fmt:20s} {k}x{n} M {m:5d}: {t:9.2f} us {row['tflops']:7.2f} TFLOP/s "
                    f"{row['gbps']:7.1f} GB/s | bf16 {t_bf16:9.2f} us {row['bf16_tflops']:7.2f} "
                    f"TFLOP/s {row['bf16_gbps']:7.1f} GB/s | x{row['speedup_vs_bf16']} "
                    f"err {err:.1e} tiles {tuple(tiles)}",
                    flush=True,
                )
    result = {"bench": "quant_triton", "device": torch.cuda.get_device_name(0), "rows": rows}
    out = Path(args.out)
    if out.suffix != ".json":
        out = out / "bench_quant_triton.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    decode = [r for r in rows if r["m"] == min(r2["m"] for r2 in rows)]
    summary = ", ".join(
        f"{r['format']} {r['in']}x{r['out']} x{r['speedup_vs_bf16']}" for r in decode
    )
    print(f"bench_quant_triton: smallest M vs bf16 matmul: {summary}; wrote {out}")


if __name__ == "__main__":
    main()

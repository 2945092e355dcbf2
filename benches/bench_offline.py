"""Offline throughput of the whole engine on the nano-vllm workload: output tokens per second.

    python benches/bench_offline.py [--num-requests 256] [--max-len 1024]
        [--model-shape qwen3-0.6b|tiny] [--cuda-graph-max-bs N] [--out FILE.json|DIR]

Workload (fixed, seeded, as nano-vllm's bench.py): --num-requests requests; prompt and output
lengths each uniform in [min(100, max_len // 2), max_len]; prompt ids uniform in
[0, min(10000, vocab)); temperature 0.6 with ignore_eos, so every request yields exactly its
output length; seed 0. Model: random weights of the chosen shape, built on the fly with
transformers into a temporary folder (no download): qwen3-0.6b is Qwen3-0.6B (hidden 1024,
28 layers, 16 query / 8 KV heads of head_dim 128, intermediate 3072, vocab 151936, tied
embeddings); tiny is tests/fixtures/tiny_models.py's Qwen3. bf16 on CUDA, fp32 on CPU.

The engine runs in-process (ModelRunner + ModelWorker + Scheduler, overlap loop, default
settings; on CUDA the decode graphs cover every batch up to --cuda-graph-max-bs, default
the number of requests, as nano-vllm captures up to its max_num_seqs). A short warm-up run
comes first; then every request is submitted at once and the clock runs until the last
token. Prints one summary line and writes JSON (default: $OUT, else bench_results/) with
nano-vllm's published figure alongside: 1,434 tok/s on an RTX 4070 laptop (an H200 has
about 18x its memory bandwidth). CPU smoke run: --model-shape tiny --num-requests 8 --max-len 64.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from sglite.config import ServerArgs  # noqa: E402
from sglite.messages import GenerateReq  # noqa: E402
from sglite.model_executor.model_runner import ModelRunner  # noqa: E402
from sglite.sampling_params import SamplingParams  # noqa: E402
from sglite.scheduler.process import scheduler_for_runner  # noqa: E402
from sglite.scheduler.scheduler import Scheduler  # noqa: E402

NANO_VLLM = {"output_tokens_per_s": 1434, "gpu": "RTX 4070 laptop", "model": "Qwen3-0.6B"}
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=False,
)
WARMUP_REQUESTS = 16


def build_model(shape: str, out_dir: Path) -> Path:
    """Write a random-weight checkpoint of `shape` (with a small BPE tokenizer) to out_dir."""
    from fixtures.tiny_models import build_tiny_model, build_tokenizer

    if shape == "tiny":
        return build_tiny_model("qwen3", out_dir)
    from transformers import AutoModelForCausalLM, Qwen3Config

    build_tokenizer(out_dir)
    config = Qwen3Config(architectures=["Qwen3ForCausalLM"], **QWEN3_0_6B)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(out_dir))
    return out_dir


def workload(n: int, max_len: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request."""
    rng = random.Random(seed)
    low, top = min(100, max(1, max_len // 2)), min(10000, vocab) - 1
    return [
        ([rng.randint(0, top) for _ in range(rng.randint(low, max_len))], rng.randint(low, max_len))
        for _ in range(n)
    ]


def build_engine(runner: ModelRunner, outputs: list) -> Scheduler:
    args = ServerArgs(model_path=str(runner.model_path)).resolved(runner.device.type)
    return scheduler_for_runner(args, runner, outputs.append)


def generate(sched: Scheduler, outputs: list, reqs: list[tuple[list[int], int]], tag: str) -> int:
    """Run every request to completion; returns the number of output tokens."""
    outputs.clear()
    for i, (prompt, n) in enumerate(reqs):
        sp = SamplingParams(max_new_tokens=n, temperature=0.6, ignore_eos=True)
        sched.add_request(GenerateReq(f"{tag}{i}", prompt, sp))
    sched.run_until_idle()
    num_out = sum(len(ids) for msg in outputs for ids in msg.output_ids)
    finished = sum(r is not None for msg in outputs for r in msg.finished_reasons)
    if finished != len(reqs) or num_out != sum(n for _, n in reqs):
        raise RuntimeError(f"{tag}: {finished}/{len(reqs)} finished, {num_out} output tokens")
    return num_out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024, help="max prompt and output length")
    p.add_argument("--model-shape", choices=("qwen3-0.6b", "tiny"), default="qwen3-0.6b")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_results",
                   help="a .json file, or a folder for bench_offline.json")  # fmt: skip
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sglite-bench-") as tmp:
        model_dir = build_model(a.model_shape, Path(tmp))
        t_build = time.perf_counter() - t0
        runner = ModelRunner(
            model_dir,
            cuda_graph_max_bs=a.cuda_graph_max_bs or min(a.num_requests, 512),
            context_length=2 * a.max_len + 16,  # what the workload needs: smaller tables
        )
    t_setup = time.perf_counter() - t0
    outputs: list = []
    sched = build_engine(runner, outputs)
    vocab = runner.model_config.vocab_size
    reqs = workload(a.num_requests, a.max_len, vocab)
    warm = workload(WARMUP_REQUESTS, min(a.max_len, 64), vocab, seed=1)
    generate(sched, outputs, warm, "warmup")
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    before = dict(sched.counters)
    start = time.perf_counter()
    num_out = generate(sched, outputs, reqs, "r")
    sync()
    elapsed = time.perf_counter() - start
    counters = {k: v - before[k] for k, v in sched.counters.items() if k.startswith("num_")}
    sched.client.shutdown()
    graphs = runner.graph_runner
    result = {
        "bench": "offline",
        "device": torch.cuda.get_device_name(0) if runner.device.type == "cuda" else "cpu",
        "model_shape": a.model_shape,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "attention_backend": runner.attention_backend_name,
        "num_requests": a.num_requests,
        "max_len": a.max_len,
        "prompt_tokens": sum(len(pr) for pr, _ in reqs),
        "output_tokens": num_out,
        "total_time_s": round(elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 1),
        "cuda_graph_batch_sizes": graphs.batch_sizes,
        "cuda_graph_replays": getattr(graphs, "num_replays", 0),
        "counters": counters,
        "model_build_s": round(t_build, 1),
        "setup_s": round(t_setup, 1),
        "nano_vllm_published": NANO_VLLM,
        "unix_time": int(time.time()),
    }
    out = Path(a.out)
    if out.suffix != ".json":
        out = out / "bench_offline.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        f"offline {a.model_shape} on {result['device']}: {a.num_requests} requests, "
        f"{num_out} output tokens in {elapsed:.2f} s = {num_out / elapsed:.0f} tok/s "
        f"(nano-vllm published: {NANO_VLLM['output_tokens_per_s']} tok/s on an "
        f"{NANO_VLLM['gpu']})"
    )


if __name__ == "__main__":
    main()

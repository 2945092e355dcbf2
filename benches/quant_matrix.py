"""The quantized-model matrix (issue 34): for every shape x file type, batch-1 decode, 16
concurrent streams, a 512-token prefill, load time and peak process-tree RSS, sglite with
default flags vs llama-server on the same random-weight GGUF.

    python benches/quant_matrix.py --dir /work/gguf --out bench_results/quant_matrix.json
    python benches/quant_matrix.py --shapes llama3.2-1b,qwen2.5-7b --types Q4_K_M,Q8_0 \
        --dir /work/gguf --llama-server ~/llama.cpp/build/bin/llama-server --rounds 2 \
        --out quant_matrix.json --plot quant_matrix.png

Rows: --shapes x --types (benches/make_gguf.py's SHAPES and FILE_TYPES); each file is made
by make_gguf.py into --dir on first use and kept there (`{shape}.{type}.gguf`; with --layers
N, a quick file of N layers, `{shape}.{type}.L{N}.gguf`; --delete-made removes the files
this run made once their row is done). Per row and round, each engine (alternating which
goes first) is started, timed until healthy (load), warmed up by one request, then measured:
- batch 1: --requests requests one at a time, --input-len random token ids in and
  --output-len out: the median per-stream decode rate, tok/s;
- prefill: --prefill-requests requests of --prefill-len tokens and 1 token out: TTFT p50;
- concurrent: --concurrency requests sent together (--input-len in, --output-len out):
  output tok/s over the wave's wall time;
- the peak RSS of the whole process tree, sampled from start to stop;
and stopped. sglite runs with no flags (its defaults) unless --sglite-args; --sglite-extra
FLAGS adds a second sglite column with those flags (a documented option, beside the
defaults). llama-server runs with --llama-args, default `-t 2 -tb 2 -c 8192 -np 16 -cb
--kv-unified` (16 slots sharing one 8192-token context, so a 512-token prompt fits a slot).
Each number is the median over rounds; ratios are sglite over llama-server (> 1: sglite
better; for TTFT, load and RSS, llama-server's over sglite's). The client is
benches/servers.py. Prints a markdown table, writes every round to --out, and with --plot
(matplotlib installed) a bar chart of the batch-1 and concurrent ratios.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import make_gguf
import servers
from servers import EngineSpec, Rounds, ServerProcess

LLAMA_ARGS = "-t 2 -tb 2 -c 8192 -np 16 -cb --kv-unified"
# (column label, result key, higher is better)
METRICS = [
    ("batch-1 decode tok/s", "decode_tok_s", True),
    ("{c} concurrent output tok/s", "concurrent_tok_s", True),
    ("prefill {p} TTFT ms", "prefill_ttft_ms", False),
    ("load s", "load_s", False),
    ("peak RSS GiB", "peak_rss_gib", False),
]


def measure(spec: EngineSpec, model: Path, args: argparse.Namespace) -> dict[str, float]:
    """Start the engine on `model`, run the three workloads once, stop it."""
    log = args.log_dir / f"{model.stem}.{spec.name.replace(' ', '_')}.log"
    out: dict[str, float] = {}
    with ServerProcess(spec, model, args.port, log, args.rss_interval) as server:
        url = server.base_url
        out["load_s"] = server.wait_healthy(args.start_timeout)
        servers.run_waves(url, servers.random_prompts(1, args.input_len, 7), 8, 1)
        one = servers.run_waves(
            url, servers.random_prompts(args.requests, args.input_len, 11), args.output_len, 1
        )
        out["decode_tok_s"], out["itl_p50_ms"] = one["decode_tok_s"], one["itl_p50_ms"]
        prompts = servers.random_prompts(args.prefill_requests, args.prefill_len, 12)
        out["prefill_ttft_ms"] = servers.run_waves(url, prompts, 1, 1)["ttft_p50_ms"]
        prompts = servers.random_prompts(args.concurrency, args.input_len, 13)
        many = servers.run_waves(url, prompts, args.output_len, args.concurrency)
        out["concurrent_tok_s"] = many["output_tok_s"]
        out["peak_rss_gib"] = server.peak_rss / 2**30
    return out


def table(rows: list[dict[str, Any]], names: list[str], args: argparse.Namespace) -> str:
    """The markdown matrix: per row and metric each engine's median, and each sglite
    column's ratio to llama-server when it ran."""
    peer = "llama-server" if "llama-server" in names else None
    ours = [n for n in names if n != peer]
    header = ["shape", "type", "GiB"]
    for label, _, _ in METRICS:
        label = label.format(c=args.concurrency, p=args.prefill_len)
        header += [f"{label}: {n}" for n in names]
        header += [f"{label}: {n} vs llama" for n in ours if peer]
    lines = []
    for row in rows:
        cells = [row["shape"], row["type"], f"{row['gib']:.2f}"]
        for _, key, higher in METRICS:
            rounds = Rounds()
            for run in row["runs"]:
                rounds.add(run["engine"], run["result"][key])
            cells += [servers.fmt(rounds.median(n)) for n in names]
            if peer:
                cells += [servers.ratio(rounds.median(n), rounds.median(peer), higher)
                          for n in ours]  # fmt: skip
        lines.append(cells)
    return servers.markdown(header, lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Bars of sglite / llama-server at batch 1 and concurrent, one group per row."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    labels, series = [], {"decode_tok_s": [], "concurrent_tok_s": []}
    for row in rows:
        r = {k: Rounds() for k in series}
        for run in row["runs"]:
            for k in series:
                r[k].add(run["engine"], run["result"][k])
        labels.append(f"{row['shape']}\n{row['type']}")
        for k in series:
            ours, peer = r[k].median("sglite"), r[k].median("llama-server")
            series[k].append(ours / peer if peer == peer and peer else float("nan"))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(labels)), 4))
    width = 0.4
    for i, (k, name) in enumerate(
        [("decode_tok_s", "batch 1"), ("concurrent_tok_s", "concurrent")]
    ):
        ax.bar([x + (i - 0.5) * width for x in range(len(labels))], series[k], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("sglite / llama-server (tok/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--shapes", default=",".join(make_gguf.SHAPES), help="comma-separated (make_gguf.py)")
    add("--types", default=",".join(make_gguf.FILE_TYPES), help="comma-separated file types")
    add("--dir", type=Path, required=True, help="where the GGUFs are made and kept")
    add("--layers", type=int, default=None, help="fewer layers, for a quick check")
    add("--delete-made", action="store_true", help="remove the files this run made, per row")
    add("--llama-server", default=None, help="the llama-server binary (omit: sglite only)")
    add("--llama-args", default=LLAMA_ARGS, help=f"llama-server flags (default: {LLAMA_ARGS})")
    add("--sglite-args", default="", help="sglite flags (default: none, the defaults)")
    add(
        "--sglite-extra",
        default="",
        help="flags of a second sglite column (e.g. a documented option)",
    )
    add("--requests", type=int, default=2, help="batch-1 requests, one at a time")
    add("--input-len", type=int, default=256)
    add("--output-len", type=int, default=64)
    add("--concurrency", type=int, default=16)
    add("--prefill-len", type=int, default=512)
    add("--prefill-requests", type=int, default=2)
    add("--rounds", type=int, default=1, help="server starts per engine per row, alternated")
    add("--port", type=int, default=30260)
    add("--start-timeout", type=float, default=1800.0, help="seconds to become healthy")
    add("--rss-interval", type=float, default=0.5, help="seconds between RSS samples")
    add("--log-dir", type=Path, default=Path("bench_results/quant_matrix_logs"))
    add("--out", type=Path, default=None, help="write every round's numbers as JSON")
    add("--plot", type=Path, default=None, help="a PNG of the ratios (needs matplotlib)")
    args = p.parse_args()
    args.shapes, args.types = args.shapes.split(","), args.types.split(",")
    for s in args.shapes:
        if s not in make_gguf.SHAPES:
            p.error(f"unknown shape {s!r}; known: {', '.join(make_gguf.SHAPES)}")
    for t in args.types:
        if t not in make_gguf.FILE_TYPES:
            p.error(f"unknown type {t!r}; known: {', '.join(make_gguf.FILE_TYPES)}")
    for name in ("requests", "input_len", "concurrency", "prefill_len", "prefill_requests",
                 "rounds"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.output_len < 2:
        p.error("--output-len must be at least 2 (a decode rate needs two tokens)")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    specs = servers.engines(args.sglite_args, args.llama_server, args.llama_args, args.sglite_extra)
    names = [s.name for s in specs]
    rows: list[dict[str, Any]] = []
    for shape in args.shapes:
        for file_type in args.types:
            path, made = make_gguf.cached(shape, file_type, args.dir, args.layers)
            row = {"shape": shape, "type": file_type, "file": str(path),
                   "gib": path.stat().st_size / 2**30, "runs": []}  # fmt: skip
            for r, spec in servers.alternated(specs, args.rounds):
                result = measure(spec, path, args)
                row["runs"].append({"engine": spec.name, "round": r, "result": result})
                print(f"{path.name} round {r} {spec.name}: batch 1 "
                      f"{result['decode_tok_s']:.2f} tok/s, {args.concurrency} concurrent "
                      f"{result['concurrent_tok_s']:.2f} tok/s, load {result['load_s']:.1f} s, "
                      f"peak RSS {result['peak_rss_gib']:.2f} GiB", flush=True)  # fmt: skip
            rows.append(row)
            if made and args.delete_made:
                path.unlink()
            if args.out:  # after every row: a long run keeps what it measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                settings = {
                    k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                }
                args.out.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    print("\n" + table(rows, names, args) + "\n")
    if args.out:
        print(f"wrote {args.out}")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()

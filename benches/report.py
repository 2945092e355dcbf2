"""Tables and plots from bench_serving results (JSON Lines files, one run per line).

    python benches/report.py RESULT.jsonl [...] [--out-dir bench_results/report] [--no-plots]

Writes report.md (and prints it): one row per run with its tag, backend, workload,
concurrency (--max-concurrency, else the peak the client reached), output tok/s, TTFT
p50/p99, ITL p50/p99/max and the cache hit rate (with the best possible one for
shared-prefix workloads). Where sglite and another backend ran the same workload at the same
concurrency, the sglite row's last column gives its output tok/s over the other's.

Plots (matplotlib: `pip install 'sglite[bench]'`): throughput.png, output tok/s against
concurrency, one line per backend and workload; ttft_cdf.png and itl_cdf.png, one CDF per
run, from the per-request values each result keeps under "details".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Run = dict[str, Any]
COLUMNS = ["tag", "backend", "workload", "conc", "out tok/s", "TTFT p50", "TTFT p99",
           "ITL p50", "ITL p99", "ITL max", "hit rate", "sglite / peer"]  # fmt: skip


def load_runs(paths: Sequence[str]) -> list[Run]:
    runs = []
    for path in paths:
        for num, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                runs.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{num}: not a JSON result line ({e})") from None
    if not runs:
        raise SystemExit(f"no results in {', '.join(paths)}")
    return runs


def concurrency(run: Run) -> int:
    return run.get("max_concurrency") or run["concurrency_peak"]


def label(run: Run) -> str:
    """The run's tag (or backend and concurrency) and its dataset, for plot legends."""
    name = run.get("tag") or f"{run['backend']} c={concurrency(run)}"
    return f"{name} {run['workload'].split('(')[0]}"


def peer_ratios(runs: Sequence[Run]) -> list[str]:
    """Per run: its output tok/s over each other backend's at the same workload and
    concurrency, for sglite runs only ("" elsewhere)."""
    cells = []
    for run in runs:
        key = (run["workload"], concurrency(run))
        peers = [
            p
            for p in runs
            if p["backend"] != run["backend"] and (p["workload"], concurrency(p)) == key
        ]
        if run["backend"] != "sglite" or not peers:
            cells.append("")
            continue
        parts = [
            f"{run['output_throughput'] / p['output_throughput']:.2f}x vs {p['backend']}"
            for p in peers
            if p["output_throughput"]
        ]
        cells.append(", ".join(parts))
    return cells


def _ms(stats: dict[str, Any], key: str) -> str:
    value = stats.get(key)
    return "n/a" if value is None else f"{value:.1f}"


def _hit(run: Run) -> str:
    rate, best = run.get("cache_hit_rate"), run.get("best_cache_hit_rate")
    text = "n/a" if rate is None else f"{rate:.1%}"
    return text if best is None else f"{text} (best {best:.1%})"


def markdown_table(runs: Sequence[Run]) -> str:
    rows = [COLUMNS, ["---"] * len(COLUMNS)]
    for run, ratio in zip(runs, peer_ratios(runs)):
        ttft, itl = run["ttft_ms"], run["itl_ms"]
        rows.append([
            run.get("tag") or "-", run["backend"], run["workload"], str(concurrency(run)),
            f"{run['output_throughput']:.1f}", _ms(ttft, "p50"), _ms(ttft, "p99"),
            _ms(itl, "p50"), _ms(itl, "p99"), _ms(itl, "max"), _hit(run), ratio,
        ])  # fmt: skip
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "plots need matplotlib: pip install 'sglite[bench]' (or pass --no-plots)"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values: Sequence[float], name: str) -> None:
    xs = sorted(values)
    ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)


def plot(runs: Sequence[Run], out_dir: Path) -> list[Path]:
    """Write throughput.png, ttft_cdf.png and itl_cdf.png into out_dir; returns the paths."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for run in runs:
        lines.setdefault((run["backend"], run["workload"]), []).append(
            (concurrency(run), run["output_throughput"])
        )
    for (backend, workload), points in sorted(lines.items()):
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=f"{backend} {workload}")
    ax.set(xlabel="concurrency", ylabel="output tok/s", title="Output throughput")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small")
    paths = [out_dir / "throughput.png"]
    fig.savefig(paths[0], dpi=120, bbox_inches="tight")
    plt.close(fig)
    for key, title in (("ttft_ms", "TTFT"), ("itl_ms", "ITL")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for run in runs:
            values = run.get("details", {}).get(key) or []
            if values:
                _cdf(ax, values, label(run))
        ax.set(xlabel=f"{title} (ms)", ylabel="fraction of values", title=f"{title} CDF")
        ax.legend(fontsize="small")
        paths.append(out_dir / f"{key.removesuffix('_ms')}_cdf.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="JSON Lines files from bench_serving")
    parser.add_argument("--out-dir", default="bench_results/report")
    parser.add_argument("--no-plots", action="store_true", help="the table only")
    args = parser.parse_args(argv)
    runs = load_runs(args.results)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(runs)
    (out_dir / "report.md").write_text(table + "\n")
    print(table)
    if not args.no_plots:
        for path in plot(runs, out_dir):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

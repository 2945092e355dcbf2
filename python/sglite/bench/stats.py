"""Benchmark statistics and the report: percentiles, the result record, the printed block.

build_report's record is what --output-file appends as one JSON line per run (JSON Lines, as
SGLang does): the printed figures, "args", and "details" (per-request ttft_ms, e2e_ms,
output_lens, group_idx, and all ITLs flattened in itl_ms), which benches/report.py turns into
tables and plots.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from sglite.bench.datasets import Conversation, RequestResult, best_prefix_hit_rate

PERCENTILES = (50, 90, 99)


# ---------------------------------------------------------------------- statistics
def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99, max of values (None each when there are none)."""
    keys = ["mean", *(f"p{p}" for p in PERCENTILES), "max"]
    if not values:
        return dict.fromkeys(keys)
    stats = [sum(values) / len(values), *(percentile(values, p) for p in PERCENTILES), max(values)]
    return dict(zip(keys, stats))


def workload_label(args: argparse.Namespace) -> str:
    if args.dataset_name == "random":
        return (
            f"random(in={args.random_input_len},out={args.random_output_len},"
            f"ratio={args.random_range_ratio})"
        )
    if args.dataset_name == "generated-shared-prefix":
        return (
            f"gsp(groups={args.gsp_num_groups}x{args.gsp_prompts_per_group},"
            f"sys={args.gsp_system_prompt_len},q={args.gsp_question_len},out={args.gsp_output_len}"
            f"{',shuffled' if args.gsp_shuffle else ''})"
        )
    return (
        f"multi-turn(convs={args.multi_turn_num_conversations},turns={args.multi_turn_turns},"
        f"in={args.multi_turn_input_len},out={args.multi_turn_output_len})"
    )


def build_report(
    args: argparse.Namespace,
    model: str,
    convs: Sequence[Conversation],
    results: Sequence[RequestResult],
    duration: float,
    peak: int,
    hit: tuple[float | None, str],
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    num_in = sum(r.prompt_len for r in ok)
    num_out = sum(r.output_len for r in ok)
    errors = Counter(r.error for r in results if not r.ok)
    itls = [x * 1000 for r in ok for x in r.itls]
    return {
        "tag": args.tag,
        "backend": args.backend,
        "api": args.api,
        "model": model,
        "dataset": args.dataset_name,
        "workload": workload_label(args),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": len(ok) / duration,
        "input_throughput": num_in / duration,
        "output_throughput": num_out / duration,
        "total_throughput": (num_in + num_out) / duration,
        "concurrency_peak": peak,
        "concurrency_mean": sum(r.e2e for r in results if r.start) / duration,
        "ttft_ms": summarize([r.ttft * 1000 for r in ok]),
        "tpot_ms": summarize([r.tpot * 1000 for r in ok if r.tpot is not None]),
        "itl_ms": summarize(itls),
        "e2e_ms": summarize([r.e2e * 1000 for r in ok]),
        "cache_hit_rate": hit[0],
        "cache_hit_source": hit[1],
        "best_cache_hit_rate": best_prefix_hit_rate(convs),
        "errors": [f"{n} x {e}" for e, n in errors.most_common(10)],
        "args": {k: v for k, v in vars(args).items() if k not in ("api_key", "request_rate")},
        "details": {
            "ttft_ms": [r.ttft * 1000 for r in ok],
            "e2e_ms": [r.e2e * 1000 for r in ok],
            "output_lens": [r.output_len for r in ok],
            "group_idx": [r.group_idx for r in ok],
            "itl_ms": itls,
        },
    }


def format_report(rep: dict[str, Any]) -> str:
    """The printed result block."""

    def row(name: str, value: Any) -> str:
        text = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else value
        return f"{name + ':':<42}{text}"

    def pct(x: float | None) -> str | None:
        return None if x is None else f"{x:.2%}"

    lines = [
        f"{' Serving Benchmark Result ':=^60}",
        row("Tag", rep["tag"] or "-"),
        row("Backend / API", f"{rep['backend']} / {rep['api']}"),
        row("Workload", rep["workload"]),
        row(
            "Request rate / max concurrency",
            f"{rep['request_rate'] or 'inf'} / {rep['max_concurrency'] or 'none'}",
        ),
        row("Successful requests", rep["completed"]),
        row("Failed requests", rep["failed"]),
        *(f"  {e}" for e in rep["errors"][:5]),
        row("Benchmark duration (s)", rep["duration_s"]),
        row("Total input tokens", rep["total_input_tokens"]),
        row("Total output tokens", rep["total_output_tokens"]),
        row("Request throughput (req/s)", rep["request_throughput"]),
        row("Input token throughput (tok/s)", rep["input_throughput"]),
        row("Output token throughput (tok/s)", rep["output_throughput"]),
        row("Total token throughput (tok/s)", rep["total_throughput"]),
        row(
            "Concurrency reached (peak / mean)",
            f"{rep['concurrency_peak']} / {rep['concurrency_mean']:.2f}",
        ),
        row(f"Cache hit rate ({rep['cache_hit_source']})", pct(rep["cache_hit_rate"])),
    ]
    if rep["best_cache_hit_rate"] is not None:
        lines.append(row("Best possible hit rate (this workload)", pct(rep["best_cache_hit_rate"])))
    for key, title in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E Latency"),
    ):
        lines.append(f"{' ' + title + ' (ms) ':-^60}")
        lines += [row(f"{stat.capitalize()} {title}", v) for stat, v in rep[key].items()]
    lines.append("=" * 60)
    return "\n".join(lines)

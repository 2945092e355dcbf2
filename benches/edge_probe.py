"""What benches/edge.py measures while each case runs: the /health latency, from a process of
its own (the bench's own work, building big bodies, must not delay the probes), and the RSS of
the server's process tree."""

from __future__ import annotations

import multiprocessing
import queue
import time
from pathlib import Path
from typing import Any

import httpx

PROBE_EVERY_S = 0.05


def _probe_loop(url: str, out: Any, stop: Any) -> None:
    while not stop.is_set():
        start = time.monotonic()  # CLOCK_MONOTONIC: the same clock in every process
        out.put(("start", start, 0.0, 0))
        try:
            status = httpx.get(url, timeout=120).status_code
        except httpx.HTTPError:
            status = 0
        out.put(("done", start, time.monotonic() - start, status))
        stop.wait(PROBE_EVERY_S)


class HealthProber:
    """Polls /health on a fresh connection from its own process (the bench's own work,
    building big bodies, must not delay it); worst latency per window."""

    def __init__(self, url: str):
        ctx = multiprocessing.get_context("spawn")
        self._queue, self._stop = ctx.Queue(), ctx.Event()
        self._proc = ctx.Process(
            target=_probe_loop, args=(url + "/health", self._queue, self._stop), daemon=True
        )
        self._proc.start()
        self.samples: list[tuple[float, float, int]] = []  # (start, latency, status)
        self.current: float | None = None

    def _drain(self) -> None:
        while True:
            try:
                kind, start, latency, status = self._queue.get_nowait()
            except queue.Empty:
                return
            if kind == "start":
                self.current = start
            else:
                self.current = None
                self.samples.append((start, latency, status))

    def window(self, since: float) -> tuple[float, float, int]:
        """(median and worst latency, probes without a 200) of the probes started since
        `since`; a probe still waiting counts with its age."""
        self._drain()
        got = [(lat, st) for t, lat, st in self.samples if t >= since]
        latencies = [lat for lat, _ in got]
        if self.current is not None:
            latencies.append(time.monotonic() - self.current)
        latencies.sort()
        median = latencies[len(latencies) // 2] if latencies else 0.0
        return median, max(latencies, default=0.0), sum(1 for _, st in got if st != 200)

    def stop(self) -> None:
        self._stop.set()
        self._proc.join(10)


def tree_rss_mb(pid: int | None) -> float | None:
    """The RSS of `pid` and its descendants, in MB (None without a pid)."""
    if pid is None:
        return None
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
            except (OSError, ValueError):
                pass
    pids, todo = [pid], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        pids += kids
        todo += kids
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024

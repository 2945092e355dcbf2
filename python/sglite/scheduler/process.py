"""The scheduler process: builds the model and the Scheduler, wires them to ZMQ, runs the loop.

It connects PULL to `ipc.scheduler_input`, PUSH to `ipc.detokenizer` (token-id outputs) and
PUSH to `ipc.tokenizer` (control replies). It reports readiness (or the start-up error) once
over `ready_conn`, and exits when its parent process is gone. Its watchdog (watchdog.py)
publishes each step's start on the launcher's heartbeat and ends the process if a step hangs.

With --tp-size N there is one such process per TP rank (`tp_rank`): only rank 0 opens the
sockets; every rank gets rank 0's messages through `TPSync` (tp_sync.py). A rank that loses
a peer (a collective fails) logs which and exits with PEER_LOST_EXIT_CODE.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Any

from sglite.config import ServerArgs
from sglite.messages import ReadyMsg
from sglite.scheduler.tp_sync import (
    PEER_LOST_EXIT_CODE,
    TPPeerLost,
    TPStopped,
    TPSync,
    idle_tick_s,
    is_peer_failure,
)
from sglite.scheduler.watchdog import Heartbeat, NullWatchdog, Watchdog

logger = logging.getLogger(__name__)

PARENT_CHECK_MS = 1000


def scheduler_for_runner(
    args: ServerArgs,
    runner,
    send,
    send_control=None,
    decode_tail=None,
    watchdog: NullWatchdog | None = None,
    tokenizer=None,
    dp_rank: int = 0,
    agree=None,
):
    """A Scheduler driving `runner` (its pools, allocator and model) with `args`; no watchdog
    unless one is given (tests and benchmarks drive it in-process). Structured output needs
    the `tokenizer` (without it, constrained requests are refused). `agree`: TPSync.share."""
    import sglite.core
    from sglite.constrained import create_backend
    from sglite.scheduler.model_worker import ModelWorker
    from sglite.scheduler.scheduler import Scheduler

    core = sglite.core.load(
        args.tree_core, page_size=args.page_size, eviction_policy=args.radix_eviction_policy
    )
    cfg = runner.model_config
    args = args.resolved(runner.device.type)  # the device's chunk size, mixed chunk, ...
    return Scheduler(
        args,
        ModelWorker(runner, args.random_seed),
        core=core,
        allocator=runner.allocator,
        req_to_token_pool=runner.req_to_token_pool,
        context_length=cfg.context_length,
        eos_token_ids=set(cfg.eos_token_ids),
        decode_tail=decode_tail or (lambda ids: ""),
        send=send,
        send_control=send_control,
        watchdog=watchdog,
        grammar_backend=create_backend(
            args.grammar_backend,
            tokenizer,
            cfg.vocab_size,
            cfg.eos_token_ids,
            compile_timeout_s=args.grammar_compile_timeout,
            compile_max_memory_mb=args.grammar_compile_max_memory_mb,
        ),
        dp_rank=dp_rank,
        agree=agree,
        kv_pool=runner.kv_pool,
        model_id=f"{runner.model_path}|{cfg.architecture}|{cfg.vocab_size}",
    )


def build_scheduler(
    args: ServerArgs,
    send,
    send_control,
    watchdog: NullWatchdog | None = None,
    dp_rank: int = 0,
    tp_rank: int = 0,
) -> tuple[Any, dict[str, Any], TPSync | None]:
    """Load the model (this rank's shard) and build a Scheduler over it; returns
    (scheduler, ready info, the TP sync or None at tp_size 1)."""
    import sglite.core
    from sglite.distributed import split_cpu_threads
    from sglite.model_executor.model_runner import ModelRunner
    from sglite.server.tokenizer import tokenizer_for

    device = _rank_device(args, tp_rank)
    if args.tp_size_per_node > 1 and _on_cpu(device):
        threads = split_cpu_threads(args.tp_size_per_node)
        logger.info("TP rank %d: %d CPU thread(s) (cores split over this node's ranks)",
                    tp_rank, threads)  # fmt: skip
    runner = ModelRunner(
        args.model_path,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=device,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        attention_backend=args.attention_backend,
        tree_core=args.tree_core,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        trust_remote_code=args.trust_remote_code,
        tp_size=args.tp_size,
        tp_rank=tp_rank,
        ep_size=args.ep_size,
        dist_init_addr=args.dist_init_addr,
        dist_timeout=args.dist_timeout,
        quantization=args.quantization,
        quant_kernel=args.quant_kernel,
    )
    sync = TPSync(runner.tp_group, args.dist_timeout) if args.tp_size > 1 else None
    if tp_rank > 0:  # only rank 0 publishes (and binds) the KV events
        args = args.replace(kv_events_config=None)
    tokenizer = tokenizer_for(args, args.tokenizer_path or str(runner.tokenizer_path))
    sched = scheduler_for_runner(
        args,
        runner,
        send,
        send_control,
        decode_tail=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        watchdog=watchdog,
        tokenizer=tokenizer,
        dp_rank=dp_rank,
        agree=sync.share if sync else None,
    )
    cfg = runner.model_config
    info = {
        "model_path": str(runner.model_path),
        "tokenizer_path": str(args.tokenizer_path or runner.tokenizer_path),
        "context_length": cfg.context_length,
        "model_type": cfg.model_type,
        "architectures": [cfg.architecture],
        "max_total_tokens": runner.allocator.capacity(),
        "max_running_requests": sched.max_running,
        "vocab_size": cfg.vocab_size,
        "eos_token_ids": sorted(cfg.eos_token_ids),
        "tree_core": sglite.core.describe(),
        "device": str(runner.device),
        "dtype": str(runner.dtype).replace("torch.", ""),
        "tp_size": args.tp_size,
    }
    return sched, info, sync


def _on_cpu(device: str | None) -> bool:
    import torch

    return device == "cpu" or (device is None and not torch.cuda.is_available())


def _rank_device(args: ServerArgs, tp_rank: int) -> str | None:
    """TP on CUDA: one GPU per rank, numbered from 0 on each node."""
    if args.tp_size == 1 or args.device == "cpu":
        return args.device
    import torch

    if not torch.cuda.is_available():
        return args.device
    return f"cuda:{tp_rank - args.node_tp_ranks[0]}"


def run_scheduler_process(
    args: ServerArgs,
    ipc,
    ready_conn,
    heartbeat: Heartbeat | None = None,
    dp_rank: int = 0,
    tp_rank: int = 0,
) -> None:
    """`dp_rank`: which data-parallel replica this is (--dp-size); its control replies say so.
    `tp_rank`: which tensor-parallel rank (--tp-size); only rank 0 talks to the sockets."""
    import zmq

    from sglite.ipc import Receiver, Sender

    name = "scheduler" if args.dp_size == 1 else f"scheduler dp{dp_rank}"
    name += f" tp{tp_rank}" if args.tp_size > 1 else ""
    logging.basicConfig(
        level=args.log_level.upper(), format=f"%(asctime)s [{name}] %(levelname)s %(message)s"
    )
    parent = os.getppid()
    watchdog = Watchdog(args.watchdog_timeout, heartbeat=heartbeat)
    leader = tp_rank == 0
    if leader:
        ctx = zmq.Context()
        to_detok, to_tok = Sender(ctx, ipc.detokenizer), Sender(ctx, ipc.tokenizer)
        inbox = Receiver(ctx, ipc.scheduler_input)

    def send(msg) -> None:
        if leader:
            to_detok.send(msg)

    def send_control(msg) -> None:
        if leader:
            msg.dp_rank = dp_rank
            to_tok.send(msg)

    try:
        sched, info, sync = build_scheduler(args, send, send_control, watchdog, dp_rank, tp_rank)
    except Exception as e:  # reported to the launcher, which prints it and exits
        ready_conn.send(ReadyMsg.failed(name, e))
        return
    ready_conn.send(ReadyMsg(name, True, info=info))
    watchdog.start()
    logger.info(
        "scheduler ready: %d KV tokens, tree core %s, %s loop",
        info["max_total_tokens"], info["tree_core"]["backend"],
        "normal" if sched.args.disable_overlap_schedule else "overlap",
    )  # fmt: skip
    if sync is not None:  # stop with the whole TP group, at the next tick (tp_sync.py)
        signal.signal(signal.SIGTERM, lambda *_: setattr(sync, "stop_requested", True))
    # under TP rank 0 must tick while idle (tp_sync.py): it waits at most one idle tick
    wait_ms = round(idle_tick_s(args.dist_timeout) * 1000) if sync else PARENT_CHECK_MS

    def recv_local(block: bool) -> list:
        if not block:
            return inbox.recv_nowait()
        while True:
            first = inbox.recv(timeout_ms=wait_ms)
            if first is not None:
                return [first, *inbox.recv_nowait()]
            if os.getppid() != parent:
                logger.info("parent process is gone; scheduler exits")
                raise SystemExit(0)
            if sync is not None:
                return []

    try:
        sched.event_loop(sync.recv(recv_local) if sync else recv_local)
    except TPStopped:
        # every rank stops at this same tick: let the batch still on the worker thread finish
        # (its collectives meet on every rank), meet once more, and leave without running
        # torch's and gloo's C++ teardown, which can abort while a peer is exiting too
        sched.client.shutdown()
        sched.grammars.shutdown()
        sched.kv_publisher.shutdown()
        with contextlib.suppress(RuntimeError):
            sync.group.barrier()
        _flush_logs()
        os._exit(0)
    except SystemExit:
        pass
    except Exception as e:
        if sync is None or not is_peer_failure(e):
            logger.exception("scheduler crashed")
            raise
        logger.error("%s; exiting", e if isinstance(e, TPPeerLost) else sync.lost_message(e))
        _flush_logs()
        os._exit(PEER_LOST_EXIT_CODE)  # now: the worker thread may wait in a dead collective
    finally:
        sched.client.shutdown()
        sched.grammars.shutdown()
        sched.kv_publisher.shutdown()


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()

"""The validation of ServerArgs (run by its __post_init__): every check of one field's range
and of how fields combine, each failure a ValueError naming the flag.

The feature checks get the args and `bad(name, why)`, which raises that error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from sglite.kv_events.config import parse_kv_events_config

if TYPE_CHECKING:
    from sglite.config import ServerArgs

Bad = Callable[[str, str], None]


def check_tensor_parallel(args: ServerArgs, bad: Bad) -> None:
    # whether tp_size splits the model is checked where the model config is read
    if args.tp_size < 1:
        bad("tp_size", f"must be >= 1, got {args.tp_size}")
    # whether ep_size divides the experts is checked where the model is built
    if args.ep_size < 1 or args.tp_size % args.ep_size:
        bad("ep_size", f"must divide --tp-size {args.tp_size}, got {args.ep_size}")
    if args.tp_size > 1 and args.dp_size > 1:
        bad("dp_size", "cannot be combined with --tp-size > 1 yet; use one of the two")
    if args.nnodes < 1:
        bad("nnodes", f"must be >= 1, got {args.nnodes}")
    if args.tp_size % args.nnodes:
        bad("nnodes", f"must divide --tp-size {args.tp_size}, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        bad("node_rank", f"must be in 0..{args.nnodes - 1} (--nnodes), got {args.node_rank}")
    if args.nnodes > 1 and args.dist_init_addr is None:
        bad("dist_init_addr", "is required with --nnodes > 1 (node 0's HOST:PORT)")
    addr = args.dist_init_addr
    if addr is not None:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            bad("dist_init_addr", f"must be HOST:PORT, got {addr!r}")
    if not args.dist_timeout > 0:
        bad("dist_timeout", f"must be > 0 seconds, got {args.dist_timeout}")


def check_hicache(args: ServerArgs, bad: Bad) -> None:
    if args.hicache_storage_backend != "none" and not args.enable_hierarchical_cache:
        bad(
            "hicache_storage_backend",
            "is a tier below the host tier; add --enable-hierarchical-cache",
        )
    if args.enable_hierarchical_cache:
        if args.disable_radix_cache:
            bad("enable_hierarchical_cache", "needs the radix cache; drop --disable-radix-cache")
        if not args.hicache_ratio > 1:
            bad("hicache_ratio", f"must be > 1 (host pool larger), got {args.hicache_ratio}")
        if not args.hicache_size >= 0:
            bad("hicache_size", f"must be >= 0 GB, got {args.hicache_size}")
    if args.hicache_storage_backend != "none" and args.tp_size > 1:
        # each rank would read its own shard's files, and a page one rank dropped would make
        # the ranks' prefix matches (so their batches) differ
        bad("hicache_storage_backend", "is not supported with --tp-size > 1 yet")


def check_front_door(args: ServerArgs, bad: Bad) -> None:
    """The limits and timeouts of the HTTP front door (server/limits.py, connections.py)."""
    for name in (
        "max_request_bytes",
        "max_prompts_per_request",
        "max_sequences_per_request",
        "max_chat_messages",
        "max_grammar_chars",
        "max_json_depth",
        "tokenizer_threads",
    ):
        if getattr(args, name) < 1:
            bad(name, f"must be >= 1, got {getattr(args, name)}")
    for name in ("max_top_logprobs_num", "max_logit_bias"):
        if getattr(args, name) < 0:
            bad(name, f"must be >= 0, got {getattr(args, name)}")
    for name in ("max_prompt_chars", "max_connections"):
        value = getattr(args, name)
        if value is not None and value < 1:
            bad(name, f"must be >= 1, got {value}")
    for name in ("timeout_keep_alive", "http_header_timeout", "http_body_timeout"):
        if not getattr(args, name) > 0:  # NaN too
            bad(name, f"must be > 0 seconds, got {getattr(args, name)}")


def validate(args: ServerArgs) -> None:
    def bad(name: str, why: str) -> None:
        raise ValueError(f"--{name.replace('_', '-')}: {why}")

    if args.page_size < 1:
        bad("page_size", f"must be >= 1, got {args.page_size}")
    if args.page_size & (args.page_size - 1):
        bad("page_size", f"must be a power of two, got {args.page_size}")
    if args.max_total_tokens is not None and args.max_total_tokens < 2 * args.page_size:
        bad("max_total_tokens", f"must hold at least two pages, got {args.max_total_tokens}")
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static < 1:
        bad("mem_fraction_static", f"must be in (0, 1), got {args.mem_fraction_static}")
    if args.max_running_requests is not None and args.max_running_requests < 1:
        bad("max_running_requests", f"must be >= 1, got {args.max_running_requests}")
    if args.prefill_lookahead_requests < 0:
        bad("prefill_lookahead_requests", f"must be >= 0, got {args.prefill_lookahead_requests}")
    if args.prefill_delayer_max_delay_passes < 1:
        bad("prefill_delayer_max_delay_passes", "must be >= 1")
    for name in ("prefill_delayer_token_usage_low_watermark", "prefill_delayer_queue_min_ratio"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= 1:
            bad(name, f"must be in [0, 1], got {value}")
    ms = args.prefill_delayer_max_delay_ms
    if ms is not None and not ms > 0:
        bad("prefill_delayer_max_delay_ms", f"must be > 0, got {ms}")
    if not 0 <= args.dynamic_chunking_smooth_factor <= 1:
        bad("dynamic_chunking_smooth_factor", "must be in [0, 1]")
    if args.priority_scheduling_preemption_threshold < 0:
        bad("priority_scheduling_preemption_threshold", "must be >= 0")
    for name in ("prefill_decode_interval", "max_consecutive_prefill_batches"):
        if getattr(args, name) < 0:
            bad(name, f"must be >= 0, got {getattr(args, name)}")
    if args.max_prefill_tokens < 1:
        bad("max_prefill_tokens", f"must be >= 1, got {args.max_prefill_tokens}")
    c = args.chunked_prefill_size
    if c is not None and c != -1 and (c < args.page_size or c % args.page_size):
        bad(
            "chunked_prefill_size",
            f"must be -1 or a positive multiple of the page size {args.page_size}, got {c}",
        )
    if args.context_length is not None and args.context_length < 2:
        bad("context_length", f"must be >= 2, got {args.context_length}")
    if args.dp_size < 1:
        bad("dp_size", f"must be >= 1, got {args.dp_size}")
    check_tensor_parallel(args, bad)
    if not 0 < args.port < 65536:
        bad("port", f"must be in 1..65535, got {args.port}")
    if not 0 < args.schedule_conservativeness <= 10:
        bad(
            "schedule_conservativeness",
            f"must be in (0, 10], got {args.schedule_conservativeness}",
        )
    if args.cuda_graph_max_bs is not None and args.cuda_graph_max_bs < 1:
        bad("cuda_graph_max_bs", f"must be >= 1, got {args.cuda_graph_max_bs}")
    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        bad("max_queued_requests", f"must be >= 1, got {args.max_queued_requests}")
    if args.api_key is not None and not args.api_key.strip():
        bad("api_key", "is empty; give a key, or leave the flag out to serve without one")
    if not args.cors_origins:
        bad("allowed_origins", "names no origin; give * or a comma-separated list")
    try:
        parse_kv_events_config(args.kv_events_config)
    except ValueError as e:
        bad("kv_events_config", str(e))
    check_hicache(args, bad)
    check_front_door(args, bad)
    if args.stream_interval < 1:
        bad("stream_interval", f"must be >= 1, got {args.stream_interval}")
    if not args.watchdog_timeout > 0:  # NaN too
        bad("watchdog_timeout", f"must be > 0 seconds, got {args.watchdog_timeout}")
    if not args.grammar_compile_timeout > 0:
        bad(
            "grammar_compile_timeout",
            f"must be > 0 seconds, got {args.grammar_compile_timeout}",
        )
    if args.grammar_compile_max_memory_mb < 16:
        bad(
            "grammar_compile_max_memory_mb",
            f"must be >= 16 MB, got {args.grammar_compile_max_memory_mb}",
        )
    for f in dataclasses.fields(args):  # every field with choices
        choices = f.metadata.get("choices")
        value = getattr(args, f.name)
        if value is not None and choices and value not in choices:
            bad(f.name, f"must be one of {', '.join(choices)}, got {value!r}")

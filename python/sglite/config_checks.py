"""Cross-field checks of ServerArgs that belong to one feature (kept out of config.py).

Each function gets the args and `bad(name, why)`, which raises ValueError naming the flag.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglite.config import ServerArgs

Bad = Callable[[str, str], None]


def check_tensor_parallel(args: ServerArgs, bad: Bad) -> None:
    # whether tp_size splits the model is checked where the model config is read
    if args.tp_size < 1:
        bad("tp_size", f"must be >= 1, got {args.tp_size}")
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

"""build_cache_manager: the CacheManager a server's flags ask for (device only, or HiCache tiers).

HiCache sizing: the host pool holds `--hicache-ratio` x the device pool's tokens, or
`--hicache-size` GB (1e9 bytes, as SGLang) when that is > 0, in whole pages. A host pool that
does not fit in the RAM available now (MemAvailable in /proc/meminfo), counted once per scheduler
process of the machine (TP ranks x --dp-size replicas), is refused at start-up with the numbers,
rather than letting the machine swap or the kernel kill the server later.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sglite import env
from sglite.config import ServerArgs
from sglite.mem_cache.cache_manager import CacheManager
from sglite.mem_cache.file_storage import FileStorage, storage_page_len
from sglite.mem_cache.hicache import HiCache, model_fingerprint
from sglite.mem_cache.host_pool import HostKVPool
from sglite.mem_cache.memory_pool import KVPool

logger = logging.getLogger(__name__)

GIB = 1 << 30


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (the kernel's estimate of RAM usable without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def host_pool_slots(args: ServerArgs, kv_pool: KVPool) -> int:
    ps = kv_pool.page_size
    if args.hicache_size > 0:
        slots = int(args.hicache_size * 1e9) // kv_pool.bytes_per_token - ps
    else:
        slots = int(kv_pool.num_slots * args.hicache_ratio)
    return max(slots // ps * ps, 0)


def check_host_pool_fits(args: ServerArgs, kv_pool: KVPool, host_slots: int) -> None:
    how = (
        f"--hicache-size {args.hicache_size:g}"
        if args.hicache_size > 0
        else f"--hicache-ratio {args.hicache_ratio:g} x {kv_pool.num_slots} device tokens"
    )
    if host_slots < kv_pool.page_size:
        raise ValueError(f"{how}: the host KV pool would hold no page; make it larger")
    need, avail = HostKVPool.bytes_for(kv_pool, host_slots), mem_available_bytes()
    # every scheduler process on this machine holds a pool like this one: its TP ranks, and
    # with --dp-size every replica (all replicas run on the machine of the HTTP server)
    copies = args.tp_size_per_node * args.dp_size
    if need * copies > avail:
        each = ""
        if args.tp_size_per_node > 1:
            each = f" on each of {args.tp_size_per_node} TP ranks"
        if args.dp_size > 1:
            each += f"{' of' if each else ' on each of'} {args.dp_size} replicas (--dp-size "
            each += f"{args.dp_size})"
        raise ValueError(
            f"{how}: the host KV pool would take {need / GIB:.2f} GiB ({host_slots} tokens)"
            f"{each} but only {avail / GIB:.2f} GiB of RAM is available (MemAvailable); "
            "lower --hicache-ratio or --hicache-size"
        )


def build_cache_manager(
    args: ServerArgs,
    core,
    allocator,
    req_to_token_pool,
    events,
    kv_pool: KVPool | None = None,
    model_id: str = "",
) -> CacheManager:
    ps = args.page_size
    enabled = not args.disable_radix_cache
    if not args.enable_hierarchical_cache:
        tree = core.RadixTree(ps, args.radix_eviction_policy)
        return CacheManager(tree, allocator, req_to_token_pool, ps, enabled, events, kv_pool)
    if kv_pool is None:
        raise ValueError("HiCache needs the device KV pool (its host copies read it)")
    host_slots = host_pool_slots(args, kv_pool)
    check_host_pool_fits(args, kv_pool, host_slots)
    tree = core.RadixTree(ps, args.radix_eviction_policy, host_slots)
    cache = CacheManager(tree, allocator, req_to_token_pool, ps, enabled, events, kv_pool)
    storage = None
    if args.hicache_storage_backend == "file":
        directory = Path(args.hicache_storage_dir or env.hicache_storage_dir())
        fingerprint = model_fingerprint(model_id, kv_pool)
        storage = FileStorage(directory, fingerprint, storage_page_len(ps))
    host_pool = HostKVPool(kv_pool, host_slots)
    cache.tier = HiCache(cache, host_pool, args.hicache_write_policy, storage)
    logger.info(
        "HiCache on: host pool %d tokens (%.2f GiB) under a device pool of %d tokens "
        "(%.2f GiB), %s%s",
        host_slots, host_pool.memory_bytes() / GIB, kv_pool.num_slots,
        kv_pool.memory_bytes() / GIB, args.hicache_write_policy,
        f", file tier in {storage.dir} ({storage.page_len}-token pages)" if storage else "",
    )  # fmt: skip
    return cache

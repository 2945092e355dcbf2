"""HiCache: the host tier (and the optional file tier) under the radix tree, for the CacheManager.

The tree core keeps the bookkeeping (which node has device slots, host slots or both; the
host page allocator); this module performs the copies the core asks for and decides when:

- match: `match_prefix_host` gives the device prefix and the host-only continuation
  (`req.host_hit_len`, `req.host_node`, `req.host_slots`; valid while the tree's version is).
- load (admission, PrefillAdder.add_one, with the device match locked): a host continuation
  of at least `LOAD_BACK_MIN_TOKENS` is loaded all-or-nothing: lock the host node, allocate
  device slots (evicting), copy host -> device, `load_back`; the request's match then ends at
  the host node, and the lock moves there. Shorter continuations are recomputed: a load costs
  two index copies per layer and an eviction round, while a few more tokens in a prefill
  that runs anyway cost next to nothing. Then, with a file tier, the storage pages that
  follow the match are read into fresh device slots and inserted as ordinary device KV.
- after each insert (`checkpoint`): write_through backs the path up at once (`backup(node,
  1)`), write_through_selective once a node was hit twice (`backup(node, 2)`), write_back
  never (device eviction copies instead: `evict_write_back`). The file tier gets the
  request's whole storage pages not yet written, at this time too (see file_storage.py):
  the core evicts host nodes internally and reports no tokens for them, so "when a page
  leaves the host" cannot be observed, and a page written early survives a crash too.

`NullTier` is the tier of a server without HiCache (plain device matching and eviction).
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import torch

from sglite.scheduler.req import Req

logger = logging.getLogger(__name__)

LOAD_BACK_MIN_TOKENS = 16
MIN_HITS = {"write_through": 1, "write_through_selective": 2}


class NullTier:
    """Device only: what the CacheManager does without HiCache."""

    enabled = False
    num_load_back_tokens = 0
    num_host_hit_tokens = 0
    num_storage_hit_tokens = 0

    def __init__(self, cache) -> None:
        self.cache = cache

    def match(self, req: Req, key: np.ndarray) -> tuple[np.ndarray, int]:
        req.host_hit_len, req.host_node, req.host_slots = 0, 0, None
        return self.cache.tree.match_prefix(key, req.extra_key)

    def evict(self, num_tokens: int) -> np.ndarray:
        return self.cache.tree.evict(num_tokens)

    def on_insert(self, req: Req, node: int, aligned: int) -> None:
        pass

    def load(self, req: Req) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def count_hits(self, req: Req, cached_len: int) -> None:
        """An admitted request's `cached_len` prompt tokens came from the cache: count the
        ones its admissions loaded from the host and file tiers (a load whose request was
        then refused by the budget and admitted later still counts for it)."""
        host = min(req.loaded_host_len, cached_len)
        self.num_host_hit_tokens += host
        self.num_storage_hit_tokens += min(req.loaded_storage_len, cached_len - host)
        req.loaded_host_len = req.loaded_storage_len = 0

    def hit_tokens(self, num_cached_tokens: int) -> dict[str, int]:
        """Prompt tokens served from the cache, by the tier they came from."""
        host, storage = self.num_host_hit_tokens, self.num_storage_hit_tokens
        return {
            "device_hit_tokens": max(num_cached_tokens - host - storage, 0),
            "host_hit_tokens": host,
            "storage_hit_tokens": storage,
        }

    def check_idle(self) -> None:
        pass

    def on_idle(self) -> None:
        pass


class HiCache(NullTier):
    enabled = True

    def __init__(self, cache, host_pool, write_policy: str, storage=None) -> None:
        super().__init__(cache)
        self.host_pool = host_pool
        self.write_policy = write_policy
        self.min_hits = MIN_HITS.get(write_policy)  # None: write_back
        self.storage = storage
        self.num_load_back_tokens = 0  # tokens copied host -> device
        self.num_storage_load_tokens = 0  # tokens read from the file tier
        self.num_host_hit_tokens = 0  # of admitted prompts (count_hits)
        self.num_storage_hit_tokens = 0
        self.num_backup_tokens = 0

    # ---------------------------------------------------------------- matching
    def match(self, req: Req, key: np.ndarray) -> tuple[np.ndarray, int]:
        slots, node, host_slots, host_node = self.cache.tree.match_prefix_host(key, req.extra_key)
        req.host_hit_len, req.host_node, req.host_slots = len(host_slots), host_node, host_slots
        return slots, node

    # ---------------------------------------------------------------- load back
    def load(self, req: Req) -> None:
        """Extend the request's (locked) device match from the host, then from storage."""
        if req.host_hit_len >= max(LOAD_BACK_MIN_TOKENS, self.cache.page_size):
            self._load_host(req)
        if self.storage is not None and req.host_hit_len == 0:
            self._load_storage(req)

    def _load_host(self, req: Req) -> None:
        cm, tree = self.cache, self.cache.tree
        n = req.host_hit_len
        tree.lock(req.host_node)  # the chain may not leave the host while it is copied
        cm.evict_for(n)
        slots = cm.allocator.alloc(n)
        if slots is None:  # all or nothing: recompute instead
            tree.unlock(req.host_node)
            return
        self.host_pool.load(req.host_slots, slots)
        tree.load_back(req.host_node, slots)
        tree.unlock(req.match_node)  # the host node's lock covers the old match too
        key = req.fill_slice(req.match_len, req.match_len + n)
        self._extend_match(req, key, slots, req.host_node)
        self.num_load_back_tokens += n
        req.loaded_host_len += n
        req.host_hit_len, req.host_slots = 0, None

    def _extend_match(self, req: Req, key: np.ndarray, slots: np.ndarray, node: int) -> None:
        cm = self.cache
        ps = cm.page_size
        parent = int(req.match_slots[req.match_len - ps]) if req.match_len else None
        cm.events.stored(key, slots, parent, req.extra_key)
        prev = req.match_slots if req.match_slots is not None else np.empty(0, np.int64)
        req.match_slots = np.concatenate([np.asarray(prev, np.int64), slots.astype(np.int64)])
        req.match_len += len(slots)
        req.match_node = node
        cm.version += 1
        req.match_version = (cm.version, req.match_limit)

    def _load_storage(self, req: Req) -> None:
        cm, st = self.cache, self.storage
        ps, sp = cm.page_size, st.page_len
        limit = req.match_limit // ps * ps
        first = req.match_len // sp
        hashes = self._hashes(req, limit)
        num_pages = st.lookup(hashes, first)
        end = min((first + num_pages) * sp, limit)
        n = end - req.match_len
        if n < max(LOAD_BACK_MIN_TOKENS, ps):
            return
        pages = []
        for h in hashes[first : first + num_pages]:
            page = st.get(h, self._page_specs())
            if page is None:
                break
            pages.append(page)
        end = min((first + len(pages)) * sp, limit)
        n = end - req.match_len
        if n < max(LOAD_BACK_MIN_TOKENS, ps):
            return
        cm.evict_for(n)
        slots = cm.allocator.alloc(n)
        if slots is None:
            return
        dev, skip = cm.kv_pool, req.match_len - first * sp
        idx = torch.as_tensor(slots, dtype=torch.int64).to(dev.device)
        for i, buf in enumerate(dev.buffers):  # the pool's buffers, in the pages' order
            rows = torch.cat([p[i] for p in pages])[skip : skip + n]
            buf.index_copy_(0, idx, rows.to(dev.device))
        prefix = req.match_slots if req.match_len else np.empty(0, np.int64)
        key = req.fill_slice(0, end)
        all_slots = np.concatenate([np.asarray(prefix, np.int64), slots.astype(np.int64)])
        cached_len, node = cm.tree.insert(key, all_slots, req.extra_key)
        if cached_len != req.match_len:  # the tree had more than matched: should not happen
            raise RuntimeError(
                f"storage load: the tree already held {cached_len} tokens, matched {req.match_len}"
            )
        cm.tree.lock(node)
        cm.tree.unlock(req.match_node)
        self._extend_match(req, key[req.match_len :], slots, node)
        self.num_storage_load_tokens += n
        req.loaded_storage_len += n

    def _page_specs(self) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """dtype and shape of each tensor of a storage page: a page of each pool buffer."""
        sp = self.storage.page_len
        return [(b.dtype, (sp, *b.shape[1:])) for b in self.cache.kv_pool.buffers]

    def _hashes(self, req: Req, end: int) -> list[str]:
        sp = self.storage.page_len
        have = req.storage_hashes
        if len(have) < end // sp:
            req.storage_hashes = self.storage.hashes(req.fill_slice(0, end), req.extra_key, have)
        return req.storage_hashes[: end // sp]

    # ---------------------------------------------------------------- writes
    def on_insert(self, req: Req, node: int, aligned: int) -> None:
        if self.min_hits is not None:
            src, dst = self.cache.tree.backup(node, self.min_hits)
            self.host_pool.backup(src, dst)
            self.num_backup_tokens += len(src)
        if self.storage is not None:
            self._store(req, aligned)

    def _store(self, req: Req, aligned: int) -> None:
        st, dev = self.storage, self.cache.kv_pool
        sp = st.page_len
        hashes = self._hashes(req, aligned)
        row = self.cache.table[req.row]
        for i, h in enumerate(hashes):
            if st.contains(h):
                continue
            idx = torch.as_tensor(row[i * sp : (i + 1) * sp].astype(np.int64)).to(dev.device)
            if not st.put(h, [b.index_select(0, idx).cpu() for b in dev.buffers]):
                break

    def evict(self, num_tokens: int) -> np.ndarray:
        tree = self.cache.tree
        if self.min_hits is not None:
            return tree.evict(num_tokens)
        freed, src, dst = tree.evict_write_back(num_tokens)
        self.host_pool.backup(src, dst)  # before anyone reuses the freed device slots
        self.num_backup_tokens += len(src)
        return freed

    # ---------------------------------------------------------------- checks and stats
    def stats(self) -> dict[str, float]:
        tree, hp = self.cache.tree, self.host_pool
        out = {
            "hicache_host_used_tokens": tree.host_used_size(),
            "hicache_host_total_tokens": tree.host_capacity(),
            "num_load_back_tokens": self.num_load_back_tokens,
            "num_storage_load_tokens": self.num_storage_load_tokens,
            "num_backup_tokens": self.num_backup_tokens,
            "hicache_bytes_to_host": hp.num_bytes_to_host,
            "hicache_bytes_to_device": hp.num_bytes_to_device,
        }
        if self.storage is not None:
            st = self.storage
            out["hicache_storage_written_pages"] = st.num_written_pages
            out["hicache_storage_dropped_pages"] = st.num_dropped_pages
            out["hicache_storage_read_pages"] = st.num_read_pages
            out["hicache_storage_bad_pages"] = st.num_bad_pages
            out["hicache_storage_failed_pages"] = st.num_failed_pages
        return out

    def check_idle(self) -> None:
        tree = self.cache.tree
        free, used, cap = tree.host_available_size(), tree.host_used_size(), tree.host_capacity()
        if free + used != cap:
            raise RuntimeError(f"host KV pool leak: free {free} + used {used} != capacity {cap}")

    def on_idle(self) -> None:
        if self.storage is not None:
            self.storage.flush()


def model_fingerprint(model_id: str, kv_pool) -> str:
    """What must be equal for two servers to share stored KV pages."""
    text = f"{model_id}|{kv_pool.layout.key(kv_pool.dtype)}"
    return hashlib.sha256(text.encode()).hexdigest()

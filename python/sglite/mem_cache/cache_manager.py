"""CacheManager: glue between the radix tree, the page allocator and the request-to-slot table.

Contract (who locks, who frees; see scheduler/req.py for the ownership of a row):
- `match(req)`: match the request's fill ids up to `req.match_limit` (one token is always
  computed, more for prompt log-probs); records match_len/match_node/match_slots on the
  request (and, with HiCache, host_hit_len/host_node), locks nothing.
- `load_back(req)` (admission, with `req.match_node` locked): HiCache extends the match from
  the host and file tiers (device slots allocated, KV copied, the lock moved to the new
  `match_node`); without HiCache it does nothing. The tier policy lives in `self.tier`
  (mem_cache/hicache.py): matching, eviction (write_back copies first), backups on insert.
- The tree changes only through this class (insert, evict, reset), each change bumps
  `version`, and a request whose match is as recent as the tree is not matched again.
- Admission locks `req.match_node` (the PrefillAdder does it while charging the candidate);
  `alloc_extend(entries)` then gives each request a row (if it has none), writes the matched
  prefix into the row and allocates the new positions page-continuing, evicting from the tree
  when the allocator runs short. It returns the new slots, or None (nothing changed).
- `checkpoint(req, up_to)`: after a prefill or chunk: insert fill[:up_to] into the tree, free
  our duplicate slots, rewrite the row to the tree's slots, move the lock to the new node.
  While a launched batch holds the request (`req.in_flight > 0`, the overlap loop) it may
  still read the duplicates (its copy of the row is older), and a load-back writes the
  slots it gets at once, not in batch order: so those frees wait in `req.stale_slots`
  until the batch is processed (`free_stale`, called by result processing and `release`).
- `release(req, insert=True)`: on finish, insert prompt + output (tokens with KV) and free
  the rest of the row; on retraction (insert=False) free everything the request owns.
- With the radix cache disabled nothing is ever matched or inserted.
- Every change of the tree's content is told to `events` (sglite.kv_events): the blocks an
  insert added, the slots an eviction freed, a flush.
Invariant at idle: free + evictable + protected == capacity (`check_idle`); with HiCache also
host free + used == host capacity (and the core's sanity check: each host slot has one owner).
"""

from __future__ import annotations

import numpy as np

from sglite.kv_events.recorder import NullKvEventRecorder
from sglite.mem_cache.hicache import NullTier
from sglite.scheduler.req import Req


class CacheManager:
    def __init__(
        self,
        tree,
        allocator,
        req_to_token_pool,
        page_size: int,
        enabled: bool = True,
        events: NullKvEventRecorder | None = None,
        kv_pool=None,
    ):
        self.tree = tree
        self.kv_pool = kv_pool
        self.tier = NullTier(self)  # HiCache replaces it (mem_cache/hicache.py)
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.page_size = page_size
        self.enabled = enabled
        self.events = events if events is not None else NullKvEventRecorder()
        self.num_evicted_tokens = 0
        self.version = 0  # bumped by every change of the tree's content or structure
        # The scheduler writes slots into a host table. On CPU it is the pool's own tensor
        # (shared memory); on a device it is a mirror whose rows travel with each batch.
        t = req_to_token_pool.req_to_token
        self.mirrored = not isinstance(t, np.ndarray) and t.device.type != "cpu"
        if self.mirrored:
            self.table = np.zeros(tuple(t.shape), dtype=np.int32)
        else:
            self.table = t if isinstance(t, np.ndarray) else t.numpy()

    # ---------------------------------------------------------------- matching
    def match(self, req: Req) -> int:
        if req.match_version == (self.version, req.match_limit):
            return req.match_len
        req.match_version = (self.version, req.match_limit)
        if not self.enabled:
            req.match_len, req.match_node, req.match_slots = 0, 0, None
            return 0
        slots, node = self.tier.match(req, req.fill_slice(0, req.match_limit))
        req.match_len, req.match_node, req.match_slots = len(slots), node, slots
        return len(slots)

    def load_back(self, req: Req) -> None:
        if self.enabled:
            self.tier.load(req)

    def lock(self, node: int) -> None:
        self.tree.lock(node)

    def unlock(self, node: int) -> None:
        self.tree.unlock(node)

    def available_and_evictable(self) -> int:
        return self.allocator.available_size() + self.tree.evictable_size()

    # ---------------------------------------------------------------- allocation
    def alloc_rows(self, reqs: list[Req]) -> bool:
        need = [r for r in reqs if r.row is None]
        if not need:
            return True
        rows = self.req_to_token_pool.alloc(len(need))
        if rows is None:
            return False
        for req, row in zip(need, rows):
            req.row = row
            # the matched prefix becomes tree-owned positions of the row
            n = req.match_len
            if n:
                self.table[row, :n] = req.match_slots
            req.cached_len = req.kv_len = req.alloc_len = n
            req.lock_node = req.match_node
        return True

    def alloc_extend(
        self, reqs: list[Req], starts: list[int], ends: list[int]
    ) -> np.ndarray | None:
        """Slots for positions [start, end) of each request (rows must exist)."""
        rows = np.fromiter((r.row for r in reqs), np.int64, len(reqs))
        start = np.asarray(starts, dtype=np.int64)
        end = np.asarray(ends, dtype=np.int64)
        last_locs = np.where(start > 0, self.table[rows, np.maximum(start - 1, 0)], -1)
        self.evict_for(int((end - start).sum()) + len(reqs) * self.page_size)
        slots = self.allocator.alloc_extend(start, end, last_locs)
        if slots is None:
            return None
        if bool(np.all(end - start == 1)):  # decode: one slot per row
            self.table[rows, start] = slots
        else:
            pos = 0
            for row, s, e in zip(rows.tolist(), starts, ends):
                self.table[row, s:e] = slots[pos : pos + e - s]
                pos += e - s
        for req, e in zip(reqs, ends):
            if e > req.alloc_len:
                req.alloc_len = e
        return slots

    def evict_for(self, num_tokens: int) -> None:
        short = num_tokens - self.allocator.available_size()
        if short > 0 and self.enabled:
            freed = self.tier.evict(short)
            if len(freed):
                self.version += 1
                self.num_evicted_tokens += len(freed)
                self.events.removed(freed)
                self.allocator.free(freed)

    def can_decode(self, reqs: list[Req]) -> bool:
        """Whether one more token for each request fits (evicting as needed)."""
        ps = self.page_size
        need = ps * sum(1 for r in reqs if r.alloc_len % ps == 0)
        self.evict_for(need)
        return self.allocator.available_size() >= need

    # ---------------------------------------------------------------- publishing
    def checkpoint(self, req: Req, up_to: int) -> None:
        if not self.enabled:
            return
        aligned = up_to // self.page_size * self.page_size
        if aligned <= req.cached_len:
            return
        key = req.fill_slice(0, aligned)
        row_slots = self.table[req.row, :aligned].astype(np.int64)
        cached_len, node = self.tree.insert(key, row_slots, req.extra_key)
        self.version += 1
        if cached_len > req.cached_len:
            # we computed [cached_len_before, cached_len) again: the tree keeps its copy
            duplicates = row_slots[req.cached_len : cached_len]
            if req.in_flight > 0:  # a launched batch may still read them (module doc)
                req.stale_slots.append(duplicates)
            else:
                self.allocator.free(duplicates)
            tree_slots, _ = self.tree.match_prefix(key[:cached_len], req.extra_key)
            self.table[req.row, req.cached_len : cached_len] = tree_slots[req.cached_len :]
        if cached_len < aligned:  # the row now holds the tree's slots up to cached_len
            parent = int(self.table[req.row, cached_len - self.page_size]) if cached_len else None
            self.events.stored(key[cached_len:], row_slots[cached_len:], parent, req.extra_key)
        self.tree.lock(node)
        if req.lock_node is not None:
            self.tree.unlock(req.lock_node)
        req.lock_node = node
        req.cached_len = aligned
        self.tier.on_insert(req, node, aligned)

    def free_stale(self, req: Req) -> None:
        """The duplicates `checkpoint` kept back: no launched batch reads them any more."""
        for slots in req.stale_slots:
            self.allocator.free(slots)
        req.stale_slots = []

    def release(self, req: Req, insert: bool) -> None:
        """Give back everything the request holds; with insert, publish its KV first.
        (Finishing releases once no launched batch holds the request; retraction at once,
        see scheduler.py's docstring for why that is safe.)"""
        if req.row is None:
            return
        if insert:
            self.checkpoint(req, min(req.kv_len, req.fill_len))
        self.free_stale(req)
        if req.alloc_len > req.cached_len:
            self.allocator.free(
                self.table[req.row, req.cached_len : req.alloc_len].astype(np.int64)
            )
        if req.lock_node is not None:
            self.tree.unlock(req.lock_node)
        self.req_to_token_pool.free([req.row])
        req.row = None
        req.lock_node = None
        req.cached_len = req.alloc_len = 0

    # ---------------------------------------------------------------- checks
    def kv_stats(self) -> dict[str, float]:
        cap = self.allocator.capacity()
        free = self.allocator.available_size()
        evictable = self.tree.evictable_size() if self.enabled else 0
        return {
            "kv_total_tokens": cap,
            "kv_free_tokens": free,
            "kv_evictable_tokens": evictable,
            "kv_used_tokens": cap - free - evictable,
            "kv_usage": (cap - free - evictable) / max(cap, 1),
            "num_evicted_tokens": self.num_evicted_tokens,
            **self.tier.stats(),
        }

    def held_tokens(self, running: list[Req]) -> int:
        ps = self.page_size
        held = 0
        for r in running:
            if r.row is not None and r.alloc_len > r.cached_len:
                pages = np.unique(self.table[r.row, r.cached_len : r.alloc_len] // ps)
                held += len(pages) * ps
            held += sum(len(np.unique(s // ps)) * ps for s in r.stale_slots)
        return held

    def check_conservation(self, running: list[Req]) -> None:
        free = self.allocator.available_size()
        evictable = self.tree.evictable_size() if self.enabled else 0
        protected = self.tree.protected_size() if self.enabled else 0
        held = self.held_tokens(running)
        capacity = self.allocator.capacity()
        if free + evictable + protected + held != capacity:
            raise RuntimeError(
                f"KV pool leak: free {free} + evictable {evictable} + protected {protected} + "
                f"held {held} != capacity {capacity}"
            )

    def check_idle(self) -> None:
        self.check_conservation([])
        if self.enabled:
            if self.tree.protected_size():
                raise RuntimeError(f"{self.tree.protected_size()} tokens still locked at idle")
            self.tree.sanity_check()
            self.tier.check_idle()
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            raise RuntimeError("request rows leaked at idle")

    def flush(self) -> None:
        """Drop the whole cache (only when idle)."""
        if self.enabled:
            freed = self.tree.evict(self.tree.evictable_size())
            if len(freed):
                self.allocator.free(freed)
            self.tree.reset()
            self.events.cleared()
            self.version += 1

"""KvEventRecorder: turns the cache manager's tree changes into block events (see wire.py).

Contract: the CacheManager calls `stored` after an insert added blocks to the tree, `removed`
with the slots an eviction freed, `cleared` when the tree is reset; the scheduler `take`s the
events once per step. Events are derived from what the tree returns (cached lengths, freed
slots), not from the tree's nodes, so both tree cores yield the same events.

A cached block is known by the KV slot of its first token: the tree holds whole pages, a slot
belongs to at most one tree position, and `evict` returns whole nodes' slots in key order, so
every page-th freed slot starts a removed block. The recorder keeps each cached block's
digest under that slot, to chain its children and to name it when it is removed.
"""

from __future__ import annotations

import numpy as np

from sglite.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    block_hash,
    chain_digests,
    namespace_seed,
)


class NullKvEventRecorder:
    """Records nothing (KV events off)."""

    def stored(
        self, tokens: np.ndarray, slots: np.ndarray, parent_slot: int | None, extra_key: str | None
    ) -> None:
        pass

    def removed(self, slots: np.ndarray) -> None:
        pass

    def cleared(self) -> None:
        pass

    def take(self) -> list[KvEvent]:
        return []


class KvEventRecorder(NullKvEventRecorder):
    def __init__(self, page_size: int):
        self.page_size = page_size
        self._digests: dict[int, bytes] = {}  # first slot of a cached block -> its digest
        self._events: list[KvEvent] = []

    @property
    def num_blocks(self) -> int:
        return len(self._digests)

    def stored(
        self, tokens: np.ndarray, slots: np.ndarray, parent_slot: int | None, extra_key: str | None
    ) -> None:
        """New blocks `tokens` (whole pages) at `slots`, after the cached block at
        `parent_slot` (None: they start at the root, in `extra_key`'s namespace)."""
        ps = self.page_size
        if parent_slot is None:
            prior, parent_hash = namespace_seed(extra_key), None
        else:
            prior = self._digests[parent_slot]
            parent_hash = block_hash(prior)
        digests = chain_digests(tokens, prior, ps)
        self._digests.update(zip(np.asarray(slots[::ps]).tolist(), digests))
        self._events.append(
            BlockStored([block_hash(d) for d in digests], parent_hash, tokens.tolist(), ps)
        )

    def removed(self, slots: np.ndarray) -> None:
        firsts = np.asarray(slots[:: self.page_size]).tolist()
        if firsts:
            self._events.append(BlockRemoved([block_hash(self._digests.pop(s)) for s in firsts]))

    def cleared(self) -> None:
        self._digests.clear()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

"""KV cache memory: the request->slot table and the per-layer K/V pools.

Names are re-exported lazily so that importing a torch-free sibling module stays cheap.
"""

from __future__ import annotations

__all__ = ["KVPool", "ReqToTokenPool", "kv_slots_for_budget"]


def __getattr__(name: str):
    if name in __all__:
        from sglite.mem_cache import memory_pool

        return getattr(memory_pool, name)
    raise AttributeError(f"module 'sglite.mem_cache' has no attribute {name!r}")

"""KV-cache events for cache-aware routers: which KV blocks this engine holds, as a stream.

`--kv-events-config` (SGLang's flag, a JSON object; see config.py) turns it on. The cache
manager's recorder derives BlockStored / BlockRemoved / AllBlocksCleared events from the radix
cache's inserts, evictions and flushes (recorder.py); the scheduler publishes them as one
batch per step (publisher.py) in vLLM's and SGLang's wire format (wire.py). Off, both are
null implementations and nothing is recorded.
"""

from __future__ import annotations

from sglite.kv_events.config import KvEventsConfig, parse_kv_events_config
from sglite.kv_events.publisher import NullEventPublisher, ZmqEventPublisher
from sglite.kv_events.recorder import KvEventRecorder, NullKvEventRecorder

__all__ = [
    "KvEventsConfig",
    "parse_kv_events_config",
    "create",
]


def create(
    config: KvEventsConfig, page_size: int, dp_rank: int = 0
) -> tuple[NullKvEventRecorder, NullEventPublisher]:
    """The recorder for the cache manager and the publisher for the scheduler."""
    if not config.enabled:
        return NullKvEventRecorder(), NullEventPublisher()
    return KvEventRecorder(page_size), ZmqEventPublisher(config, dp_rank)

"""KvEventsConfig: the parsed, validated `--kv-events-config` JSON (SGLang's keys and defaults)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

PUBLISHERS = ("null", "zmq")
SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KvEventsConfig:
    publisher: str = "null"  # "zmq" publishes; "null" records nothing
    endpoint: str = "tcp://*:5557"  # PUB socket: bound when it has * or :: or is ipc/inproc
    replay_endpoint: str | None = None  # ROUTER socket (always bound) answering replays
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark: beyond it a slow subscriber loses batches
    max_queue_size: int = 100_000  # batches waiting for the sender thread; beyond, dropped
    topic: str = ""  # first frame of every message (SUB sockets filter on it)

    @property
    def enabled(self) -> bool:
        return self.publisher != "null"


_TYPES = {
    "publisher": (str,),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}


def parse_kv_events_config(text: str | None) -> KvEventsConfig:
    """Parse and check the JSON object; every error says which key is wrong and why."""
    if text is None or not text.strip():
        return KvEventsConfig()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"is not valid JSON ({e}); e.g. '{_EXAMPLE}'") from None
    if not isinstance(data, dict):
        raise ValueError(f"must be a JSON object, e.g. '{_EXAMPLE}'")
    known = [f.name for f in dataclasses.fields(KvEventsConfig)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    for key, value in data.items():
        types = _TYPES[key]
        if not isinstance(value, types) or isinstance(value, bool):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f"{key} must be {want}, got {json.dumps(value)}")
    cfg = KvEventsConfig(**data)
    if cfg.publisher not in PUBLISHERS:
        raise ValueError(f"publisher must be one of {', '.join(PUBLISHERS)}, got {cfg.publisher!r}")
    for key in ("endpoint", "replay_endpoint"):
        ep = getattr(cfg, key)
        if ep is not None and not ep.startswith(SCHEMES):
            raise ValueError(f"{key} must start with {', '.join(SCHEMES)}, got {ep!r}")
    if cfg.replay_endpoint is not None and cfg.replay_endpoint == cfg.endpoint:
        raise ValueError("replay_endpoint must differ from endpoint")
    for key in ("buffer_steps", "max_queue_size"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.hwm < 0:
        raise ValueError(f"hwm must be >= 0 (0: no limit), got {cfg.hwm}")
    return cfg


_EXAMPLE = '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'

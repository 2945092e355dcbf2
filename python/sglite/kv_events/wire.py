"""The KV-event wire format: event records, block hashes, and the msgpack codec of a batch.

The layout is the one vLLM and SGLang publish (msgspec structs with `array_like=True`, events
tagged by class name), so routers built for them (SGLang's router, Dynamo) read it unchanged:

    batch          = [ts, events, dp_rank]         ts: float seconds since the epoch
    BlockStored    = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                      lora_id, medium]
    BlockRemoved   = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

`block_hashes` are signed 64-bit ints; `parent_block_hash` is the hash of the block before the
first one (None when the chain starts at the root); `token_ids` is flat, `block_size` ids per
block in order; `lora_id` is always None; `medium` is "GPU" (the device KV pool, also on CPU).

A block is one page of `page_size` tokens of the radix cache. Its digest chains its parent's:

    digest(block) = SHA-256(prior || token ids as 4-byte little-endian unsigned ints)
    prior         = the parent block's digest (32 bytes); for the first block of a chain
                    nothing, or SHA-256(extra_key as UTF-8) when the request has a cache
                    namespace (extra_key); equal tokens in two namespaces never share a hash
    block hash    = the first 8 bytes of the digest, big-endian, as a signed int64

Without a namespace this is SGLang's page hash, so a router can hash a prompt's pages itself.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

MEDIUM_GPU = "GPU"


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> list[Any]:
        return [
            "BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids,
            self.block_size, self.lora_id, self.medium,
        ]  # fmt: skip


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, self.medium]


@dataclass
class AllBlocksCleared:
    def to_wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KvEventBatch:
    ts: float
    events: list[KvEvent]
    dp_rank: int | None = None


# ---------------------------------------------------------------- hashing
def namespace_seed(extra_key: str | None) -> bytes | None:
    """The prior of a chain's first block: none without a namespace ("" is none)."""
    return hashlib.sha256(extra_key.encode()).digest() if extra_key else None


def chain_digests(tokens: np.ndarray, prior: bytes | None, page_size: int) -> list[bytes]:
    """Digests of the consecutive blocks of `tokens` (a whole number of pages) after `prior`."""
    raw = np.asarray(tokens, dtype="<u4").tobytes()
    step = 4 * page_size
    digests = []
    for start in range(0, len(raw), step):
        h = hashlib.sha256(prior) if prior is not None else hashlib.sha256()
        h.update(raw[start : start + step])
        prior = h.digest()
        digests.append(prior)
    return digests


def block_hash(digest: bytes) -> int:
    """The published hash of a block: its digest's first 8 bytes as a big-endian int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


# ---------------------------------------------------------------- codec
def encode_batch(batch: KvEventBatch) -> bytes:
    body: list[Any] = [batch.ts, [e.to_wire() for e in batch.events]]
    if batch.dp_rank is not None:
        body.append(batch.dp_rank)
    return msgpack.packb(body, use_bin_type=True)


def decode_batch(payload: bytes) -> KvEventBatch:
    """The inverse of encode_batch (for subscribers and tests); unknown tags raise ValueError."""
    body = msgpack.unpackb(payload, raw=False)
    events: list[KvEvent] = []
    for item in body[1]:
        tag, fields = item[0], item[1:]
        if tag == "BlockStored":
            events.append(BlockStored(*fields[:6]))
        elif tag == "BlockRemoved":
            events.append(BlockRemoved(*fields[:2]))
        elif tag == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event tag {tag!r}")
    return KvEventBatch(body[0], events, body[2] if len(body) > 2 else None)

"""Load-balancing policies of the data-parallel dispatcher: which replica gets a request.

Pure logic, no sockets (the dispatcher in server/dp_dispatcher.py owns those). A policy
sees each request's prompt token ids and the dispatcher's own count of in-flight requests
per replica (routed, not yet finished: no round trip to the schedulers), and answers a
replica index. Chosen by name through `LOAD_BALANCE_METHODS` (`--load-balance-method`):

    round_robin     replica 0, 1, ..., N-1, 0, ... (SGLang's default)
    shortest_queue  the replica with the fewest in-flight requests (ties: the lowest index)
    cache_aware     prefix affinity: the replica whose prefix cache most likely holds the
                    longest prefix of this prompt, unless it is overloaded (see CacheAware)

Contract: `choose(input_ids, loads)` is called once per request, in arrival order, and may
update the policy's state (a cursor, the prefix index) as if the request were sent to the
answer; `loads[i]` is replica i's in-flight count before this request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

PREFIX_BLOCK_LEN = 16  # tokens per hashed prefix block (the cache-aware routing unit)
IMBALANCE_LIMIT = 16  # in-flight requests by which a cache hit may exceed the least loaded
DEFAULT_INDEX_BLOCKS = 1 << 16  # per replica, when its KV capacity is unknown


class LoadBalancer:
    """Picks a replica for each request (see the module docstring for the contract)."""

    def __init__(self, num_replicas: int, kv_capacity: int | None = None):
        if num_replicas < 1:
            raise ValueError(f"need at least one replica, got {num_replicas}")
        self.num_replicas = num_replicas

    def choose(self, input_ids: Sequence[int], loads: Sequence[int]) -> int:
        raise NotImplementedError


class RoundRobin(LoadBalancer):
    def __init__(self, num_replicas: int, kv_capacity: int | None = None):
        super().__init__(num_replicas)
        self._next = 0

    def choose(self, input_ids: Sequence[int], loads: Sequence[int]) -> int:
        idx = self._next
        self._next = (idx + 1) % self.num_replicas
        return idx


class ShortestQueue(LoadBalancer):
    def choose(self, input_ids: Sequence[int], loads: Sequence[int]) -> int:
        return least_loaded(loads)


def least_loaded(loads: Sequence[int]) -> int:
    return min(range(len(loads)), key=lambda i: (loads[i], i))


def prefix_block_hashes(input_ids: Sequence[int], block_len: int = PREFIX_BLOCK_LEN) -> list[int]:
    """One hash per whole block of the prompt, each chained to all blocks before it, so
    equal hashes at position j mean equal prompts up to the end of block j (barring
    collisions, which only cost a worse routing choice). A partial last block is skipped."""
    out: list[int] = []
    h = 0
    for end in range(block_len, len(input_ids) + 1, block_len):
        h = hash((h, tuple(input_ids[end - block_len : end])))
        out.append(h)
    return out


class PrefixIndex:
    """An approximate picture of one replica's prefix cache: the chained block hashes of the
    prompts routed to it, least recently used first, at most `capacity` blocks (the
    replica's KV capacity in blocks, so it forgets about as fast as an LRU cache evicts)."""

    def __init__(self, capacity: int):
        self.capacity = max(capacity, 1)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match_len(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the index holds."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class CacheAware(LoadBalancer):
    """Prefix affinity. The prompt is cut into blocks of PREFIX_BLOCK_LEN tokens with
    chained hashes; each replica has a PrefixIndex of the blocks routed to it. The request
    goes to the replica holding the longest run of its leading blocks, so prompts sharing a
    system prompt or a few-shot preamble meet their cached KV, unless that replica has more
    than IMBALANCE_LIMIT in-flight requests over the least loaded one (affinity must not
    pile everything on one replica). No match (or a prompt shorter than one block): the
    least loaded replica, and among equally loaded ones the one whose index holds the fewest
    blocks, so distinct prefixes spread over the replicas even when the server is idle. The
    chosen replica's index then learns the prompt's blocks."""

    def __init__(self, num_replicas: int, kv_capacity: int | None = None):
        super().__init__(num_replicas)
        blocks = kv_capacity // PREFIX_BLOCK_LEN if kv_capacity else DEFAULT_INDEX_BLOCKS
        self.indexes = [PrefixIndex(blocks) for _ in range(num_replicas)]

    def choose(self, input_ids: Sequence[int], loads: Sequence[int]) -> int:
        hashes = prefix_block_hashes(input_ids)
        idx = min(range(self.num_replicas), key=lambda i: (loads[i], len(self.indexes[i]), i))
        if hashes:
            matched = [index.match_len(hashes) for index in self.indexes]
            best = max(range(self.num_replicas), key=lambda i: (matched[i], -loads[i], -i))
            if matched[best] > 0 and loads[best] - loads[idx] <= IMBALANCE_LIMIT:
                idx = best
            self.indexes[idx].insert(hashes)
        return idx


LOAD_BALANCE_METHODS: dict[str, type[LoadBalancer]] = {
    "round_robin": RoundRobin,
    "shortest_queue": ShortestQueue,
    "cache_aware": CacheAware,
}


def create_load_balancer(
    method: str, num_replicas: int, kv_capacity: int | None = None
) -> LoadBalancer:
    try:
        cls = LOAD_BALANCE_METHODS[method]
    except KeyError:
        raise ValueError(
            f"--load-balance-method must be one of {', '.join(LOAD_BALANCE_METHODS)}, "
            f"got {method!r}"
        ) from None
    return cls(num_replicas, kv_capacity)

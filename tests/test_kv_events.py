"""KV-cache events: config, wire layout, block hashes, and a router's view of the radix cache.

A subscriber (tests/fixtures/kv_subscriber.py) rebuilds the set of cached blocks from the
published batches; after random workloads on an in-process scheduler (inserts, evictions in a
small pool, namespaces, a flush) it must equal the tree's content, computed independently:
every request's sequence matched against the tree, its cached pages hashed by the spec. Both
tree cores must publish the same events.
"""

from __future__ import annotations

import json
import random
import tempfile

import msgpack
import numpy as np
import pytest

from fixtures.backends import load_backend
from fixtures.kv_subscriber import KvSubscriber, apply_events, spec_hashes
from fixtures.sched import Harness
from sglite.config import ServerArgs
from sglite.kv_events import create, parse_kv_events_config
from sglite.kv_events.publisher import NullEventPublisher, endpoint_for_rank
from sglite.kv_events.recorder import KvEventRecorder, NullKvEventRecorder
from sglite.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    block_hash,
    chain_digests,
    decode_batch,
    encode_batch,
    namespace_seed,
)
from sglite.messages import FlushCacheReq, GenerateReq
from sglite.sampling_params import SamplingParams


# ---------------------------------------------------------------- config
def test_config_defaults_off_and_sglang_keys():
    assert not parse_kv_events_config(None).enabled
    assert not ServerArgs().kv_events.enabled
    cfg = parse_kv_events_config(
        '{"publisher": "zmq", "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001", '
        '"topic": "kv", "buffer_steps": 5, "hwm": 10, "max_queue_size": 7}'
    )
    assert cfg.enabled and cfg.endpoint == "tcp://*:6000" and cfg.topic == "kv"
    assert (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size) == (5, 10, 7)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{nope", "not valid JSON"),
        ('["zmq"]', "must be a JSON object"),
        ('{"publisher": "zmq", "port": 1}', "unknown key(s) port"),
        ('{"publisher": "kafka"}', "publisher must be one of null, zmq"),
        ('{"endpoint": "http://x:1"}', "endpoint must start with tcp://"),
        ('{"endpoint": "tcp://*:1", "replay_endpoint": "tcp://*:1"}', "must differ"),
        ('{"buffer_steps": 0}', "buffer_steps must be >= 1"),
        ('{"hwm": "many"}', "hwm must be int"),
        ('{"topic": null}', "topic must be str"),
    ],
)
def test_config_errors_name_the_flag_and_the_key(text, message):
    with pytest.raises(ValueError) as e:
        ServerArgs(kv_events_config=text)
    assert str(e.value).startswith("--kv-events-config: ") and message in str(e.value)


def test_disabled_is_a_null_recorder_and_publisher():
    recorder, publisher = create(parse_kv_events_config(None), page_size=4)
    assert type(recorder) is NullKvEventRecorder and type(publisher) is NullEventPublisher
    recorder.stored(np.arange(4), np.arange(4), None, None)
    assert recorder.take() == []


def test_endpoint_for_rank():
    assert endpoint_for_rank("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for_rank("tcp://*:5557", 2) == "tcp://*:5559"
    assert endpoint_for_rank("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


# ---------------------------------------------------------------- wire
def test_batch_layout_is_vllm_and_sglang_array_like():
    batch = KvEventBatch(
        12.5,
        [
            BlockStored([1, -2], None, [5, 6, 7, 8], 2),
            BlockStored([3], -2, [9, 10], 2),
            BlockRemoved([1, -2, 3]),
            AllBlocksCleared(),
        ],
        dp_rank=0,
    )
    payload = encode_batch(batch)
    assert msgpack.unpackb(payload) == [
        12.5,
        [
            ["BlockStored", [1, -2], None, [5, 6, 7, 8], 2, None, "GPU"],
            ["BlockStored", [3], -2, [9, 10], 2, None, "GPU"],
            ["BlockRemoved", [1, -2, 3], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    assert decode_batch(payload) == batch
    big = [2**63 - 1, -(2**63)]  # int64 extremes survive msgpack
    assert decode_batch(encode_batch(KvEventBatch(0.0, [BlockRemoved(big)]))).events[0] == (
        BlockRemoved(big)
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_block_hash_follows_the_spec(page_size):
    rng = random.Random(page_size)
    tokens = [rng.randrange(0, 2**32) for _ in range(6 * page_size)]
    for ns in (None, "lora-a"):
        digests = chain_digests(np.asarray(tokens), namespace_seed(ns), page_size)
        assert [block_hash(d) for d in digests] == spec_hashes(tokens, page_size, ns)
    assert spec_hashes(tokens, page_size, "a") != spec_hashes(tokens, page_size, "b")
    assert spec_hashes(tokens, page_size, "") == spec_hashes(tokens, page_size, None)
    # chained: a block's hash depends on its whole prefix
    other = [tokens[0] ^ 1, *tokens[1:]]
    assert spec_hashes(other, page_size)[-1] != spec_hashes(tokens, page_size)[-1]


def test_recorder_chains_stores_and_names_removed_blocks():
    rec = KvEventRecorder(page_size=2)
    rec.stored(np.array([1, 2, 3, 4]), np.array([10, 11, 20, 21]), None, None)
    rec.stored(np.array([5, 6]), np.array([30, 31]), 20, None)  # after block (3, 4)
    h = spec_hashes([1, 2, 3, 4, 5, 6], 2)
    assert rec.take() == [
        BlockStored(h[:2], None, [1, 2, 3, 4], 2),
        BlockStored([h[2]], h[1], [5, 6], 2),
    ]
    rec.removed(np.array([30, 31, 20, 21]))  # a leaf, then its parent
    assert rec.take() == [BlockRemoved([h[2], h[1]])] and rec.num_blocks == 1
    rec.cleared()
    assert rec.take() == [AllBlocksCleared()] and rec.num_blocks == 0


# ---------------------------------------------------------------- scheduler workloads
def endpoints() -> dict:
    d = tempfile.mkdtemp(prefix="kv")
    return {"publisher": "zmq", "endpoint": f"ipc://{d}/pub", "replay_endpoint": f"ipc://{d}/rep"}


class Recording(NullEventPublisher):
    def __init__(self):
        self.batches: list[list] = []

    def publish(self, events) -> None:
        if events:
            self.batches.append([e.to_wire() for e in events])


def make_harness(core, page_size: int, seed: int, kv_cfg: dict | None) -> Harness:
    rng = random.Random(seed)
    return Harness(
        core,
        total_tokens=64 * page_size if page_size > 1 else 160,  # small: it evicts
        rows=8,
        context_length=512,
        page_size=page_size,
        disable_overlap_schedule=rng.random() < 0.5,
        chunked_prefill_size=rng.choice([-1, 8 * page_size]),
        radix_eviction_policy=rng.choice(["lru", "lfu", "fifo"]),
        kv_events_config=json.dumps(kv_cfg) if kv_cfg else None,
    )


def submit_round(h: Harness, rng: random.Random, tag: str) -> dict[str, tuple[list, str | None]]:
    """Requests sharing system prompts, in two namespaces and none; returns rid -> (prompt, ns)."""
    systems = [[rng.randrange(3, 900) for _ in range(rng.randrange(4, 40))] for _ in range(3)]
    sent = {}
    for i in range(rng.randrange(10, 24)):
        prompt = rng.choice(systems) + [rng.randrange(3, 900) for _ in range(rng.randrange(1, 30))]
        ns = rng.choice([None, None, "", "ns-a", "ns-b"])
        sp = SamplingParams(max_new_tokens=rng.choice([1, 4, 16]))
        rid = f"{tag}-{i}"
        h.sched.add_request(GenerateReq(rid, prompt, sp, extra_key=ns))
        sent[rid] = (prompt, ns)
    h.run()
    return sent


def tree_blocks(h: Harness, sent: dict[str, tuple[list, str | None]]) -> set[int]:
    """The tree's page-aligned blocks: every request's sequence matched and hashed by the spec
    (every node's path is a prefix of some request's prompt + output)."""
    ps = h.args.page_size
    results = h.results()
    want: set[int] = set()
    for rid, (prompt, ns) in sent.items():
        seq = prompt + results[rid]["ids"]
        slots, _ = h.sched.cache.tree.match_prefix(np.asarray(seq, dtype=np.int64), ns)
        want.update(spec_hashes(seq[: len(slots)], ps, ns))
    return want


def flush(h: Harness) -> None:
    h.sched.handle_messages([FlushCacheReq()])  # as the event loop: messages, then a step
    assert h.control.pop().success
    h.sched.step()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_subscriber_rebuilds_the_tree(core, page_size, seed):
    cfg = endpoints()
    h = make_harness(core, page_size, seed, cfg)
    sub = KvSubscriber(cfg["endpoint"], cfg["replay_endpoint"])
    publisher = h.sched.kv_publisher
    rng = random.Random(seed)
    try:
        sent = submit_round(h, rng, "a")
        assert h.sched.cache.num_evicted_tokens > 0, "the workload should evict"
        sub.sync(publisher.num_published - 1)
        assert sub.blocks() == tree_blocks(h, sent) != set()
        assert h.sched.cache.events.num_blocks == len(sub.blocks())

        flush(h)
        sub.sync(publisher.num_published - 1)
        assert sub.blocks() == set()
        sent = submit_round(h, rng, "b")
        sub.sync(publisher.num_published - 1)
        assert sub.blocks() == tree_blocks(h, sent) != set()
    finally:
        publisher.shutdown()
        sub.close()


def test_late_subscriber_catches_up_by_replay(core):
    cfg = endpoints()
    h = make_harness(core, 4, 2, cfg)
    publisher = h.sched.kv_publisher
    try:
        sent = submit_round(h, random.Random(2), "a")
        sub = KvSubscriber(cfg["endpoint"], cfg["replay_endpoint"])
        try:
            sub.sync(publisher.num_published - 1, live_wait_s=0)  # nothing live: all replayed
            assert sub.num_replayed == publisher.num_published
            assert sub.blocks() == tree_blocks(h, sent)
            assert sub.replay(publisher.num_published) == []  # nothing newer: just the end mark
        finally:
            sub.close()
    finally:
        publisher.shutdown()


def test_replay_buffer_is_bounded(core):
    cfg = {**endpoints(), "buffer_steps": 3, "topic": "kv"}
    h = make_harness(core, 1, 3, cfg)
    publisher = h.sched.kv_publisher
    sub = KvSubscriber(cfg["endpoint"], cfg["replay_endpoint"], topic="kv")
    try:
        submit_round(h, random.Random(3), "a")
        n = publisher.num_published
        assert n > 3
        assert sub.replay(0) == [n - 3, n - 2, n - 1]
    finally:
        publisher.shutdown()
        sub.close()


def test_both_tree_cores_publish_the_same_events():
    streams = []
    for name in ("python", "rust"):
        core = load_backend(name)
        h = make_harness(core, 4, 5, None)
        h.sched.cache.events = KvEventRecorder(4)
        h.sched.kv_publisher = recording = Recording()
        rng = random.Random(5)
        submit_round(h, rng, "a")
        flush(h)
        submit_round(h, rng, "b")
        streams.append(recording.batches)
    assert streams[0] == streams[1]
    tags = {ev[0] for batch in streams[0] for ev in batch}
    assert tags == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


class RecordingHarness(Harness):
    """A scheduler-fuzz harness whose cache records events into a Recording publisher."""

    made: list[Harness] = []

    def __init__(self, core, **kw):
        super().__init__(core, **kw)
        self.sched.cache.events = KvEventRecorder(self.args.page_size)
        self.sched.kv_publisher = Recording()
        RecordingHarness.made.append(self)


@pytest.mark.parametrize("seed", range(10))
def test_events_follow_the_scheduler_fuzz(core, seed, monkeypatch):
    """Under the fuzz's configurations (retraction, aborts, both loops, chunking, a mirrored
    table), every event is consistent with those before it and the blocks left are the tree's."""
    import test_scheduler_fuzz as fuzz

    monkeypatch.setattr(fuzz, "Harness", RecordingHarness)
    RecordingHarness.made = []
    fuzz.run_case(core, seed)
    h = RecordingHarness.made[0]  # the case's own harness (the others run requests alone)
    held = apply_events(h.sched.kv_publisher.batches)
    assert len(held) * h.args.page_size == h.sched.cache.tree.total_size()
    assert h.sched.cache.events.num_blocks == len(held)

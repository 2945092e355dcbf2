"""Event publishers: where the scheduler's per-step event batches go (ZMQ PUB, or nowhere).

Contract: `publish(events)` is called once per scheduler step from the scheduler thread and
never blocks it; an empty list publishes nothing. `shutdown()` is idempotent.

ZMQ wire protocol (as vLLM and SGLang):
- PUB socket, one message per batch, three frames: topic (UTF-8), sequence number (8 bytes,
  big-endian; 0, 1, 2, ... per publisher), payload (msgpack, see wire.py).
- Replay (ROUTER socket, optional): a client (DEALER) sends [b"", start_seq (8 bytes
  big-endian)]; it gets [b"", seq, payload] for each batch still buffered (the last
  `buffer_steps`) with seq >= start_seq, in order, then [b"", -1 (8 bytes, signed), b""].
  A sequence gap that replay cannot fill means batches were lost (a full queue or buffer).

The scheduler thread encodes a batch, numbers it and hands it (non-blocking) over an inproc
pipe to a sender thread, which owns the PUB and ROUTER sockets: it sends, keeps the replay
buffer and answers replays even while the scheduler is idle or blocked on its inbox.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import zmq

from sglite.kv_events.config import KvEventsConfig
from sglite.kv_events.wire import KvEvent, KvEventBatch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = b"stop"


class NullEventPublisher:
    """Publishes nothing (KV events off)."""

    num_published = 0

    def publish(self, events: list[KvEvent]) -> None:
        pass

    def shutdown(self) -> None:
        pass


def endpoint_for_rank(endpoint: str | None, dp_rank: int) -> str | None:
    """A data-parallel rank's endpoint: tcp ports offset by the rank, inproc/ipc suffixed."""
    if endpoint is None or dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


def _should_bind(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher(NullEventPublisher):
    def __init__(self, config: KvEventsConfig, dp_rank: int = 0):
        self.dp_rank = dp_rank
        self.endpoint = endpoint_for_rank(config.endpoint, dp_rank)
        self.replay_endpoint = endpoint_for_rank(config.replay_endpoint, dp_rank)
        self.num_published = 0  # batches numbered so far (the next sequence number)
        self.num_dropped = 0
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            assert self.endpoint is not None
            if _should_bind(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            where = " and ".join(ep for ep in (self.endpoint, self.replay_endpoint) if ep)
            raise RuntimeError(
                f"--kv-events-config: cannot open {where} ({e}); choose free addresses"
            ) from None
        pipe = f"inproc://kv-events-{id(self)}"
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.bind(pipe)
        self._outbox = self._ctx.socket(zmq.PUSH)
        self._outbox.set_hwm(config.max_queue_size)
        self._outbox.connect(pipe)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- scheduler thread
    def publish(self, events: list[KvEvent]) -> None:
        if not events or self._closed:
            return
        payload = encode_batch(KvEventBatch(time.time(), events, self.dp_rank))
        seq = self.num_published.to_bytes(8, "big")
        self.num_published += 1
        try:
            self._outbox.send_multipart([seq, payload], zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning(
                    "KV events: the sender is %d batches behind; dropped %d batches so far",
                    self._outbox.get_hwm(), self.num_dropped,
                )  # fmt: skip

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._outbox.send(_STOP, zmq.NOBLOCK)
        except zmq.Again:
            pass
        self._thread.join(timeout=2.0)
        self._outbox.close(linger=0)
        if self._thread.is_alive():
            logger.warning("KV events: the sender thread did not stop; closing its sockets")
            self._ctx.destroy(linger=0)
        else:
            self._ctx.term()

    # ---------------------------------------------------------------- sender thread
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                # batches first: a replay asked after a publish() then covers that batch
                if not self._send_queued():
                    return
                if self._replay is not None and self._replay in ready:
                    self._answer_replay()
        except zmq.ZMQError as e:  # the context was destroyed under us at shutdown
            if e.errno != zmq.ETERM:
                logger.exception("KV events: the sender thread failed")
        finally:
            self._pub.close(linger=500)  # give the last batches half a second to leave
            self._inbox.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send_queued(self) -> bool:
        """Send every batch waiting in the pipe; False once the stop message came."""
        while True:
            try:
                frames = self._inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if frames == [_STOP]:
                return False
            seq, payload = frames
            self._pub.send_multipart([self._topic, seq, payload])  # drops at HWM
            self._buffer.append((int.from_bytes(seq, "big"), seq, payload))

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning(
                "KV events: ignoring a malformed replay request (%d frames)", len(frames)
            )
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq_int, seq, payload in self._buffer:
            if seq_int >= start_seq:
                self._replay.send_multipart([client, b"", seq, payload])
        self._replay.send_multipart([client, b"", END_SEQ, b""])

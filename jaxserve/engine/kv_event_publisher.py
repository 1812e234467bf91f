"""KV-cache events over ZeroMQ, in vLLM's wire format (`vllm/distributed/kv_events.py`), so that
llm-d's KV-cache manager or any subscriber written for vLLM reads jaxserve's.

Each step's events (`core/kv_events.py`, taken from the block pool after the step) become one
batch: a msgpack `[ts, events, data_parallel_rank]` (the rank left out when None), sent as three
frames: the topic, an 8-byte big-endian sequence number (from 0), the payload. Events are msgpack
maps tagged with their type (`{"type": "BlockStored", "block_hashes": ..., ...}`, newer vLLM) or,
with `wire: "array"`, arrays whose first element is the type (older vLLM). Block hashes go out as
vLLM sends them by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, what llm-d's indexer decodes):
the low 64 bits of the pool's chained hash as an unsigned int; with that variable set to 0, the
whole digest as bytes (16 for xxh3-128, 32 for sha256).

Replay: a ROUTER socket at `replay_endpoint` answers a request frame holding an 8-byte start
sequence number with every buffered batch from there (`[identity, b"", seq, payload]` each),
then `[identity, b"", -1 as 8 signed bytes, b""]`: a subscriber that joined late or missed
sequence numbers catches up.

Sending runs on its own thread: the engine's step only queues a batch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections import deque

import msgspec

from jaxserve.config import KVEventsConfig
from jaxserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def int_block_hashes() -> bool:
    return os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip().lower() not in ("0", "false")


def external_hash(h: int | None, as_int: bool = True, hash_bytes: int = 16) -> int | bytes | None:
    """A pool hash as the events carry it (vLLM's `maybe_convert_block_hash`): the low 64 bits,
    or the digest's `hash_bytes` bytes (16 for xxh3-128, 32 for sha256)."""
    if h is None:
        return None
    return h & ((1 << 64) - 1) if as_int else h.to_bytes(hash_bytes, "big")


def wire_event(event: KVEvent, form: str = "map", as_int: bool = True, hash_bytes: int = 16):
    """One event as vLLM encodes it: a tagged map (newer vLLM) or a tagged array (older)."""
    def ext(h):
        return external_hash(h, as_int, hash_bytes)
    if isinstance(event, BlockStored):
        fields = {"block_hashes": [ext(h) for h in event.block_hashes],
                  "parent_block_hash": ext(event.parent_block_hash),
                  "token_ids": list(event.token_ids), "block_size": event.block_size,
                  "lora_id": event.lora_id, "medium": event.medium, "lora_name": event.lora_name}
        tag = "BlockStored"
    elif isinstance(event, BlockRemoved):
        fields = {"block_hashes": [ext(h) for h in event.block_hashes], "medium": event.medium}
        tag = "BlockRemoved"
    elif isinstance(event, AllBlocksCleared):
        fields, tag = {}, "AllBlocksCleared"
    else:
        raise TypeError(f"not a KV-cache event: {event!r}")
    if form == "array":
        return [tag, *fields.values()]
    return {"type": tag, **fields}


def encode_batch(events: list[KVEvent], ts: float, data_parallel_rank: int | None = None,
                 form: str = "map", as_int: bool = True, hash_bytes: int = 16) -> bytes:
    batch = [ts, [wire_event(e, form, as_int, hash_bytes) for e in events]]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    return msgspec.msgpack.encode(batch)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """`publish(events)` queues one step's events; a thread sends them and answers replays."""

    POLL_S = 0.05

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None,
                 hash_bytes: int = 16):
        """hash_bytes: the block hashes' digest size (`BlockHasher.digest_bytes`)."""
        import zmq
        self.config, self.rank, self.hash_bytes = config, data_parallel_rank, hash_bytes
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close()
            field = "replay_endpoint" if self._replay is not None else "endpoint"
            raise ValueError(f"kv_events_config.{field}: cannot open "
                             f"{getattr(config, field)!r}: {e}") from None
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._seq = 0
        self._dropped = 0
        self._as_int = int_block_hashes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxserve-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV-cache events: publishing on %s%s", config.endpoint,
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                logger.warning("KV-cache events: %d batches dropped (the sending thread is behind; "
                               "raise kv_events_config.max_queue_size)", self._dropped)

    def _run(self) -> None:
        import zmq
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set() or not self._queue.empty():
            try:
                ts, events = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                pass
            else:
                payload = encode_batch(events, ts, self.rank, self.config.wire, self._as_int,
                                       self.hash_bytes)
                seq = self._seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload))
                self._buffer.append((self._seq, payload))
                self._seq += 1
            if self._replay is not None and dict(poller.poll(0)).get(self._replay):
                self._answer_replay()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV-cache events: a replay request of %d frames was ignored "
                           "(expected identity, empty frame, 8-byte start sequence)", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        self._stop.set()
        self._thread.join(timeout)
        self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule for data-parallel replicas: rank r publishes on a TCP endpoint's port + r
    ("tcp://*:5557" -> "tcp://*:5558" for rank 1), an ipc/inproc endpoint gets "_dp{r}"."""
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def make_publisher(config: KVEventsConfig, data_parallel_rank: int | None = None,
                   hash_bytes: int = 16):
    """The publisher `config` asks for, or None (events off, or publisher "null"). A
    data-parallel replica (rank not None) publishes on its rank's endpoints and tags its batches
    with the rank."""
    if not config.publishes:
        return None
    if data_parallel_rank is not None:
        config = dataclasses.replace(
            config, endpoint=offset_endpoint_port(config.endpoint, data_parallel_rank),
            replay_endpoint=offset_endpoint_port(config.replay_endpoint, data_parallel_rank))
    return ZmqEventPublisher(config, data_parallel_rank, hash_bytes)

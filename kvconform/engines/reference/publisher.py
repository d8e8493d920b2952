"""KV events in vLLM's ZMQ wire format: PUB (topic, 8-byte seq, msgpack batch) + replay ROUTER.

Speaking the same format as vLLM lets one subscriber and one ledger serve both.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventPublisher:
    def __init__(
        self, endpoint: str | None, replay_endpoint: str | None, topic: str, faults: frozenset[str]
    ) -> None:
        self.faults = faults
        self.topic = topic.encode()
        self.seq = 0
        self.batches_sent = 0
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=10_000)
        self.lock = threading.Lock()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.pub = None
        self.replay = None
        self._closing = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if endpoint:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 1000)
            if "*" in endpoint:
                self.pub.bind(endpoint)
            else:
                self.pub.connect(endpoint)
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.bind(replay_endpoint)
            self._replay_thread = threading.Thread(
                target=self._serve_replay, daemon=True, name="event-replay"
            )
            self._replay_thread.start()

    def publish(self, events: list[dict[str, Any]]) -> None:
        if not events or self.pub is None:
            return
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.batches_sent += 1
            if "event_seq_gap" in self.faults and self.batches_sent % 5 == 0:
                return  # the sequence number is consumed, the batch is lost
            payload = msgpack.packb([time.time(), events, None], use_bin_type=True)
            seq_bytes = seq.to_bytes(8, "big")
            self.pub.send_multipart((self.topic, seq_bytes, payload))
            if "event_batch_resent" in self.faults and self.batches_sent % 5 == 0:
                self.pub.send_multipart((self.topic, seq_bytes, payload))  # a retry of a sent batch
            self.buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        # The replay socket lives and dies in this thread: ZMQ sockets are not thread-safe, and
        # closing it while this thread is blocked in it aborts the process (signaler.cpp assertion).
        assert self.replay is not None
        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                if dict(poller.poll(100)):
                    self._answer_replay()
        except (zmq.ZMQError, ValueError):
            return
        finally:
            self.replay.close(linger=0)

    def _answer_replay(self) -> None:
        assert self.replay is not None
        client, _, start = self.replay.recv_multipart(zmq.NOBLOCK)
        start_seq = int.from_bytes(start, "big")
        with self.lock:
            items = [item for item in self.buffer if item[0] >= start_seq]
        for seq, payload in items:
            self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        if self.pub is not None:
            self.pub.close(linger=500)
        if self._replay_thread is not None:
            self._closing.set()
            self._replay_thread.join(timeout=5)


def stored_event(hashes: list[str], parent: str | None, block_size: int, medium: str) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": [],
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def removed_event(hashes: list[str], medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def cleared_event() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}

"""Subscriber for KV events in vLLM's ZMQ wire format (also spoken by engines that mimic it).

Wire format: PUB multipart (topic, 8-byte big-endian sequence number, msgpack EventBatch),
EventBatch = [ts, [event, ...], dp_rank?], each event a map tagged with "type"
(BlockStored / BlockRemoved / AllBlocksCleared). The suite binds the SUB socket before the
engine starts, so the engine's publisher connects to us and no early event is missed; a
gap that remains is filled from the engine's replay socket before judging, so what is left
is the engine's own gap, not a transport loss.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import msgpack
import zmq

from kvconform.events import EventLedger, KvEvent, hash_text

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def decode_batch(seq: int, payload: bytes) -> list[KvEvent]:
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    items = batch[1] if isinstance(batch, list) else batch.get("events", [])
    events = []
    for sub, raw in enumerate(items):
        events.append(_decode_event(seq, sub, raw))
    return events


def _decode_event(seq: int, sub: int, raw: Any) -> KvEvent:
    if isinstance(raw, dict):
        kind = raw.get("type", "")
        fields = raw
    else:  # array-like encoding: [tag, field...]
        kind, fields = raw[0], {}
        if kind == "BlockStored":
            fields = {
                "block_hashes": raw[1],
                "parent_block_hash": raw[2],
                "token_ids": raw[3],
                "medium": raw[6] if len(raw) > 6 else None,
            }
        elif kind == "BlockRemoved":
            fields = {"block_hashes": raw[1], "medium": raw[2] if len(raw) > 2 else None}
    medium = str(fields.get("medium") or "GPU").lower()
    if kind == "BlockStored":
        parent = fields.get("parent_block_hash")
        return KvEvent(
            seq,
            "stored",
            tuple(hash_text(h) for h in fields.get("block_hashes", [])),
            hash_text(parent) if parent is not None else None,
            medium,
            len(fields.get("token_ids") or []),
            sub,
        )
    if kind == "BlockRemoved":
        return KvEvent(
            seq, "removed", tuple(hash_text(h) for h in fields.get("block_hashes", [])), None, medium, 0, sub
        )
    if kind == "AllBlocksCleared":
        return KvEvent(seq, "cleared", (), None, medium, 0, sub)
    raise ValueError(f"unknown KV event type {kind!r}")


class ZmqEventSubscriber:
    def __init__(
        self,
        ledger: EventLedger,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        connect: bool = False,
    ) -> None:
        self.ledger = ledger
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.decode_errors: list[str] = []
        self.seen: set[int] = set()
        self.live_seen: set[int] = set()
        self._payloads: dict[int, int] = {}  # seq -> hash of the batch taken under it
        self._live_max = -1
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Bound before the engine starts, its publisher connects to us and no early event is
        # lost; an engine whose publisher binds (Dynamo's mocker) is connected to, and what the
        # subscription missed at the start comes from its replay socket.
        if connect:
            self._sock.connect(endpoint)
        else:
            self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            with contextlib.suppress(zmq.ZMQError):
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
                self._accept(frames[-2], frames[-1])

    def _accept(self, seq_bytes: bytes, payload: bytes) -> None:
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        live = threading.current_thread() is self._thread
        with self._lock:
            if live:  # the engine's own order (replay answers come late by design)
                if seq in self.live_seen:
                    self.ledger.note_disorder(seq, "live batch repeated")
                elif self.live_seen and seq < self._live_max:
                    self.ledger.note_disorder(seq, f"arrived after seq {self._live_max}")
                self.live_seen.add(seq)
                self._live_max = max(self._live_max, seq)
            # A number seen before is a replay answer or a resent batch, dropped; a live batch
            # that reuses a number for other content (a publisher renumbering from 0 inside one
            # instance) is the engine's own history and goes to the ledger (its regress is noted).
            if seq in self.seen and not (live and self._payloads.get(seq) != hash(payload)):
                return
            try:
                events = decode_batch(seq, payload)
            except Exception as exc:
                why = f"{type(exc).__name__}: {str(exc)[:200]}"
                self.decode_errors.append(f"seq {seq}: {why}")
                self.ledger.note_undecodable(seq, f"{why} (from {self.endpoint})")
                return
            self.seen.add(seq)
            self._payloads[seq] = hash(payload)
            self.ledger.note_decoded(seq)
        self.ledger.extend(events)

    def fill_gaps(self, timeout_ms: int = 2000) -> int:
        """Ask the engine's replay socket for sequence numbers we did not receive."""
        with self._lock:
            seen = sorted(self.seen)
        if not seen or self.replay_endpoint is None:
            return 0
        # From the first missing number, or past the last one seen: a batch lost at the end of
        # the stream has no later number to show its gap, only the replay buffer does.
        missing = [s for s in range(0, seen[-1]) if s not in self.seen]
        start = missing[0] if missing else seen[-1] + 1
        # DEALER, not REQ: the replay socket streams many replies to one request.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, timeout_ms)
        filled = 0
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = dealer.recv_multipart()
                if frames[-2] == END_SEQ:
                    break
                before = len(self.seen)
                self._accept(frames[-2], frames[-1])
                filled += len(self.seen) - before
        except zmq.ZMQError:
            pass
        finally:
            dealer.close(0)
        return filled

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(0)

"""KV events end to end: the reference engine's publisher -> ZmqEventSubscriber -> ledger, on
loopback ports. A transport loss is filled from the replay socket; an engine's own gap (the
publisher's event_seq_gap fault) stays a gap."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from kvconform.engines.reference.publisher import EventPublisher, cleared_event, removed_event, stored_event
from kvconform.events import EventLedger
from kvconform.kit.zmq_events import ZmqEventSubscriber, decode_batch
from kvconform.processes import free_port

TOPIC = "kv@selftest"
Pair = tuple[EventPublisher, ZmqEventSubscriber, EventLedger]


class LossySubscriber(ZmqEventSubscriber):
    """Loses the live frames of the sequence numbers in `lose` (a transport loss: the frame
    never arrives); what the replay socket sends still gets through."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.lose: set[int] = set()
        super().__init__(*args, **kwargs)

    def _accept(self, seq_bytes: bytes, payload: bytes) -> None:
        live = threading.current_thread() is self._thread
        if live and int.from_bytes(seq_bytes, "big", signed=True) in self.lose:
            return
        super()._accept(seq_bytes, payload)


@pytest.fixture
def pair() -> Iterator[Callable[[frozenset[str]], Pair]]:
    """pair(faults) -> (publisher, subscriber, ledger). The subscriber binds first and the
    publisher connects to it, as the suite does with engines."""
    made: list[Pair] = []

    def make(faults: frozenset[str] = frozenset()) -> Pair:
        ledger = EventLedger()
        pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        subscriber = LossySubscriber(ledger, pub_ep, topic=TOPIC, replay_endpoint=replay_ep)
        publisher = EventPublisher(pub_ep, replay_ep, TOPIC, faults)
        made.append((publisher, subscriber, ledger))
        return publisher, subscriber, ledger

    yield make
    for publisher, subscriber, _ in made:
        subscriber.close()
        publisher.close()


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def publish_until_connected(publisher: EventPublisher, subscriber: ZmqEventSubscriber) -> list[str]:
    """PUB drops what it sends before the subscription arrives: a transport loss. Publish
    one-block stores until one gets through; the earlier ones were lost on the wire."""
    blocks = []
    while not subscriber.seen:
        block = f"warm{len(blocks)}"
        blocks.append(block)
        publisher.publish([stored_event([block], None, 16, "GPU")])
        assert len(blocks) < 2000, "the subscriber never received anything"
        time.sleep(0.005)
    return blocks


def test_transport_loss_is_filled_from_replay(pair: Callable[..., Pair]) -> None:
    publisher, subscriber, ledger = pair()
    warm = publish_until_connected(publisher, subscriber)
    assert isinstance(subscriber, LossySubscriber)
    lost = set(range(publisher.seq, publisher.seq + 3))
    subscriber.lose |= lost
    for i in range(3):
        publisher.publish([stored_event([f"lost{i}"], warm[-1], 16, "GPU")])
    publisher.publish([removed_event(["lost0"], "GPU"), stored_event(["tail"], None, 16, "CPU")])
    last = publisher.seq - 1
    assert wait_for(lambda: last in subscriber.seen)
    assert not lost & subscriber.seen
    assert ledger.judge().counts().get("seq_gap", 0) >= 1, "before the fill, the loss looks like a gap"

    filled = subscriber.fill_gaps()

    assert filled >= len(lost)
    assert sorted(subscriber.seen) == list(range(last + 1))
    verdict = ledger.judge()
    assert verdict.counts() == {}, [str(v) for v in verdict.violations]
    assert {"lost1", "lost2"} <= set(verdict.resident["gpu"]) and "lost0" not in verdict.resident["gpu"]
    assert set(verdict.resident["cpu"]) == {"tail"}
    assert subscriber.decode_errors == []
    assert subscriber.fill_gaps() == 0, "nothing left to fill"


def test_last_batches_lost_are_filled_from_replay(pair: Callable[..., Pair]) -> None:
    """A loss at the end of the stream shows no gap (no later number arrives): fill_gaps() asks
    the replay socket past the last number seen."""
    publisher, subscriber, ledger = pair()
    warm = publish_until_connected(publisher, subscriber)
    subscriber.fill_gaps()  # the warm-up batches sent before the subscription took
    assert isinstance(subscriber, LossySubscriber)
    subscriber.lose |= {publisher.seq, publisher.seq + 1}
    publisher.publish([removed_event([warm[-1]], "GPU")])
    publisher.publish([stored_event(["last"], None, 16, "GPU")])
    last = publisher.seq - 1
    time.sleep(0.3)
    assert last not in subscriber.seen and ledger.judge().counts() == {}

    assert subscriber.fill_gaps() == 2
    assert sorted(subscriber.seen) == list(range(last + 1))
    verdict = ledger.judge()
    assert verdict.counts() == {} and warm[-1] not in verdict.resident["gpu"]
    assert "last" in verdict.resident["gpu"]


def test_early_events_lost_before_subscription_are_replayed(pair: Callable[..., Pair]) -> None:
    publisher, subscriber, ledger = pair()
    warm = publish_until_connected(publisher, subscriber)
    publisher.publish([cleared_event()])
    publisher.publish([stored_event(["after-clear"], None, 16, "GPU")])
    assert wait_for(lambda: publisher.seq - 1 in subscriber.seen)
    subscriber.fill_gaps()
    assert sorted(subscriber.seen) == list(range(publisher.seq))
    verdict = ledger.judge()
    assert verdict.counts() == {}
    assert verdict.stored == len(warm) + 1
    assert {m: set(c) for m, c in verdict.resident.items()} == {"gpu": {"after-clear"}}


def test_engine_gap_stays_a_gap(pair: Callable[..., Pair]) -> None:
    """event_seq_gap: every 5th batch consumes its sequence number and is never sent nor
    kept for replay. fill_gaps() cannot invent it; the checker reports each one."""
    publisher, subscriber, ledger = pair(frozenset({"event_seq_gap"}))
    publish_until_connected(publisher, subscriber)
    while publisher.batches_sent < 12 or publisher.batches_sent % 5 == 0:
        publisher.publish([stored_event([f"b{publisher.seq}"], None, 16, "GPU")])
    last = publisher.seq - 1
    assert wait_for(lambda: last in subscriber.seen)
    subscriber.fill_gaps()

    dropped = [s for s in range(last + 1) if (s + 1) % 5 == 0]
    assert dropped and sorted(set(range(last + 1)) - subscriber.seen) == dropped
    gaps = [v for v in ledger.judge().violations if v.kind == "seq_gap"]
    assert [v.seq for v in gaps] == [s + 1 for s in dropped]
    assert all("1 missing" in v.detail for v in gaps)


def test_decode_array_encoding_and_bad_payloads(pair: Callable[..., Pair]) -> None:
    payload = msgpack.packb(
        [
            1.0,
            [
                ["BlockStored", [1, 2], None, [5, 6, 7], 16, None, "CPU"],
                ["BlockRemoved", [b"\x01\x02"], "GPU"],
                {"type": "AllBlocksCleared"},
            ],
            None,
        ]
    )
    events = decode_batch(7, payload)
    assert [(e.kind, e.block_hashes, e.medium, e.sub, e.seq) for e in events] == [
        ("stored", ("1", "2"), "cpu", 0, 7),
        ("removed", ("0102",), "gpu", 1, 7),
        ("cleared", (), "gpu", 2, 7),
    ]
    assert events[0].token_count == 3

    _, subscriber, ledger = pair()
    bad = msgpack.packb([1.0, [{"type": "BlockExploded"}], None])
    subscriber._accept((3).to_bytes(8, "big"), bad)
    subscriber._accept((4).to_bytes(8, "big"), b"\xc1 not msgpack")
    assert len(subscriber.decode_errors) == 2
    assert "seq 3" in subscriber.decode_errors[0] and "BlockExploded" in subscriber.decode_errors[0]
    assert ledger.events() == [] and subscriber.seen == set()


def test_renumbered_live_batches_reach_the_ledger(pair: Callable[..., Pair]) -> None:
    """A live batch under a number already taken: the same batch again (a resend) is dropped,
    other content (a publisher numbering from 0 again inside one instance) is kept, and both
    are noted as a regress."""
    _, subscriber, ledger = pair()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(subscriber.endpoint)

    def batch(*hashes: str) -> bytes:
        return msgpack.packb([1.0, [stored_event(list(hashes), None, 16, "GPU")], None])

    frames = [(0, batch("a")), (1, batch("b")), (1, batch("b")), (0, batch("c"))]
    try:
        time.sleep(0.3)  # the subscription settles before the first frame
        for seq, payload in frames:
            pub.send_multipart((TOPIC.encode(), seq.to_bytes(8, "big"), payload))
        assert wait_for(lambda: len(ledger.disorder) == 2)
    finally:
        pub.close(0)
    assert sorted(h for e in ledger.events() for h in e.block_hashes) == ["a", "b", "c"]
    assert [v.kind for v in ledger.disorder] == ["seq_regress", "seq_regress"]


def test_publisher_closes_while_its_replay_socket_waits() -> None:
    """close() with the replay thread blocked waiting for requests: no abort of the process
    (ZMQ sockets are single-threaded), and the replay port is released."""
    replay_ep = f"tcp://127.0.0.1:{free_port()}"
    publisher = EventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_ep, TOPIC, frozenset())
    time.sleep(0.2)  # the replay thread is now waiting in poll
    publisher.close()
    # ZMQ releases a closed listener from its I/O thread, shortly after close() returns.
    deadline = time.monotonic() + 3.0
    while True:
        try:
            again = EventPublisher(None, replay_ep, TOPIC, frozenset())  # binds the same port
            break
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    again.close()

"""KV events from a publisher in vLLM's ZMQ wire format (vLLM, SGLang's server, the reference
engine), for an adapter to compose before EngineAdapter in its bases: a fresh ledger per engine
instance, fed by a SUB socket the suite binds before the engine starts, and drained with the
engine's replay socket filling transport gaps."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvconform.contract.facets import KvEvents
from kvconform.events import EventLedger
from kvconform.kit.zmq_events import ZmqEventSubscriber
from kvconform.processes import free_port

if TYPE_CHECKING:
    from kvconform.contract import EngineAdapter

    class _Base(EngineAdapter, KvEvents):  # the adapter this is composed into
        pass
else:
    _Base = KvEvents


class ZmqEventFeed(_Base):
    subscriber: ZmqEventSubscriber | None = None

    def open_event_subscriber(self) -> tuple[str, str]:
        """A fresh ledger (sequence numbers restart with each engine instance) and a bound SUB
        socket; returns (events endpoint, replay endpoint) for the engine's command line."""
        return self.subscribe(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")

    def subscribe(self, events: str, replay: str) -> tuple[str, str]:
        self.close_event_subscriber()
        self.ledger = EventLedger()
        self.subscriber = ZmqEventSubscriber(self.ledger, events, topic="kv", replay_endpoint=replay)
        return events, replay

    def close_event_subscriber(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None

    def drain_events(self) -> int:
        if self.subscriber is None:
            return 0
        time.sleep(self.traits.event_settle_s)
        return self.subscriber.fill_gaps()

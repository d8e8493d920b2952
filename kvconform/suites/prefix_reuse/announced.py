"""The block hashes an engine announces stored (KV events) while it serves one request."""

from __future__ import annotations

from collections.abc import Callable

from kvconform.contract import EngineAdapter, KvEvents, ServedPrompt, facet


def stored_while(engine: EngineAdapter, serve: Callable[[], ServedPrompt]) -> tuple[ServedPrompt, set[str]]:
    """Serve one request and collect the hashes of every BlockStored event it caused (events
    the engine had already published are drained first, and the request's own afterwards)."""
    facet(engine, KvEvents).drain_events()
    mark = engine.ledger.mark()
    served = serve()
    facet(engine, KvEvents).drain_events()
    return served, {h for e in engine.ledger.since(mark) if e.kind == "stored" for h in e.block_hashes}

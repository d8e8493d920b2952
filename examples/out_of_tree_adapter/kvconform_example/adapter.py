"""A vendor's adapter lives in the vendor's package. This one drives kvconform's reference
engine under its own name, as a stand-in for a real engine: subclass the contract's
EngineAdapter, declare capabilities, implement the methods behind them."""

from __future__ import annotations

from kvconform.adapters.reference.adapter import ReferenceAdapter


class ExampleAdapter(ReferenceAdapter):
    name = "example-ref"

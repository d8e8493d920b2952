"""Registration refuses an adapter that declares a capability without the contract methods
behind it, naming the capability, the methods and the class; every shipped adapter passes."""

from __future__ import annotations

from typing import ClassVar

import pytest

from kvconform import registry
from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, ServedPrompt
from kvconform.contract.requirements import METHODS, missing_methods
from kvconform.errors import UsageError
from kvconform.memory import MemoryMeasure


class HalfDoneAdapter(EngineAdapter):
    """Declares prefix reuse and churn; implements churn_cycle but not reclaim_probe."""

    name = "half-done"
    capabilities = frozenset({C.PREFIX_CACHE, C.INSTANCE_CHURN})
    churn_paths: ClassVar[tuple[str, ...]] = ("unregister",)

    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        raise AssertionError("never called")

    def churn_cycle(self, path: str, index: int, tokens: list[int]) -> None:
        raise AssertionError("never called")


class NoPathAdapter(HalfDoneAdapter):
    churn_paths: ClassVar[tuple[str, ...]] = ()

    def reclaim_probe(self) -> dict[str, MemoryMeasure]:
        raise AssertionError("never called")


@pytest.mark.parametrize("name", registry.names())
def test_every_shipped_adapter_provides_what_it_declares(name: str) -> None:
    registry.adapter_class(name)  # raises UsageError naming what is missing


def test_a_declared_capability_without_its_methods_is_refused_at_registration() -> None:
    registry.register("half-done", f"{__name__}:HalfDoneAdapter")
    try:
        with pytest.raises(UsageError) as err:
            registry.adapter_class("half-done")
    finally:
        registry.unregister("half-done")
    text = str(err.value)
    assert "engine 'half-done'" in text and "HalfDoneAdapter" in text
    assert "instance_churn needs reclaim_probe" in text
    assert "prefix_cache" not in text, "serve_prompt is provided"


def test_churn_needs_a_release_path() -> None:
    assert missing_methods(NoPathAdapter) == {C.INSTANCE_CHURN: ["churn_paths (no release path named)"]}


def test_every_listed_method_is_a_contract_stub() -> None:
    for capability, methods in METHODS.items():
        for method in methods:
            assert callable(getattr(EngineAdapter, method, None)), (capability, method)

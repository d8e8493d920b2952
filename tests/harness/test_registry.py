"""Registration refuses an adapter that declares a capability without the contract methods
behind it, naming the capability, the methods and the class; every shipped adapter passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconform import registry
from kvconform.contract import (
    AdapterContext,
    EngineAdapter,
    InstanceChurn,
    KvPool,
    PersistentTier,
    ReclaimProbe,
    ServedPrompt,
    facet,
    provides,
)
from kvconform.contract import Capability as C
from kvconform.contract.requirements import NEEDS, missing_methods
from kvconform.errors import UsageError
from kvconform.memory import MemoryMeasure


class HalfDoneAdapter(EngineAdapter):
    """Declares prefix reuse and churn; returns its churn facet but has no reclaim probe."""

    name = "half-done"
    capabilities = frozenset({C.PREFIX_CACHE, C.INSTANCE_CHURN})

    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        raise AssertionError("never called")

    @provides(InstanceChurn)
    def instance_churn(self) -> InstanceChurn:
        raise AssertionError("never called")


class NoFacetAdapter(EngineAdapter, ReclaimProbe):
    name = "no-facet"
    capabilities = frozenset({C.INSTANCE_CHURN, C.INSTANCE_REGISTRY})

    def reclaim_probe(self, path: str | None = None) -> dict[str, MemoryMeasure]:
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
    assert "instance_churn needs the ReclaimProbe facet" in text
    assert "prefix_cache" not in text, "serve_prompt is provided"


def test_a_facet_capability_needs_its_facet() -> None:
    assert missing_methods(NoFacetAdapter) == {
        C.INSTANCE_CHURN: ["the InstanceChurn facet"],
        C.INSTANCE_REGISTRY: ["the InstanceChurn facet"],
    }


def test_a_facet_is_found_through_its_mark_and_refused_by_name_without_one(tmp_path: Path) -> None:
    adapter = HalfDoneAdapter(AdapterContext(workdir=tmp_path))
    with pytest.raises(AssertionError, match="never called"):
        facet(adapter, InstanceChurn)  # the marked method is what facet() calls
    with pytest.raises(NotImplementedError, match="engine half-done provides no PersistentTier facet"):
        facet(adapter, PersistentTier)


def test_every_listed_need_is_a_contract_stub_or_a_facet_type() -> None:
    for capability, needs in NEEDS.items():
        for need in needs:
            if isinstance(need, str):  # a core stub, or a method of a facet the capability needs
                owners = [EngineAdapter, *(n for n in needs if isinstance(n, type))]
                assert any(callable(getattr(o, need, None)) for o in owners), (capability, need)
            else:
                assert isinstance(need, type), need
                assert need.__module__.startswith("kvconform.contract.facets."), need


class PoolWithoutBytes(EngineAdapter, KvPool):
    """Inherits the KvPool facet but leaves the method the long session needs as its stub."""

    name = "pool-without-bytes"
    capabilities = frozenset({C.FORCED_EVICTION, C.LONG_SESSION})

    def cache_capacity_tokens(self) -> int:
        raise AssertionError("never called")


def test_an_inherited_facet_is_provided_but_its_stubs_are_not() -> None:
    assert missing_methods(PoolWithoutBytes) == {C.LONG_SESSION: ["kv_pool_bytes"]}


# The lifecycle core every adapter shares. Anything else an engine offers is a facet
# (kvconform.contract.facets) or a function of the contract over the core (ensure(), facet(),
# deployed_block_size(), read_metric(), restart()): the core grows only with a reason here.
CORE_DECLARATIONS = {"capabilities", "deployment", "traits"}
CORE_METHODS = {
    "version",
    "preflight",
    "unsupported",
    "resolved_block_size",
    "start",
    "stop",
    "running",
    "close",
    "healthy",
    "engine_pids",
    "logs",
    "metrics",
    "serve_prompt",
}


def test_the_adapter_core_is_the_lifecycle_and_nothing_else() -> None:
    public = {name for name in vars(EngineAdapter) if not name.startswith("_")}
    assert public == CORE_DECLARATIONS | CORE_METHODS
    assert len(public) == 16

"""The engine x capability inventory agrees with the adapters, and docs/inventory.md with both."""

from __future__ import annotations

import pytest

from kvconform import dashboard, inventory, registry
from kvconform.contract.capabilities import Capability
from kvconform.errors import UsageError
from kvconform.records import CheckResult
from tests.paths import REPO

REAL_ENGINES = [n for n in registry.BUILTIN if n != "reference"]
DOC = REPO / "docs" / "inventory.md"


@pytest.mark.parametrize("engine", REAL_ENGINES)
def test_every_capability_has_a_cell_and_has_means_declared(engine: str) -> None:
    inv = inventory.load(engine)
    assert inv is not None, f"{engine}: its adapter package ships no {inventory.FILE_NAME} table for it"
    assert set(inv.cells) == set(Capability), sorted(set(Capability) - set(inv.cells))
    declared = registry.adapter_class(engine).capabilities
    has = {c for c, cell in inv.cells.items() if cell.status == inventory.HAS}
    assert has == set(declared), (
        f"{engine}: declared but not 'has' {sorted(set(declared) - has)}; "
        f"'has' but not declared {sorted(has - set(declared))}"
    )
    assert inv.release and inv.release != "?"
    assert not any("/work/" in c.source or "/home/" in c.source for c in inv.cells.values())


@pytest.mark.parametrize("engine", REAL_ENGINES)
def test_elsewhere_names_a_configuration_of_the_same_release_that_judges_it(engine: str) -> None:
    inv = inventory.load(engine)
    assert inv is not None
    for cell in inv.cells.values():
        if cell.status != inventory.ELSEWHERE:
            continue
        other = inventory.load(cell.judged_by)
        assert other is not None, f"{engine} {cell.capability}: judged_by {cell.judged_by!r} has no inventory"
        # The same release, or, for a stack, one of its parts at the version the stack runs
        # (vllm-lmcache's LMCache server is lmcache's).
        parts = set(inv.release.split(" + "))
        assert set(other.release.split(" + ")) <= parts, (
            f"{engine} {cell.capability}: {other.release} is not part of {inv.release}"
        )
        status = other.status(cell.capability)
        where = f"{engine} {cell.capability}: {cell.judged_by}"
        assert status == inventory.HAS, f"{where} does not judge it ({status})"


def test_doc_is_up_to_date() -> None:
    assert DOC.read_text() == inventory.markdown(REAL_ENGINES), "run `kvconform inventory`"


def test_a_cell_without_status_source_or_note_is_refused() -> None:
    with pytest.raises(UsageError, match="status"):
        inventory.parse("e", {"prefix_cache": {"status": "maybe", "source": "x"}})
    with pytest.raises(UsageError, match="cites no source"):
        inventory.parse("e", {"prefix_cache": {"status": "has"}})
    with pytest.raises(UsageError, match="note"):
        inventory.parse("e", {"prefix_cache": {"status": "lacks", "source": "x"}})
    with pytest.raises(UsageError, match="no capability"):
        inventory.parse("e", {"prefix_kache": {"status": "has", "source": "x"}})
    with pytest.raises(UsageError, match="judged_by"):
        inventory.parse("e", {"prefix_cache": {"status": "elsewhere", "source": "x", "note": "n"}})
    with pytest.raises(UsageError, match="judged_by"):
        cell = {"status": "lacks", "source": "x", "note": "n", "judged_by": "f"}
        inventory.parse("e", {"prefix_cache": cell})


def test_skip_kind_prefers_lacks_then_gpu_then_not_implemented() -> None:
    inv = inventory.parse(
        "e",
        {
            "release": "e 1.0",
            "remote_tier": {"status": "lacks", "source": "s", "note": "n"},
            "kv_events": {"status": "needs_gpu", "source": "s", "note": "n"},
            "long_session": {"status": "not_implemented", "source": "s", "note": "n"},
            "restart": {"status": "has", "source": "s"},
        },
    )
    C = Capability
    assert inventory.skip_kind(inv, [C.LONG_SESSION, C.KV_EVENTS, C.REMOTE_TIER]) == inventory.LACKS
    assert inventory.skip_kind(inv, [C.LONG_SESSION, C.KV_EVENTS]) == inventory.NEEDS_GPU
    assert inventory.skip_kind(inv, [C.LONG_SESSION]) == inventory.NOT_IMPLEMENTED
    assert inventory.skip_kind(inv, [C.RESTART]) == inventory.HAS  # attach mode: declared, removed


def test_checks_per_capability_include_markers_and_has_calls() -> None:
    checks = inventory.judging_checks()
    assert "prefix_reuse::test_block_size_sweep" in checks[Capability.BLOCK_SIZE_CONFIG]  # marker
    assert "prefix_reuse::test_partial_block_prefix_hits_match_oracle" in checks[Capability.BLOCK_SIZE_CONFIG]
    assert "prefix_reuse::test_reset_drops_cached_prefix" in checks[Capability.ANSWERS_FROM_KV]  # via helper


def test_dashboard_tells_the_three_kinds_of_empty_cell_apart() -> None:
    kinds = {}
    for engine in REAL_ENGINES:
        inv = inventory.load(engine)
        assert inv is not None
        for cell in inv.cells.values():
            kinds.setdefault(cell.status, (engine, cell.capability))
    for status, state in (("lacks", "lacks"), ("not_implemented", "todo"), ("elsewhere", "elsewhere")):
        engine, capability = kinds[status]
        record = {
            "engine": engine,
            "check": "x::test_y",
            "outcome": "skipped",
            "message": f"Skipped: engine {engine} lacks capability {capability}",
        }
        cell = dashboard.cell_of(CheckResult.from_dict(record))
        assert cell.state == state and capability.value in cell.text and cell.detail
    other = dashboard.cell_of(
        CheckResult.from_dict(
            {"engine": "vllm", "check": "x::test_y", "outcome": "skipped", "message": "Skipped: no layout"}
        )
    )
    assert other.state == "skip"

"""KV transfer byte totals reconcile, and page indices are right.

bytes sent = bytes received = (pages x page bytes + states x state bytes) x replicas, with
page bytes computed from the model shape (layers, heads, head dim, dtype, MHA vs MLA, state
components) and replicas = the fan-out for MLA layouts only (SGLang's accounting fix).
"""

from __future__ import annotations

import math

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, EngineConfig, KvTransfer, ensure, facet
from kvconform.oracles import KvLayout, page_indices, transfer_bytes
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict

LAYOUTS = [("mha", 1), ("mha", 4), ("mla", 1), ("mla", 4), ("mla_state", 4)]
# 32: the block size of engines that transfer whole blocks of at least 32 tokens (vLLM on CPU)
PAGE_SIZES = [1, 4, 16, 32]


def _transfer(engine: EngineAdapter, layout: str | None, page_size: int, destinations: int = 1) -> KvTransfer:
    """The engine's transfer facet, or a skip naming the shape it does not transfer."""
    transfer = facet(engine, KvTransfer)
    if layout is not None and layout not in transfer.layouts:
        pytest.skip(f"engine {engine.name} has no {layout} transfer layout")
    if page_size not in transfer.page_sizes:
        pytest.skip(f"engine {engine.name} does not transfer with page size {page_size}")
    if destinations not in transfer.destinations:
        pytest.skip(f"engine {engine.name} does not transfer to {destinations} decode ranks")
    return transfer


@pytest.mark.requires(C.TRANSFER_ACCOUNTING)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("layout", "destinations"), LAYOUTS)
def test_transfer_bytes_reconcile(
    engine: EngineAdapter,
    layout: str,
    destinations: int,
    page_size: int,
    prompts: PromptFactory,
    verdict: Verdict,
) -> None:
    transfer = _transfer(engine, layout, page_size, destinations)
    ensure(engine, EngineConfig())
    tokens = prompts.fresh(3 * 16 + 5)
    result = transfer.transfer(tokens, layout, page_size, destinations)
    kv_layout = KvLayout(layout)
    pages = math.ceil(len(tokens) / page_size)
    page_bytes = engine.deployment.model.page_bytes(kv_layout, page_size)
    # The request's state: one index per component, components of different sizes
    # (ModelShape.state_components), so its bytes are the sum of the components' own sizes.
    state_indices = len(engine.deployment.model.state_components) if layout == "mla_state" else 0
    request_state_bytes = engine.deployment.model.state_bytes(kv_layout)
    expected = transfer_bytes(
        kv_layout, pages, page_bytes, int(state_indices > 0), request_state_bytes, destinations
    )
    verdict.record("pages", pages)
    verdict.record("page_bytes_from_model_shape", page_bytes, "bytes")
    verdict.record("state_bytes_from_model_shape", request_state_bytes, "bytes")
    verdict.record("replica_factor", kv_layout.replica_factor(destinations))
    verdict.record(
        "state_indices_recorded_by_engine",
        "not reported" if result.state_indices is None else result.state_indices,
        note=f"{state_indices} sent (one per state component); judged through the bytes they add",
    )
    oracle = "(pages x page bytes + states x state bytes) x replicas"
    if result.bytes_sent is None and result.bytes_received is None:
        pytest.fail(f"engine {engine.name}: its transfer counted bytes on neither side")
    if result.bytes_sent is None:
        verdict.record("bytes_sent", "not counted", note="the engine counts at the receiver only")
    else:
        verdict.equal("bytes_sent", result.bytes_sent, expected, "bytes", note=oracle)
    for name, value in result.detail.items():
        verdict.record(f"engine_{name}", value)
    if result.bytes_received is not None:
        verdict.equal("bytes_received", result.bytes_received, expected, "bytes", note=oracle)
    verdict.conclude()


@pytest.mark.requires(C.PAGE_INDEX)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_page_indices_match_oracle(
    engine: EngineAdapter, page_size: int, prompts: PromptFactory, verdict: Verdict
) -> None:
    """Page indices = the pages the request's KV slots touch, in order (SGLang #31173)."""
    transfer = _transfer(engine, None, page_size)
    ensure(engine, EngineConfig())
    # Another request's KV first, so this one's does not start at the pool's first page: there
    # the request's own page numbers and the pool's coincide (SGLang #31471 sent the first for
    # the second).
    transfer.transfer(prompts.fresh(2 * 16 + 7), transfer.layouts[0], page_size, 1)
    tokens = prompts.fresh(2 * 16 + 7)
    result = transfer.transfer(tokens, transfer.layouts[0], page_size, 1)
    expected = page_indices(result.kv_indices, page_size)
    wrong = [i for i, (a, b) in enumerate(zip(result.page_indices, expected, strict=False)) if a != b]
    verdict.record("kv_indices", len(result.kv_indices))
    verdict.equal("page_count", len(result.page_indices), len(expected))
    verdict.equal(
        "pages_differing_from_oracle",
        len(wrong),
        0,
        note=f"first: engine {result.page_indices[wrong[0]]} vs oracle {expected[wrong[0]]}" if wrong else "",
    )
    verdict.conclude()

"""Oracles: what should be true, computed from first principles."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconform.contract import ModelShape
from kvconform.oracles import KvLayout, page_indices, pages, prefix_hit_tokens, theil_sen, transfer_bytes


@pytest.mark.parametrize(
    ("shared", "prompt_len", "block", "last_token", "expected"),
    [
        (100, 200, 16, True, 96),  # floor(100/16)*16
        (100, 200, 16, False, 96),
        (64, 64, 16, False, 64),  # fully cached pure store: every block
        (64, 64, 16, True, 48),  # serving engine recomputes the last token: one block less
        (65, 65, 16, True, 64),
        (15, 100, 16, True, 0),  # less than a block
        (0, 10, 16, True, 0),
        (10, 1, 16, True, 0),  # one-token prompt: nothing usable
        (1, 1, 1, False, 1),
    ],
)
def test_prefix_hit_tokens(shared: int, prompt_len: int, block: int, last_token: bool, expected: int) -> None:
    assert prefix_hit_tokens(shared, prompt_len, block, last_token) == expected


@given(st.integers(0, 5000), st.integers(1, 5000), st.integers(1, 256), st.booleans())
def test_prefix_hit_tokens_properties(shared: int, prompt_len: int, block: int, last_token: bool) -> None:
    hit = prefix_hit_tokens(shared, prompt_len, block, last_token)
    assert hit % block == 0
    assert 0 <= hit <= min(shared, prompt_len)
    assert hit > min(shared, prompt_len - last_token) - block
    if last_token:
        assert hit < prompt_len


def test_page_indices() -> None:
    assert page_indices([], 16) == []
    assert page_indices([0, 1, 2, 15, 16, 17, 40], 16) == [0, 1, 2]
    assert page_indices([33, 34, 2, 3, 64], 16) == [2, 0, 4]  # order of first appearance
    assert page_indices([5, 6, 7, 8], 1) == [5, 6, 7, 8]
    assert pages(33, 16) == 3 and pages(32, 16) == 2 and pages(0, 16) == 0


LAYERS, KV_HEADS, HEAD_DIM, DTYPE, LATENT, PAGE = 2, 4, 64, 2, 576, 16


@pytest.mark.parametrize("destinations", [1, 2, 4])
def test_transfer_bytes_by_layout(destinations: int) -> None:
    mha, mla, mla_state = KvLayout("mha"), KvLayout("mla"), KvLayout("mla_state")
    mha_page = mha.page_bytes(LAYERS, KV_HEADS, HEAD_DIM, DTYPE, LATENT, PAGE)
    mla_page = mla.page_bytes(LAYERS, KV_HEADS, HEAD_DIM, DTYPE, LATENT, PAGE)
    assert mha_page == 2 * 2 * 4 * 64 * 2 * 16  # layers x (K and V) x heads x dim x bytes x tokens
    assert mla_page == 2 * 576 * 2 * 16  # one latent vector per token per layer
    assert mla_state.page_bytes(LAYERS, KV_HEADS, HEAD_DIM, DTYPE, LATENT, PAGE) == mla_page
    assert mha.state_bytes(LAYERS, 4096) == 0 and mla.state_bytes(LAYERS, 4096) == 0
    state = mla_state.state_bytes(LAYERS, 4096)
    assert state == 2 * 4096

    # MHA: each destination gets its own heads, so fan-out does not multiply bytes.
    assert transfer_bytes(mha, 5, mha_page, 0, 0, destinations) == 5 * mha_page
    # MLA: the latent KV is replicated to every destination.
    assert transfer_bytes(mla, 5, mla_page, 0, 0, destinations) == 5 * mla_page * destinations
    # MLA + state: pages and state buffers, both replicated.
    assert (
        transfer_bytes(mla_state, 5, mla_page, 3, state, destinations)
        == (5 * mla_page + 3 * state) * destinations
    )
    # Two state components of different sizes: each index counts its own component's size.
    shape = ModelShape(layers=LAYERS, state_components=(4096, 1024))
    assert shape.state_bytes(mla_state) == LAYERS * 4096 + LAYERS * 1024
    assert shape.state_bytes(mla) == 0
    assert [layout.replica_factor(destinations) for layout in (mha, mla, mla_state)] == [
        1,
        destinations,
        destinations,
    ]


def test_theil_sen_flat_series_has_zero_slope() -> None:
    flat = [1000.0, 1003.0, 998.0, 1001.0, 999.0, 1000.0, 1002.0, 997.0]
    trend = theil_sen(flat)
    assert abs(trend.slope) < 1.0
    assert trend.low <= 0.0 <= trend.high


def test_theil_sen_leaking_series() -> None:
    """4096 bytes leaked per cycle, with noise and one outlier: the slope shows the leak."""
    noise = [0, 37, -21, 12, -40, 25, 3, -9, 30, -15]
    series = [10_000 + 4096 * i + n for i, n in enumerate(noise)]
    series[4] += 200_000  # one sample caught mid-allocation
    trend = theil_sen(series)
    assert 4000 < trend.slope < 4200
    assert trend.low > 0, "the whole confidence band is above zero"


def test_theil_sen_short_series() -> None:
    assert theil_sen([]).slope == 0.0
    single = theil_sen([5.0])
    assert (single.slope, single.intercept) == (0.0, 5.0)
    assert theil_sen([1.0, 3.0]).slope == 2.0


def test_an_engine_that_trims_its_kv_by_a_token_serves_all_but_one() -> None:
    from kvconform.oracles import LastToken

    assert prefix_hit_tokens(2560, 2560, 256, LastToken.TOKEN) == 2559  # block-aligned, all cached
    assert prefix_hit_tokens(2560, 2560, 256, LastToken.BLOCK) == 2304
    assert prefix_hit_tokens(600, 600, 256, LastToken.TOKEN) == 512  # the partial block is never cached
    assert prefix_hit_tokens(300, 600, 256, LastToken.TOKEN) == 256
    assert prefix_hit_tokens(2560, 2560, 256, LastToken.NONE) == 2560


def test_gauge_judged_against_the_transfer_workers_log() -> None:
    from kvconform.suites.offload_metrics.gauges import gauge_vs_transfers, in_flight_windows

    origin = 100.0
    log = [(100.0, 0), (101.0, 2), (101.01, 0), (101.02, 1), (101.3, 0), (103.0, 1), (103.02, 0)]
    windows = in_flight_windows(log, origin, merge_gap_s=0.05)
    assert [(round(w.start, 2), round(w.end, 2)) for w in windows] == [(1.0, 1.3), (3.0, 3.02)]
    samples = [(t / 100, 0.0) for t in range(0, 500, 5)]
    lit = [(t, 0.5 if 1.05 <= t <= 1.4 else v) for t, v in samples]
    assert gauge_vs_transfers(lit, windows, slack_s=0.2, min_window_s=0.05) == ([], [])
    phantom, unseen = gauge_vs_transfers(
        [(t, 0.5 if 1.05 <= t <= 2.0 else v) for t, v in samples], windows, 0.2, 0.05
    )
    assert phantom[0].startswith("t=1.5") and unseen == []  # stuck up after the stores ended
    assert gauge_vs_transfers(samples, windows, 0.2, 0.05) == ([], ["1.000-1.300s"])  # never shown

"""Contract tests of adapters/trtllm.py against FakeTrtllm (no GPU, no TensorRT-LLM)."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from kvconform.adapters.trtllm.adapter import TrtllmAdapter, parse_kv_event
from kvconform.contract import AdapterContext
from kvconform.contract import Capability as C
from kvconform.errors import EngineError, UsageError
from kvconform.processes import free_port
from tests.contract.fake_trtllm import FakeTrtllm
from tests.suite_runs import run_suites


def test_serve_prompt_sends_token_ids_and_reads_cached_tokens(trtllm: TrtllmAdapter, fake_trtllm) -> None:
    prompt = list(range(100, 140))  # 40 tokens = 5 blocks of 8
    first = trtllm.serve_prompt(prompt)
    second = trtllm.serve_prompt(prompt)
    assert (first.prompt_tokens, first.cached_tokens) == (40, 0)
    assert second.cached_tokens == 32  # 4 whole blocks; the last token is always computed
    assert second.output == [17]
    body_prompts = [m for m, p in fake_trtllm.log if p == "/v1/completions"]
    assert len(body_prompts) == 2


def test_capabilities_attach_vs_launch(tmp_path: Path) -> None:
    launched = TrtllmAdapter(AdapterContext(workdir=tmp_path))
    attached = TrtllmAdapter(AdapterContext(workdir=tmp_path, url="http://127.0.0.1:9"))
    assert {
        C.BLOCK_POOL_STATS,
        C.KV_EVENTS,
        C.PREFIX_CACHE,
        C.PREFIX_HIT_COUNTERS,
    } <= attached.effective_capabilities()
    assert C.RESTART in launched.effective_capabilities()
    assert C.RESTART not in attached.effective_capabilities()
    assert C.HOST_MEMORY not in attached.effective_capabilities()
    assert C.RESET_PREFIX_CACHE not in launched.capabilities  # no reset endpoint in trtllm-serve


def test_block_pool_stats_read_from_drained_metrics(trtllm: TrtllmAdapter, fake_trtllm) -> None:
    trtllm.ensure()
    prompt = list(range(10, 50))
    trtllm.serve_prompt(prompt)
    trtllm.serve_prompt(prompt)
    pools = trtllm.block_pool_stats()
    assert [p.iteration for p in pools] == [1, 2, 3, 4]
    last = pools[-1]
    assert (last.max_blocks, last.used_blocks, last.free_blocks, last.tokens_per_block) == (256, 0, 256, 8)
    assert (last.reused_blocks, last.missed_blocks) == (4, 6)
    assert last.hit_rate == pytest.approx(0.4, abs=1e-6)
    assert all(p.cumulative for p in pools)
    assert trtllm.block_size() == 8
    # drained: the server holds nothing more, yet the adapter still has every iteration
    assert fake_trtllm.iterations == []
    assert len(trtllm.block_pool_stats()) == 4


def test_concurrent_drain_loses_and_doubles_nothing(fake_trtllm, tmp_path: Path) -> None:
    adapter = TrtllmAdapter(AdapterContext(workdir=tmp_path, url=fake_trtllm.url))
    adapter.poll_interval_s = 0.005  # the background reader races the suite's own reads
    adapter.ensure()
    stop = threading.Event()
    seen_lengths: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            seen_lengths.append(len(adapter.block_pool_stats()))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(25):
            adapter.serve_prompt(list(range(1000 + i, 1024 + i)))
    finally:
        stop.set()
        thread.join()
    iters = [p.iteration for p in adapter.block_pool_stats()]
    adapter.close()
    assert iters == list(range(1, 51)), "every iteration once, in order"
    assert seen_lengths == sorted(seen_lengths), "a snapshot never shrinks"


def test_redelivered_iteration_is_kept_once(tmp_path: Path) -> None:
    fake = FakeTrtllm(mode="redeliver")
    adapter = TrtllmAdapter(AdapterContext(workdir=tmp_path, url=fake.url))
    try:
        adapter.serve_prompt(list(range(10, 30)))
        adapter.poll_now()
        adapter.serve_prompt(list(range(10, 30)))
        adapter.poll_now()
        adapter.poll_now()
        iters = [p.iteration for p in adapter.block_pool_stats()]
        assert iters == [1, 2, 3, 4]
        assert adapter.consumer is not None and adapter.consumer.iterations.duplicates >= 2
    finally:
        adapter.close()
        fake.close()


def test_iteration_gap_is_recorded(tmp_path: Path) -> None:
    fake = FakeTrtllm(mode="skip_iter")
    adapter = TrtllmAdapter(AdapterContext(workdir=tmp_path, url=fake.url))
    try:
        for _ in range(2):
            adapter.serve_prompt(list(range(10, 30)))
        assert [p.iteration for p in adapter.block_pool_stats()] == [1, 2, 4, 5]
        assert adapter.consumer is not None and adapter.consumer.iterations.gaps == [(2, 4)]
    finally:
        adapter.close()
        fake.close()


def test_kv_events_drained_into_ledger(trtllm: TrtllmAdapter, fake_trtllm) -> None:
    trtllm.ensure()
    trtllm.serve_prompt(list(range(10, 50)))  # 5 full blocks stored
    trtllm.serve_prompt(list(range(10, 58)))  # 1 more
    assert trtllm.drain_events() == 0
    events = trtllm.ledger.events()
    assert [e.seq for e in events] == [0, 1, 2]
    assert [e.kind for e in events] == ["cleared", "stored", "stored"]
    assert events[1].parent_hash is None and events[2].parent_hash == events[1].block_hashes[-1]
    judged = trtllm.ledger.judge()
    assert judged.violations == [] and judged.stored == 6 and judged.resident_count("device") == 6
    assert fake_trtllm.events == []  # drained on the server side
    trtllm.drain_events()
    assert len(trtllm.ledger.events()) == 3  # nothing counted twice


def test_kv_event_kinds_map_to_one_ledger_form() -> None:
    medium: dict[str, str] = {}
    stored = {
        "event_id": 7,
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [
                {"type": "stored_block", "block_hash": 11, "tokens": [], "cache_level": 0, "priority": 35},
                {"type": "stored_block", "block_hash": 12, "tokens": [], "cache_level": 0, "priority": 35},
            ],
        },
        "window_size": 64,
    }
    offload = {
        "event_id": 8,
        "data": {
            "type": "updated",
            "block_hash": 12,
            "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
            "priority": None,
        },
        "window_size": 64,
    }
    priority_only = {
        "event_id": 9,
        "data": {"type": "updated", "block_hash": 11, "cache_level": None, "priority": {"new_value": 1}},
        "window_size": 64,
    }
    removed = {"event_id": 10, "data": {"type": "removed", "block_hashes": [11, 12]}, "window_size": 64}
    out = [e for raw in (stored, offload, priority_only, removed) for e in parse_kv_event(raw, medium)]
    assert [(e.seq, e.sub, e.kind, e.medium, e.block_hashes) for e in out] == [
        (7, 0, "stored", "device", ("11", "12")),
        (8, 0, "removed", "device", ("12",)),
        (8, 1, "stored", "host", ("12",)),
        (9, 0, "stored", "device", ()),
        (10, 0, "removed", "device", ("11",)),
        (10, 1, "removed", "host", ("12",)),
    ]
    with pytest.raises(ValueError, match="unknown KV cache event type"):
        parse_kv_event({"event_id": 1, "data": {"type": "teleported"}}, medium)


def test_prometheus_counters_and_perf_metrics(trtllm: TrtllmAdapter) -> None:
    before = trtllm.metrics()
    prompt = list(range(300, 340))
    trtllm.serve_prompt(prompt)
    trtllm.serve_prompt(prompt)
    after = trtllm.metrics()
    assert trtllm.metric_delta("prefix_queries", before, after) == 80
    assert trtllm.metric_delta("prefix_hits", before, after) == 32
    perf = trtllm.perf_metrics()
    assert [p["perf_metrics"]["kv_cache_metrics"]["num_reused_blocks"] for p in perf] == [0, 4]
    assert trtllm.perf_metrics() == perf  # drained once, kept


@pytest.mark.parametrize(
    ("fault", "expected"),
    [("garbage", "/metrics returned non-JSON"), ("500", "GET /metrics -> HTTP 500")],
)
def test_bad_metrics_answer_is_a_clear_engine_error(
    trtllm: TrtllmAdapter, fake_trtllm, fault, expected
) -> None:
    fake_trtllm.faults["/metrics"] = fault
    with pytest.raises(EngineError, match="engine trtllm") as info:
        trtllm.block_pool_stats()
    assert expected in str(info.value)


def test_bad_events_answer_is_a_clear_engine_error(trtllm: TrtllmAdapter, fake_trtllm) -> None:
    fake_trtllm.faults["/kv_cache_events"] = "garbage"
    with pytest.raises(EngineError, match=r"engine trtllm: /kv_cache_events returned non-JSON"):
        trtllm.drain_events()


def test_unreachable_url_names_the_engine(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    adapter = TrtllmAdapter(AdapterContext(workdir=tmp_path, url=url))
    with pytest.raises(UsageError, match=rf"engine trtllm at {url} is unreachable"):
        adapter.preflight()


def run_suite(url: str, tmp_path: Path, target: str) -> subprocess.CompletedProcess[str]:
    options = ["--engine", "trtllm", "--engine-url", url]
    return run_suites([target], options, tmp_path / "results", timeout=300)[0]


POOL_CHECK = "kvconform/suites/offload_metrics/test_pool_stats.py"


def test_pool_stats_check_passes_on_consistent_engine(fake_trtllm, tmp_path: Path) -> None:
    run = run_suite(fake_trtllm.url, tmp_path, POOL_CHECK)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout


@pytest.mark.parametrize(
    ("mode", "violated"),
    [
        ("pool", "iterations_used_plus_free_not_max"),
        ("hit_rate", "iterations_hit_rate_not_reused_over_lookups"),
    ],
)
def test_pool_stats_check_fails_with_numbers(tmp_path: Path, mode: str, violated: str) -> None:
    fake = FakeTrtllm(mode=mode)
    try:
        run = run_suite(fake.url, tmp_path, POOL_CHECK)
    finally:
        fake.close()
    assert run.returncode == 1, run.stdout[-3000:]
    assert "1 failed" in run.stdout
    assert f"{violated} = " in run.stdout and "[VIOLATED]" in run.stdout
    assert "max=256" in run.stdout  # the first offending iteration, with its numbers


def test_unreachable_engine_url_stops_the_session_with_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    run = run_suite(url, tmp_path, POOL_CHECK)
    assert run.returncode != 0
    assert f"engine trtllm at {url} is unreachable" in run.stdout + run.stderr

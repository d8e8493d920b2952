"""Contract tests of adapters/trtllm against FakeTrtllm (no GPU, no TensorRT-LLM), per release.

Every adapter-against-fake test runs against the 1.2.1 and the 1.3.0rc29 fake: the adapter
reads the release from /version and may read only the names that release serves.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconform.adapters.trtllm.adapter import (
    METRIC_SINCE,
    PERF_METRICS_ENV,
    RELEASE_12,
    RELEASE_13,
    TrtllmAdapter,
    parse_kv_event,
    release_line,
)
from kvconform.contract import (
    AdapterContext,
    EngineConfig,
    deployed_block_size,
    ensure,
    metric_delta,
    read_metric,
    supported,
)
from kvconform.contract import Capability as C
from kvconform.errors import EngineError, UsageError
from kvconform.metrics import parse_prometheus
from kvconform.processes import free_port
from tests.adapters.contract import fake_trtllm as fakes
from tests.adapters.contract.fake_trtllm import RELEASES, FakeTrtllm
from tests.system.suite_runs import run_suites


@pytest.fixture(params=RELEASES)
def fake_trtllm(request: pytest.FixtureRequest) -> Iterator[FakeTrtllm]:
    """One fake per release (overrides conftest's single one)."""
    server = FakeTrtllm(release=request.param)
    yield server
    server.close()


def attach(fake: FakeTrtllm, tmp_path: Path) -> TrtllmAdapter:
    return TrtllmAdapter(AdapterContext(workdir=tmp_path, url=fake.url, request_timeout_s=5))


def test_release_line_of_versions() -> None:
    assert release_line("1.2.1") == "1.2"
    assert release_line("1.2.0rc6") == "1.2"
    assert release_line("1.3.0rc29") == "1.3"
    assert release_line("1.4.0") == "1.3"  # newer: the newest line this adapter knows
    assert release_line("1.1.0") is None
    assert release_line("unknown (attached)") is None


def test_adapter_reads_the_release_from_version(trtllm: TrtllmAdapter, fake_trtllm) -> None:
    assert trtllm.version == fake_trtllm.release
    expected = RELEASE_13 if fake_trtllm.v13 else RELEASE_12
    assert trtllm.release() is expected
    assert trtllm.version == fake_trtllm.release  # asked once: skips ask per collected check
    assert [p for _, p in fake_trtllm.log].count("/version") == 1


def test_serve_prompt_sends_token_ids_and_reads_cached_tokens(trtllm: TrtllmAdapter, fake_trtllm) -> None:
    prompt = list(range(100, 140))  # 40 tokens = 5 blocks of 8
    first = trtllm.serve_prompt(prompt)
    second = trtllm.serve_prompt(prompt)
    assert (first.prompt_tokens, first.cached_tokens) == (40, 0)
    assert second.cached_tokens == 32  # 4 whole blocks; the last token is always computed
    assert second.output == [17]
    body_prompts = [m for m, p in fake_trtllm.log if p == "/v1/completions"]
    assert len(body_prompts) == 2


def test_capabilities_per_release_and_mode(tmp_path: Path, fake_trtllm) -> None:
    attached = attach(fake_trtllm, tmp_path)
    caps = supported(attached)
    assert {C.BLOCK_POOL_STATS, C.KV_EVENTS, C.PREFIX_CACHE} <= caps
    assert C.RESTART not in caps and C.HOST_MEMORY not in caps
    assert C.RESET_PREFIX_CACHE not in attached.capabilities  # no reset endpoint in trtllm-serve
    if fake_trtllm.v13:
        assert C.PREFIX_HIT_COUNTERS in caps
        assert C.PREFIX_HIT_COUNTERS not in attached.unsupported()
    else:
        assert C.PREFIX_HIT_COUNTERS not in caps
        why = attached.unsupported()[C.PREFIX_HIT_COUNTERS]
        assert why.startswith("TensorRT-LLM 1.2.1: ") and "trtllm_prompt_cached_tokens_total" in why


def test_launch_mode_release_is_the_env_spec_pin(tmp_path: Path) -> None:
    launched = TrtllmAdapter(AdapterContext(workdir=tmp_path))
    assert launched.target_version() == "1.2.1"  # envs/trtllm.toml: tensorrt-llm==1.2.1
    caps = supported(launched)
    assert {C.RESTART, C.HOST_MEMORY, C.BLOCK_POOL_STATS, C.KV_EVENTS} <= caps
    assert C.PREFIX_HIT_COUNTERS not in caps
    assert launched.traits.metric_map.names == {}


def test_unknown_version_reads_as_the_oldest_line(tmp_path: Path) -> None:
    fake = FakeTrtllm(release=fakes.RELEASE_13)
    fake.routes.pop(("GET", "/version"))  # an older or proxied server: no /version
    adapter = attach(fake, tmp_path)
    try:
        assert adapter.release() is RELEASE_12
        assert C.PREFIX_HIT_COUNTERS not in supported(adapter)
        assert "not a known release: read as 1.2" in adapter.unsupported()[C.PREFIX_HIT_COUNTERS]
    finally:
        adapter.close()
        fake.close()


def test_options_file_keeps_perf_metrics(tmp_path: Path) -> None:
    launched = TrtllmAdapter(AdapterContext(workdir=tmp_path))
    options = launched.llm_api_options(EngineConfig())
    assert options["perf_metrics_max_requests"] > 0  # default 0 keeps no /perf_metrics records
    assert options["return_perf_metrics"] and options["enable_iter_perf_stats"]
    assert options["kv_cache_config"]["event_buffer_max_size"] > 0  # default 0: no events
    assert not launched.reads_perf_metrics()  # nothing written yet
    launched._options = options  # what start() writes to the options file
    assert launched.reads_perf_metrics()


def test_block_pool_stats_read_from_drained_metrics(trtllm: TrtllmAdapter, fake_trtllm) -> None:
    ensure(trtllm)
    prompt = list(range(10, 50))
    trtllm.serve_prompt(prompt)
    trtllm.serve_prompt(prompt)
    pools = trtllm.block_pool_stats()
    assert [p.iteration for p in pools] == [1, 2, 3, 4]
    last = pools[-1]
    assert (last.max_blocks, last.used_blocks, last.free_blocks, last.tokens_per_block) == (256, 0, 256, 8)
    # 1.2.1 counts its warmup request's block as missed; 1.3 (#12132) leaves warmup out
    warmup = 0 if fake_trtllm.v13 else fake_trtllm.warmup_missed
    assert warmup == (0 if fake_trtllm.v13 else 1)
    assert (last.reused_blocks, last.missed_blocks) == (4, 6 + warmup)
    assert last.hit_rate == pytest.approx(4 / (10 + warmup), abs=1e-6)
    assert all(p.cumulative for p in pools)
    assert trtllm.resolved_block_size() == 8  # the fake's pool; asked for: the default
    assert deployed_block_size(trtllm) == trtllm.deployment.block_size
    # drained: the server holds nothing more, yet the adapter still has every iteration
    assert fake_trtllm.iterations == []
    assert len(trtllm.block_pool_stats()) == 4


def test_concurrent_drain_loses_and_doubles_nothing(fake_trtllm, tmp_path: Path) -> None:
    adapter = TrtllmAdapter(AdapterContext(workdir=tmp_path, url=fake_trtllm.url))
    adapter.poll_interval_s = 0.005  # the background reader races the suite's own reads
    ensure(adapter)
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


@pytest.mark.parametrize("release", RELEASES)
def test_redelivered_iteration_is_kept_once(tmp_path: Path, release: str) -> None:
    fake = FakeTrtllm(release, mode="redeliver")
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


@pytest.mark.parametrize("release", RELEASES)
def test_iteration_gap_is_recorded(tmp_path: Path, release: str) -> None:
    fake = FakeTrtllm(release, mode="skip_iter")
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
    ensure(trtllm)
    trtllm.serve_prompt(list(range(10, 50)))  # 5 full blocks stored
    trtllm.serve_prompt(list(range(10, 58)))  # 1 more
    assert trtllm.drain_events() == 0
    events = trtllm.ledger.events()
    assert [e.seq for e in events] == [0, 1, 2]
    assert [e.kind for e in events] == ["cleared", "stored", "stored"]
    assert events[1].parent_hash is None and events[2].parent_hash == events[1].block_hashes[-1]
    judged = trtllm.ledger.judge()
    assert judged.violations == [] and judged.stored == 6 and judged.resident_count("device") == 6
    assert list(fake_trtllm.events) == []  # drained on the server side
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


def test_prometheus_counters_per_release(trtllm: TrtllmAdapter, fake_trtllm) -> None:
    before = trtllm.metrics()
    prompt = list(range(300, 340))
    trtllm.serve_prompt(prompt)
    trtllm.serve_prompt(prompt)
    after = trtllm.metrics()
    assert after.value("request_success_total") == 2  # both releases: the request metrics
    if fake_trtllm.v13:
        assert metric_delta(trtllm, "prefix_queries", before, after) == 80
        assert metric_delta(trtllm, "prefix_hits", before, after) == 32
        assert read_metric(trtllm, "blocks_total", after) == 256
    else:
        with pytest.raises(
            NotImplementedError, match=r"TensorRT-LLM 1\.2\.1 exports no trtllm_prompt_tokens_total"
        ):
            metric_delta(trtllm, "prefix_queries", before, after)


def test_adapter_reads_only_names_its_release_serves(trtllm: TrtllmAdapter, fake_trtllm) -> None:
    """Every name the adapter maps for this release is in that release's exposition, every
    other logical metric is refused naming the release, and 1.3-only row fields are never read
    from 1.2.1."""
    trtllm.serve_prompt(list(range(500, 540)))
    text = fake_trtllm._prometheus({}, None, {})[1]
    served = set(parse_prometheus(text).names())
    mapped = set(trtllm.traits.metric_map.names.values())
    assert mapped <= served
    if not fake_trtllm.v13:
        assert mapped == set() and not any(n.startswith("trtllm_") for n in served)
    snapshot = trtllm.metrics()
    for logical in set(METRIC_SINCE) - set(trtllm.traits.metric_map.names):
        with pytest.raises(NotImplementedError, match=rf"TensorRT-LLM {fake_trtllm.release} exports no "):
            read_metric(trtllm, logical, snapshot)
    rows = trtllm.iteration_stats()
    assert all(("kvCacheIterationStats" in r) == fake_trtllm.v13 for r in rows)
    if fake_trtllm.v13:
        per_iter = trtllm.iteration_pool_stats()
        assert [(p.used_blocks, p.missed_blocks, p.cumulative) for p in per_iter] == [
            (5, 5, False),
            (0, 0, False),
        ]
    else:
        with pytest.raises(
            NotImplementedError, match=r"TensorRT-LLM 1\.2\.1 serves no kvCacheIterationStats"
        ):
            trtllm.iteration_pool_stats()
    assert "/perf_metrics" not in [p for _, p in fake_trtllm.log]  # attached, not told: never read


def test_exported_metric_missing_is_an_error_naming_it(tmp_path: Path) -> None:
    fake = FakeTrtllm(fakes.RELEASE_13)
    full = fake._prometheus_13
    fake._prometheus_13 = lambda: [ln for ln in full() if "trtllm_prompt_cached_tokens_total" not in ln]
    adapter = attach(fake, tmp_path)
    try:
        with pytest.raises(EngineError, match=r"/prometheus/metrics lacks trtllm_prompt_cached_tokens_total"):
            read_metric(adapter, "prefix_hits", adapter.metrics())  # never a 0
    finally:
        adapter.close()
        fake.close()


@pytest.mark.parametrize("release", RELEASES)
def test_perf_metrics_only_where_the_server_keeps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: str
) -> None:
    keeping = FakeTrtllm(release, perf_metrics_max_requests=16)
    default = FakeTrtllm(release)  # perf_metrics_max_requests=0, as upstream's default
    try:
        plain = attach(keeping, tmp_path)
        with pytest.raises(NotImplementedError, match=PERF_METRICS_ENV):
            plain.perf_metrics()
        plain.close()
        monkeypatch.setenv(PERF_METRICS_ENV, "1")
        told = attach(keeping, tmp_path)
        prompt = list(range(300, 340))
        told.serve_prompt(prompt)
        told.serve_prompt(prompt)
        perf = told.perf_metrics()
        assert [p["perf_metrics"]["kv_cache_metrics"]["num_reused_blocks"] for p in perf] == [0, 4]
        assert told.perf_metrics() == perf  # drained once, kept
        told.close()
        empty = attach(default, tmp_path)
        empty.serve_prompt(prompt)
        assert empty.perf_metrics() == []  # the server answers [] without the option
        empty.close()
    finally:
        keeping.close()
        default.close()


@pytest.mark.parametrize("release", RELEASES)
def test_fake_serves_what_its_release_serves(release: str) -> None:
    """The fakes themselves, against the facts read from upstream."""
    import requests

    fake = FakeTrtllm(release)
    try:
        requests.post(fake.url + "/v1/completions", json={"prompt": list(range(20))}, timeout=5)
        snap = parse_prometheus(requests.get(fake.url + "/prometheus/metrics", timeout=5).text)
        unprefixed = {n for n in snap.names() if not n.startswith("trtllm_")}
        assert {
            n.rsplit("_", 1)[0] if n.endswith(("_bucket", "_count", "_sum")) else n for n in unprefixed
        } == {
            "request_success_total",
            "e2e_request_latency_seconds",
            "time_to_first_token_seconds",
            "time_per_output_token_seconds",
            "request_queue_time_seconds",
        }
        assert snap.labels_of("request_success_total") == [
            {"model_name": "undefined", "engine_type": "undefined", "finished_reason": "length"}
        ]
        assert any(n.startswith("trtllm_") for n in snap.names()) == release.startswith("1.3")
        assert requests.get(fake.url + "/perf_metrics", timeout=5).json() == []
        rows = requests.get(fake.url + "/metrics", timeout=5).json()
        assert all(("kvCacheIterationStats" in r) == release.startswith("1.3") for r in rows)
    finally:
        fake.close()
    bare = FakeTrtllm(
        release, return_perf_metrics=False, enable_iter_perf_stats=False, event_buffer_max_size=0
    )
    try:
        assert requests.get(bare.url + "/prometheus/metrics", timeout=5).status_code == 404
        requests.post(bare.url + "/v1/completions", json={"prompt": list(range(20))}, timeout=5)
        assert requests.get(bare.url + "/metrics", timeout=5).json() == []
        assert requests.post(bare.url + "/kv_cache_events", timeout=5).json() == []
    finally:
        bare.close()


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
REUSE_CHECK = "kvconform/suites/prefix_reuse/test_block_reuse.py"


@pytest.mark.parametrize("release", RELEASES)
def test_pool_stats_check_passes_on_consistent_engine(tmp_path: Path, release: str) -> None:
    fake = FakeTrtllm(release, tokens_per_block=32)  # the block size the check asks for
    try:
        run = run_suite(fake.url, tmp_path, POOL_CHECK)
    finally:
        fake.close()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout


@pytest.mark.parametrize("release", RELEASES)
def test_block_reuse_checks_read_counters_only_where_the_release_has_them(
    tmp_path: Path, release: str
) -> None:
    """The prefix checks run on both; the hit counters they read where PREFIX_HIT_COUNTERS is
    offered (1.3) and are left alone on 1.2.1, whose /prometheus/metrics lacks them."""
    fake = FakeTrtllm(release, tokens_per_block=32)  # the default before any iteration is seen
    options = ["--engine", "trtllm", "--engine-url", fake.url]
    try:
        check = REUSE_CHECK + "::test_repeated_prompt_served_from_cache"
        run, records = run_suites([check], options, tmp_path / "results", timeout=300)
    finally:
        fake.close()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout
    measured = {
        m["name"] for m in records["prefix_reuse::test_repeated_prompt_served_from_cache"]["measures"]
    }
    assert ("prefix_hits_counter_delta" in measured) == release.startswith("1.3")


@pytest.mark.parametrize(
    ("mode", "violated"),
    [
        ("pool", "iterations_used_plus_free_not_max"),
        ("hit_rate", "iterations_hit_rate_not_reused_over_lookups"),
    ],
)
@pytest.mark.parametrize("release", RELEASES)
def test_pool_stats_check_fails_with_numbers(tmp_path: Path, mode: str, violated: str, release: str) -> None:
    fake = FakeTrtllm(release, mode=mode)
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

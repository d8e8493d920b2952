"""Contract tests of adapters/omlx.py against FakeOmlx (no Mac, no MLX)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconform.adapters.omlx.adapter import OmlxAdapter, token_ids, words
from kvconform.contract import AdapterContext
from kvconform.contract import Capability as C
from kvconform.errors import EngineError, UsageError
from kvconform.processes import free_port
from tests.contract.fake_omlx import FakeOmlx


def test_token_ids_travel_as_words_and_cached_tokens_are_read(omlx: OmlxAdapter) -> None:
    prompt = list(range(500, 540))  # 40 words = 2 blocks of 16 + 8
    first = omlx.serve_prompt(prompt)
    second = omlx.serve_prompt(prompt)
    assert (first.prompt_tokens, first.cached_tokens) == (40, 0)
    assert second.cached_tokens == 32
    assert second.output == [42]
    assert token_ids(words([3, 4, 5])) == [3, 4, 5]


def test_block_size_is_read_from_runtime_cache(omlx: OmlxAdapter) -> None:
    assert omlx.block_size() == 16  # the fake's block, not oMLX's default 256


def test_capabilities_attach_vs_launch(tmp_path: Path) -> None:
    launched = OmlxAdapter(AdapterContext(workdir=tmp_path))
    attached = OmlxAdapter(AdapterContext(workdir=tmp_path, url="http://127.0.0.1:9"))
    assert {C.PERSISTENT_PREFIX, C.RESTART, C.CORRUPT_PERSISTED} <= launched.effective_capabilities()
    assert attached.effective_capabilities() == frozenset({C.PREFIX_CACHE, C.PREFIX_HIT_COUNTERS})
    assert C.KV_EVENTS not in launched.capabilities  # oMLX publishes no KV events
    assert C.BLOCK_POOL_STATS not in launched.capabilities


def test_metrics_read_session_scope_only(omlx: OmlxAdapter, fake_omlx: FakeOmlx) -> None:
    before = omlx.metrics()
    omlx.serve_prompt(list(range(10, 42)))
    omlx.serve_prompt(list(range(10, 42)))
    after = omlx.metrics()
    assert omlx.metric_delta("prefix_queries", before, after) == 64
    assert omlx.metric_delta("prefix_hits", before, after) == 16
    fake_omlx.restart()  # a new server life: session counters start over, all-time go on
    fresh = omlx.metrics()
    assert omlx.metric("prefix_queries", fresh) == 0
    assert fresh.value("omlx_total_prompt_tokens") < FakeOmlx.ALLTIME_SEED
    stats_queries = [p for m, p in fake_omlx.log if p.startswith("/admin/api/stats")]
    assert stats_queries and all(p.endswith("scope=session") for p in stats_queries)
    assert fresh.value("omlx_model_memory_used_bytes") == 123_456_789
    assert fresh.value("omlx_cache_efficiency") == 0.0


def test_ssd_tier_survives_restart_and_clears(omlx: OmlxAdapter, fake_omlx: FakeOmlx) -> None:
    prompt = list(range(700, 750))
    omlx.serve_prompt(prompt)
    fake_omlx.restart()
    assert omlx.serve_prompt(prompt).cached_tokens == 48
    assert omlx.clear_ssd_cache() == 3
    assert omlx.serve_prompt(prompt).cached_tokens == 0


def test_cache_probe_answer(omlx: OmlxAdapter) -> None:
    omlx.serve_prompt(list(range(20, 52)))
    probe = omlx.probe([{"role": "user", "content": words(list(range(20, 52)))}])
    assert probe["model_loaded"] is True
    assert (probe["blocks_ssd_disk"], probe["blocks_cold"], probe["ssd_hit_tokens"]) == (2, 0, 32)


def test_admin_login_with_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeOmlx(api_key="s3cret-key")
    monkeypatch.setenv("KVCONFORM_OMLX_API_KEY", "s3cret-key")
    adapter = OmlxAdapter(AdapterContext(workdir=tmp_path, url=fake.url))
    try:
        adapter.serve_prompt(list(range(10, 30)))
        snap = adapter.metrics()  # admin stats: 401, then login, then the session numbers
        assert adapter.metric("prefix_queries", snap) == 20
        assert ("POST", "/admin/api/login") in fake.log
    finally:
        fake.close()


def test_admin_without_key_says_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeOmlx(api_key="s3cret-key")
    monkeypatch.delenv("KVCONFORM_OMLX_API_KEY", raising=False)
    adapter = OmlxAdapter(AdapterContext(workdir=tmp_path, url=fake.url))
    try:
        with pytest.raises(
            EngineError,
            match=r"engine omlx: POST /admin/api/ssd-cache/clear -> HTTP 401.*KVCONFORM_OMLX_API_KEY",
        ):
            adapter.clear_ssd_cache()
    finally:
        fake.close()


def test_non_word_level_tokenizer_is_refused(omlx: OmlxAdapter, fake_omlx: FakeOmlx) -> None:
    original = fake_omlx.routes[("POST", "/v1/completions")]

    def with_bos(q, body, h):
        status, payload, headers = original(q, body, h)
        payload["usage"]["prompt_tokens"] += 1
        return status, payload, headers

    fake_omlx.route("POST", "/v1/completions", with_bos)
    with pytest.raises(EngineError, match="counted 21 prompt tokens for 20 words"):
        omlx.serve_prompt(list(range(10, 30)))


@pytest.mark.parametrize(
    ("fault", "expected"),
    [("garbage", "/api/status returned non-JSON"), ("500", "GET /api/status -> HTTP 500")],
)
def test_bad_status_answer_is_a_clear_engine_error(omlx: OmlxAdapter, fake_omlx, fault, expected) -> None:
    fake_omlx.faults["/api/status"] = fault
    with pytest.raises(EngineError, match="engine omlx") as info:
        omlx.metrics()
    assert expected in str(info.value)


def test_unreachable_url_names_the_engine(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    adapter = OmlxAdapter(AdapterContext(workdir=tmp_path, url=url))
    with pytest.raises(UsageError, match=rf"engine omlx at {url} is unreachable"):
        adapter.preflight()


def test_launch_without_omlx_on_path_is_a_usage_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UsageError, match="`omlx` is not on PATH"):
        OmlxAdapter(AdapterContext(workdir=tmp_path)).preflight()


def test_persisted_entries_are_the_ssd_safetensors(tmp_path: Path) -> None:
    adapter = OmlxAdapter(AdapterContext(workdir=tmp_path))
    (adapter.ssd_dir() / "a").mkdir(parents=True)
    (adapter.ssd_dir() / "a" / "abc.safetensors").write_bytes(b"x" * 10)
    (adapter.ssd_dir() / "response-state").mkdir()
    (adapter.ssd_dir() / "response-state" / "r.json").write_text("{}")
    assert [p.name for p in adapter.persisted_entries()] == ["abc.safetensors"]
    assert adapter.persisted_bytes() == 10

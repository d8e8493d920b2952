"""Contract tests of adapters/omlx.py against FakeOmlx (no Mac, no MLX)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvconform.adapters.omlx.adapter import BLOCK_SIZE, OmlxAdapter, token_ids, words
from kvconform.contract import AdapterContext, deployed_block_size, metric_delta, read_metric, supported
from kvconform.contract import Capability as C
from kvconform.errors import EngineError, UsageError
from kvconform.processes import free_port
from tests.adapters.contract.fake_omlx import FakeOmlx


def test_token_ids_travel_as_words_and_cached_tokens_are_read(omlx: OmlxAdapter) -> None:
    prompt = list(range(500, 540))  # 40 words = 2 blocks of 16 + 8
    first = omlx.serve_prompt(prompt)
    second = omlx.serve_prompt(prompt)
    assert (first.prompt_tokens, first.cached_tokens) == (40, 0)
    assert second.cached_tokens == 32
    assert second.output == [42]
    assert token_ids(words([3, 4, 5])) == [3, 4, 5]


def test_block_size_is_read_from_runtime_cache(omlx: OmlxAdapter) -> None:
    assert deployed_block_size(omlx) == 16  # attached: the server's block, not oMLX's default 256


def test_resolved_block_size_is_the_servers_report(omlx: OmlxAdapter, fake_omlx: FakeOmlx) -> None:
    from kvconform.suites.prefix_reuse.counters import resolved_block_size

    assert omlx.resolved_block_size() is None  # attached: nothing is loaded on a team's server
    assert resolved_block_size(omlx) == 16  # the stats' report, judged, never the oracle's block
    assert not any(path.endswith("/load") for _, path in fake_omlx.log)


def test_launched_block_size_is_the_fixed_one_never_the_report(tmp_path: Path) -> None:
    launched = OmlxAdapter(AdapterContext(workdir=tmp_path))
    assert deployed_block_size(launched) == BLOCK_SIZE == 256
    assert C.BLOCK_SIZE_CONFIG not in launched.capabilities  # `omlx serve` cannot set it


def test_capabilities_attach_vs_launch(tmp_path: Path) -> None:
    launched = OmlxAdapter(AdapterContext(workdir=tmp_path))
    attached = OmlxAdapter(AdapterContext(workdir=tmp_path, url="http://127.0.0.1:9"))
    launch_only = {
        C.PERSISTENT_PREFIX,
        C.RESTART,
        C.CORRUPT_PERSISTED,
        C.FORCED_EVICTION,
        C.HOST_MEMORY,
        C.LONG_SESSION,
        C.INSTANCE_CHURN,
        C.INSTANCE_REGISTRY,
    }
    assert launch_only <= supported(launched)
    assert supported(attached) == frozenset(
        {C.PREFIX_CACHE, C.PREFIX_HIT_COUNTERS, C.ANSWERS_FROM_KV, C.RESET_PREFIX_CACHE, C.ABORT_REQUESTS}
    )
    assert C.KV_EVENTS not in launched.capabilities  # oMLX publishes no KV events
    assert C.BLOCK_POOL_STATS not in launched.capabilities


def test_metrics_read_session_scope_only(omlx: OmlxAdapter, fake_omlx: FakeOmlx) -> None:
    before = omlx.metrics()
    omlx.serve_prompt(list(range(10, 42)))
    omlx.serve_prompt(list(range(10, 42)))
    after = omlx.metrics()
    assert metric_delta(omlx, "prefix_queries", before, after) == 64
    assert metric_delta(omlx, "prefix_hits", before, after) == 31  # exact hit, trimmed by one
    fake_omlx.restart()  # a new server life: session counters start over, all-time go on
    fresh = omlx.metrics()
    assert read_metric(omlx, "prefix_queries", fresh) == 0
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
        assert read_metric(adapter, "prefix_queries", snap) == 20
        assert ("POST", "/admin/api/login") in fake.log
    finally:
        fake.close()


def test_reset_clears_ssd_and_hot_cache(omlx: OmlxAdapter, fake_omlx: FakeOmlx) -> None:
    prompt = list(range(300, 340))
    omlx.serve_prompt(prompt)
    assert omlx.serve_prompt(prompt).cached_tokens == 32
    omlx.reset_prefix_cache()
    assert omlx.serve_prompt(prompt).cached_tokens == 0
    assert ("POST", "/admin/api/ssd-cache/clear") in fake_omlx.log
    assert ("POST", "/admin/api/hot-cache/clear") in fake_omlx.log


def test_older_build_usage_and_no_hot_cache_route(tmp_path: Path) -> None:
    """Before oMLX #922: usage.cached_tokens only; /admin/api/hot-cache/clear answers 404."""
    fake = FakeOmlx(legacy=True)
    adapter = OmlxAdapter(AdapterContext(workdir=tmp_path, url=fake.url))
    try:
        prompt = list(range(400, 440))
        adapter.serve_prompt(prompt)
        assert adapter.serve_prompt(prompt).cached_tokens == 32
        assert adapter.clear_hot_cache() is None
        adapter.reset_prefix_cache()
        assert adapter.serve_prompt(prompt).cached_tokens == 0
        snap = adapter.metrics()
        assert not snap.has("omlx_runtime_cache_hot_cache_entries")
        assert snap.has("omlx_runtime_cache_total_num_files")
    finally:
        fake.close()


def test_current_usage_reports_prompt_tokens_details(omlx: OmlxAdapter, fake_omlx: FakeOmlx) -> None:
    body = omlx.completion_body(list(range(10, 30)), 1)
    data = omlx.post_json("/v1/completions", body)
    assert "cached_tokens" not in data["usage"]
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_login_on_a_server_without_api_key_is_refused_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key on the server: login 400 and admin 401 (no verification skipping configured)."""
    fake = FakeOmlx(skip_verification=False)
    monkeypatch.setenv("KVCONFORM_OMLX_API_KEY", "a-guess")
    adapter = OmlxAdapter(AdapterContext(workdir=tmp_path, url=fake.url))
    try:
        with pytest.raises(EngineError, match=r"login -> HTTP 400: the server has no API key") as info:
            adapter.clear_ssd_cache()
        assert "a-guess" not in str(info.value)
    finally:
        fake.close()


def test_stats_answer_never_keeps_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeOmlx(api_key="s3cret-key")
    monkeypatch.setenv("KVCONFORM_OMLX_API_KEY", "s3cret-key")
    adapter = OmlxAdapter(AdapterContext(workdir=tmp_path, url=fake.url))
    try:
        assert "api_key" not in adapter.session_stats()
        assert "s3cret" not in repr(adapter)
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


def test_launch_without_env_or_omlx_on_path_is_a_usage_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("KVCONFORM_ENV_ROOT", str(tmp_path / "no-envs"))
    with pytest.raises(UsageError, match=r"kvconform env build omlx\) and `omlx` is not on PATH"):
        OmlxAdapter(AdapterContext(workdir=tmp_path)).preflight()


def test_launch_command_keeps_everything_in_the_work_dir(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVCONFORM_OMLX_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.delenv("KVCONFORM_OMLX_API_KEY", raising=False)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "omlx").write_text("#!/bin/sh\n")
    (fake_bin / "omlx").chmod(0o755)
    monkeypatch.setenv("PATH", str(fake_bin))
    monkeypatch.setenv("KVCONFORM_ENV_ROOT", str(tmp_path / "no-envs"))
    work = tmp_path / "work"
    adapter = OmlxAdapter(AdapterContext(workdir=work))
    argv = adapter.server_argv(8123)
    opts = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert argv[:2] == [str(fake_bin / "omlx"), "serve"]
    assert Path(opts["--base-path"]).is_relative_to(work)  # never ~/.omlx
    assert Path(opts["--paged-ssd-cache-dir"]).is_relative_to(work)
    assert opts["--host"] == "127.0.0.1"
    assert len(opts["--api-key"]) >= 24  # generated per adapter: the admin API needs one
    assert opts["--api-key"] != OmlxAdapter(AdapterContext(workdir=work)).api_key
    assert (
        adapter.cache_capacity_tokens()
        == int(opts["--paged-ssd-cache-max-size"]) // (adapter.deployment.model.block_bytes(256)) * 256
    )


def test_settings_file_secrets_are_redacted(tmp_path: Path) -> None:
    adapter = OmlxAdapter(AdapterContext(workdir=tmp_path))
    settings = adapter.base_dir() / "settings.json"
    settings.parent.mkdir(parents=True)
    auth = {"api_key": adapter.api_key, "secret_key": "abc123", "skip_api_key_verification": False}
    settings.write_text(json.dumps({"server": {"port": 1}, "auth": auth}))
    adapter.redact_settings()
    data = json.loads(settings.read_text())
    assert data == {"server": {"port": 1}, "auth": {"skip_api_key_verification": False}}


def test_persistent_tier_is_the_ssd_safetensors(tmp_path: Path) -> None:
    adapter = OmlxAdapter(AdapterContext(workdir=tmp_path))
    (adapter.ssd_dir() / "a").mkdir(parents=True)
    (adapter.ssd_dir() / "a" / "abc.safetensors").write_bytes(b"x" * 10)
    (adapter.ssd_dir() / "response-state").mkdir()
    (adapter.ssd_dir() / "response-state" / "r.json").write_text("{}")
    tier = adapter.persistent_tier()
    assert [p.name for p in tier.files()] == ["abc.safetensors"]
    assert sum(tier.sizes().values()) == 10

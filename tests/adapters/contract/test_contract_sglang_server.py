"""Contract tests of the sglang-server adapter against FakeSglang (no GPU, no SGLang server).

The fake answers as SGLang 0.5.23's server does (see tests/adapters/contract/fake_sglang.py for the
source files each payload is shaped after). These are contract tests: they prove the
adapter's reading of SGLang's HTTP API and the suite's checks against it, never a run of
SGLang itself.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvconform.adapters.sglang_server.adapter as server_module
from kvconform.adapters.sglang.adapter import INPROCESS_CAPABILITIES, SglangAdapter
from kvconform.adapters.sglang_server.adapter import STUB_DIRS, SglangServerAdapter
from kvconform.contract import (
    AdapterContext,
    EngineConfig,
    RadixCacheModel,
    deployed_block_size,
    facet,
    metric_delta,
    read_metric,
    supported,
)
from kvconform.contract import Capability as C
from kvconform.errors import EngineError, UsageError
from kvconform.events import EventLedger
from kvconform.kit.zmq_events import ZmqEventSubscriber
from kvconform.processes import free_port
from tests.adapters.contract.fake_sglang import FakeSglang, FakeSglangPublisher, removed, stored
from tests.system.suite_runs import run_suites

ATTACHED = frozenset(
    {
        C.PREFIX_CACHE,
        C.PREFIX_HIT_COUNTERS,
        C.ANSWERS_FROM_KV,
        C.RESET_PREFIX_CACHE,
        C.FORCED_EVICTION,
        C.CACHE_SALT,
    }
)


@pytest.fixture
def fake_sglang() -> Iterator[FakeSglang]:
    server = FakeSglang()
    yield server
    server.close()


@pytest.fixture
def sglang(fake_sglang: FakeSglang, tmp_path: Path) -> Iterator[SglangServerAdapter]:
    adapter = SglangServerAdapter(AdapterContext(workdir=tmp_path, url=fake_sglang.url, request_timeout_s=5))
    yield adapter
    adapter.close()


# ---- requests ------------------------------------------------------------------------------
def test_generate_sends_input_ids_and_reads_cached_tokens(sglang: SglangServerAdapter, fake_sglang) -> None:
    prompt = list(range(100, 200))  # 100 tokens: 3 whole pages of 32 + 4
    first = sglang.serve_prompt(prompt)
    second = sglang.serve_prompt(prompt)
    assert (first.prompt_tokens, first.cached_tokens, first.source) == (100, 0, {})
    assert (second.cached_tokens, second.source) == (96, {"device": 96, "host": 0})
    assert second.output == [17]
    aligned = list(range(300, 364))  # 64 tokens = 2 pages: the last token is always computed
    sglang.serve_prompt(aligned)
    assert sglang.serve_prompt(aligned).cached_tokens == 32
    body = fake_sglang.bodies[0]
    assert body["input_ids"] == prompt and body["stream"] is False
    assert body["sampling_params"]["max_new_tokens"] == 1
    assert body["sampling_params"]["temperature"] == 0.0
    assert [p for m, p in fake_sglang.log if m == "POST"] == ["/generate"] * 4


def test_prompt_counted_differently_is_refused(tmp_path: Path) -> None:
    fake = FakeSglang(mode="bos")
    adapter = SglangServerAdapter(AdapterContext(workdir=tmp_path, url=fake.url))
    try:
        expected = r"engine sglang-server: /generate counted 41 prompt tokens for 40"
        with pytest.raises(EngineError, match=expected):
            adapter.serve_prompt(list(range(10, 50)))
    finally:
        fake.close()


def test_missing_cached_tokens_is_a_clear_engine_error(tmp_path: Path) -> None:
    fake = FakeSglang(mode="no_cached")
    adapter = SglangServerAdapter(AdapterContext(workdir=tmp_path, url=fake.url))
    try:
        expected = r"engine sglang-server: /generate: meta_info.cached_tokens is None"
        with pytest.raises(EngineError, match=expected):
            adapter.serve_prompt(list(range(10, 50)))
    finally:
        fake.close()


def test_stream_and_disconnect_reads_generate_chunks(sglang: SglangServerAdapter, fake_sglang) -> None:
    assert sglang.stream_and_disconnect(list(range(10, 60)), after_chunks=2) == 2
    assert fake_sglang.bodies[-1]["stream"] is True


# ---- reset -----------------------------------------------------------------------------------
def test_flush_cache_retried_while_it_answers_400(sglang: SglangServerAdapter, fake_sglang) -> None:
    prompt = list(range(500, 600))
    sglang.serve_prompt(prompt)
    fake_sglang.busy_flushes = 3
    sglang.reset_prefix_cache()
    assert fake_sglang.flushes == 4
    flush_calls = [(m, p) for m, p in fake_sglang.log if p.startswith("/flush_cache")]
    assert all(m == "POST" and p.startswith("/flush_cache?timeout=") for m, p in flush_calls)
    assert sglang.serve_prompt(prompt).cached_tokens == 0


def test_flush_cache_gives_up_with_the_servers_message(
    sglang: SglangServerAdapter, fake_sglang, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "RESET_RETRY_S", 0.5)
    fake_sglang.busy_flushes = 10**6
    with pytest.raises(EngineError, match=r"/flush_cache kept answering 400 .*Timed out waiting for idle"):
        sglang.reset_prefix_cache()


def test_flush_cache_http_500_is_not_retried(sglang: SglangServerAdapter, fake_sglang) -> None:
    fake_sglang.faults["/flush_cache"] = "500"
    with pytest.raises(EngineError, match=r"engine sglang-server: POST /flush_cache -> HTTP 500"):
        sglang.reset_prefix_cache()
    assert len([p for _, p in fake_sglang.log if p.startswith("/flush_cache")]) == 1


# ---- server info ----------------------------------------------------------------------------
def test_server_info_gives_version_page_size_and_capacity(sglang: SglangServerAdapter) -> None:
    assert sglang.version == "0.5.23+contract-fake"
    assert deployed_block_size(sglang) == 32
    assert sglang.deployment.block_size == 32  # the attached server's page size
    assert sglang.cache_capacity_tokens() == 4096


def test_older_server_info_endpoint_is_used_when_the_new_one_is_missing(tmp_path: Path) -> None:
    fake = FakeSglang(page_size=16, legacy=True)
    adapter = SglangServerAdapter(AdapterContext(workdir=tmp_path, url=fake.url))
    try:
        assert deployed_block_size(adapter) == 16
        assert ("GET", "/get_server_info") in fake.log
    finally:
        fake.close()


# ---- metrics --------------------------------------------------------------------------------
def test_sglang_metrics_map_to_logical_counters(sglang: SglangServerAdapter) -> None:
    before = sglang.metrics()
    assert not before.has("sglang:cached_tokens_total")  # lazily created: absent reads 0
    assert read_metric(sglang, "prefix_hits", before) == 0
    prompt = list(range(1000, 1100))
    sglang.serve_prompt(prompt)
    sglang.serve_prompt(prompt)
    sglang.stream_and_disconnect(list(range(2000, 2040)), after_chunks=1)
    after = sglang.metrics()
    assert metric_delta(sglang, "prefix_queries", before, after) == 240  # both is_streaming series
    assert metric_delta(sglang, "prefix_hits", before, after) == 96
    assert metric_delta(sglang, "prefix_hits_host", before, after) == 0
    assert read_metric(sglang, "kv_usage", after) == 0.0
    assert metric_delta(sglang, "requests", before, after) == 3


def test_eviction_counter_moves_past_capacity(sglang: SglangServerAdapter) -> None:
    before = sglang.metrics()
    for i in range(10):  # 10 x 512 tokens through a 4096-token pool
        sglang.serve_prompt([10 + (i * 512 + t) % 3000 for t in range(512)])
    after = sglang.metrics()
    assert metric_delta(sglang, "evicted_tokens", before, after) == 10 * 512 - 4096


# ---- capabilities ---------------------------------------------------------------------------
def test_capabilities_of_the_two_adapters(tmp_path: Path) -> None:
    inprocess = SglangAdapter(AdapterContext(workdir=tmp_path))
    attached = SglangServerAdapter(AdapterContext(workdir=tmp_path, url="http://127.0.0.1:9"))
    assert not issubclass(SglangServerAdapter, SglangAdapter)  # two adapters, not one branching
    assert supported(inprocess) == INPROCESS_CAPABILITIES
    assert supported(attached) == ATTACHED  # only what works over HTTP
    launched = SglangServerAdapter(AdapterContext(workdir=tmp_path))
    assert launched.env_spec == "sglang-server"
    caps = supported(launched)
    assert {C.RESTART, C.BLOCK_SIZE_CONFIG, C.KV_EVENTS, C.ABORT_REQUESTS, C.PREFIX_HIT_COUNTERS} <= caps
    assert not caps & {C.RADIX_CACHE_MODEL, C.PAGE_INDEX, C.TRANSFER_ACCOUNTING, C.RELEASE_GUARD}
    with pytest.raises(NotImplementedError, match="engine sglang-server provides no RadixCacheModel facet"):
        facet(launched, RadixCacheModel)
    with pytest.raises(UsageError, match="--engine sglang-server"):
        SglangAdapter(AdapterContext(workdir=tmp_path, url="http://127.0.0.1:9"))


def test_server_env_spec_for_the_in_process_engine_is_refused(tmp_path: Path) -> None:
    adapter = SglangAdapter(AdapterContext(workdir=tmp_path, env_name="sglang-server"))
    with pytest.raises(UsageError, match=r"--engine sglang-server"):
        adapter.preflight()


def test_launch_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = SglangServerAdapter(AdapterContext(workdir=tmp_path))
    python = tmp_path / "venv" / "bin" / "python"
    monkeypatch.setattr(adapter, "env", lambda: SimpleNamespace(python=python))
    monkeypatch.setattr(adapter, "model_dir", lambda: tmp_path / "model")
    argv = adapter.server_argv(EngineConfig(block_size=128), 30000, "tcp://127.0.0.1:5", "tcp://127.0.0.1:6")
    assert argv[:3] == [str(python), "-m", "sglang.launch_server"]
    flags = dict(itertools.pairwise(argv))
    assert flags["--model-path"] == str(tmp_path / "model") and "--load-format" not in flags
    assert flags["--page-size"] == "128" and flags["--port"] == "30000"
    assert flags["--max-total-tokens"] == "4096" and flags["--tp"] == "1"
    assert "--enable-metrics" in argv and "--skip-server-warmup" in argv
    # the default spec is the CPU build: SGLang's CPU engine with the native-torch attention
    assert flags["--device"] == "cpu" and flags["--attention-backend"] == "torch_native"
    events = json.loads(flags["--kv-events-config"])
    assert events == {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5",
        "bind": False,
        "replay_endpoint": "tcp://127.0.0.1:6",
        "topic": "kv",
    }


def test_cpu_spec_puts_the_stand_ins_on_the_path_and_the_cuda_spec_does_not(tmp_path: Path) -> None:
    cpu = SglangServerAdapter(AdapterContext(workdir=tmp_path))
    env = cpu.server_env(tmp_path / "tmp")
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["TMPDIR"] == str(tmp_path / "tmp")
    assert env["PYTHONPATH"].split(":") == [str(d) for d in STUB_DIRS]
    assert (STUB_DIRS[0] / "sgl_kernel" / "__init__.py").exists()
    assert (STUB_DIRS[1] / "torchvision" / "__init__.py").exists()
    gpu = SglangServerAdapter(AdapterContext(workdir=tmp_path, env_name="sglang-server-cuda"))
    env = gpu.server_env(tmp_path / "tmp")
    assert "SGLANG_USE_CPU_ENGINE" not in env and "PYTHONPATH" not in env
    gpu.env = lambda: SimpleNamespace(python=tmp_path / "python")  # type: ignore[method-assign]
    gpu.model_dir = lambda: tmp_path / "model"  # type: ignore[method-assign]
    argv = gpu.server_argv(EngineConfig(), 1, "tcp://127.0.0.1:5", "tcp://127.0.0.1:6")
    assert "--device" not in argv and "--attention-backend" not in argv


def test_sgl_kernel_stand_in_imports_and_raises_when_called() -> None:
    code = (
        "from sgl_kernel.scalar_type import ScalarType, scalar_types\n"
        "import sgl_kernel\n"
        "class K(sgl_kernel.SomeBase): pass\n"
        "t = scalar_types.uint4b8\n"
        "try:\n    sgl_kernel.common_ops.fused_add_rmsnorm_cpu(1)\nexcept RuntimeError as e:\n"
        "    print('raised', e)\n"
    )
    out = subprocess.run(
        ["python3", "-c", code],
        # the path the adapter gives the server: the sgl_kernel stand-in and the shared placeholders
        env={"PYTHONPATH": os.pathsep.join(str(d) for d in STUB_DIRS), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "raised sgl_kernel.common_ops.fused_add_rmsnorm_cpu was called" in out.stdout


def test_launched_oracles_come_from_the_request_not_the_server(tmp_path: Path) -> None:
    adapter = SglangServerAdapter(AdapterContext(workdir=tmp_path))
    assert deployed_block_size(adapter) == 16 and adapter.cache_capacity_tokens() == 4096
    adapter.config = EngineConfig(block_size=64)
    assert deployed_block_size(adapter) == 64


def test_the_resolved_page_size_is_the_servers_not_the_request(tmp_path: Path) -> None:
    """Launched, the page size /server_info reports is what the prefix checks judge against the
    request (a server that resolved another one fails there, on its measure); the oracles keep
    the requested one."""
    fake = FakeSglang(page_size=16)
    adapter = SglangServerAdapter(AdapterContext(workdir=tmp_path))
    adapter.base_url = fake.url
    try:
        adapter.config = EngineConfig(block_size=32)
        assert adapter.resolved_block_size() == 16
        assert deployed_block_size(adapter) == 32
    finally:
        fake.close()


# ---- KV events (launch mode's transport, with SGLang's encoding) -----------------------------
def test_sglang_kv_events_reach_the_ledger_and_gaps_are_replayed(tmp_path: Path) -> None:
    adapter = SglangServerAdapter(AdapterContext(workdir=tmp_path))
    ports = free_port(), free_port()
    config = adapter.kv_events_config(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")
    ledger = EventLedger()
    sub = ZmqEventSubscriber(
        ledger, config["endpoint"], topic="kv", replay_endpoint=config["replay_endpoint"]
    )
    pub = FakeSglangPublisher(config)
    try:
        pub.publish([stored([1, 2], None, list(range(64)), 32)])  # slow joiner: may be lost
        deadline = time.monotonic() + 5
        while not sub.seen and time.monotonic() < deadline:
            pub.publish([stored([90 + pub.seq], None, list(range(32)), 32)])
            time.sleep(0.05)
        assert sub.seen, "subscriber never received a batch"
        pub.publish([stored([3], 2, list(range(64, 96)), 32)], send=False)  # lost in transport
        pub.publish([removed([1])])
        time.sleep(0.3)
        replayer = threading.Thread(target=pub.serve_replay)
        replayer.start()
        filled = sub.fill_gaps()
        replayer.join()
        assert filled >= 1
        assert sub.decode_errors == []
        assert sorted(sub.seen) == list(range(pub.seq))
        kinds = {(e.kind, e.block_hashes) for e in ledger.events()}
        assert ("stored", ("3",)) in kinds and ("removed", ("1",)) in kinds
        assert ledger.judge().violations == []
    finally:
        pub.close()
        sub.close()


# ---- errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "fault", "call", "expected"),
    [
        ("/generate", "garbage", "serve", r"engine sglang-server: /generate returned non-JSON"),
        ("/generate", "500", "serve", r"engine sglang-server: POST /generate -> HTTP 500"),
        ("/metrics", "500", "metrics", r"engine sglang-server: GET /metrics -> HTTP 500"),
        ("/server_info", "garbage", "info", r"engine sglang-server: /server_info returned non-JSON"),
        ("/server_info", "500", "info", r"engine sglang-server: GET /server_info -> HTTP 500"),
    ],
)
def test_bad_answers_are_clear_engine_errors(
    sglang: SglangServerAdapter, fake_sglang, path: str, fault: str, call: str, expected: str
) -> None:
    fake_sglang.faults[path] = fault
    with pytest.raises(EngineError, match=expected):
        if call == "serve":
            sglang.serve_prompt(list(range(10, 50)))
        elif call == "metrics":
            sglang.metrics()
        else:
            deployed_block_size(sglang)


def test_unreachable_url_names_the_engine(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    adapter = SglangServerAdapter(AdapterContext(workdir=tmp_path, url=url))
    with pytest.raises(UsageError, match=rf"engine sglang-server at {url} is unreachable"):
        adapter.preflight()


# ---- the suite against the fake, as a user runs it (attach mode) ----------------------------
def run_suite(url: str, tmp_path: Path, target: str) -> subprocess.CompletedProcess[str]:
    options = ["--engine", "sglang-server", "--engine-url", url]
    return run_suites([target], options, tmp_path / "results", timeout=300)[0]


def test_prefix_reuse_suite_passes_on_a_block_exact_server(fake_sglang, tmp_path: Path) -> None:
    run = run_suite(fake_sglang.url, tmp_path, "kvconform/suites/prefix_reuse")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "failed" not in run.stdout
    assert "5 passed" in run.stdout, run.stdout[-2000:]
    records = json.loads((tmp_path / "results" / "results.json").read_text())
    assert records["session"]["engines"] == {"sglang-server": "0.5.23+contract-fake"}
    ran = {r["check"]: r["outcome"] for r in records["records"] if r["outcome"] != "skipped"}
    assert ran == {
        "prefix_reuse::test_repeated_prompt_served_from_cache": "passed",
        "prefix_reuse::test_reset_drops_cached_prefix": "passed",
        "prefix_reuse::test_partial_block_prefix_hits_match_oracle[32]": "passed",
        "prefix_reuse::test_evicted_prefix_not_reported_as_hit": "passed",
        "prefix_reuse::test_cache_salt_isolates_prefix_and_event_hashes": "passed",
    }


def test_prefix_reuse_suite_fails_with_numbers_when_partial_pages_lose_hits(tmp_path: Path) -> None:
    fake = FakeSglang(mode="partial_loss")
    try:
        run = run_suite(fake.url, tmp_path, "kvconform/suites/prefix_reuse/test_block_reuse.py")
    finally:
        fake.close()
    assert run.returncode == 1, run.stdout[-3000:]
    assert "1 failed" in run.stdout and "2 passed" in run.stdout, run.stdout[-3000:]
    assert "test_partial_block_prefix_hits_match_oracle[sglang-server-32]" in run.stdout
    expected = (
        "cached_tokens_in_response = 0 tokens, expected == 96 tokens [VIOLATED] (oracle floor(113/32)*32)"
    )
    assert expected in run.stdout, run.stdout[-3000:]
    assert "prefix_hits_counter_delta = 0 tokens, expected == 96 tokens [VIOLATED]" in run.stdout


def test_unreachable_engine_url_stops_the_session_with_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    run = run_suite(url, tmp_path, "kvconform/suites/prefix_reuse/test_block_reuse.py")
    assert run.returncode != 0
    assert f"engine sglang-server at {url} is unreachable" in run.stdout + run.stderr

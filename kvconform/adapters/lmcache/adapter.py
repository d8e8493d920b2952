"""LMCache: its multiprocess server (driven by a client of our own that plays a serving
engine's worker) and its in-process engine (the `destroy` release path).

The client (adapters/drivers/lmcache_mp_client.py) registers KV memory over POSIX shared
memory, looks up, retrieves (checking every byte against what was stored), stores and
unregisters through LMCache's own client code. Killing that client is how the stale-instance
reaper is exercised; stopping the server is the `close` path.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from kvconform import envs
from kvconform.adapters.lmcache.coordinator_index import LmcacheCoordinatorIndex
from kvconform.adapters.lmcache.redis_server import RedisServer, redis_binary
from kvconform.adapters.lmcache.redis_store import REDIS_L2_CAPACITY_BYTES, RedisStore
from kvconform.adapters.lmcache.trace_replay import LmcacheTraceReplay
from kvconform.contract import (
    AdapterContext,
    CacheReset,
    Capability,
    Deployment,
    EngineAdapter,
    EngineConfig,
    EngineTraits,
    InstanceChurn,
    KvEvents,
    KvPool,
    MetricMap,
    ModelShape,
    PersistentTier,
    ReclaimProbe,
    RemoteStore,
    RouterIndex,
    SaltedPrompts,
    SecondRelease,
    ServedPrompt,
    TraceReplay,
    apply_launch_profile,
    deployed_block_size,
    log_tail,
    poll_until,
    provides,
    read_metric,
)
from kvconform.errors import EngineError, UsageError
from kvconform.events import EventLedger, KvEvent
from kvconform.kit.drivers import DriverProcess, live_driver
from kvconform.kit.engine_env import EngineEnv
from kvconform.kit.http_api import HttpApi
from kvconform.kit.leftover_tally import LeftoverTally
from kvconform.kit.persistent_tiers import FileTier, StoreTier
from kvconform.kit.server import LaunchedServer
from kvconform.memory import SHM_DIR, MemoryMeasure, gpu_measures, sample_processes, threads_measure
from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport, free_port

DRIVERS = Path(__file__).resolve().parent / "drivers"  # run inside the engine's environment

C = Capability
# L1 evicts from a 1 Hz loop (lmcache/v1/distributed/storage_controllers/eviction_controller.py,
# L1EvictionController.eviction_loop: sleep(1), then 20 % of LRU keys once usage >= 0.8); a store
# into a full L1 between two runs is dropped (l1_allocation_failure), not made room for.
L1_EVICTION_PERIOD_S = 1.0
L1_GB = 0.05  # small, so eviction is reachable and the server's RSS stays ~470 MB
REAP_TIMEOUT_S = 30  # LMCache's minimum
LOCK_SETTLE_S = 2.0  # a store's L1 write locks clear within ms of its reply (commit callback)
CLIENT_DTYPES = {2: "float16", 4: "float32"}  # KV dtype our client registers, by bytes per element
SERVING_INSTANCE = 1
SERVING_BLOCKS = 512  # 8192 tokens of 16-token blocks
CHURN_BLOCKS = 256  # 4096 tokens: 4 MiB of KV per instance
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1", "DO_NOT_TRACK": "1"}
# LMCache's own `lmcache server` parser, built as lmcache/cli/main.py builds it (run inside an
# LMCache environment by envs.check_argvs): an unknown flag fails with its name.
SERVER_PARSER_CODE = """
def check(argv):
    import argparse
    from lmcache.cli.commands import register_commands

    parser = argparse.ArgumentParser(prog="lmcache")
    sub = parser.add_subparsers(dest="command")
    register_commands(sub, list(argv))
    parser.parse_args(argv)
"""


class LmcacheAdapter(
    EngineEnv, HttpApi, EngineAdapter, KvPool, SaltedPrompts, KvEvents, ReclaimProbe, CacheReset
):
    name = "lmcache"
    env_spec = "lmcache"
    # LMCache's chunk size
    deployment = Deployment(
        block_size=256, model=ModelShape(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2)
    )
    # a cache store returns every stored chunk; L1 evicts on a background loop
    # lookup_requested_tokens counts whole chunks only (a shorter tail is never looked up)
    traits = EngineTraits(
        recomputes_last_token=False,
        eviction_period_s=L1_EVICTION_PERIOD_S,
        queries_whole_blocks=True,
        metric_map=MetricMap(
            names={
                "prefix_queries": "lmcache_mp_lookup_requested_tokens_total",
                "prefix_hits": "lmcache_mp_lookup_hit_tokens_total",
                "lookup_requested_tokens": "lmcache_mp_lookup_requested_tokens_total",
                "lookup_hit_tokens": "lmcache_mp_lookup_hit_tokens_total",
                "l1_usage_bytes": "lmcache_mp_l1_memory_usage_bytes",
                "l1_usage_ratio": "lmcache_mp_l1_usage_ratio",
                "l2_usage_bytes": "lmcache_mp_l2_usage_bytes",
                "l2_store_submitted": "lmcache_mp_l2_store_submitted_objects_chunks_total",
                "l2_store_completed": "lmcache_mp_l2_store_completed_objects_chunks_total",
                # per store task, failed ones included (storage_controllers/store_controller.py
                # _finalize_store publishes L2_STORE_COMPLETED either way); the object counter above
                # counts successful chunks only (mp_observability/subscribers/metrics/l2.py)
                "l2_store_submitted_requests": "lmcache_mp_l2_store_submitted_requests_total",
                "l2_store_completed_requests": "lmcache_mp_l2_store_completed_requests_total",
            },
            lazy=frozenset(
                {
                    "prefix_queries",
                    "prefix_hits",
                    "lookup_requested_tokens",
                    "lookup_hit_tokens",
                    "l2_store_submitted",
                    "l2_store_completed",
                    "l2_store_submitted_requests",
                    "l2_store_completed_requests",
                }
            ),
        ),
    )
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.PREFIX_HIT_COUNTERS,
            # the answer is the retrieved bytes, checked against the prefix's own (op_retrieve)
            C.ANSWERS_FROM_KV,
            C.RESET_PREFIX_CACHE,
            C.BLOCK_SIZE_CONFIG,
            C.RESTART,
            C.PERSISTENT_PREFIX,
            C.CORRUPT_PERSISTED,
            C.FORCED_EVICTION,
            C.HOST_MEMORY,
            C.INSTANCE_CHURN,
            C.INSTANCE_REGISTRY,
            C.LONG_SESSION,
            C.TIERED_STORE_METRICS,
            C.CACHE_SALT,  # IPCCacheServerKey.cache_salt, as the vLLM connector sends it
            C.KV_EVENTS,  # SUBSCRIBE_KV_EVENTS: the server's sequenced CPU-tier records
            C.TRACE_REPLAY,  # its cache simulator over lookup-hash logs (drivers/lmcache_simulator_driver.py)
            C.RADIX_INDEX,  # its MP coordinator's key directory (`lmcache coordinator`)
        }
    )
    health_path = "/healthcheck"

    def unsupported(self) -> dict[Capability, str]:
        gaps = super().unsupported()
        if self.ctx.attached:
            # One sequence numbers every model's KV-event records: the gaps other models
            # leave in ours would read as losses.
            gaps[C.KV_EVENTS] = "attached: a shared server's KV-event sequence is every model's"
        return gaps

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.profile = apply_launch_profile(self, "lmcache")  # lmcache-redis takes lmcache's profiles
        self.server: LaunchedServer | None = None
        self.client: DriverProcess | None = None
        self.churner: DriverProcess | None = None
        self.inproc: DriverProcess | None = None
        self.simulator: DriverProcess | None = None
        self.coordinator: LmcacheCoordinatorIndex | None = None  # RADIX_INDEX
        self.rpc_url = ""
        self.closed = LeftoverTally()  # what the servers closed with an instance left
        self.killed_client_files = 0
        self.instances_made = 0

    # ---- lifecycle ----------------------------------------------------------------------
    def l2_dir(self) -> Path:
        return self.ctx.workdir / "l2"

    def l2_adapter_spec(self, config: EngineConfig) -> dict[str, Any] | None:
        """The `--l2-adapter` JSON: the fs adapter when the suite asks for persistence."""
        if not config.persistent:
            return None
        self.l2_dir().mkdir(parents=True, exist_ok=True)
        return {"type": "fs", "base_path": str(self.l2_dir())}

    def l1_gb(self) -> float:
        """L1 (host memory) of the server: the profile's kv_cache_bytes, else the small default."""
        if self.profile.kv_cache_bytes is not None:
            return self.profile.kv_cache_bytes / 2**30
        return L1_GB

    def server_args(
        self, config: EngineConfig, rpc_port: int, http_port: int, l2: dict[str, Any] | None
    ) -> list[str]:
        """`server ...`, the arguments after the program; a profile's extra_args last."""
        chunk = config.block_size or self.deployment.block_size
        argv = [
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(rpc_port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(http_port),
            "--chunk-size",
            str(chunk),
            "--l1-size-gb",
            f"{self.l1_gb():g}",
            "--eviction-policy",
            "LRU",
            "--worker-reap-timeout-seconds",
            str(REAP_TIMEOUT_S),
            "--worker-registration-grace-seconds",
            str(REAP_TIMEOUT_S),
        ]
        if l2 is not None:
            argv += ["--l2-adapter", json.dumps(l2)]
        return [*argv, *self.profile.extra_args]

    def command_argvs(self) -> list[list[str]]:
        """What launch mode would run (`server` first), default and persistent (the fs L2 at a
        placeholder path), for the argument-parser check."""
        fs = {"type": "fs", "base_path": "/placeholder/l2"}
        return [
            self.server_args(EngineConfig(), 5555, 8080, None),
            self.server_args(EngineConfig(), 5555, 8080, fs),
        ]

    def preflight(self) -> None:
        super().preflight()
        if not self.ctx.attached and not self.profile.is_default:
            self.check_command_line()

    def check_command_line(self) -> None:
        """A profile's command lines against LMCache's own `lmcache server` parser, in the launch
        env if built, else in the CPU env of the same release (the spec's parser_env)."""
        try:
            env = self.env()
        except UsageError:
            spec = self.ctx.env_name or self.profile.env or str(self.env_spec)
            env = envs.find(envs.load_spec(spec).parser_env)
        argvs = self.command_argvs()
        for argv, error in zip(
            argvs, envs.check_argvs(env, SERVER_PARSER_CODE, argvs, LMCACHE_ENV), strict=True
        ):
            if error:
                raise UsageError(
                    f"launch profile {self.profile.name}: lmcache server ({env.version}) rejects its "
                    f"command line: {error}\n  lmcache {' '.join(argv)}"
                )

    def register_args(self) -> dict[str, Any]:
        """The KV layout our client registers: the profile's model shape (and name), else the tiny
        default model's."""
        shape = self.deployment.model
        if shape.dtype_bytes not in CLIENT_DTYPES:
            raise UsageError(
                f"launch profile {self.profile.name}: [model_shape] dtype_bytes {shape.dtype_bytes} "
                f"has no KV dtype our client registers (one of {sorted(CLIENT_DTYPES)})"
            )
        args: dict[str, Any] = {
            "num_layers": shape.layers,
            "num_heads": shape.kv_heads,
            "head_size": shape.head_dim,
            "dtype": CLIENT_DTYPES[shape.dtype_bytes],
        }
        if self.profile.served_model_name:
            args["model_name"] = self.profile.served_model_name
        return args

    def start(self, config: EngineConfig) -> None:
        rpc_port, http_port = free_port(), free_port()
        argv = [
            str(self.env().bin("lmcache")),
            *self.server_args(config, rpc_port, http_port, self.l2_adapter_spec(config)),
        ]
        self.base_url = f"http://127.0.0.1:{http_port}"
        self.rpc_url = f"tcp://127.0.0.1:{rpc_port}"
        self.server = LaunchedServer(
            self.name,
            "lmcache-server",
            argv,
            self.ctx.workdir,
            self.url(self.health_path),
            env={**LMCACHE_ENV, **self.profile.env_vars},
            timeout_s=self.ctx.start_timeout_s,
            session=self.http,
        )
        self.config = config
        self.client = self._client("lmcache-client")
        self.client.call(
            "register",
            instance_id=SERVING_INSTANCE,
            num_blocks=SERVING_BLOCKS,
            heartbeat_s=5.0,
            **self.register_args(),
        )
        self._subscribe_events()

    def attach(self) -> None:
        """The suite's client: it speaks LMCache's RPC protocol, whose address the HTTP URL
        does not give (KVCONFORM_LMCACHE_RPC_URL)."""
        if self.client is None:
            self.rpc_url = os.environ.get("KVCONFORM_LMCACHE_RPC_URL", "")
            if not self.rpc_url:
                raise UsageError(
                    "engine lmcache in attach mode: set KVCONFORM_LMCACHE_RPC_URL to the server's "
                    "RPC address (tcp://HOST:PORT of `lmcache server --port`)"
                )
            self.client = self._client("lmcache-client")
            self.client.call(
                "register", instance_id=SERVING_INSTANCE, num_blocks=SERVING_BLOCKS, heartbeat_s=5.0
            )

    def attached_version(self) -> str:
        return "unknown (attached)"

    def _client(self, name: str) -> DriverProcess:
        return DriverProcess(
            self.name,
            self.env().python,
            DRIVERS / "lmcache_mp_client.py",
            self.ctx.workdir / "logs" / f"{name}.log",
            env={
                **LMCACHE_ENV,
                "KVC_LMCACHE_RPC_URL": self.rpc_url,
                "KVC_LMCACHE_HTTP_URL": self.base_url or "",
            },
            shm_patterns=("lmcache_kv_*",),
        )

    def stop(self) -> list[TeardownReport]:
        reports = []
        for driver in (self.client, self.churner):
            if driver is not None:
                reports.append(driver.close())
        self.client = self.churner = None
        if self.server is not None:
            reports.append(self.server.stop())
            self.server = None
        self.config = None
        return reports

    def close(self) -> None:
        super().close()
        for driver in (self.inproc, self.simulator):
            if driver is not None:
                driver.close()
        self.inproc = self.simulator = None
        if self.coordinator is not None:
            self.coordinator.close()
            self.coordinator = None

    # ---- the router's directory (RADIX_INDEX) ---------------------------------------------
    @provides(RouterIndex)
    def router_index(self) -> RouterIndex:
        if self.coordinator is None:
            self.coordinator = LmcacheCoordinatorIndex(
                self.name,
                lambda: self.env().bin("lmcache"),
                self.ctx.workdir,
                LMCACHE_ENV,
                self.ctx.start_timeout_s,
            )
        return self.coordinator

    # ---- offline replay (TRACE_REPLAY) --------------------------------------------------
    @provides(TraceReplay)
    def trace_replay(self) -> TraceReplay:
        return LmcacheTraceReplay(self.name, self._simulator_call, self.deployment.model)

    def _simulator_call(self, op: str, **args: Any) -> Any:
        self.simulator = live_driver(
            self.simulator,
            lambda: DriverProcess(
                self.name,
                self.env().python,
                DRIVERS / "lmcache_simulator_driver.py",
                self.ctx.workdir / "logs" / "lmcache-simulator.log",
                env=LMCACHE_ENV,
            ),
        )
        return self.simulator.call(op, **args)

    def running(self) -> bool:
        return self.server is not None and self.server.process.alive()

    # ---- requests -----------------------------------------------------------------------
    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        """What a serving engine with LMCache does per request: look up and retrieve the cached
        prefix (bytes checked), compute the rest, store the prompt's full chunks."""
        return self._serve(tokens, "")

    def serve_salted(self, tokens: list[int], salt: str, max_tokens: int = 1) -> ServedPrompt:
        """The same, with the request's cache salt in every key, as LMCache's vLLM connector
        sends it (lmcache_mp_metadata.py LMCacheMPRequestTracker.cache_salt)."""
        return self._serve(tokens, salt)

    def _serve(self, tokens: list[int], salt: str) -> ServedPrompt:
        assert self.client is not None
        salted: dict[str, Any] = {"cache_salt": salt} if salt else {}
        got = self.client.call("retrieve", instance_id=SERVING_INSTANCE, token_ids=tokens, **salted)
        stored = self.client.call("store", instance_id=SERVING_INSTANCE, token_ids=tokens, **salted)
        if not stored.get("ok", False):
            raise EngineError(self.name, f"store of {len(tokens)} tokens failed: {stored}", log_tail(self))
        intact = got.get("bytes_match") is not False
        return ServedPrompt(len(tokens), int(got.get("hit_tokens") or 0), [int(intact)])

    # ---- KV events: the server's own sequenced records (modules/kv_events.py) -------------
    def _subscribe_events(self) -> None:
        """A fresh ledger per server process: its records are numbered from its start, from 1
        (multiprocess/modules/kv_events.py: _kv_event_next_seq = 1; a subscription from cursor
        0 replays every record after it)."""
        assert self.client is not None
        self.ledger = EventLedger(first_seq=1)
        self.client.call("subscribe_events", instance_id=SERVING_INSTANCE)

    def drain_events(self) -> int:
        """Take the records the server pushed. Their `seq` is the server's, counted over every
        model (the suite registers one), so a record it dropped shows as a gap; a batch with
        `lost` set is LMCache saying so itself (KVEventBatch)."""
        if self.client is None:
            return 0
        time.sleep(self.traits.event_settle_s)
        got = self.client.call("take_events")
        if got.get("error"):
            raise EngineError(self.name, f"KV event subscription failed: {got['error']}", log_tail(self))
        events: list[KvEvent] = []
        for batch in got.get("batches", []):
            if not batch["enabled"]:
                raise EngineError(self.name, "the server records no KV events (disabled)", log_tail(self))
            for record in batch["events"]:
                if record["kind"] not in ("stored", "removed"):
                    raise EngineError(self.name, f"KV event record of unknown kind: {record}")
                events.append(
                    KvEvent(
                        record["seq"],
                        "stored" if record["kind"] == "stored" else "removed",
                        tuple(record["block_hashes"]),
                        record["parent"],
                        record["medium"].lower(),
                        record["token_count"],
                    )
                )
        self.ledger.extend(events)
        return 0

    def reset_prefix_cache(self) -> None:
        self.post_json("/cache/clear", {"tier": "l1", "force": True})

    def metrics(self) -> MetricSnapshot:
        return self.scrape("/metrics")

    def engine_pids(self) -> list[int]:
        return self.server.pids() if self.server else []

    def kv_pool_bytes(self) -> int:
        return int(self.l1_gb() * 2**30)

    def cache_capacity_tokens(self) -> int:
        return self.kv_pool_bytes() // self.deployment.model.kv_bytes_per_token()

    # ---- persistence ---------------------------------------------------------------------
    @provides(PersistentTier)
    def persistent_tier(self) -> PersistentTier:
        """The fs L2 adapter's files (one per chunk), flushed by the L2 store tasks."""
        return FileTier(
            self.l2_dir(), "**/*", self.deployment.model.block_bytes(deployed_block_size(self)), self.flush_l2
        )

    def flush_l2(self, timeout_s: float = 30.0, quiet_s: float = 0.5) -> None:
        """Until every chunk written to L1 is in L2 and nothing new came for quiet_s, as LMCache's
        own GET /status tells it: no L1 write lock held (the chunks the client stored are
        committed), no key waiting for the store controller, no L2 store task in flight
        (store_controller.py report_status). The task counters, which count a failed task done
        (the object counters never count a failed chunk), agree. The controller submits from its
        own loop after the client's store returned: on a loaded runner a quiet spell alone can
        end before it submitted anything. Not done in timeout_s: an error, never a partial tier."""
        deadline = time.monotonic() + timeout_s
        last, since = -1.0, time.monotonic()
        while True:
            snap = self.metrics()
            submitted = read_metric(self, "l2_store_submitted_requests", snap)
            completed = read_metric(self, "l2_store_completed_requests", snap)
            busy = self.l2_store_backlog()
            if submitted != last:
                last, since = submitted, time.monotonic()
            if submitted <= completed and not any(busy.values()) and time.monotonic() - since >= quiet_s:
                return
            if time.monotonic() > deadline:
                raise EngineError(
                    self.name,
                    f"L2 stores not done after {timeout_s:.0f} s: {submitted:.0f} store tasks submitted, "
                    f"{completed:.0f} completed; {busy}",
                    log_tail(self),
                )
            time.sleep(0.1)

    def storage_status(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """GET /status's L1 managers and store controllers (storage_manager report_status)."""
        sm = self.get_json("/status").get("storage_manager", {})
        # 0.5.6: one entry per L1 tag; earlier releases: one unnamed entry
        managers = sm.get("l1_managers") or ({"l1": sm["l1_manager"]} if "l1_manager" in sm else {})
        stores = sm.get("store_controllers") or (
            {"l1": sm["store_controller"]} if "store_controller" in sm else {}
        )
        if not managers or not stores:
            raise EngineError(self.name, f"GET /status names no L1 manager or store controller: {sorted(sm)}")
        return managers, stores

    def l2_store_backlog(self) -> dict[str, int]:
        """What GET /status says is still on its way to L2: L1 write locks held, keys waiting for
        the store controller, store tasks in flight (summed over L1 managers)."""
        managers, stores = self.storage_status()
        try:  # a field LMCache no longer reports is an error, never a 0 that reads as drained
            return {
                "l1_write_locked": sum(int(m["write_locked_count"]) for m in managers.values()),
                "pending_keys": sum(int(c["pending_keys_count"]) for c in stores.values()),
                "in_flight_tasks": sum(int(c["in_flight_task_count"]) for c in stores.values()),
            }
        except KeyError as missing:
            raise EngineError(self.name, f"GET /status lacks {missing} (report_status)") from None

    def l1_objects_locked(self) -> int:
        """L1 objects requests hold now, read- or write-locked, by LMCache's own count
        (L1Manager.report_status read_locked_count + write_locked_count). A store's write locks
        clear a few ms after its reply (the commit callback): read once they have, or after
        LOCK_SETTLE_S, so what is counted is what no request released."""

        def locked() -> int:
            managers, _stores = self.storage_status()
            try:
                return sum(
                    int(m["read_locked_count"]) + int(m["write_locked_count"]) for m in managers.values()
                )
            except KeyError as missing:
                raise EngineError(self.name, f"GET /status lacks {missing} (report_status)") from None

        poll_until(lambda: locked() == 0, timeout_s=LOCK_SETTLE_S, interval_s=0.05)
        return locked()

    # ---- instance churn -------------------------------------------------------------------
    @provides(InstanceChurn)
    def instance_churn(self) -> InstanceChurn:
        return LmcacheChurn(self, ("unregister", "reaper", "close", "destroy"))

    def churn_cycle(self, path: str, index: int, tokens: list[int]) -> None:
        instance_id = self._next_instance_id()
        if path == "destroy":
            self._inproc_cycle(index, tokens)
            return
        if path == "close":
            self._close_cycle(instance_id, tokens)
            return
        client = self._client(f"lmcache-churn-{path}") if path == "reaper" else self._churn_client()
        client.call(
            "register",
            instance_id=instance_id,
            num_blocks=CHURN_BLOCKS,
            heartbeat_s=2.0,
            **self.register_args(),
        )
        client.call("store", instance_id=instance_id, token_ids=tokens)
        client.call("retrieve", instance_id=instance_id, token_ids=tokens)
        if path == "unregister":
            client.call("unregister", instance_id=instance_id)
            return
        pid = client.process.pid
        client.process.kill_hard()  # the worker dies without unregistering
        self._wait_reaped(instance_id)
        client.close()
        self.killed_client_files += self._unlink_client_shm(pid)

    def _next_instance_id(self) -> int:
        self.instances_made += 1
        return 1000 + self.instances_made

    def _churn_client(self) -> DriverProcess:
        if self.churner is None or not self.churner.process.alive():
            self.churner = self._client("lmcache-churn")
        return self.churner

    def _wait_reaped(self, instance_id: int, timeout_s: float = 3 * REAP_TIMEOUT_S) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if instance_id not in self.get_json("/status").get("registered_gpu_ids", []):
                return time.monotonic() - t0
            time.sleep(1.0)
        raise EngineError(
            self.name,
            f"instance {instance_id} not reaped {timeout_s:.0f}s after its client died",
            log_tail(self),
        )

    def _unlink_client_shm(self, pid: int) -> int:
        """A SIGKILLed client's shm segments outlive it; nobody else removes them."""
        count = 0
        for path in SHM_DIR.glob(f"lmcache_kv_{pid}_*"):
            with contextlib.suppress(OSError):
                path.unlink()
                count += 1
        return count

    def _close_cycle(self, instance_id: int, tokens: list[int]) -> None:
        client = self._churn_client()
        client.call(
            "register",
            instance_id=instance_id,
            num_blocks=CHURN_BLOCKS,
            heartbeat_s=0.0,
            **self.register_args(),
        )
        client.call("store", instance_id=instance_id, token_ids=tokens)
        config = self.config or EngineConfig()
        assert self.server is not None
        report = self.server.stop()  # the server closes with the instance still registered
        self.server = None
        self.closed.count(report)
        for driver in (self.client, self.churner):  # clients of a closed server go too
            if driver is not None:
                self.killed_client_files += len(driver.close().leftover_shm)
        self.client = self.churner = None
        self.start(config)

    def _inproc_cycle(self, index: int, tokens: list[int]) -> None:
        self.inproc = live_driver(
            self.inproc,
            lambda: DriverProcess(
                self.name,
                self.env().python,
                DRIVERS / "lmcache_inproc_driver.py",
                self.ctx.workdir / "logs" / "lmcache-inproc.log",
                env=LMCACHE_ENV,
            ),
        )
        engine_id = f"churn-{index}"
        self.inproc.call(
            "create",
            engine_id=engine_id,
            chunk_size=deployed_block_size(self),
            max_local_cpu_size_gb=self.l1_gb(),
        )
        self.inproc.call("store", engine_id=engine_id, token_ids=tokens)
        got = self.inproc.call("retrieve", engine_id=engine_id, token_ids=tokens)
        if got.get("bytes_match") is False:
            raise EngineError(self.name, f"in-process retrieve returned other bytes than stored: {got}")
        self.inproc.call("destroy", engine_id=engine_id)

    def reclaim_probe(self, path: str | None = None) -> dict[str, MemoryMeasure]:
        if path == "destroy":
            sample = sample_processes(self.inproc.pids() if self.inproc else [])
            return {
                "inproc_engine_rss_bytes": MemoryMeasure(sample.rss, exact=False),
                # LMCacheEngine's workers (async store, prefetch) end with destroy (cache_engine.py close)
                "inproc_engine_threads": threads_measure(sample),
            }
        if path == "close":
            return {
                "closed_server_leftover_processes": MemoryMeasure(
                    self.closed.counts["processes"], True, "processes"
                ),
                "closed_server_leftover_shm_bytes": MemoryMeasure(self.closed.counts["shm_bytes"], True),
            }
        sample = sample_processes(self.engine_pids())
        measures = {
            "server_shm_mapped_bytes": MemoryMeasure(sample.shm_bytes, exact=True),
            "server_rss_bytes": MemoryMeasure(sample.rss, exact=False),
            **gpu_measures(sample),
        }
        if path is None and self.running():
            # The KV requests pin in L1 between requests: every object a request locked and did
            # not release (LMCache#4852: read locks of a lookup nobody retrieves, kept for the
            # server's lifetime). One chunk object is a block of the registered model's KV.
            chunk = self.deployment.model.block_bytes(deployed_block_size(self))
            measures["l1_bytes_locked_by_requests"] = MemoryMeasure(
                self.l1_objects_locked() * chunk, exact=True
            )
        return measures

    def unregister_twice(self, tokens: list[int]) -> SecondRelease:
        client = self._churn_client()
        instance_id = self._next_instance_id()
        client.call(
            "register",
            instance_id=instance_id,
            num_blocks=CHURN_BLOCKS,
            heartbeat_s=0.0,
            **self.register_args(),
        )
        client.call("store", instance_id=instance_id, token_ids=tokens)
        first = client.call("unregister", instance_id=instance_id)
        second = client.call("unregister", instance_id=instance_id)
        return SecondRelease(
            bool(first.get("was_registered")) and not first.get("server_error"),
            second.get("server_error") is None,
            f"second: {second.get('server_error') or 'no error'}",
        )

    # ---- logs -------------------------------------------------------------------------------
    def logs(self, lines: int = 80) -> dict[str, str]:
        logs = {"lmcache server": self.server.log_tail(lines) if self.server else ""}
        for name, driver in (
            ("client", self.client),
            ("churn client", self.churner),
            ("in-process", self.inproc),
        ):
            if driver is not None:
                logs[f"lmcache {name}"] = driver.log_tail(lines)
        return logs

    def cleanup_workdir(self) -> None:
        shutil.rmtree(self.l2_dir(), ignore_errors=True)


class LmcacheRedisAdapter(LmcacheAdapter):
    """LMCache's MP server with its RESP L2 adapter against a real redis-server the suite owns.

    Redis is a second process of the stack: started with the first LMCache launch, kept across
    LMCache restarts (that is the point of a remote tier), stopped and audited in close(). The
    L2 tier is Redis in every config (this engine *is* LMCache-with-Redis), with LMCache's own
    L2 eviction (LRU) at REDIS_L2_CAPACITY_BYTES.
    """

    name = "lmcache-redis"
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.PREFIX_HIT_COUNTERS,
            C.ANSWERS_FROM_KV,  # the retrieved bytes, checked as on `lmcache`
            C.RESTART,
            C.PERSISTENT_PREFIX,
            C.TIERED_STORE_METRICS,
            C.REMOTE_TIER,
            # with Redis attached, every instance's stores also go to L2: churn and long
            # sessions are judged on this deployment too, not only on L1-and-disk `lmcache`
            C.HOST_MEMORY,
            C.INSTANCE_CHURN,
            C.INSTANCE_REGISTRY,
            C.LONG_SESSION,
            C.BLOCK_SIZE_CONFIG,  # --chunk-size, as on `lmcache`; Redis is kept across restarts
            C.CACHE_SALT,  # the salt is part of the key in L1 and in Redis alike
            C.KV_EVENTS,
            # A prefix L1 evicted still comes back from Redis until L2's own eviction drops it:
            # cache_capacity_tokens counts both tiers.
            C.FORCED_EVICTION,
        }
    )

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.redis: RedisServer | None = None
        self.redis_reports: list[TeardownReport] = []
        self.redis_left_files: list[str] = []

    def preflight(self) -> None:
        super().preflight()
        redis_binary()  # a clear UsageError naming the Debian package when it is missing

    def cache_capacity_tokens(self) -> int:
        """L1 and the Redis L2 behind it (LMCache's L2 capacity, REDIS_L2_CAPACITY_BYTES)."""
        return (
            super().cache_capacity_tokens()
            + REDIS_L2_CAPACITY_BYTES // self.deployment.model.kv_bytes_per_token()
        )

    def ensure_redis(self) -> RedisServer:
        if self.redis is not None and not self.redis.alive():
            self.stop_remote()  # it died under us: audit what it left
        if self.redis is None:
            self.redis = RedisServer(self.ctx.workdir)
        return self.redis

    def l2_adapter_spec(self, config: EngineConfig) -> dict[str, Any] | None:
        self.ensure_redis()
        assert self.redis is not None
        return {
            "type": "resp",
            "host": "127.0.0.1",
            "port": self.redis.port,
            "num_workers": 2,
            "max_capacity_gb": REDIS_L2_CAPACITY_BYTES / 2**30,
            "eviction": {"eviction_policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2},
        }

    def engine_pids(self) -> list[int]:
        return super().engine_pids() + (self.redis.pids() if self.redis and self.redis.alive() else [])

    def close(self) -> None:
        super().close()
        if self.redis is not None:
            report = self.stop_remote()
            if not report.clean or self.redis_left_files:
                raise EngineError(
                    self.name,
                    f"redis teardown: {report.describe()}; data dir files {self.redis_left_files}",
                )

    # ---- the remote tier (REMOTE_TIER) ----------------------------------------------------
    def running_redis(self) -> RedisServer:
        if self.redis is None or not self.redis.alive():
            raise EngineError(self.name, "the Redis L2 server is not running")
        return self.redis

    @provides(RemoteStore)
    def remote_tier(self) -> RemoteStore:
        return RedisStore(self)

    def stop_remote(self) -> TeardownReport:
        assert self.redis is not None
        report = self.redis.stop()
        self.redis_left_files = self.redis.left_data_files
        self.redis_reports.append(report)
        self.redis = None
        return report

    @provides(InstanceChurn)
    def instance_churn(self) -> InstanceChurn:
        # The MP server's release paths, with Redis as its L2; `destroy` is LMCache's in-process
        # engine, which has no Redis here (its fs-L2 churn is judged on `lmcache`).
        return LmcacheChurn(self, ("unregister", "reaper", "close"))

    @provides(PersistentTier)
    def persistent_tier(self) -> PersistentTier:
        """Redis is L2: its objects are the persistent tier."""
        return StoreTier(
            self.remote_tier(), self.deployment.model.block_bytes(deployed_block_size(self)), self.flush_l2
        )

    def logs(self, lines: int = 80) -> dict[str, str]:
        logs = super().logs(lines)
        if self.redis is not None:
            logs["redis server"] = self.redis.log_tail(lines)
        return logs

    def cleanup_workdir(self) -> None:
        super().cleanup_workdir()
        shutil.rmtree(self.ctx.workdir / "redis-data", ignore_errors=True)


class LmcacheChurn(InstanceChurn):
    """Instances of the LMCache server (its clients register, store, retrieve and release) and,
    where the engine has no remote L2, LMCache's in-process engine."""

    def __init__(self, engine: LmcacheAdapter, paths: tuple[str, ...]) -> None:
        self.engine = engine
        self.paths = paths

    def cycle(self, path: str, index: int, tokens: list[int]) -> None:
        self.engine.churn_cycle(path, index, tokens)

    def cycles(self, path: str, requested: int) -> int:
        return min(requested, 2) if path == "reaper" else requested  # ~37 s per reap

    def warmup_path(self, path: str) -> str:
        return "unregister" if path == "reaper" else path

    def second_release(self, path: str, tokens: list[int]) -> SecondRelease:
        return self.engine.unregister_twice(tokens)

    def release_notes(self, path: str) -> list[str]:
        return list(self.engine.closed.notes) if path == "close" else []

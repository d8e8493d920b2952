"""Dynamo: frontend with the KV router + mocker workers (file discovery, TCP request plane,
ZMQ event plane: no etcd, no NATS), and in-process through adapters/drivers/dynamo_driver.py
(RadixTree, offline replay), plus the slot tracker service.

Dynamo writes into $HOME/.cache and $TMPDIR and keeps discovery files: each stack gets its
own HOME, TMPDIR and discovery directory under the work directory.
"""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path
from typing import Any, ClassVar

import requests

from kvconform.adapters.dynamo.router_index import DynamoRouterIndex
from kvconform.adapters.dynamo.slot_tracker import SlotTrackerClient
from kvconform.adapters.dynamo.trace_replay import DynamoTraceReplay
from kvconform.contract import (
    ActiveBlockTracker,
    AdapterContext,
    Capability,
    Deployment,
    DisaggregatedServing,
    EngineAdapter,
    EngineConfig,
    EngineTraits,
    InstanceChurn,
    KvEvents,
    KvPool,
    KvRouter,
    MetricMap,
    ModelShape,
    OffloadTier,
    ReclaimProbe,
    RouterIndex,
    SaltedPrompts,
    SecondRelease,
    ServedPrompt,
    TraceReplay,
    deployed_block_size,
    ensure,
    log_tail,
    poll_until,
    provides,
    read_metric,
)
from kvconform.errors import EngineError, EngineStartError
from kvconform.events import StreamedLedger
from kvconform.kit.drivers import DriverProcess, engine_side_script, live_driver
from kvconform.kit.engine_env import EngineEnv
from kvconform.kit.http_api import HttpApi
from kvconform.kit.restart_churn import RestartChurn
from kvconform.kit.server import LaunchedServer
from kvconform.kit.zmq_events import ZmqEventSubscriber
from kvconform.memory import MemoryMeasure
from kvconform.metrics import MetricSnapshot
from kvconform.polling import seconds_until_steady
from kvconform.processes import TeardownReport, free_port

DRIVERS = Path(__file__).resolve().parent / "drivers"  # run inside the engine's environment

C = Capability
MODEL_NAME = "tiny"
WORKERS = 2
GPU_BLOCKS = 256  # per mocker
GAUGE_SETTLE_S = 0.5  # a mocker's pass that finished a request publishes its gauges just after
DRAIN_TIMEOUT_S = 10.0
# The offload configuration's host tier (--num-host-blocks, per DP rank): four device pools, so
# the offload scenario's prompts stay in it beside the fill that evicts them from the device.
HOST_BLOCKS = 4 * GPU_BLOCKS
DISAGG_BANDWIDTH_GBPS = 10.0
# The mocker's simulated step times, unscaled: about 15.5 ms per decoded token (1.6.1, measured),
# so a request nobody aborted is still decoding when a check reads it seconds later (at 100x,
# 1536 tokens took 0.25 s and an abort could not be told from a finished request). Prefill,
# which most checks are made of, stays at tens of ms.
SPEEDUP_RATIO = 1
RELEASE_SETTLE_S = 10.0  # a stopped worker leaves the frontend's routable set within this
SHUTDOWN_ERRORS = (" ERROR ", "panicked", "Traceback")  # a second shutdown that was not a no-op


class DynamoAdapter(
    EngineEnv,
    HttpApi,
    EngineAdapter,
    KvPool,
    KvRouter,
    SaltedPrompts,
    DisaggregatedServing,
    KvEvents,
    ReclaimProbe,
):
    name = "dynamo"
    env_spec = "dynamo"
    worker_label = "mocker"  # in the workers' log names
    deployment = Deployment(block_size=16, model=ModelShape(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2))
    traits = EngineTraits(
        workers=WORKERS,
        metric_map=MetricMap(
            names={
                "prefix_queries": "dynamo_frontend_input_sequence_tokens_sum",
                "prefix_hits": "dynamo_frontend_cached_tokens_sum",
                # IntCounterVec "kv_cache_events_applied" {event_type, status} of the KV router's indexer
                # (lib/kv-router/src/indexer/metrics.rs, 1.6.1); the runtime prefixes dynamo_component_
                # and, being Rust's prometheus crate, adds no _total (none in 1.6.1's _core.abi3.so).
                "router_events_applied": "dynamo_component_kv_cache_events_applied",
                "active_blocks": "dynamo_frontend_worker_active_decode_blocks",
                # Each mocker's simulated KV pool, on its system port in vLLM's names (used blocks /
                # pool blocks, set as its scheduler steps); summed over the mockers it is 0 only when
                # no worker holds a block for a request.
                "kv_usage": "vllm:kv_cache_usage_perc",
            },
        ),
    )
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.PREFIX_HIT_COUNTERS,
            C.CACHE_SALT,  # nvext.cache_salt, pinned to one worker (serve_salted)
            C.BLOCK_SIZE_CONFIG,
            C.RESTART,
            C.FORCED_EVICTION,
            C.HOST_MEMORY,
            C.LONG_SESSION,
            C.INSTANCE_CHURN,  # whole-stack restarts (RestartChurn): frontend and mockers
            C.INSTANCE_REGISTRY,  # a mocker leaving the frontend's discovery, its runtime shut down twice
            C.ABORT_REQUESTS,  # live request counts, the mockers' KV usage, their KV events
            C.KV_EVENTS,  # each mocker's vLLM-format ZMQ stream (--zmq-kv-events-ports), a ledger stream each
            C.ROUTER_PREDICTION,
            C.RADIX_INDEX,
            C.TRACE_REPLAY,
            C.BLOCK_TRACKER,
            C.DISAGG_SERVING,
            C.OFFLOAD_HOST_HITS,  # the mocker's native vLLM G2 host tier (--num-host-blocks), one mocker
        }
    )
    # Read from each mocker's system port and merged into metrics() with a `mocker` label.
    worker_metric_families: ClassVar[tuple[str, ...]] = (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "dynamo_component_inflight_requests",
    )

    def unsupported(self) -> dict[Capability, str]:
        gaps = super().unsupported()
        if self.ctx.attached:
            # The suite knows the frontend only: the mockers' system ports (their KV usage,
            # their request counts) and event ports are a team's own.
            why = "attached: the workers' event and system ports are not the suite's"
            gaps |= {C.ABORT_REQUESTS: why, C.KV_EVENTS: why}
            gaps[C.INSTANCE_REGISTRY] = "attached: the workers are a team's own, the suite stops none"
        return gaps

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.churn = DynamoChurn(self)
        self.frontend: LaunchedServer | None = None
        self.mockers: list[LaunchedServer] = []
        self.driver: DriverProcess | None = None
        self.tracker: LaunchedServer | None = None
        self.tracker_url = ""
        self._model_dir: Path | None = None
        self._stacks = 0
        self._stack: Path | None = None
        self.system_ports: list[int] = []  # each mocker's system server (health, /metrics)
        self.subscribers: list[ZmqEventSubscriber] = []  # one per aggregated mocker (KV_EVENTS)
        self.streams = StreamedLedger(())

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
                        *self.model_args(),
                    ],
                    check=True,
                    capture_output=True,
                    timeout=300,
                )
            self._model_dir = out
        return self._model_dir

    def model_args(self) -> list[str]:
        """make_tiny_model.py's arguments: the mocker reads the model's config and tokenizer only."""
        return []

    def stack_env(self, stack: Path) -> dict[str, str]:
        for sub in ("kv", "home", "tmp", "hf"):
            (stack / sub).mkdir(parents=True, exist_ok=True)
        return {
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(stack / "kv"),
            "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq",
            "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            "DYN_SYSTEM_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "HOME": str(stack / "home"),
            "TMPDIR": str(stack / "tmp"),
            "HF_HOME": str(stack / "hf"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }

    def start(self, config: EngineConfig) -> None:
        if config.persistent:
            raise NotImplementedError("Dynamo's mocker keeps no KV across restarts (simulated tiers)")
        block = config.block_size or self.deployment.block_size
        self._stacks += 1
        stack = self.ctx.workdir / f"stack-{self._stacks}"
        self._stack = stack
        env = self.stack_env(stack)
        python = str(self.env().python)
        planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.frontend = LaunchedServer(
            self.name,
            "dynamo-frontend",
            [
                python,
                "-m",
                "dynamo.frontend",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                str(port),
                "--router-mode",
                "kv",
                "--kv-cache-block-size",
                str(block),
                *planes,
            ],
            self.ctx.workdir,
            self.url("/live"),
            env=env,
            timeout_s=self.ctx.start_timeout_s,
            session=self.http,
        )
        self.mockers = []
        self.system_ports = []
        roles = self.worker_roles(config)
        self.streams = StreamedLedger(f"mocker-{i}" for i, role in enumerate(roles) if role is None)
        self.ledger = self.streams
        for i, role in enumerate(roles):
            system_port = free_port()
            self.system_ports.append(system_port)
            self.mockers.append(
                LaunchedServer(
                    self.name,
                    f"dynamo-{self.worker_label}-{i}-{role or 'agg'}",
                    [python, *self.worker_args(i, role, block, config), *planes],
                    self.ctx.workdir,
                    f"http://127.0.0.1:{system_port}/health",
                    env={
                        **env,
                        **self.worker_env(),
                        "DYN_SYSTEM_PORT": str(system_port),
                        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
                    },
                    timeout_s=self.ctx.start_timeout_s,
                    session=self.http,
                )
            )
        if not poll_until(
            self._all_workers_routable, timeout_s=min(120.0, self.ctx.start_timeout_s), interval_s=0.2
        ):
            tails = log_tail(self, 60)
            self.stop()
            raise EngineStartError(
                self.name, f"frontend never listed {len(roles)} workers for model {MODEL_NAME}", tails
            )
        self.config = config

    def worker_args(self, index: int, role: str | None, block: int, config: EngineConfig) -> list[str]:
        """A mocker: vLLM's scheduler and KV manager simulated, no model (dynamo/mocker)."""
        return [
            "-m",
            "dynamo.mocker",
            "--model-path",
            str(self.model_dir()),
            "--model-name",
            MODEL_NAME,
            "--block-size",
            str(block),
            "--num-gpu-blocks-override",
            str(GPU_BLOCKS),
            "--speedup-ratio",
            str(SPEEDUP_RATIO),
            *self.disagg_args(role),
            *self.event_args(index, role),
            *(["--num-host-blocks", str(HOST_BLOCKS)] if config.offload else []),
        ]

    def worker_env(self) -> dict[str, str]:
        return {}

    def event_args(self, index: int, role: str | None) -> list[str]:
        """An aggregated mocker publishes its KV events in vLLM's ZMQ format on a port of its
        own, with a replay socket for gaps (dynamo/mocker/args.py:546, :555); the suite's
        subscriber connects to it (the mocker binds) and feeds that mocker's ledger stream."""
        if role is not None:
            return []
        events, replay = free_port(), free_port()
        self.subscribers.append(
            ZmqEventSubscriber(
                self.streams.streams[f"mocker-{index}"],
                f"tcp://127.0.0.1:{events}",
                replay_endpoint=f"tcp://127.0.0.1:{replay}",
                connect=True,
            )
        )
        return ["--zmq-kv-events-ports", str(events), "--zmq-replay-ports", str(replay)]

    def drain_events(self) -> int:
        time.sleep(self.traits.event_settle_s)
        return sum(sub.fill_gaps() for sub in self.subscribers)

    def close_event_subscriber(self) -> None:
        for sub in self.subscribers:
            sub.close()
        self.subscribers = []

    @staticmethod
    def worker_roles(config: EngineConfig) -> list[str | None]:
        """Offload runs one mocker: the KV router predicts from device blocks only (a host hit
        reads as kv_hit_rate 0), so with two it may send a prompt back to the other worker."""
        if config.disaggregated:
            return ["prefill", "decode"]
        return [None] if config.offload else [None] * WORKERS

    def disagg_args(self, role: str | None) -> list[str]:
        """Prefill/decode mockers hand KV off at the model's bytes per token over a set link."""
        if role is None:
            return []
        args = [
            "--disaggregation-mode",
            role,
            "--kv-bytes-per-token",
            str(self.deployment.model.kv_bytes_per_token()),
            "--kv-transfer-bandwidth",
            str(DISAGG_BANDWIDTH_GBPS),
        ]
        return [*args, "--bootstrap-ports", str(free_port())] if role == "prefill" else args

    def routable_workers(self) -> int | None:
        """Workers the frontend routes the model to (its /health "generate" instances, the model
        listed in /v1/models); None when the frontend does not answer."""
        try:
            health = self.http.get(self.url("/health"), timeout=2).json()
            models = self.http.get(self.url("/v1/models"), timeout=2).json()
        except (requests.RequestException, ValueError):
            return None
        if not any(m.get("id") == MODEL_NAME for m in models.get("data", [])):
            return 0
        return len(generate_instances(health))

    def _all_workers_routable(self) -> bool:
        return (self.routable_workers() or 0) >= len(self.mockers)

    def release_worker_twice(self) -> SecondRelease:
        """Stop one mocker as Kubernetes does (SIGTERM). Its own code releases its runtime
        twice: the signal handler's graceful_shutdown shuts each DistributedRuntime down, then
        worker()'s finally shuts them down again (dynamo/mocker/main.py:34, :276-283). The
        first release must take the worker out of the frontend's routable set, the second be a
        no-op: the process exits 0 with both shutdowns logged and no error after them. The
        stack stays one worker short until the next check's ensure relaunches it."""
        before = self.routable_workers()
        mocker = self.mockers.pop()
        self.stale = "a check stopped one of its workers (the stack is relaunched in full)"
        report = mocker.stop()
        after = before
        deadline = time.monotonic() + RELEASE_SETTLE_S
        while time.monotonic() < deadline and after == before:
            time.sleep(0.2)
            after = self.routable_workers()
        lines = mocker.log_tail(200).splitlines()
        first = next(
            (i for i, line in enumerate(lines) if "DistributedRuntime shutdown complete" in line), None
        )
        later = lines[first + 1 :] if first is not None else []
        second = any("Shutting down DistributedRuntime instances" in line for line in later)
        errors = [line for line in later if any(mark in line for mark in SHUTDOWN_ERRORS)]
        released = not report.forced_kill and before is not None and after is not None and after < before
        return SecondRelease(
            released,
            second and report.exit_code == 0 and not errors,
            f"{report.describe()}; routable workers {before} -> {after}; first shutdown logged: "
            f"{first is not None}, second: {second}; errors after it: {errors[:3] or 'none'}",
        )

    def stop(self) -> list[TeardownReport]:
        reports = [m.stop() for m in self.mockers]
        if self.frontend is not None:
            reports.append(self.frontend.stop())
        self.mockers, self.frontend = [], None
        self.system_ports = []
        self.close_event_subscriber()
        self.config = None
        if self._stack is not None:
            left = self.leftover_registrations(self._stack)
            self.churn.tally.counts.setdefault("registrations", 0)
            self.churn.tally.counts["registrations"] += len(left)
            if left:
                notes = [f"left {len(left)} registrations, e.g. {left[:3]}"]
                reports.append(TeardownReport("dynamo discovery", None, 0.0, False, notes=notes))
            self._stack = None
        return reports

    @staticmethod
    def leftover_registrations(stack: Path) -> list[str]:
        """Entries a stopped stack left in its file discovery directory (instances, model cards,
        event channels). A graceful shutdown removes every one (mocker/main.py:34
        graceful_shutdown -> DistributedRuntime.shutdown; 0 left in 1.6.1, measured); one left
        behind is a dead worker a new frontend on the same directory would route to."""
        root = stack / "kv"
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    @provides(InstanceChurn)
    def instance_churn(self) -> InstanceChurn:
        return self.churn

    def reclaim_probe(self, path: str | None = None) -> dict[str, MemoryMeasure]:
        """What the stopped stacks left, cumulative over restarts: processes and /dev/shm files
        (RestartChurn) and file-discovery registrations; while the stack runs, the KV blocks its
        mockers' requests hold (exact, by the mockers' own allocators)."""
        measures = self.churn.leftover_measures()
        registrations = self.churn.tally.counts.get("registrations", 0)
        measures["restart_leftover_registrations"] = MemoryMeasure(
            registrations, True, "registrations", holds_kv=False
        )
        if self.running():
            measures["kv_blocks_held_bytes"] = MemoryMeasure(self.kv_blocks_held_bytes(), True)
        return measures

    def kv_blocks_held_bytes(self) -> float:
        """The KV blocks requests hold in the mockers now, in bytes, by each mocker's own
        allocator: its vllm:kv_cache_usage_perc is active blocks / --num-gpu-blocks
        (MockerMetrics::from_parts, lib/llm/src/mocker/metrics.rs in 1.6.1; active = blocks a
        live request references, cached blocks no request holds are inactive), so the sum over
        the mockers times GPU_BLOCKS is the held blocks (k/256 survives the text format
        exactly). Read once no request is open anywhere in the stack, after a fixed settle: a
        mocker sets its gauges at its scheduler's pass, which can come after the response."""
        if not poll_until(lambda: self.requests_in_flight() == 0, timeout_s=DRAIN_TIMEOUT_S):
            raise EngineError(
                self.name,
                f"requests still open {DRAIN_TIMEOUT_S:.0f} s after the last response "
                f"({self.requests_in_flight()} in flight)",
                log_tail(self),
            )
        time.sleep(GAUGE_SETTLE_S)
        usage = read_metric(self, "kv_usage", self.metrics())
        blocks = round(usage * self.worker_pool_blocks())
        return blocks * self.deployment.model.block_bytes(deployed_block_size(self))

    def worker_pool_blocks(self) -> int:
        """Blocks in one worker's KV pool: the mockers' --num-gpu-blocks-override."""
        return GPU_BLOCKS

    def close(self) -> None:
        super().close()
        if self.driver is not None:
            self.driver.close()
            self.driver = None
        if self.tracker is not None:
            self.tracker.stop()
            self.tracker = None

    def running(self) -> bool:
        procs = [self.frontend, *self.mockers]
        return self.frontend is not None and all(p is not None and p.process.alive() for p in procs)

    def attached_version(self) -> str:
        return "unknown (attached)"

    # ---- requests -----------------------------------------------------------------------
    def _complete(self, tokens: list[int], max_tokens: int) -> dict[str, Any]:
        body = self.completion_body(tokens, max_tokens)
        body["nvext"]["extra_fields"] += ["worker_id", "timing"]
        return self.post_json("/v1/completions", body)

    def completion_body(self, tokens: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
        """Greedy, with the answer's token ids (nvext.completion_token_ids: Dynamo's completion
        responses carry no choices[].token_ids)."""
        return {
            "model": MODEL_NAME,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
            "nvext": {"extra_fields": ["completion_token_ids"]},
        }

    def served_from_openai(self, data: Any, tokens: list[int]) -> ServedPrompt:
        served = super().served_from_openai(data, tokens)
        ids = ((data.get("nvext") or {}).get("completion_token_ids")) or served.output
        return ServedPrompt(served.prompt_tokens, served.cached_tokens, [int(t) for t in ids])

    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        return self.served_from_openai(self._complete(tokens, max_tokens), tokens)

    def serve_salted(self, tokens: list[int], salt: str, max_tokens: int = 1) -> ServedPrompt:
        """nvext.cache_salt, Dynamo's salt API (ai-dynamo/dynamo#8197: salted requests are
        routed and reused apart, their blocks hashed with the salt), every salted request sent
        to the same worker (nvext.backend_instance_id): with two workers the router may place
        two salts' requests apart, isolating them by placement alone; on one worker the
        isolation is the backend's to keep."""
        body = self.completion_body(tokens, max_tokens)
        body["nvext"] |= {"cache_salt": salt, "backend_instance_id": self.pinned_worker()}
        return self.served_from_openai(self.post_json("/v1/completions", body), tokens)

    def pinned_worker(self) -> int:
        """The lowest instance id among the frontend's generate endpoints."""
        health = self.get_json("/health")
        ids = [i["instance_id"] for i in generate_instances(health)]
        if not ids:
            raise EngineError(
                self.name, f"frontend /health lists no generate instance: {health}", log_tail(self)
            )
        return min(ids)

    def serve_disaggregated(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        if self.config is None or not self.config.disaggregated:
            raise EngineError(self.name, "serve_disaggregated needs EngineConfig(disaggregated=True)")
        return self.serve_prompt(tokens, max_tokens)

    def serve_routed(self, tokens: list[int]) -> tuple[int, ServedPrompt]:
        """The router's prediction for this request: nvext.timing.kv_hit_rate is matched
        blocks / prompt blocks, so matched tokens = rate x ceil(n / block) x block."""
        self._wait_router_caught_up()
        data = self._complete(tokens, 1)
        served = self.served_from_openai(data, tokens)
        rate = ((data.get("nvext") or {}).get("timing") or {}).get("kv_hit_rate")
        if rate is None:
            raise EngineError(self.name, f"response lacks nvext.timing.kv_hit_rate: {data.get('nvext')}")
        block = deployed_block_size(self)
        return round(float(rate) * math.ceil(len(tokens) / block)) * block, served

    def _wait_router_caught_up(self, quiet_s: float = 0.3, timeout_s: float = 5.0) -> None:
        """The router applies KV events asynchronously (eventually consistent by design): route
        once its applied-events counter has stopped moving, so a prediction is judged against
        the events of the requests before it, not against the transport's lag."""
        (name,) = self.traits.metric_map.sample_names("router_events_applied")
        last: list[float] = []

        def settled() -> bool:
            total = self.metrics().value(name, 0.0)
            moved = not last or last[-1] != total
            last.append(total)
            return not moved

        seconds_until_steady(settled, timeout_s, quiet_s)

    def router_event_status(self, before: MetricSnapshot, after: MetricSnapshot) -> dict[str, float]:
        """KV events the router applied since `before`, by status (ok, parent_block_not_found,
        block_not_found, invalid_block, ...: lib/kv-router/src/indexer/metrics.rs)."""
        (name,) = self.traits.metric_map.sample_names("router_events_applied")
        if not after.has(name):
            raise EngineError(
                self.name, f"metric {name} is absent from the frontend's /metrics after routed requests"
            )
        statuses = sorted({labels.get("status", "?") for labels in after.labels_of(name)})
        return {s: after.value(name, status=s) - before.value(name, 0.0, status=s) for s in statuses}

    def metrics(self) -> MetricSnapshot:
        """The frontend's /metrics, with the mockers' per-worker families merged in."""
        snap = self.scrape("/metrics")
        for index, port in enumerate(self.system_ports):
            where = f"mocker {index} /metrics"
            worker = self.scrape("/metrics", base=f"http://127.0.0.1:{port}")
            # The vllm: gauges appear with a mocker's first request (1.6.1, measured): absent on
            # a mocker whose generate endpoint has served nothing, they are 0; absent after
            # that, an error.
            served = worker.value("dynamo_component_requests_total", 0.0, dynamo_endpoint="generate")
            for family in self.worker_metric_families:
                if not worker.has(family) and served:
                    raise EngineError(self.name, f"{where} lacks {family} after {served:.0f} requests")
                rows = snap.samples.setdefault(family, {})
                if not worker.has(family):
                    rows[frozenset({("mocker", str(index))})] = 0.0
                for labels, value in worker.samples.get(family, {}).items():
                    rows[labels | {("mocker", str(index))}] = value
        return snap

    def requests_in_flight(self) -> int | None:
        """Requests still open anywhere in the stack, by live counts: the frontend's
        (dynamo_frontend_inflight_requests), each mocker's request handlers
        (dynamo_component_inflight_requests of its generate endpoint) and each mocker's
        scheduler (vllm:num_requests_running + vllm:num_requests_waiting)."""
        snap = self.metrics()
        total = 0.0  # the frontend's gauge appears with its first request (labelled by model)
        if snap.has("dynamo_frontend_inflight_requests"):
            total = snap.value("dynamo_frontend_inflight_requests")
        elif served := snap.value("dynamo_frontend_requests_total", 0.0):
            missing = "dynamo_frontend_inflight_requests"
            raise EngineError(self.name, f"frontend /metrics lacks {missing} after {served:.0f} requests")
        total += snap.value("dynamo_component_inflight_requests", dynamo_endpoint="generate")
        total += snap.value("vllm:num_requests_running") + snap.value("vllm:num_requests_waiting")
        return round(total)

    def cache_capacity_tokens(self) -> int:
        return GPU_BLOCKS * deployed_block_size(self)  # per worker; the router spreads the fill

    def kv_pool_bytes(self) -> int:
        workers = len(self.worker_roles(self.config)) if self.config else WORKERS
        return workers * GPU_BLOCKS * self.deployment.model.block_bytes(deployed_block_size(self))

    @provides(OffloadTier)
    def host_tier(self) -> OffloadTier:
        return MockerHostTier(self)

    def engine_pids(self) -> list[int]:
        return [pid for p in (self.frontend, *self.mockers) if p is not None for pid in p.pids()]

    # ---- in-process (RADIX_INDEX, TRACE_REPLAY) -----------------------------------------
    @provides(RouterIndex)
    def router_index(self) -> RouterIndex:
        return DynamoRouterIndex(self.inproc)

    @provides(TraceReplay)
    def trace_replay(self) -> TraceReplay:
        return DynamoTraceReplay(self.inproc)

    def inproc(self, op: str, **args: Any) -> Any:
        self.driver = live_driver(
            self.driver,
            lambda: DriverProcess(
                self.name,
                self.env().python,
                DRIVERS / "dynamo_driver.py",
                self.ctx.workdir / "logs" / "dynamo-driver.log",
                env=self.stack_env(self.ctx.workdir / "driver"),
            ),
        )
        return self.driver.call(op, **args)

    # ---- slot tracker (BLOCK_TRACKER) ---------------------------------------------------
    @provides(ActiveBlockTracker)
    def block_tracker(self) -> ActiveBlockTracker:
        return SlotTrackerClient(self.name, self._tracker_call)

    def _tracker_call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One call to the slot tracker service (started on first use): (HTTP status, JSON)."""
        if self.tracker is None or not self.tracker.process.alive():
            port = free_port()
            self.tracker_url = f"http://127.0.0.1:{port}"
            self.tracker = LaunchedServer(
                self.name,
                "dynamo-slot-tracker",
                [str(self.env().python), "-m", "dynamo.slot_tracker", "--port", str(port)],
                self.ctx.workdir,
                f"{self.tracker_url}/health",
                env=self.stack_env(self.ctx.workdir / "tracker"),
                timeout_s=60,
                session=self.http,
            )
        resp = self.http.request(method, f"{self.tracker_url}{path}", json=body, timeout=10)
        try:
            payload = resp.json() if resp.content else None
        except ValueError:
            payload = resp.text
        return resp.status_code, payload

    def logs(self, lines: int = 80) -> dict[str, str]:
        logs = {}
        for server in (self.frontend, *self.mockers, self.tracker):
            if server is not None:
                logs[server.process.name] = server.log_tail(lines)
        if self.driver is not None:
            logs["dynamo driver"] = self.driver.log_tail(lines)
        return logs


def generate_instances(health: dict[str, Any]) -> list[dict[str, Any]]:
    """The workers' generate endpoints in the frontend's /health answer."""
    return [i for i in health.get("instances", []) if i.get("endpoint") == "generate"]


class DynamoChurn(RestartChurn):
    """Whole-stack restarts; a second release is one worker's runtime shut down twice by its
    own code."""

    def __init__(self, engine: DynamoAdapter) -> None:
        super().__init__(engine)
        self.stack = engine

    def second_release(self, path: str, tokens: list[int]) -> SecondRelease:
        ensure(self.stack, self.stack.config or EngineConfig())
        self.stack.serve_prompt(tokens)
        return self.stack.release_worker_twice()


class MockerHostTier(OffloadTier):
    """The mocker's native vLLM G2 host tier (dynamo/mocker/config.py _build_native_host_offload
    -> the rank's native_host_offload): simulated inside its scheduler's steps, with no counter
    or event of its own (1.6.1: no host metric on the frontend or the mocker's system port, every
    KV event says storage tier "device"). What comes back from it is read in the answers'
    cached tokens."""

    def __init__(self, engine: DynamoAdapter) -> None:
        self.engine = engine

    def wait_idle(self, timeout_s: float = 15.0, quiet_s: float = 1.0) -> None:
        """Until no request is open anywhere in the stack for `quiet_s`: a store to the host
        tier is part of the step that frees the block (copy time at the d2h bandwidth)."""
        deadline = time.monotonic() + timeout_s
        still_since = time.monotonic()
        while time.monotonic() < deadline:
            if self.engine.requests_in_flight():
                still_since = time.monotonic()
            elif time.monotonic() - still_since >= quiet_s:
                return
            time.sleep(0.1)
        raise EngineError(self.engine.name, f"requests still open {timeout_s:.0f} s after the offload load")

    def block_bytes(self) -> int:
        return self.engine.deployment.model.block_bytes(deployed_block_size(self.engine))

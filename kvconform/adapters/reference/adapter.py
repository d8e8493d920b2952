"""The reference engine (engines/reference): the suite's own, fault-injectable proving ground.

It runs with the suite's interpreter (torch is a suite dependency), so it needs no engine
environment: `pytest suites` works on a fresh checkout. Faults come from --fault.
"""

from __future__ import annotations

import base64
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import requests

from kvconform.contract import (
    AdapterContext,
    BlockPoolStats,
    CacheReset,
    Capability,
    Deployment,
    DisaggregatedServing,
    EngineAdapter,
    EngineConfig,
    EngineTraits,
    InstanceChurn,
    KvPool,
    KvRouter,
    KvTransfer,
    MetricMap,
    ModelShape,
    OffloadTier,
    PersistentTier,
    ReclaimProbe,
    ReleaseGuard,
    ReleaseTwice,
    SecondRelease,
    ServedPrompt,
    TransferResult,
    deployed_block_size,
    log_tail,
    provides,
)
from kvconform.engines.reference import VERSION
from kvconform.engines.reference.disk import HEADER as DISK_HEADER
from kvconform.errors import EngineError
from kvconform.kit.event_feed import ZmqEventFeed
from kvconform.kit.http_api import HttpApi
from kvconform.kit.leftover_tally import LeftoverTally
from kvconform.kit.offload_tier import MetricOffloadTier
from kvconform.kit.persistent_tiers import FileTier
from kvconform.kit.server import LaunchedServer
from kvconform.memory import MemoryMeasure, gpu_measures, nvml, sample_processes
from kvconform.metrics import MetricSnapshot
from kvconform.processes import SHM_DIR, TeardownReport, free_port

C = Capability
# The folder holding the kvconform package: the server runs as `-m kvconform.engines...` from it.
PACKAGE_PARENT = Path(__file__).resolve().parents[3]
NUM_BLOCKS = 256
OFFLOAD_CHUNKS = 64
DISK_HEADER_BYTES = DISK_HEADER.size


class ReferenceAdapter(
    ZmqEventFeed,
    HttpApi,
    EngineAdapter,
    KvPool,
    KvRouter,
    DisaggregatedServing,
    ReleaseGuard,
    ReclaimProbe,
    CacheReset,
):
    name = "reference"
    env_spec = None
    # pytest option dests it reads from ctx.options (its own plugin adds --fault: .options)
    pytest_options = ("fault",)
    deployment = Deployment(block_size=16, model=ModelShape(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2))
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.PREFIX_HIT_COUNTERS,
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
            C.OFFLOAD_GAUGES,
            C.OFFLOAD_STORE_FAILURE,
            C.OFFLOAD_HOST_HITS,
            C.TIERED_STORE_METRICS,
            C.BLOCK_POOL_STATS,
            C.KV_EVENTS,
            C.ABORT_REQUESTS,
            C.TRANSFER_ACCOUNTING,
            C.PAGE_INDEX,
            C.RELEASE_GUARD,
            C.ROUTER_PREDICTION,
            C.DISAGG_SERVING,
        }
    )
    traits = EngineTraits(
        event_settle_s=0.3,
        metric_map=MetricMap(
            names={
                "prefix_queries": "kvref_prefix_queries_total",
                "prefix_hits": "kvref_prefix_hits_total",
                "cached_by_source_host": "kvref_prompt_tokens_cached_by_source_total{source=host}",
                "kv_usage": "kvref_kv_usage_perc",
                "blocks_total": "kvref_blocks_total",
                "offload_usage": "kvref_offload_usage_perc",
                "offload_write_usage": "kvref_offload_write_usage_perc",
                "offload_read_usage": "kvref_offload_read_usage_perc",
                "offload_store_bytes": "kvref_offload_store_bytes_total",
                "offload_load_bytes": "kvref_offload_load_bytes_total",
                "offload_stored_blocks": "kvref_offload_stored_blocks_total",
                "offload_loaded_blocks": "kvref_offload_loaded_blocks_total",
                "offload_failed_stores": "kvref_offload_failed_stores_total",
                "transfer_bytes_sent": "kvref_transfer_bytes_sent_total",
                "transfer_bytes_received": "kvref_transfer_bytes_received_total",
                "l2_usage_bytes": "kvref_disk_usage_bytes",
                "l2_store_submitted": "kvref_disk_store_submitted_total",
                "l2_store_completed": "kvref_disk_store_completed_total",
            },
        ),
    )  # events leave the engine with each response
    shm_prefix = "kvconform-ref-"

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.server: LaunchedServer | None = None
        self.decode: LaunchedServer | None = None
        self.exports: dict[str, tuple[str, int]] = {}
        self.gpu_exports: dict[str, Any] = {}
        self.churn_leftovers = {p: LeftoverTally() for p in ("close", "restart")}

    @property
    def faults(self) -> tuple[str, ...]:
        return tuple(self.ctx.options.get("fault") or ())

    @property
    def version(self) -> str:
        return VERSION + (f"+faults:{','.join(self.faults)}" if self.faults else "")

    def attached_version(self) -> str:
        return str(self.get_json("/version").get("version", "unknown"))

    # ---- lifecycle ----------------------------------------------------------------------
    def disk_dir(self) -> Path:
        return self.ctx.workdir / "disk"

    def _launch(self, name: str, config: EngineConfig, events: bool) -> tuple[LaunchedServer, str]:
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "kvconform.engines.reference.server",
            "--port",
            str(port),
            "--block-size",
            str(config.block_size or self.deployment.block_size),
            "--num-blocks",
            str(NUM_BLOCKS),
        ]
        if config.offload:
            argv += ["--offload-chunks", str(OFFLOAD_CHUNKS)]
        if config.persistent:
            argv += ["--disk-dir", str(self.disk_dir())]
        if events:
            events_endpoint, replay_endpoint = self.open_event_subscriber()
            argv += ["--events-endpoint", events_endpoint, "--replay-endpoint", replay_endpoint]
        for fault in self.faults:
            argv += ["--fault", fault]
        url = f"http://127.0.0.1:{port}"
        inherited_path = os.environ.get("PYTHONPATH")
        server = LaunchedServer(
            self.name,
            name,
            argv,
            self.ctx.workdir,
            f"{url}/health",
            # after ours, what the caller's PYTHONPATH holds (a GPU runner's carried wheels)
            env={"PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_PARENT), inherited_path]))},
            timeout_s=self.ctx.start_timeout_s,
            session=self.http,
        )
        return server, url

    def start(self, config: EngineConfig) -> None:
        if not config.persistent and self.disk_dir().exists():
            shutil.rmtree(self.disk_dir())
        self.server, self.base_url = self._launch("reference", config, events=True)
        self.config = config

    def stop(self) -> list[TeardownReport]:
        reports = []
        for server in (self.server, self.decode):
            if server is not None:
                reports.append(server.stop())
        self.server = self.decode = None
        self.close_event_subscriber()
        for name, _size in list(self.exports.values()):
            (SHM_DIR / name).unlink(missing_ok=True)
        self.exports.clear()
        self.config = None
        return reports

    def running(self) -> bool:
        return self.server is not None and self.server.process.alive()

    # ---- requests -----------------------------------------------------------------------
    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        data = self.post_json("/v1/completions", {"prompt": tokens, "max_tokens": max_tokens})
        usage = data["usage"]
        return ServedPrompt(
            usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
            data["choices"][0]["token_ids"],
            usage.get("cached_tokens_by_source", {}),
        )

    def reset_prefix_cache(self) -> None:
        self._request("POST", "/reset_prefix_cache")

    def metrics(self) -> MetricSnapshot:
        return self.scrape("/metrics")

    def engine_pids(self) -> list[int]:
        return self.server.pids() if self.server else []

    def predict_cached_tokens(self, tokens: list[int]) -> int:
        return int(self.post_json("/router/predict", {"prompt": tokens})["predicted_cached_tokens"])

    def serve_routed(self, tokens: list[int]) -> tuple[int, ServedPrompt]:
        predicted = int(self.post_json("/router/predict", {"prompt": tokens})["predicted_cached_tokens"])
        return predicted, self.serve_prompt(tokens)

    def kv_pool_bytes(self) -> int:
        return NUM_BLOCKS * self.deployment.model.block_bytes(deployed_block_size(self))

    def cache_capacity_tokens(self) -> int:
        return NUM_BLOCKS * deployed_block_size(self)

    def resident_blocks_reported(self) -> int | None:
        stats = self.get_json("/stats")
        return int(stats["cached_free"])

    # ---- persistence ---------------------------------------------------------------------
    @provides(PersistentTier)
    def persistent_tier(self) -> PersistentTier:
        # each .kv file: a 16-byte header (magic, payload length, CRC32) and the block's KV
        # (kvconform/engines/reference/disk.py HEADER)
        block_bytes = self.deployment.model.block_bytes(deployed_block_size(self)) + DISK_HEADER_BYTES
        return FileTier(self.disk_dir(), "*.kv", block_bytes)

    def reset_all_tiers(self) -> None:
        self._request("POST", "/reset_prefix_cache?lower_tiers=1")

    # ---- offload -----------------------------------------------------------------------
    @provides(OffloadTier)
    def offload_tier(self) -> OffloadTier:
        return ReferenceOffloadTier(self)

    # ---- instances (memory churn) --------------------------------------------------------
    # Imported KV per churn instance; the reclaim-power benchmark shrinks it to one block.
    # 8 MiB: a leak of one instance per cycle is plain in RSS too (4 cycles: 32 MiB, 8 MiB/cycle).
    INSTANCE_BYTES = int(os.environ.get("KVCONFORM_REF_INSTANCE_BYTES", 8 * 2**20))
    HEARTBEAT_S = 0.1  # reaper path: the engine reaps an instance two missed beats after
    REAP_WAIT_S = 3.0  # how long a cycle waits for the reaper (then measures what is left)
    TEARDOWN_GRACE_S = 3.0  # close/restart cycles: the server exits in well under 1 s

    @provides(InstanceChurn)
    def instance_churn(self) -> InstanceChurn:
        return ReferenceChurn(self)

    def churn_cycle(self, path: str, index: int, tokens: list[int]) -> None:
        """One lifecycle per release path:
        unregister: create, load, DELETE the instance;
        reaper: create with a heartbeat, load, then the client dies (no more beats, its own
          export removed as the OS would on exit): the engine must reap the instance;
        close: create, load, then the server closes with the instance still registered;
        restart: serve requests, stop the server (its whole tree), start it again;
        destroy: create an in-process engine, store the prompt's KV in it, destroy it."""
        if path not in ReferenceChurn.paths:
            raise NotImplementedError(f"reference engine has no release path {path!r}")
        instance_id = f"churn-{path}-{index}"
        if path == "destroy":
            self.post_json("/engines", {"engine_id": instance_id, "nbytes": self.INSTANCE_BYTES})
            self.post_json(f"/engines/{instance_id}/store", {"prompt": tokens})
            resp = self.http.delete(self.url(f"/engines/{instance_id}"), timeout=30)
            if resp.status_code != 200:
                why = f"destroy {instance_id} -> HTTP {resp.status_code}: {resp.text[:200]}"
                raise EngineError(self.name, why)
            return
        if path == "restart":
            for shift in range(3):
                self.serve_prompt(tokens[: len(tokens) - shift])
            self._restart_server(path)
            return
        heartbeat = self.HEARTBEAT_S if path == "reaper" else 0.0
        self.create_instance(instance_id, self.INSTANCE_BYTES, heartbeat_s=heartbeat)
        self.post_json(f"/instances/{instance_id}/load", {"prompt": tokens})
        if path == "unregister":
            self.release_instance(instance_id, path)
            return
        if path == "close":
            self._restart_server(path)
            return
        self._client_died(instance_id)
        self._wait_reaped(instance_id)
        self._free_dead_exports()

    def _client_died(self, instance_id: str) -> None:
        """The exporting client is gone: its side of the memory goes with it."""
        name, _size = self.exports.pop(instance_id, (None, 0))
        if name:
            (SHM_DIR / name).unlink(missing_ok=True)
        self.gpu_exports.pop(instance_id, None)  # freed once the engine lets go: _free_dead_exports

    def _free_dead_exports(self) -> None:
        """A dead client's CUDA memory goes back to the driver with its process. Ours lives
        on, so a tensor it dropped while the engine still held the import waits in torch's
        sent-tensor limbo until the exporter collects it (torch.cuda.ipc_collect, an exporter
        call) and returns its cache; without this the device-wide figure counts our own
        allocator (measured on an H200: one 20 MiB segment, docs/gpu-measurements.md)."""
        if self.gpu_exports_enabled():
            import torch

            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()

    def _wait_reaped(self, instance_id: str) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.REAP_WAIT_S:
            if self.http.get(self.url(f"/instances/{instance_id}"), timeout=10).status_code == 404:
                return time.monotonic() - t0
            time.sleep(0.05)
        return None  # not reaped: what it still holds shows in the probe

    def _restart_server(self, path: str) -> str:
        """Stop the server (and its whole tree) and start it again; count what teardown found
        left of it. The instances' own exports are the clients', not the engine's leftovers."""
        assert self.server is not None
        config = self.config or EngineConfig()
        report = self.server.process.stop(grace_s=self.TEARDOWN_GRACE_S)
        exported = {name for name, _size in self.exports.values()}
        self.churn_leftovers[path].count(report, not_the_engines=exported)
        for instance_id in [*self.exports, *self.gpu_exports]:
            self._client_died(instance_id)  # the clients of a closed server go too
        self._free_dead_exports()
        self.server = None
        self.close_event_subscriber()
        self.server, self.base_url = self._launch("reference", config, events=True)
        self.config = config
        return report.describe()

    def reclaim_probe(self, path: str | None = None) -> dict[str, MemoryMeasure]:
        """Per release path, the memory that must come back: mapped shm and RSS of the server
        (unregister, reaper); live tensor bytes and RSS (destroy); what teardown found left,
        cumulative over cycles (close, restart). Outside churn: all of the server's."""
        if path in ("close", "restart"):
            left = self.churn_leftovers[path].counts
            return {
                f"{path}_leftover_processes": MemoryMeasure(left["processes"], True, "processes"),
                f"{path}_leftover_shm_bytes": MemoryMeasure(left["shm_bytes"], True),
            }
        sample = sample_processes(self.engine_pids())
        measures: dict[str, MemoryMeasure] = {}
        if path != "destroy":
            measures["engine_shm_mapped_bytes"] = MemoryMeasure(sample.shm_bytes, exact=True)
        if path in (None, "destroy"):
            tensors = self.get_json("/admin/memory")["live_tensor_bytes"]
            measures["engine_live_tensor_bytes"] = MemoryMeasure(tensors, exact=True)
        measures["engine_rss_bytes"] = MemoryMeasure(sample.rss, exact=False)
        if path != "destroy":
            measures.update(gpu_measures(sample))
            if sample.gpu is not None:
                # CUDA-IPC memory stays in the exporter's allocation until the importer
                # collects: on a dedicated GPU the device-wide figure is what shows it.
                measures["gpu_device_used_bytes"] = MemoryMeasure(sample.gpu.device_used, exact=True)
        return measures

    def release_instance_twice(self, path: str, tokens: list[int]) -> SecondRelease:
        instance_id = f"twice-{time.monotonic_ns()}"
        self.create_instance(instance_id, self.INSTANCE_BYTES)
        first = self.release_instance(instance_id, path)
        try:
            status: int | str = self.http.delete(
                self.url(f"/instances/{instance_id}"), timeout=30
            ).status_code
        except requests.RequestException as exc:
            status = f"no answer ({type(exc).__name__})"
        return SecondRelease(bool(first["released"]), status == 404, f"second DELETE: {status}")

    def create_instance(self, instance_id: str, nbytes: int, heartbeat_s: float = 0.0) -> None:
        """Export KV memory (the client side) and register it with the engine: a CUDA tensor
        over CUDA IPC where the engine runs on a GPU, a POSIX shm file on hosts."""
        if self.gpu_exports_enabled():
            import pickle

            import torch
            from torch.multiprocessing.reductions import reduce_tensor

            tensor = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
            self.gpu_exports[instance_id] = tensor
            handle = base64.b64encode(pickle.dumps(reduce_tensor(tensor))).decode()
            self.post_json(
                "/instances", {"instance_id": instance_id, "cuda_ipc": handle, "heartbeat_s": heartbeat_s}
            )
            return
        name = f"{self.shm_prefix}{os.getpid()}-{instance_id}"
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self.exports[instance_id] = (name, nbytes)
        self.post_json(
            "/instances",
            {"instance_id": instance_id, "shm_name": name, "nbytes": nbytes, "heartbeat_s": heartbeat_s},
        )

    def gpu_exports_enabled(self) -> bool:
        """CUDA IPC needs a CUDA torch in this (exporting) process and a GPU for the engine."""
        return nvml().available and _torch_cuda_available()

    def release_instance(self, instance_id: str, path: str) -> dict[str, Any]:
        """Release through DELETE /instances/ID (the unregister path; second_release uses it
        whatever path it is given: the others have no second release to make)."""
        resp = self.http.delete(self.url(f"/instances/{instance_id}"), timeout=30)
        name, _size = self.exports.pop(instance_id, (None, 0))
        if name:
            (SHM_DIR / name).unlink(missing_ok=True)  # the exporter frees its side
        if self.gpu_exports.pop(instance_id, None) is not None:
            import torch

            torch.cuda.empty_cache()  # freed only once the importer let go (ipc_collect)
        if resp.status_code not in (200, 404):
            raise EngineError(self.name, f"unregister {instance_id}: HTTP {resp.status_code}")
        return {"released": resp.status_code == 200, "status": resp.status_code}

    # ---- transfer -------------------------------------------------------------------------
    def ensure_decode_instance(self) -> str:
        if self.decode is None or not self.decode.process.alive():
            self.decode, url = self._launch("reference-decode", self.config or EngineConfig(), events=False)
            self._decode_url = url
        return self._decode_url

    @provides(KvTransfer)
    def kv_transfer(self) -> KvTransfer:
        return ReferenceTransfer(self)

    def block_pool_stats(self) -> list[BlockPoolStats]:
        return [
            BlockPoolStats(
                max_blocks=it["maxNumBlocks"],
                free_blocks=it["freeNumBlocks"],
                used_blocks=it["usedNumBlocks"],
                reused_blocks=it["reusedBlocks"],
                missed_blocks=it["missedBlocks"],
                hit_rate=it["cacheHitRate"],
                tokens_per_block=it["tokensPerBlock"],
                iteration=it["iter"],
                cumulative=True,
            )
            for it in self.get_json("/kv_stats")
        ]

    def serve_disaggregated(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        """Prefill here, hand the KV pages to the decode instance (the transfer path)."""
        receiver = self.ensure_decode_instance()
        result = self.post_json(
            "/transfer/send",
            {
                "prompt": tokens,
                "receiver": receiver,
                "layout": "mha",
                "page_size": deployed_block_size(self),
                "destinations": 1,
            },
        )
        # prompt tokens as the decode instance accounts them, not as we sent them
        received = self.http.get(f"{receiver}/transfer/received/{result['transfer_id']}", timeout=10)
        if received.status_code != 200:
            raise EngineError(
                self.name,
                f"decode instance has no record of transfer {result['transfer_id']} "
                f"(GET /transfer/received -> {received.status_code})",
                log_tail(self),
            )
        # The reference's decode instance keeps received pages apart from its prefix cache: its
        # answer is computed over KV of its own (what the answer measure compares), and it
        # says nothing of a hand-off into its pool (source has no "handoff").
        answer = self.http.post(
            f"{receiver}/v1/completions", json={"prompt": tokens, "max_tokens": max_tokens}, timeout=30
        ).json()["choices"][0]["token_ids"]
        # usage as the answer's side reports it (a frontend returns the decode instance's)
        record = received.json()
        return ServedPrompt(int(record["prompt_tokens"]), int(record["cached_tokens"]), list(answer))

    def release_twice(self, tokens: list[int]) -> ReleaseTwice:
        return ReleaseTwice.from_json(self.post_json("/admin/release_twice", {"prompt": tokens}))

    def logs(self, lines: int = 80) -> dict[str, str]:
        logs = {}
        if self.server:
            logs["reference"] = self.server.log_tail(lines)
        if self.decode:
            logs["reference-decode"] = self.decode.log_tail(lines)
        return logs


def _torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class ReferenceTransfer(KvTransfer):
    """The reference engine's /transfer/send to its decode instance, which counts what arrived."""

    layouts = ("mha", "mla", "mla_state")
    page_sizes = (1, 4, 16, 32)
    aborts = True

    def __init__(self, adapter: ReferenceAdapter) -> None:
        self.adapter = adapter

    def transfer(
        self,
        tokens: list[int],
        layout: str,
        page_size: int,
        destinations: int,
        abort_after_pages: int | None = None,
    ) -> TransferResult:
        receiver = self.adapter.ensure_decode_instance()
        result = self.adapter.post_json(
            "/transfer/send",
            {
                "prompt": tokens,
                "receiver": receiver,
                "page_size": page_size,
                "layout": layout,
                "destinations": destinations,
                "abort_after_pages": abort_after_pages,
            },
        )
        received = self.adapter.http.get(f"{receiver}/transfer/received/{result['transfer_id']}", timeout=10)
        return TransferResult(
            kv_indices=result["kv_indices"],
            page_indices=result["page_indices"],
            bytes_sent=result["bytes_counted"],
            bytes_received=received.json()["bytes"] if received.status_code == 200 else 0,
            detail={"aborted": result["aborted"]},
        )


class ReferenceChurn(InstanceChurn):
    """The reference engine's instances: registered over HTTP (unregister, a reaper for dead
    clients, the server closing with them), a whole restart, or an in-process engine destroyed."""

    paths = ("unregister", "reaper", "close", "restart", "destroy")

    def __init__(self, engine: ReferenceAdapter) -> None:
        self.engine = engine

    def cycle(self, path: str, index: int, tokens: list[int]) -> None:
        self.engine.churn_cycle(path, index, tokens)

    def warmup_path(self, path: str) -> str:
        return "unregister" if path == "reaper" else path  # same probe, no reaper wait

    def second_release(self, path: str, tokens: list[int]) -> SecondRelease:
        return self.engine.release_instance_twice(path, tokens)

    def release_notes(self, path: str) -> list[str]:
        left = self.engine.churn_leftovers.get(path)
        return list(left.notes) if left else []


class ReferenceOffloadTier(MetricOffloadTier):
    """The reference engine's host tier: its transfer worker's log and its store-failure switch
    are admin routes."""

    def __init__(self, engine: ReferenceAdapter) -> None:
        super().__init__(engine)
        self.server = engine

    def fail_stores(self, fail: bool) -> None:
        self.server.post_json("/admin/offload", {"fail_stores": fail})

    def transfer_log(self) -> list[tuple[float, int, int]] | None:
        log = self.server.get_json("/admin/offload/transfers")["log"]
        return [(float(t), int(s), int(lo)) for t, s, lo in log]

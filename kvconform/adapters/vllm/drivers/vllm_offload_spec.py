"""An out-of-tree vLLM offloading spec for hosts without an accelerator.

Loaded *inside* vLLM's processes by the OffloadingConnector
(`kv_connector_extra_config: {"spec_name": "KvconformCPUOffloadingSpec",
"spec_module_path": "vllm_offload_spec"}`, this folder on PYTHONPATH); the suite process never
imports it.

vLLM's own CPU offloading spec refuses the CPU platform only when it builds its copy worker,
which drives accelerator streams. This spec keeps everything else of vLLM's: the connector, its
scheduler side and the scheduler-side `CPUOffloadingManager` whose gauges are under test. It
replaces only the worker, with a synchronous host-to-host copy between the (CPU) KV cache and a
host buffer of `num_chunks` pages, one KV block per chunk.

Extra config keys read here (all optional, beside vLLM's own such as `cpu_bytes_to_use`):

- `kvconform_store_delay_s`: a store is copied at submit time but reported finished only this
  long afterwards, as an asynchronous transfer would be, so the write gauge is visibly > 0.
- `kvconform_load_delay_s`: the same for loads (the read gauge).
- `kvconform_transfer_log`: the worker appends `monotonic_s stores loads` (chunks in flight
  by its own account, from submit to the finished report) at each change, so the suite can
  judge vLLM's gauges against the transfers really in flight.
- `kvconform_fail_stores_file`: while this file exists, new stores fail. The connector of this
  vLLM version has no way for a worker to report a failed transfer (its worker asserts
  `TransferResult.success`), so the failure is decided where the manager allocates the store
  (`prepare_store`), carried to the worker in the store spec (the worker then copies nothing and
  reports no bytes), and given back to vLLM's manager as `complete_store(success=False)` when
  the connector completes the job. The manager's bookkeeping and gauges stay vLLM's own.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

logger = init_logger("vllm.kvconform_offload_spec")  # vLLM's handlers: lines land in the server log

STORE_DELAY_KEY = "kvconform_store_delay_s"
LOAD_DELAY_KEY = "kvconform_load_delay_s"
FAIL_FILE_KEY = "kvconform_fail_stores_file"
TRANSFER_LOG_KEY = "kvconform_transfer_log"


class FailingStoreSpec(CPULoadStoreSpec):
    """Destination of a store that is to fail: the worker must leave these chunks untouched."""


class FailableStoreManager(CPUOffloadingManager):
    """vLLM's CPUOffloadingManager, plus a way for a store to end in failure.

    Only the `success` flag given to vLLM's `complete_store` changes; allocation, eviction,
    ref counts and `get_stats()` are the parent's. State of this class lives in attributes set
    by `attach_failure_control` (the instance is built by vLLM's own `get_manager`).
    """

    _kvc_fail_file: str | None
    _kvc_doomed: set[OffloadKey]
    _kvc_failed_chunks: int

    def attach_failure_control(self, fail_file: str | None) -> None:
        self._kvc_fail_file = fail_file
        self._kvc_doomed = set()
        self._kvc_failed_chunks = 0

    def _stores_should_fail(self) -> bool:
        return self._kvc_fail_file is not None and os.path.exists(self._kvc_fail_file)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        output = super().prepare_store(keys, req_context)
        if output is None or not output.keys_to_store or not self._stores_should_fail():
            return output
        self._kvc_doomed.update(output.keys_to_store)
        assert isinstance(output.store_spec, BlockIDsLoadStoreSpec)
        output.store_spec = FailingStoreSpec(output.store_spec.block_ids.tolist())
        return output

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        failed = [key for key in keys if key in self._kvc_doomed]
        if not failed:
            super().complete_store(keys, req_context, success)
            return
        self._kvc_doomed.difference_update(failed)
        self._kvc_failed_chunks += len(failed)
        logger.info(
            "kvconform: %d offload store chunk(s) failed on request (%d so far)",
            len(failed),
            self._kvc_failed_chunks,
        )
        super().complete_store(failed, req_context, success=False)
        failed_set = set(failed)
        rest = [key for key in keys if key not in failed_set]
        if rest:
            super().complete_store(rest, req_context, success)

    def reset_cache(self) -> None:
        self._kvc_doomed.clear()
        super().reset_cache()


@dataclass
class _Job:
    job_id: int
    due: float
    started: float
    nbytes: int | None  # None: nothing was transferred (a failed store)
    chunks: int = 0
    store: bool = True


class HostCopyWorker(OffloadingWorker):
    """Copies KV blocks between the device KV cache (CPU tensors here) and a host buffer.

    One host page per chunk per KV tensor; blocks_per_chunk must be 1, so block i of a transfer
    maps to chunk i. Copies happen synchronously at submit; completion is reported after the
    configured delay, in submission order.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        num_chunks: int,
        settings: WorkerSettings,
        host_pages: Callable[[int], torch.Tensor] | None = None,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        """`host_pages(page_bytes)` gives one KV tensor's host buffer, (num_chunks, page_bytes)
        int8; by default a private tensor. `on_shutdown` runs after the buffers are dropped."""
        self.on_shutdown = on_shutdown
        self.device: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        self.page_bytes: list[int] = []
        for canonical in kv_caches.tensors:
            tensor = canonical.tensor
            if tensor.dtype != torch.int8:
                tensor = tensor.view(torch.int8)
            if tensor.ndim != 2:
                tensor = tensor.reshape(tensor.shape[0], -1)
            page = canonical.page_size_bytes
            if tensor.shape[1] < page:
                raise ValueError(f"KV tensor row of {tensor.shape[1]} bytes < page of {page} bytes")
            self.device.append(tensor[:, :page])
            self.host.append(
                host_pages(page) if host_pages else torch.zeros((num_chunks, page), dtype=torch.int8)
            )
            self.page_bytes.append(page)
        self.group_tensors: list[list[int]] = [
            sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs
        ]
        self.store_delay_s = settings.store_delay_s
        self.load_delay_s = settings.load_delay_s
        self.jobs: deque[_Job] = deque()
        self.in_flight = [0, 0]  # chunks of stores, of loads: submitted, not reported finished
        log = settings.transfer_log
        self.transfer_log = open(log, "w", buffering=1) if log else None  # noqa: SIM115
        self._log_in_flight()
        logger.info(
            "kvconform host-copy worker: %d KV tensor(s), page bytes %s, %d host chunks, "
            "device shapes %s, store delay %.3fs, load delay %.3fs",
            len(self.device),
            self.page_bytes,
            num_chunks,
            [tuple(t.shape) for t in self.device],
            self.store_delay_s,
            self.load_delay_s,
        )

    def _copy(self, gpu_spec: GPULoadStoreSpec, chunk_ids: np.ndarray, to_host: bool) -> int:
        block_ids = gpu_spec.block_ids
        if len(block_ids) != len(chunk_ids):
            raise ValueError(
                f"{len(block_ids)} blocks vs {len(chunk_ids)} chunks (blocks_per_chunk must be 1)"
            )
        nbytes = 0
        offset = 0
        for group, size in enumerate(gpu_spec.group_sizes):
            if size == 0:
                continue
            blocks = torch.from_numpy(block_ids[offset : offset + size].astype(np.int64))
            chunks = torch.from_numpy(chunk_ids[offset : offset + size].astype(np.int64))
            offset += size
            for t in self.group_tensors[group]:
                if to_host:
                    self.host[t].index_copy_(0, chunks, self.device[t].index_select(0, blocks))
                else:
                    self.device[t].index_copy_(0, blocks, self.host[t].index_select(0, chunks))
                nbytes += size * self.page_bytes[t]
        return nbytes

    def _log_in_flight(self) -> None:
        if self.transfer_log is not None:
            self.transfer_log.write(f"{time.monotonic():.6f} {self.in_flight[0]} {self.in_flight[1]}\n")

    def _enqueue(
        self, job_id: int, started: float, delay: float, nbytes: int | None, chunks: int, store: bool
    ) -> None:
        # completions come back in submission order, like a single transfer queue
        due = max(time.monotonic() + delay, self.jobs[-1].due if self.jobs else 0.0)
        self.jobs.append(_Job(job_id, due, started, nbytes, chunks, store))
        self.in_flight[0 if store else 1] += chunks
        self._log_in_flight()

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        started = time.monotonic()
        nbytes = (
            None if isinstance(dst_spec, FailingStoreSpec) else self._copy(src_spec, dst_spec.block_ids, True)
        )
        self._enqueue(job_id, started, self.store_delay_s, nbytes, len(dst_spec.block_ids), True)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        started = time.monotonic()
        nbytes = self._copy(dst_spec, src_spec.block_ids, False)
        self._enqueue(job_id, started, self.load_delay_s, nbytes, len(src_spec.block_ids), False)
        return True

    def get_finished(self) -> list[TransferResult]:
        now = time.monotonic()
        done: list[TransferResult] = []
        while self.jobs and self.jobs[0].due <= now:
            job = self.jobs.popleft()
            self.in_flight[0 if job.store else 1] -= job.chunks
            self._log_in_flight()
            if job.nbytes is None:
                done.append(TransferResult(job_id=job.job_id, success=True))
            else:
                done.append(
                    TransferResult(
                        job_id=job.job_id,
                        success=True,
                        transfer_size=job.nbytes,
                        transfer_time=now - job.started,
                    )
                )
        return done

    def wait(self, job_ids: set[int]) -> None:
        due = max((job.due for job in self.jobs if job.job_id in job_ids), default=0.0)
        remaining = due - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def shutdown(self) -> None:
        if self.transfer_log is not None:
            self.transfer_log.close()
            self.transfer_log = None
        self.jobs.clear()
        self.host.clear()
        self.device.clear()
        if self.on_shutdown is not None:
            self.on_shutdown()
            self.on_shutdown = None


@dataclass(frozen=True)
class WorkerSettings:
    """What the kvconform keys of a spec's extra config ask of the host-copy worker."""

    store_delay_s: float
    load_delay_s: float
    transfer_log: str | None

    @classmethod
    def of(cls, spec: CPUOffloadingSpec) -> WorkerSettings:
        # the worker copies one block per chunk; vLLM's own worker handles larger chunks
        if spec.blocks_per_chunk != 1:
            raise ValueError(
                f"kvconform host-copy worker needs blocks_per_chunk == 1, got {spec.blocks_per_chunk}"
            )
        extra = spec.extra_config
        return cls(
            store_delay_s=float(extra.get(STORE_DELAY_KEY, 0.0)),
            load_delay_s=float(extra.get(LOAD_DELAY_KEY, 0.0)),
            transfer_log=extra.get(TRANSFER_LOG_KEY),
        )


class KvconformCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPUOffloadingSpec with a host-copy worker and failable stores."""

    _worker: OffloadingWorker | None  # vLLM's CPUOffloadingSpec.__init__ sets it to None

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.worker_settings = WorkerSettings.of(self)
        self.fail_file: str | None = self.extra_config.get(FAIL_FILE_KEY)

    def get_manager(self) -> OffloadingManager:
        manager = super().get_manager()
        if not isinstance(manager, FailableStoreManager):
            assert type(manager) is CPUOffloadingManager, type(manager)
            # vLLM built its own manager; give it the one extra behaviour (failed stores)
            manager.__class__ = FailableStoreManager
            manager.attach_failure_control(self.fail_file)
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            # host chunks: num_chunks from vLLM 0.29.0, num_blocks before
            chunks = getattr(self, "num_chunks", None) or self.num_blocks
            self._worker = HostCopyWorker(kv_caches, chunks, self.worker_settings)
        return self._worker


class KvconformTieringSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec (a CPU primary tier and the secondary tiers of its extra
    config, such as "fs"), with the host-copy worker in place of vLLM's accelerator worker.

    The worker's host buffer is the primary tier's SharedOffloadRegion, mapped as vLLM's own
    worker maps it (one view per KV tensor in this rank's slot of each chunk row): the secondary
    tiers read and write that region through the scheduler-side view, so what the worker
    copies is what the fs tier persists and what a promotion loads is what the worker copies
    back. Manager, tiers, cascade and promotion are vLLM's.
    """

    _worker: OffloadingWorker | None  # vLLM's CPUOffloadingSpec.__init__ sets it to None

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.worker_settings = WorkerSettings.of(self)
        self._region: SharedOffloadRegion | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            self._region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._worker = HostCopyWorker(
                kv_caches,
                self.num_chunks,
                self.worker_settings,
                host_pages=self._region.create_next_worker_view,
                # the worker process may be the region's creator (it is on the CPU backend,
                # whose worker starts first): then its cleanup is what unlinks the /dev/shm file
                on_shutdown=self._region.cleanup,
            )
        assert self._worker is not None
        return self._worker

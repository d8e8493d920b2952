"""Driver: LMCache's in-process engine (LMCacheEngine) on the CPU.

Run with the LMCache environment's interpreter:

    <lmcache-venv>/bin/python lmcache_inproc_driver.py

Each engine is built with LMCacheEngineBuilder.get_or_create and our own host-memory
connector (below): the "device" KV cache is a CPU tensor (2, layers, slots, heads*head_size)
addressed by a slot mapping, and the connector really copies between it and LMCache's
memory objects (KV_2LTD layout), so bytes can be checked after a retrieve. Backends:
local_cpu (+ local_disk when disk_dir is given).

Bytes written for a chunk are a pure function of the token prefix that ends the chunk, so
retrieved bytes can be checked in any process.

Ops: create, store, lookup, retrieve, destroy, clear, metrics, memory, info.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import sys
import time
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no telemetry from a test rig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jsonl_loop import serve
from kv_content import chunk_seed

ENGINE = "lmcache-inproc"
_engines: dict[str, _Engine] = {}
_destroyed: dict[str, dict[str, Any]] = {}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("lmcache")
    except Exception:
        return "unknown"


def _connector_base():
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    return GPUConnectorInterface


def _make_connector(num_layers: int, hidden: int, num_slots: int, dtype: Any):
    import torch

    base = _connector_base()

    class HostKVConnector(base):  # type: ignore[misc, valid-type]
        """Host-memory KV cache + copies to/from LMCache memory objects (KV_2LTD:
        [2, layers, tokens, hidden]). Token t of a request lives in slot slot_mapping[t]."""

        def __init__(self) -> None:
            self.kv = torch.zeros((2, num_layers, num_slots, hidden), dtype=dtype)
            self.num_layers = num_layers
            self.hidden = hidden
            self.copies_in = 0  # memory objects filled from the KV cache (store)
            self.copies_out = 0  # memory objects written into the KV cache (retrieve)
            self.bytes_in = 0
            self.bytes_out = 0

        @staticmethod
        def _slots(kwargs: dict[str, Any], start: int, end: int):
            slot_mapping = kwargs["slot_mapping"]
            return slot_mapping[start:end].to(torch.long)

        def from_gpu(self, memory_obj, start: int, end: int, **kwargs):
            idx = self._slots(kwargs, start, end)
            dst = memory_obj.tensor
            dst[:, :, : end - start].copy_(self.kv[:, :, idx])
            self.copies_in += 1
            self.bytes_in += (end - start) * 2 * num_layers * hidden * self.kv.element_size()

        def to_gpu(self, memory_obj, start: int, end: int, **kwargs):
            idx = self._slots(kwargs, start, end)
            src = memory_obj.tensor
            self.kv[:, :, idx] = src[:, :, : end - start].to(self.kv.dtype)
            self.copies_out += 1
            self.bytes_out += (end - start) * 2 * num_layers * hidden * self.kv.element_size()

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for obj, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(obj, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
            for obj, s, e in zip(memory_objs or [], starts or [], ends or [], strict=True):
                self.to_gpu(obj, s, e, **kwargs)

        def get_shape(self, num_tokens: int):
            return torch.Size([2, num_layers, num_tokens, hidden])

    return HostKVConnector()


class _Engine:
    # What create() built (passed as keywords).
    engine_id: str
    engine: Any  # LMCacheEngine
    connector: Any
    config: Any  # LMCacheEngineConfig
    chunk_size: int
    num_layers: int
    hidden: int
    num_slots: int
    dtype: Any  # a torch dtype
    data_salt: str
    disk_dir: str | None

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)
        self.next_slot = 0

    def take_slots(self, n: int):
        import torch

        if n > self.num_slots:
            raise ValueError(f"need {n} slots, engine has {self.num_slots}")
        if self.next_slot + n > self.num_slots:
            self.next_slot = 0
        out = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.long)
        self.next_slot += n
        return out

    def chunk_bounds(self, n: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.chunk_size, n)) for s in range(0, n, self.chunk_size)]

    def expected(self, token_ids: list[int], start: int, end: int):
        import torch

        gen = torch.Generator().manual_seed(chunk_seed(token_ids, end, self.data_salt))
        data = torch.randn((2, self.num_layers, end - start, self.hidden), generator=gen)
        return data.to(self.dtype)

    def fill(self, token_ids: list[int], slots) -> list[str]:
        import torch

        digests = []
        for s, e in self.chunk_bounds(len(token_ids)):
            data = self.expected(token_ids, s, e)
            self.connector.kv[:, :, slots[s:e]] = data
            digests.append(hashlib.md5(data.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
        return digests


def _get(engine_id: str) -> _Engine:
    eng = _engines.get(engine_id)
    if eng is None:
        raise KeyError(f"engine {engine_id!r} does not exist in this driver")
    return eng


def op_info() -> dict[str, Any]:
    import torch

    return {
        "engine": ENGINE,
        "lmcache_version": _version(),
        "torch_version": torch.__version__,
        "python": sys.version.split()[0],
        "pid": os.getpid(),
        "engines": sorted(_engines),
        "destroyed": sorted(_destroyed),
    }


def op_create(
    engine_id: str,
    chunk_size: int = 256,
    max_local_cpu_size_gb: float = 0.25,
    disk_dir: str | None = None,
    max_local_disk_size_gb: float = 1.0,
    num_layers: int = 2,
    num_heads: int = 2,
    head_size: int = 64,
    dtype: str = "float16",
    num_slots: int = 8192,
    model_name: str = "kvc-model",
    save_unfull_chunk: bool | None = None,
    data_salt: str = "",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """LMCacheEngineBuilder.get_or_create + post_init with local_cpu (+ local_disk)."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    if engine_id in _engines:
        raise ValueError(f"engine {engine_id!r} already created in this driver")
    cfg_kwargs: dict[str, Any] = {
        "chunk_size": chunk_size,
        "local_cpu": True,
        "max_local_cpu_size": max_local_cpu_size_gb,
    }
    if disk_dir:
        os.makedirs(disk_dir, exist_ok=True)
        cfg_kwargs["local_disk"] = "file://" + os.path.abspath(disk_dir).rstrip("/") + "/"
        cfg_kwargs["max_local_disk_size"] = max_local_disk_size_gb
    if save_unfull_chunk is not None:
        cfg_kwargs["save_unfull_chunk"] = save_unfull_chunk
    cfg_kwargs.update(extra or {})
    config = LMCacheEngineConfig.from_defaults(**cfg_kwargs)
    tdtype = getattr(torch, dtype)
    metadata = LMCacheMetadata(
        model_name=model_name,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=tdtype,
        kv_shape=(num_layers, 2, chunk_size, num_heads, head_size),
        chunk_size=chunk_size,
    )
    connector = _make_connector(num_layers, num_heads * head_size, num_slots, tdtype)
    t0 = time.monotonic()
    engine = LMCacheEngineBuilder.get_or_create(
        engine_id,
        config,
        metadata,
        connector,
        lambda tensor, src: None,
        lambda obj, src: obj,
    )
    engine.post_init()
    _engines[engine_id] = _Engine(
        engine_id=engine_id,
        engine=engine,
        connector=connector,
        config=config,
        chunk_size=chunk_size,
        num_layers=num_layers,
        hidden=num_heads * head_size,
        num_slots=num_slots,
        dtype=tdtype,
        data_salt=data_salt,
        disk_dir=disk_dir,
    )
    _destroyed.pop(engine_id, None)
    return {
        "engine_id": engine_id,
        "chunk_size": chunk_size,
        "max_local_cpu_size_gb": max_local_cpu_size_gb,
        "local_disk": cfg_kwargs.get("local_disk"),
        "max_local_disk_size_gb": cfg_kwargs.get("max_local_disk_size"),
        "save_unfull_chunk": bool(getattr(config, "save_unfull_chunk", False)),
        "bytes_per_token": 2 * num_layers * num_heads * head_size * tdtype.itemsize,
        "bytes_per_chunk": 2 * num_layers * num_heads * head_size * tdtype.itemsize * chunk_size,
        "latency_ms": round((time.monotonic() - t0) * 1000, 3),
    }


def op_store(engine_id: str, token_ids: list[int]) -> dict[str, Any]:
    """Fill fresh slots with the tokens' deterministic KV, then engine.store()."""
    import torch

    eng = _get(engine_id)
    slots = eng.take_slots(len(token_ids))
    digests = eng.fill(token_ids, slots)
    before = (eng.connector.copies_in, eng.connector.bytes_in)
    t0 = time.monotonic()
    eng.engine.store(torch.tensor(token_ids, dtype=torch.long), slot_mapping=slots)
    latency = (time.monotonic() - t0) * 1000
    return {
        "engine_id": engine_id,
        "requested_tokens": len(token_ids),
        "chunks_copied": eng.connector.copies_in - before[0],
        "bytes_copied": eng.connector.bytes_in - before[1],
        "chunk_digests": digests,
        "latency_ms": round(latency, 3),
    }


def op_lookup(engine_id: str, token_ids: list[int]) -> dict[str, Any]:
    eng = _get(engine_id)
    t0 = time.monotonic()
    hit = int(eng.engine.lookup(tokens=list(token_ids)))
    return {
        "engine_id": engine_id,
        "requested_tokens": len(token_ids),
        "hit_tokens": hit,
        "chunk_size": eng.chunk_size,
        "latency_ms": round((time.monotonic() - t0) * 1000, 3),
    }


def op_retrieve(engine_id: str, token_ids: list[int]) -> dict[str, Any]:
    """engine.retrieve() into freshly zeroed slots; compare each retrieved chunk's bytes
    with the bytes its token prefix was stored with."""
    import torch

    eng = _get(engine_id)
    n = len(token_ids)
    slots = eng.take_slots(n)
    eng.connector.kv[:, :, slots] = 0
    before = (eng.connector.copies_out, eng.connector.bytes_out)
    t0 = time.monotonic()
    ret_mask = eng.engine.retrieve(torch.tensor(token_ids, dtype=torch.long), slot_mapping=slots)
    latency = (time.monotonic() - t0) * 1000
    mask = ret_mask.to(torch.bool).tolist()
    retrieved = int(sum(mask))
    prefix = 0
    while prefix < n and mask[prefix]:
        prefix += 1
    checked = matched = 0
    bad: list[int] = []
    for ci, (s, e) in enumerate(eng.chunk_bounds(n)):
        if not all(mask[s:e]):
            continue
        checked += 1
        if torch.equal(eng.connector.kv[:, :, slots[s:e]], eng.expected(token_ids, s, e)):
            matched += 1
        else:
            bad.append(ci)
    return {
        "engine_id": engine_id,
        "requested_tokens": n,
        "retrieved_tokens": retrieved,
        "retrieved_prefix_tokens": prefix,
        "chunks_checked": checked,
        "chunks_matched": matched,
        "mismatched_chunks": bad,
        "bytes_match": (not bad) if checked else None,
        "chunks_copied": eng.connector.copies_out - before[0],
        "bytes_copied": eng.connector.bytes_out - before[1],
        "latency_ms": round(latency, 3),
    }


def op_clear(engine_id: str) -> dict[str, Any]:
    eng = _get(engine_id)
    result = eng.engine.clear()
    return {"engine_id": engine_id, "result": result}


def op_destroy(engine_id: str) -> dict[str, Any]:
    """LMCacheEngineBuilder.destroy; a second call is reported, not raised."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    eng = _engines.pop(engine_id, None)
    if eng is None:
        known_to_builder = LMCacheEngineBuilder.get(engine_id) is not None
        LMCacheEngineBuilder.destroy(engine_id)  # logs "not found" and returns
        return {
            "engine_id": engine_id,
            "was_created": False,
            "duplicate": engine_id in _destroyed,
            "known_to_builder": known_to_builder,
            "previous": _destroyed.get(engine_id),
        }
    t0 = time.monotonic()
    LMCacheEngineBuilder.destroy(engine_id)
    latency = (time.monotonic() - t0) * 1000
    del eng
    gc.collect()
    record = {
        "engine_id": engine_id,
        "was_created": True,
        "duplicate": False,
        "still_known_to_builder": LMCacheEngineBuilder.get(engine_id) is not None,
        "latency_ms": round(latency, 3),
        "at": time.time(),
    }
    _destroyed[engine_id] = record
    return record


def _prometheus_lines() -> dict[str, float]:
    from prometheus_client import REGISTRY, generate_latest

    out: dict[str, float] = {}
    for line in generate_latest(REGISTRY).decode().splitlines():
        if line.startswith("lmcache"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def op_metrics(flush: bool = True) -> dict[str, Any]:
    """Prometheus samples named lmcache* from this process's default registry.

    LMCache's stats-logger thread moves LMCStatsMonitor's interval stats into Prometheus
    every 10 s; flush=True does one such step now (get_stats_and_clear -> log_prometheus,
    exactly what that thread does) and also returns that interval's stats."""
    interval: dict[str, Any] | None = None
    if flush:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        loggers = list(LMCacheEngineBuilder._stat_loggers.values())
        if loggers:
            stat_logger = loggers[0]
            scalar = (int, float, str, bool)
            stats = stat_logger.monitor.get_stats_and_clear()
            stat_logger.prometheus_logger.log_prometheus(stats)
            try:
                from dataclasses import asdict

                interval = {k: v for k, v in asdict(stats).items() if isinstance(v, scalar)}
            except Exception:
                interval = {k: v for k, v in vars(stats).items() if isinstance(v, scalar)}
    return {"prometheus": _prometheus_lines(), "interval_stats": interval}


def op_memory(engine_id: str | None = None) -> dict[str, Any]:
    """Process RSS/PSS plus, per engine, what its backends say they hold."""
    out: dict[str, Any] = {}
    try:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                key = line.split(":")[0]
                if key in ("Rss", "Pss", "Anonymous"):
                    out[key.lower() + "_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    engines = [engine_id] if engine_id else sorted(_engines)
    per: dict[str, Any] = {}
    for eid in engines:
        eng = _get(eid)
        sm = eng.engine.storage_manager
        info: dict[str, Any] = {}
        for name, backend in getattr(sm, "storage_backends", {}).items():
            b: dict[str, Any] = {"type": type(backend).__name__}
            for attr in ("usage", "current_cache_size", "max_cache_size", "hot_cache"):
                if hasattr(backend, attr):
                    val = getattr(backend, attr)
                    sized = hasattr(val, "__len__") and not isinstance(val, (int, float))
                    b[attr] = len(val) if sized else val
            alloc = getattr(backend, "memory_allocator", None)
            if alloc is not None:
                for attr in ("total_allocated_size", "num_active_allocations"):
                    fn = getattr(alloc, attr, None)
                    if fn is not None:
                        with contextlib.suppress(Exception):
                            b[attr] = fn() if callable(fn) else fn
            info[name] = b
        if eng.disk_dir and os.path.isdir(eng.disk_dir):
            files = [os.path.join(r, f) for r, _, fs in os.walk(eng.disk_dir) for f in fs]
            total = sum(os.path.getsize(f) for f in files)
            info["disk_dir"] = {"files": len(files), "bytes": total}
        per[eid] = info
    out["engines"] = per
    return out


def main() -> None:
    serve(
        ENGINE,
        _version(),
        {
            "info": op_info,
            "create": op_create,
            "store": op_store,
            "lookup": op_lookup,
            "retrieve": op_retrieve,
            "clear": op_clear,
            "destroy": op_destroy,
            "metrics": op_metrics,
            "memory": op_memory,
        },
    )
    for eid in list(_engines):
        with contextlib.suppress(Exception):
            op_destroy(eid)


if __name__ == "__main__":
    main()
